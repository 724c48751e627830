"""Snapshot reads of a store's LMDB environment, without the writer lock (read-only serving).

`SnapshotReader` opens the environment read-only (LMDB's reader table, `lock.mdb`, registers
its snapshot so the writer never reuses the pages it sees) and reads rows from one read
transaction: an MVCC snapshot that later commits do not change. A row is the value the writer
published at its last flush: the undo value `u:<table>[row]` when the writer overwrote it since
(an empty undo value: not stored at the flush), else `t:<table>[row]` (see publish.py).

py-lmdb allows one environment per store directory in a process, so:
- readers in a process without a writer of the store share one read-only environment
  (`_SharedEnv`); a reader that finds it stale (a compaction renamed a new file in) reopens it
  for all of them, and the others begin a new snapshot at their next call;
- a reader in the writer's process borrows the writer's environment, with the database handles
  the writer's publisher opened up front (opening one would take a write transaction and wait for
  the background writer). The writer's map growth, compaction or close then invalidates the
  snapshot, and `get` raises `SnapshotLostError` (the caller begins a new snapshot).

A chunked table (a format-4 store's table without a `t:<table>` database: an export of one
writes B-trees) is read through a manifest and the ranges it names (`pagechunks.lookup`): the
published manifest (`publish.published_manifests`) where the marker is covered (the writer keeps
the ranges it names unchanged while readers are registered), else the current one
(`chunks:<table>` in the metadata: no writer alive).

In another process a snapshot survives the writer's map growth (`MDB_MAP_RESIZED` is adopted at
the next `begin`) and compaction (the old file stays mapped until `begin` sees a new inode).
"""

from __future__ import annotations

import json
import operator
import os
import threading
import weakref
from dataclasses import dataclass
from itertools import repeat
from pathlib import Path

import lmdb
import numpy as np

from .._kernels import HAVE_NUMBA
from ..errors import StoreCorruptError, TierstoreError
from .format import CHUNK_FORMAT
from .lmdb_backend import DATA_NAME, META_DB, encode_keys
from .lmdb_meta import check_file_size
from .pagechunks import lookup
from .pages import PageReader
from .publish import PUBLISH_DB, PUBLISHED, UNDO_PREFIX, parse_marker, published_manifests
from .record import CHECK_BYTES, open_records, open_values
from .writers import live_writer

LOCK_FILE = "lock.mdb"
_RETRIES = 50


class SnapshotLostError(TierstoreError):
    """The snapshot became unusable (the writer in this process remapped, compacted or closed)."""


@dataclass(frozen=True)
class Snapshot:
    """What one read transaction sees: its LMDB txn id, the published flush marker and metadata."""

    txn_id: int
    epoch: int | None  # the writer's flush count at the snapshot; None: no marker (export, old store)
    covered: bool  # every row written since that flush kept its flushed value (see publish.py)
    meta: dict[str, dict]


def _wanted(name: bytes) -> bool:
    """Whether a reader reads this database (metadata, the publish marker, tables, undo values)."""
    return name in (META_DB, PUBLISH_DB) or name.startswith((b"t:", UNDO_PREFIX.encode()))


def _ino(path: Path) -> int:
    try:
        return path.stat().st_ino
    except OSError:
        return -1


def _inos(path: Path) -> tuple[int, int]:
    return _ino(path / DATA_NAME), _ino(path / LOCK_FILE)


class _SharedEnv:
    """The read-only environment of one store directory, shared by this process's readers of it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.mu = threading.RLock()  # every use of the environment and of its users' txns
        self.env = None
        self.inos = (-1, -1)
        self.gen = 0  # bumped at each (re)open
        self.users: weakref.WeakSet = weakref.WeakSet()

    def stale(self) -> bool:
        """Whether the environment is closed or no longer the store's current data file."""
        return self.env is None or _ino(self.path / DATA_NAME) != self.inos[0]

    def reopen(self) -> None:
        """(Re)open the environment; the users' snapshots are lost (they begin new ones)."""
        self.close()
        for _ in range(_RETRIES):
            before = _inos(self.path)
            try:
                env = lmdb.open(str(self.path), readonly=True, lock=True, subdir=True,
                                max_dbs=4096, readahead=False)
            except lmdb.Error as exc:
                raise StoreCorruptError(f"cannot open LMDB store at {self.path}: {exc}") from exc
            try:  # LMDB maps the map size: a page past the file's end would be SIGBUS, not an error
                check_file_size(env, self.path / DATA_NAME, self.path)
            except BaseException:
                env.close()
                raise
            if _inos(self.path) == before:  # not swapped by a compaction while opening
                self.env, self.inos = env, before
                self.gen += 1
                return
            env.close()
        raise StoreCorruptError(f"{self.path}: its files keep changing; cannot open a snapshot")

    def close(self) -> None:
        """Abort every user's snapshot and close the environment."""
        for user in list(self.users):
            user.lose()
        if self.env is not None:
            self.env.close()
            self.env = None


_SHARED: dict[str, _SharedEnv] = {}
_SHARED_MU = threading.Lock()


def _key(path: Path) -> str:
    return os.path.realpath(path)


def release_readers(path: Path) -> None:
    """Close this process's shared reader environment on `path` (a handle opens it for itself).

    py-lmdb allows one environment per directory in a process; those readers borrow the
    writer's environment (or reopen their own) at their next call, on a new snapshot.
    """
    with _SHARED_MU:
        share = _SHARED.pop(_key(path), None)
    if share is not None:
        with share.mu:
            share.close()


class _FileSwapped(SnapshotLostError):
    """A chunk read found its snapshot's file replaced by a compaction (no page reader for it)."""


class SnapshotReader:
    """Reads rows of a store from one MVCC snapshot, never taking the writer lock."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        if not (self.path / DATA_NAME).exists():
            raise StoreCorruptError(f"{self.path} holds no tierstore data (no {DATA_NAME})")
        self.env = None
        self.reopens = 0  # snapshots lost to a compaction / remap / writer open or close
        self._backend = None  # the in-process writer whose environment is borrowed
        self._share: _SharedEnv | None = None  # or the process's shared read-only environment
        self._gen = 0
        self._txn = None
        self._dbs: dict[str, object] = {}
        self._undo: dict[str, object] = {}
        self._chunks: dict[str, tuple[list[int], list]] | None = None  # chunked: table -> ranges
        self._pages: PageReader | None = None  # checks the search paths of misses
        self._attach()

    # environment -------------------------------------------------------------------------
    def _guard(self):
        """The lock under which this reader uses its environment."""
        return self._backend.reading() if self._backend is not None else self._share.mu

    def _attach(self) -> None:
        """Borrow the in-process writer's environment, or join (opening) the shared one."""
        self._backend = live_writer(self.path)
        self._pages = None  # made for the environment attached now (pages.py: pinned to its file)
        if self._backend is not None:
            self.env = self._backend.env
            return
        with _SHARED_MU:
            share = _SHARED.get(_key(self.path))
            if share is None:
                share = _SHARED[_key(self.path)] = _SharedEnv(self.path)
            with share.mu:
                if share.stale():
                    share.reopen()
                share.users.add(self)
                self._share, self.env, self._gen = share, share.env, share.gen

    def lose(self) -> None:
        """The shared environment is being closed (caller holds its lock): drop our snapshot."""
        if self._txn is not None:
            try:
                self._txn.abort()
            except lmdb.Error:
                pass
            self._txn = None
            self.reopens += 1
        self._dbs, self._undo, self._chunks = {}, {}, None

    def _detach(self) -> None:
        if self._backend is not None:
            self._abort()
        elif self._share is not None:
            share = self._share
            with _SHARED_MU, share.mu:  # the order `_attach` takes them in
                self._abort()
                share.users.discard(self)
                if not share.users:
                    if _SHARED.get(_key(self.path)) is share:
                        del _SHARED[_key(self.path)]
                    share.close()
        self.env, self._backend, self._share = None, None, None
        self._dbs, self._undo = {}, {}

    def _stale(self) -> bool:
        """Whether the environment is no longer the store's current one."""
        if self._backend is not None:
            return self._backend.env is not self.env
        share = self._share
        return share is None or share.gen != self._gen or share.stale() or \
            live_writer(self.path) is not None

    def _abort(self) -> None:
        if self._txn is not None:
            with self._guard():  # never abort while the writer remaps the borrowed environment
                try:
                    self._txn.abort()
                except lmdb.Error:
                    pass
            self._txn = None

    # snapshots ---------------------------------------------------------------------------
    def begin(self) -> Snapshot:
        """Start a new read transaction (releasing the previous one); what it sees."""
        for _ in range(_RETRIES):
            if self.env is None or self._stale():
                if self.env is not None:
                    self.reopens += 1
                self._detach()
                self._attach()
            self._abort()
            try:
                return self._begin()
            except lmdb.MapResizedError:
                with self._guard():
                    if self._share is not None and self.env is self._share.env:
                        self.env.set_mapsize(0)  # adopt the size another process grew the map to
            except lmdb.Error:
                self._detach()  # an environment that was remapped or closed meanwhile
                self.reopens += 1
        raise SnapshotLostError(f"{self.path}: cannot begin a snapshot")

    def _begin(self) -> Snapshot:
        with self._guard():  # the writer's map growth (or another reader's reopen) waits for this
            if self._backend is not None:
                if self._backend.env is not self.env:  # reopened or closed meanwhile: retry
                    raise lmdb.Error("the writer's environment changed")
                return self._begin_in(self.env, self._borrowed_handles)
            if self._share.env is not self.env:
                raise lmdb.Error("the shared environment was reopened")
            return self._begin_in(self.env, self._own_handles)

    def _borrowed_handles(self, env, names: set[bytes]) -> dict[bytes, object]:
        """The writer's handles, opened before its background writer ran (publish.py).

        Opening a handle on the writer's environment would take a write transaction and wait
        for the background writer: a reader must never wait on the writer.
        """
        publisher = self._backend.publisher
        handles = {} if publisher is None else dict(publisher.handles)
        if any(n not in handles for n in names if _wanted(n)):
            raise lmdb.Error("a database of the store has no handle in the writer yet")
        return handles

    @staticmethod
    def _own_handles(env, names: set[bytes]) -> dict[bytes, object]:
        """Handles opened on a read-only environment (a read transaction: never waits)."""
        # without a txn: py-lmdb keeps the handle (cached per name) past its own short txn
        return {n: env.open_db(n, create=False) for n in names if _wanted(n)}

    def _begin_in(self, env, open_handles) -> Snapshot:
        with env.begin() as t:  # handles must exist before the snapshot that uses them
            names = {k for k, _ in t.cursor()}
        handles = open_handles(env, names)
        txn = env.begin()
        try:
            if {k for k, _ in txn.cursor()} - names:  # a database created meanwhile: retry
                raise lmdb.Error("databases changed while opening a snapshot")
            meta = {}
            if META_DB in handles:
                try:
                    meta = {k.decode(): json.loads(v) for k, v in txn.cursor(db=handles[META_DB])}
                except ValueError as exc:
                    raise StoreCorruptError(f"store {self.path}: metadata is not valid JSON") from exc
            marker = None
            if PUBLISH_DB in handles:
                raw = txn.get(PUBLISHED, db=handles[PUBLISH_DB])
                marker = parse_marker(raw, self.path) if raw else None
        except BaseException:
            txn.abort()
            raise
        self._txn = txn
        self._dbs = {n[2:].decode(): h for n, h in handles.items() if n.startswith(b"t:")}
        pre = UNDO_PREFIX.encode()
        self._undo = {n[len(pre):].decode(): h for n, h in handles.items() if n.startswith(pre)}
        self._chunks = None
        if (meta.get("store") or {}).get("format_version") == CHUNK_FORMAT:
            self._chunks = self._manifests(txn, handles, meta, marker)
        return Snapshot(txn.id(), None if marker is None else int(marker["epoch"]),
                        True if marker is None else bool(marker["covered"]), meta)

    def _manifests(self, txn, handles: dict, meta: dict, marker: dict | None
                   ) -> dict[str, tuple[list[int], list]]:
        """The ranges ((bounds, names) a table) the snapshot reads a chunked store's rows from."""
        if marker is not None and marker.get("covered", True):  # the last publish's manifests
            pubs = published_manifests(txn, handles[PUBLISH_DB], self.path)
            return {t: (m["bounds"], m["names"]) for t, m in pubs.items()}
        out = {}  # no writer since (or an export): the current manifests are the state
        for key, rec in meta.items():
            if key.startswith("chunks:"):
                try:
                    out[key[len("chunks:"):]] = ([int(b) for b in rec["bounds"]],
                                                 [None if n is None else n.encode()
                                                  for n in rec["names"]])
                except (KeyError, TypeError, ValueError, AttributeError) as exc:
                    raise StoreCorruptError(f"store {self.path}: the chunk manifest {key!r} "
                                            f"is damaged") from exc
        return out

    def _chunk_get(self, table: str, rows: np.ndarray, width: int
                   ) -> tuple[np.ndarray, np.ndarray]:
        """`get` of a chunked table, through the snapshot's manifest (caller holds the guard)."""
        n = len(rows)
        out = np.zeros((n, width), dtype=np.float32)
        found = np.zeros(n, dtype=bool)
        man = self._chunks.get(table)
        if n == 0 or man is None:
            return out, found
        ids, inv = np.unique(np.asarray(rows, dtype=np.int64), return_inverse=True)
        got = np.zeros((len(ids), width), dtype=np.float32)
        hit = np.zeros(len(ids), dtype=bool)
        bounds, names = man
        cuts = [0, *np.searchsorted(ids, np.array(bounds[1:], dtype=np.int64)).tolist(), len(ids)]
        pages = self._reader()
        if pages is None and not HAVE_NUMBA:
            raise StoreCorruptError(f"store {self.path}: chunked tables are read by the page "
                                    f"walker, which needs numba")
        if pages is None:  # a compaction swapped the file under the snapshot: a new one reads
            # the new file (B-tree reads fall back to py-lmdb instead; `get` drops this one)
            raise _FileSwapped(f"{self.path}: snapshot lost (the file was compacted)")
        for r, name in enumerate(names):
            lo, hi = cuts[r], cuts[r + 1]
            if name is None or lo == hi:
                continue
            part = lookup(pages, self._txn, name, table, ids[lo:hi], width, f"store {self.path}, ")
            if part is None:
                raise StoreCorruptError(f"store {self.path}: chunk range {name!r} of table "
                                        f"{table!r} holds a layout chunks never use")
            got[lo:hi], hit[lo:hi] = part
        return got[inv.ravel()], hit[inv.ravel()]

    def get(self, table: str, rows: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
        """Rows as of the snapshot: (rows float32 [n, width], found bool [n]); missing: zeros.

        `width` is the stored row's float32 columns (a store's `row_dim`); every record's
        checksum is verified (`StoreCorruptError` on damage).
        """
        n = len(rows)
        out = np.zeros((n, width), dtype=np.float32)
        found = np.zeros(n, dtype=bool)
        order = np.argsort(rows, kind="stable")
        keys = encode_keys(rows[order])
        if self._txn is None or (self._backend is None and self._share is None):
            raise SnapshotLostError("no snapshot: call begin() first")
        try:
            with self._guard():  # the writer's map growth (or another reader's reopen) waits
                if self._txn is None:  # lost meanwhile (a reader of this process reopened)
                    raise SnapshotLostError(f"{self.path}: snapshot lost (reopened)")
                if self._chunks is not None and table not in self._dbs:  # (an export: B-trees)
                    return self._chunk_get(table, rows, width)
                db = self._dbs.get(table)
                if n == 0 or db is None:
                    return out, found
                got = self._walk(table, rows[order], width)
                if got is None:
                    self._check_paths(table, rows[order])
                    vals = self._read(db, self._undo.get(table), keys)
        except lmdb.Error as exc:
            self.reopens += 1
            self._abort()
            raise SnapshotLostError(f"{self.path}: snapshot lost ({exc})") from exc
        except _FileSwapped:  # a chunk read whose file was swapped by a compaction
            self.reopens += 1
            self._abort()
            raise
        if got is not None:  # read by the page walker: records copied out of the snapshot's pages
            data, hit = got
            if hit.any():
                srt = rows[order]
                out[order[hit]] = open_records(table, srt[hit], data[hit].ravel(), width,
                                               f"store {self.path}, ")
                found[order[hit]] = True
            return out, found
        hit = np.fromiter(map(operator.truth, vals), dtype=bool, count=n)  # None and b"": absent
        open_values(table, rows, order, vals, hit, out, found, f"store {self.path}, ")
        return out, found

    def _walk(self, table: str, srt: np.ndarray, width: int
              ) -> tuple[np.ndarray, np.ndarray] | None:
        """Records and found mask of sorted rows read by the page walker (pages.py), or None
        where py-lmdb must read them: no numba, undo values to merge, a layout it does not read."""
        undo = self._undo.get(table)
        if self._reader() is None or (undo is not None and self._txn.stat(undo)["entries"]):
            return None
        return self._pages.lookup(self._txn.get(b"t:" + table.encode()), srt.astype(np.uint64),
                                  width * 4 + CHECK_BYTES)

    def _reader(self) -> PageReader | None:
        """This environment's page reader (made on first use), or None without numba."""
        if not HAVE_NUMBA:
            return None
        if self._pages is None:  # opened while our snapshot is held: unless a compaction swapped
            # the file in between (its new inode), this is the file the snapshot's pages are in
            pages = PageReader(self.path / DATA_NAME, self.env.stat()["psize"])
            if self._share is not None and _ino(self.path / DATA_NAME) != self._share.inos[0]:
                return None
            self._pages = pages
        return self._pages

    def _check_paths(self, table: str, srt: np.ndarray) -> None:
        """Check the pages on the rows' search paths before py-lmdb walks them (pages.py)."""
        if self._reader() is None:
            return
        self._pages.check_paths(self._txn.get(b"t:" + table.encode()), srt.astype(np.uint64),
                                self._txn.id())

    def _read(self, db, undo, keys: list[bytes]) -> list:
        """Values of sorted keys: the undo value where one exists, else the table's."""
        txn = self._txn
        vals = list(map(txn.cursor(db=db).get, keys))  # a C loop; a missing key gives None
        if undo is not None and txn.stat(undo)["entries"]:
            uvals = list(map(txn.cursor(db=undo).get, keys))
            has = np.fromiter(map(operator.is_not, uvals, repeat(None)), dtype=bool,
                              count=len(keys))
            if has.any():  # rows rewritten since the flush: their undo values
                out = np.empty(len(keys), dtype=object)
                out[:] = vals
                pick = np.empty(len(keys), dtype=object)
                pick[:] = uvals
                out[has] = pick[has]
                vals = out.tolist()
        return vals

    @property
    def borrowed(self) -> bool:
        """Whether this reader uses the environment of a writer in the same process."""
        return self._backend is not None

    def close(self) -> None:
        """Release the snapshot and the environment."""
        self._detach()
