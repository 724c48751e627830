"""Small file-system operations: fsyncs, atomic JSON, digests, staged directories published whole.

A checkpoint, an export or an import is written under a hidden sibling (`.NAME.partial-PID-HEX`)
and published by an atomic exchange of the two directories (`renameat2(RENAME_EXCHANGE)`, or two
renames where that is unsupported); staging directories left by a killed process are removed by
the next writer in the same parent (`clean_stale`).
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Any

from .errors import ConfigError, OutOfSpaceError, TierstoreError

_CHUNK = 8 << 20


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (renames, new files) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write JSON to `path` via a fsynced temporary file and a rename."""
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def file_digest(path: Path) -> tuple[int, str]:
    """(size, sha256 hex) of a file, read in bounded chunks."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return size, h.hexdigest()


def os_error(exc: OSError, what: str) -> TierstoreError:
    """Translate an OSError into the matching TierstoreError."""
    if isinstance(exc, TierstoreError):  # OutOfSpaceError is an OSError already
        return exc
    if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return OutOfSpaceError(f"{what}: out of space: {exc}")
    return ConfigError(f"{what}: {exc}")


def check_new_dir(dest: Path, overwrite: bool, what: str, hint: str = "pass overwrite=True") -> None:
    """Refuse a destination that is a file, or a non-empty directory unless `overwrite`."""
    if dest.is_symlink() or (dest.exists() and not dest.is_dir()):
        raise ConfigError(f"{what} {dest} exists and is not a directory")
    if dest.is_dir() and any(dest.iterdir()) and not overwrite:
        raise ConfigError(f"{what} {dest} exists and is not empty ({hint})")


def check_apart(dest: Path, store: Path, what: str, whose: str = "the store") -> None:
    """Refuse a `dest` that is `store`, lies inside it or contains it (resolved real paths)."""
    try:
        d, s = Path(os.path.realpath(dest)), Path(os.path.realpath(store))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot resolve {what} {dest}: {exc}") from exc
    if d == s or s in d.parents or d in s.parents:
        rel = "is" if d == s else "lies inside" if s in d.parents else "contains"
        raise ConfigError(f"{what} {dest} {rel} {whose} {store}: choose a path outside it")


# staging names: `.NAME.partial-PID-HEX` (being written, or an old copy after an exchange) and
# `.NAME.old-PID-HEX` (the old copy during a two-rename publish where exchange is unsupported)
_STAGING_RE = re.compile(r"^\.(?P<name>.+)\.(?P<kind>partial|old)-(?:(?P<pid>\d+)-)?[0-9A-Za-z_]+$")
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def is_staging(path: Path) -> bool:
    """Whether `path` is a staging or leftover directory of a checkpoint, export or import."""
    return _STAGING_RE.match(Path(path).name) is not None


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two existing paths (Linux renameat2); False where that is unsupported."""
    fn = getattr(_libc(), "renameat2", None)
    if fn is None:
        return False
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM):
        return False
    raise OSError(err, os.strerror(err), str(b))


_LIBC: list = []


def _libc():
    if not _LIBC:
        try:
            _LIBC.append(ctypes.CDLL(None, use_errno=True))
        except OSError:
            _LIBC.append(None)
    return _LIBC[0]


def publish_dir(staging: Path, dest: Path) -> None:
    """Make a fully written staging directory `dest`, replacing what was there.

    An existing `dest` is swapped with the staging directory in one atomic exchange, then the
    old content (now under the staging name) is removed: a kill at any point leaves `dest`
    complete, old or new. Where the file system cannot exchange, two renames are used and a
    kill between them leaves the old one under `.NAME.old-*`, which `recover_dest` (run by
    every later checkpoint, read and restore of `dest`) renames back.
    """
    if dest.is_dir() and not dest.is_symlink():
        if _exchange(staging, dest):
            fsync_dir(dest.parent)
            shutil.rmtree(staging, ignore_errors=True)  # the old content
            return
        old = dest.with_name(f".{dest.name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        os.replace(dest, old)
        os.replace(staging, dest)
        fsync_dir(dest.parent)
        shutil.rmtree(old, ignore_errors=True)
        return
    os.replace(staging, dest)
    fsync_dir(dest.parent)


def _pid_alive(pid: int) -> bool:
    """Whether process `pid` is running (a zombie counts as dead)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


def recover_dest(dest: Path) -> None:
    """Rename a complete `.NAME.old-*` copy back to a missing `dest` (a two-rename publish cut short)."""
    if dest.exists() or dest.is_symlink() or not dest.parent.is_dir():
        return
    olds = sorted((p for p in dest.parent.glob(f".{glob_escape(dest.name)}.old-*")
                   if is_staging(p) and p.is_dir() and not _writer_alive(p)),
                  key=lambda p: p.stat().st_mtime)
    if olds:
        try:
            os.replace(olds[-1], dest)
            fsync_dir(dest.parent)
        except OSError:
            pass


def _writer_alive(p: Path) -> bool:
    """Whether the process named in a staging directory's name (another one) is still running."""
    m = _STAGING_RE.match(p.name)
    pid = None if m is None or m.group("pid") is None else int(m.group("pid"))
    return pid is not None and pid != os.getpid() and _pid_alive(pid)


def glob_escape(name: str) -> str:
    """`name` with glob metacharacters escaped."""
    return re.sub(r"([*?\[])", r"[\1]", name)


def clean_stale(parent: Path) -> list[Path]:
    """Remove staging directories of dead processes in `parent`; returns what was removed."""
    gone: list[Path] = []
    try:
        entries = list(parent.iterdir())
    except OSError:
        return gone
    for p in entries:
        m = _STAGING_RE.match(p.name)
        if m is None or p.is_symlink() or not p.is_dir():
            continue
        if _writer_alive(p) or p in _ACTIVE:
            continue  # another live process's, or one of ours, being written
        if m.group("kind") == "old" and not (parent / m.group("name")).exists():
            recover_dest(parent / m.group("name"))
            continue
        shutil.rmtree(p, ignore_errors=True)
        gone.append(p)
    return gone


_ACTIVE: set[Path] = set()  # staging directories this process is writing now


def staging_dir(dest: Path) -> Path:
    """A fresh hidden sibling directory of `dest` to assemble it in (stale ones are removed first)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    clean_stale(dest.parent)
    recover_dest(dest)
    staging = dest.with_name(f".{dest.name}.partial-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    staging.mkdir()
    _ACTIVE.add(staging)
    return staging


def end_staging(staging: Path) -> None:
    """Forget (and remove, if still there) a staging directory of this process."""
    _ACTIVE.discard(staging)
    shutil.rmtree(staging, ignore_errors=True)
