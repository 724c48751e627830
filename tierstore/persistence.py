"""Checkpoints: flush, copy an MVCC snapshot of the LMDB file, publish it under a manifest.

Layout of a checkpoint directory: `data.mdb` (a compacted LMDB copy of the whole store, taken in
one read transaction right after the flush) and `MANIFEST.json` (written last, with a checksum of
its own content). The directory is assembled under a hidden sibling name (`.NAME.partial-PID-*`)
and published by one atomic exchange of the two directories (`renameat2(RENAME_EXCHANGE)`), so
`dest` is at every instant either the complete old checkpoint or the complete new one (see
docs/reliability.md). Staging directories left by a killed process are removed by the next
checkpoint, export or import in the same parent directory.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import tierstore.validate as validate

from ._version import __version__
from .backends.format import FORMAT_VERSION, ROW_FORMATS
from .backends.lmdb_backend import LOCK_NAME, LmdbBackend, lmdb_errors
from .backends.lmdb_log import unlink_log_dir
from .backends.wal import replay_stored
from .config import TableSpec
from .errors import (
    ConfigError,
    ConfigMismatchError,
    StoreCorruptError,
    StoreLockedError,
    TierstoreError,
)
from .fsops import (  # noqa: F401 (re-exported: export, quantize, integration and tests import them here)
    check_apart,
    check_new_dir,
    clean_stale,
    end_staging,
    file_digest,
    fsync_dir,
    glob_escape,
    is_staging,
    os_error,
    publish_dir,
    recover_dest,
    staging_dir,
    write_json_atomic,
)

if TYPE_CHECKING:
    from .store import TierStore

CHECKPOINT_FORMAT = "tierstore-checkpoint"
CHECKPOINT_VERSION = 1
MANIFEST = "MANIFEST.json"
DATA = "data.mdb"
_CHUNK = 8 << 20


# manifest checksums ----------------------------------------------------------------------------
DIGEST_KEY = "manifest_sha256"


def manifest_digest(manifest: dict) -> str:
    """sha256 of a manifest's canonical JSON, without its own checksum field."""
    body = {k: v for k, v in manifest.items() if k != DIGEST_KEY}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()


def seal(manifest: dict) -> dict:
    """Add the manifest's checksum of its own content."""
    manifest[DIGEST_KEY] = manifest_digest(manifest)
    return manifest


def check_seal(manifest: dict, path: Path, kind: str) -> None:
    """StoreCorruptError when a manifest's content does not match its checksum.

    Manifests written before checksums existed have none; they get the cross-checks only.
    """
    want = manifest.get(DIGEST_KEY)
    if want is None:
        return
    try:
        got = manifest_digest(manifest)
    except (TypeError, ValueError) as exc:
        raise StoreCorruptError(f"{kind} manifest {path} is malformed: {exc}") from exc
    if got != want:
        raise StoreCorruptError(
            f"{kind} manifest {path} was changed after it was written (its checksum does not "
            f"match its content)")


# checkpoint ------------------------------------------------------------------------------------
class PendingCheckpoint:
    """A checkpoint whose snapshot is being copied in a background thread; `wait()` for it."""

    def __init__(self, dest: Path, pause_s: float) -> None:
        self.dest = dest
        self.pause_s = pause_s
        self._manifest: dict | None = None
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def settle(self, manifest: dict | None = None, error: BaseException | None = None) -> None:
        """Record the copy's outcome: its manifest, or the error `wait` re-raises."""
        self._manifest, self._error = manifest, error

    def attach(self, thread: threading.Thread) -> None:
        """Record the thread that copies the checkpoint (`done` and `wait` follow it)."""
        self._thread = thread

    def done(self) -> bool:
        """Whether the copy has finished (successfully or not)."""
        return self._thread is None or not self._thread.is_alive()

    def wait(self) -> dict:
        """Block until the checkpoint is published; return its manifest or raise its error."""
        if self._thread is not None:
            self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._manifest is not None
        return self._manifest


def start_checkpoint(store: TierStore, dest: str | os.PathLike, *, step: int | None = None,
                     extra: dict | None = None, overwrite: bool = False) -> PendingCheckpoint:
    """Hand `store`'s dirty rows to its write-behind log, then snapshot and copy it to `dest`
    in a background thread.

    The caller may keep training as soon as this returns (the pause: dirty rows down to the log
    and the log's merges held at that point). The background thread merges the log up to the
    point into the tables, publishes it to serving readers, takes the snapshot (an LMDB read
    transaction: later writes do not reach it) and copies it. Call `wait()` on the result to
    get the manifest.
    """
    dest = Path(dest)
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        raise ConfigError(f"step must be an int >= 0 or None, got {step!r}")
    extra = validate.json_extra(extra)  # before the flush and the copy
    store.check_live()
    if is_staging(dest):
        raise ConfigError(f"{dest} is a staging directory name; choose another destination")
    check_apart(dest, store.path, "checkpoint destination")
    check_new_dir(dest, overwrite, "checkpoint destination")
    try:
        staging = staging_dir(dest)
    except OSError as exc:
        raise os_error(exc, f"cannot create checkpoint {dest}") from exc
    backend = store.backend
    try:
        backend.wait_for_copies()  # one copy at a time (before the hold: its thread ends it)
        t0 = time.perf_counter()
        mark = store.hold_for_snapshot()  # rows down to the log, merges held at its end
        pause = time.perf_counter() - t0
    except BaseException:
        end_staging(staging)
        raise
    pending = PendingCheckpoint(dest, pause)
    created = time.time()

    def copy() -> None:
        t1 = time.perf_counter()
        try:
            txn = store.snapshot_at(mark)  # the log merged up to the pause, then a snapshot
            try:
                meta = backend.snapshot_meta(txn)
                tables = [TableSpec.from_config(v) for k, v in sorted(meta.items())
                          if k.startswith("table:")]
                counts = {t.name: backend.snapshot_count(txn, t.name) for t in tables}
                head = {"format": CHECKPOINT_FORMAT, "version": CHECKPOINT_VERSION,
                        "store_format_version": (meta.get("store") or {}).get("format_version",
                                                                              FORMAT_VERSION),
                        "tierstore_version": __version__,
                        "created_unix": created, "step": step, "extra": extra,
                        "seed": (meta.get("store") or {}).get("seed", store.seed),
                        "tables": [{"spec": t.to_config(), "rows_stored": counts[t.name]}
                                   for t in tables],
                        "pause_s": pause}
                backend.copy_snapshot(staging, txn, compact=True)
            finally:
                txn.abort()
            data = staging / DATA
            with open(data, "rb+") as f:
                os.fsync(f.fileno())
            size, digest = file_digest(data)
            manifest = seal({**head, "files": {DATA: {"bytes": size, "sha256": digest}},
                             "copy_s": time.perf_counter() - t1})
            write_json_atomic(staging / MANIFEST, manifest)
            publish_dir(staging, dest)
            pending.settle(manifest=manifest)
        except OSError as exc:
            pending.settle(error=os_error(exc, f"cannot write checkpoint {dest}"))
        except BaseException as exc:  # re-raised by wait()
            pending.settle(error=exc)
        finally:
            end_staging(staging)

    thread = threading.Thread(target=copy, name=f"tierstore-checkpoint-{dest.name}", daemon=False)
    pending.attach(thread)
    try:
        backend.track_copy(thread)
        thread.start()
    except BaseException:  # no thread to end the hold: end it here
        store.log.thaw()
        end_staging(staging)
        raise
    return pending


def checkpoint(store: TierStore, dest: str | os.PathLike, *, step: int | None = None,
               extra: dict | None = None, overwrite: bool = False) -> dict:
    """Flush, snapshot and copy the store to `dest`; returns the manifest once it is durable."""
    with lmdb_errors(store.path):
        return start_checkpoint(store, dest, step=step, extra=extra, overwrite=overwrite).wait()


def load_manifest(directory: Path, name: str, kind: str, fmt: str, version: int,
                  hint: str = "") -> dict:
    """The JSON manifest `directory/name` of a `kind` ("checkpoint", "export") of format `fmt`.

    Raises StoreCorruptError when it is missing, unreadable or foreign, ConfigMismatchError when
    its format version is not `version` (`hint` says what to do instead).
    """
    path = directory / name
    if not directory.is_dir():
        raise StoreCorruptError(f"{directory} is not a {kind} directory")
    if not path.is_file():
        raise StoreCorruptError(f"{directory} is not a complete {kind} (no {name})")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise StoreCorruptError(f"{kind} manifest {path} is unreadable: {exc}") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != fmt:
        raise StoreCorruptError(f"{path} is not a tierstore {kind} manifest")
    if manifest.get("version") != version:
        raise ConfigMismatchError(
            f"{kind} {directory} has format version {manifest.get('version')!r}; this tierstore "
            f"reads version {version}{hint}")
    return manifest


def read_manifest(dest: str | os.PathLike) -> dict:
    """The manifest of a complete checkpoint; raises on a missing, foreign or corrupt one."""
    dest = Path(dest)
    if is_staging(dest):
        raise StoreCorruptError(
            f"{dest} is a staging directory of a checkpoint, export or import that did not "
            f"finish (or the old copy of one that did); it is not a checkpoint")
    recover_dest(dest)
    manifest = load_manifest(dest, MANIFEST, "checkpoint", CHECKPOINT_FORMAT, CHECKPOINT_VERSION,
                             " (use `tierstore export` to move across versions)")

    if manifest.get("store_format_version") not in ROW_FORMATS:  # 2 is converted when opened
        raise ConfigMismatchError(
            f"checkpoint {dest} holds a store of format version "
            f"{manifest.get('store_format_version')!r}; this tierstore reads {FORMAT_VERSION}")
    check_seal(manifest, dest / MANIFEST, "checkpoint")
    try:
        manifest["specs"] = [TableSpec.from_config(t["spec"]) for t in manifest["tables"]]
        files = manifest["files"][DATA]
        int(files["bytes"]), str(files["sha256"]), int(manifest["seed"])
        for t in manifest["tables"]:
            if int(t["rows_stored"]) < 0:
                raise ValueError(f"negative row count for table {t['spec']['name']!r}")
    except (KeyError, TypeError, ValueError, TierstoreError) as exc:
        raise StoreCorruptError(f"checkpoint manifest {dest / MANIFEST} is malformed: {exc!r}") from exc
    return manifest


def cross_check(dest: Path, manifest: dict) -> None:
    """StoreCorruptError when a checkpoint's manifest disagrees with its data file's metadata.

    The table specs (optimizer hyperparameters included) and the seed the manifest lists must be
    the ones stored inside `data.mdb` itself.
    """
    with lmdb_errors(dest):
        backend = LmdbBackend(dest, readonly=True)
        try:
            meta = {k: backend.get_meta(k) for k in backend.meta_keys()}
        finally:
            backend.close()
    stored = {k[6:]: TableSpec.from_config(v).to_config() for k, v in meta.items()
              if k.startswith("table:") and v is not None}
    listed = {s.name: s.to_config() for s in manifest["specs"]}
    if stored != listed:
        diff = sorted(n for n in set(stored) | set(listed) if stored.get(n) != listed.get(n))
        raise StoreCorruptError(
            f"checkpoint {dest}: the manifest's tables disagree with {DATA} for {diff}")
    seed = (meta.get("store") or {}).get("seed")
    if seed is not None and seed != manifest["seed"]:
        raise StoreCorruptError(
            f"checkpoint {dest}: the manifest says seed {manifest['seed']}, {DATA} says {seed}")


def verify_checkpoint(dest: str | os.PathLike) -> dict:
    """Check a checkpoint's manifest, file sizes and checksums; returns the manifest."""
    dest = Path(dest)
    manifest = read_manifest(dest)
    want = manifest["files"][DATA]
    data = dest / DATA
    if not data.is_file():
        raise StoreCorruptError(f"checkpoint {dest} is missing {DATA}")
    size, digest = file_digest(data)
    if size != want["bytes"] or digest != want["sha256"]:
        raise StoreCorruptError(
            f"checkpoint {dest}: {DATA} is corrupt or truncated ({size} bytes, sha256 "
            f"{digest[:12]}...; manifest says {want['bytes']} bytes, {want['sha256'][:12]}...)")
    cross_check(dest, manifest)
    return manifest


# restore ---------------------------------------------------------------------------------------
@contextmanager
def writer_lock(path: Path, doing: str = "restoring") -> Iterator[None]:
    """Hold the store's writer lock (the one TierStore takes) for the duration."""
    fd = os.open(path / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            raise StoreLockedError(
                f"store {path} is open for writing elsewhere; close it before {doing}") from exc
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _copy_verified(src: Path, dst: Path, size: int, sha256: str) -> None:
    """Copy `src` to `dst` in chunks, checking size and checksum on the way; fsyncs `dst`."""
    h = hashlib.sha256()
    n = 0
    with open(src, "rb") as fi, open(dst, "wb") as fo:
        while chunk := fi.read(_CHUNK):
            h.update(chunk)
            fo.write(chunk)
            n += len(chunk)
        fo.flush()
        os.fsync(fo.fileno())
    if n != size or h.hexdigest() != sha256:
        raise StoreCorruptError(
            f"checkpoint file {src} is corrupt or truncated ({n} bytes, manifest says {size})")


def restore_files(dest: str | os.PathLike, path: str | os.PathLike, *, seed: int | None = None,
                  tables: list[TableSpec] | None = None) -> tuple[list[TableSpec], int]:
    """Replace the store files at `path` with the checkpoint at `dest`; returns (tables, seed) to open.

    `tables`/`seed` default to the checkpoint's (a given seed must match it). The checkpoint
    is verified while it is copied; on any error the store at `path` is left as it was.
    `TierStore.restore` opens the result.
    """
    dest, path = Path(dest), Path(path)
    manifest = read_manifest(dest)
    seed = manifest["seed"] if seed is None else seed
    if seed != manifest["seed"]:
        raise ConfigMismatchError(f"checkpoint {dest} has seed {manifest['seed']}, given {seed}")
    tables = manifest["specs"] if tables is None else tables
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        raise ConfigError(f"store path {path} exists and is not a directory")
    check_apart(path, dest, "store path", "the checkpoint")
    src = dest / DATA
    if not src.is_file():
        raise StoreCorruptError(f"checkpoint {dest} is missing {DATA}")
    if src.stat().st_size != int(manifest["files"][DATA]["bytes"]):
        raise StoreCorruptError(f"checkpoint file {src} is corrupt or truncated "
                                f"({src.stat().st_size} bytes, manifest says "
                                f"{manifest['files'][DATA]['bytes']})")
    cross_check(dest, manifest)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise os_error(exc, f"cannot create store directory {path}") from exc
    with writer_lock(path):
        tmp = path / f".{DATA}.restore-{uuid.uuid4().hex[:8]}"
        try:
            want = manifest["files"][DATA]
            _copy_verified(src, tmp, int(want["bytes"]), str(want["sha256"]))
            # a write-behind log left by a crash belongs to the replaced file: it goes first, so
            # its entries are never replayed onto the checkpoint's rows (a crash between leaves
            # the old store at its last flush, which its crash guarantee allows)
            unlink_log_dir(path)
            (path / "lock.mdb").unlink(missing_ok=True)  # reader table of the replaced file, first
            os.replace(tmp, path / DATA)  # (a reader never pairs the new file with the old table)
            fsync_dir(path)
        except OSError as exc:
            raise os_error(exc, f"cannot restore into {path}") from exc
        finally:
            tmp.unlink(missing_ok=True)
    return tables, seed


# compaction ------------------------------------------------------------------------------------
def compact(path: str | os.PathLike, progress: Callable[[int], None] | None = None) -> dict:
    """Rewrite a closed store's file in key order (full pages, no free pages); returns sizes.

    `progress` gets the rows copied after each chunk (the `tierstore compact` progress bar).

    Takes the store's writer lock (`StoreLockedError` while it is open elsewhere). The new file
    is written beside the old one and renamed over it, so a crash leaves one or the other.
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"store path {path} exists and is not a directory")
    if not (path / DATA).is_file():
        raise StoreCorruptError(f"{path} holds no tierstore data (no {DATA})")
    with writer_lock(path, "compacting"):  # not open elsewhere (StoreLockedError) ...
        LmdbBackend(path, readonly=True).close()  # ... and a tierstore store, or raise
    t0 = time.perf_counter()
    backend = LmdbBackend(path)
    try:
        replay_stored(backend)  # a write-behind log left by a crash is folded in first
        before, after = backend.compact(reopen=False, progress=progress)
    finally:
        backend.close()
    return {"path": str(path), "bytes_before": before, "bytes_after": after,
            "seconds": time.perf_counter() - t0}
