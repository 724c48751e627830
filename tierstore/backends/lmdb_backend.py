"""The SSD tier: one LMDB environment, one named database per table, batched transactions."""

from __future__ import annotations

import errno
import fcntl
import json
import operator
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from itertools import islice, repeat
from pathlib import Path

import lmdb
import numpy as np

from ..errors import OutOfSpaceError, StoreCorruptError, StoreLockedError, TierstoreError

META_DB = b"__tierstore_meta__"
LOCK_NAME = "tierstore.lock"
_INITIAL_MAP = 1 << 30
_KEY_DTYPE = np.dtype(">u8")  # big-endian: byte order == row id order
_KEY_VOID = np.dtype("V8")  # raw 8-byte records: `.tolist()` gives `bytes` (no NUL stripping)


def encode_keys(rows: np.ndarray) -> list[bytes]:
    """Encode row ids as 8-byte big-endian keys that sort like the ids."""
    # one C pass: a void view's tolist() yields one 8-byte `bytes` per id ("S8" would strip NULs)
    return np.ascontiguousarray(rows, dtype=_KEY_DTYPE).ravel().view(_KEY_VOID).tolist()


def decode_keys(keys: list[bytes]) -> np.ndarray:
    """Inverse of `encode_keys`."""
    return np.frombuffer(b"".join(keys), dtype=_KEY_DTYPE).astype(np.int64)


class LmdbBackend:
    """Rows on disk in LMDB: batched reads, batched writes in one transaction, durable sync.

    The map grows automatically before it fills (up to `map_limit` bytes when given).
    A lock file held with `flock` keeps a second writer (another process or handle) out.
    """

    def __init__(self, path: str | os.PathLike, *, readonly: bool = False,
                 map_limit: int | None = None) -> None:
        self.path = Path(path)
        self.readonly = readonly
        self.map_limit = map_limit
        self._lock_fd: int | None = None
        self._io = threading.Condition()  # background readers vs. map resizing
        self._readers = 0
        self._resizing = False
        self._io = threading.Condition()  # background readers vs. map resizing
        self._readers = 0
        self._resizing = False
        if self.path.exists() and not self.path.is_dir():
            raise TierstoreError(f"store path {self.path} exists and is not a directory")
        if not readonly:
            self.path.mkdir(parents=True, exist_ok=True)
            self._acquire_lock()
        elif not (self.path / "data.mdb").exists():
            raise StoreCorruptError(f"{self.path} holds no tierstore data (no data.mdb)")
        try:
            start = _INITIAL_MAP if map_limit is None else min(_INITIAL_MAP, map_limit)
            self.env = lmdb.open(str(self.path), map_size=start, max_dbs=4096, subdir=True,
                                 readonly=readonly, lock=not readonly, sync=False,
                                 metasync=False, readahead=False, meminit=False)
        except lmdb.Error as exc:
            self._release_lock()
            raise StoreCorruptError(f"cannot open LMDB store at {self.path}: {exc}") from exc
        self._dbs: dict[str, object] = {}
        self._copy_thread: threading.Thread | None = None
        try:
            self.check_file()
            self._meta = self.env.open_db(META_DB, create=not readonly)
        except StoreCorruptError:
            self.close()
            raise
        except lmdb.Error as exc:
            self.close()
            raise StoreCorruptError(
                f"store at {self.path} has no tierstore metadata: {exc}") from exc

    # locking ------------------------------------------------------------------------
    def _acquire_lock(self) -> None:
        fd = os.open(self.path / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            raise StoreLockedError(
                f"store {self.path} is already open for writing (by another process or handle)"
            ) from exc
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self._lock_fd = fd

    def _release_lock(self) -> None:
        if self._lock_fd is not None:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            os.close(self._lock_fd)
            self._lock_fd = None

    # metadata ---------------------------------------------------------------------------
    def get_meta(self, key: str) -> dict | None:
        """A JSON metadata record, or None."""
        with self.env.begin(db=self._meta) as txn:
            raw = txn.get(key.encode())
        if raw is None:
            return None
        try:
            return json.loads(raw)
        except ValueError as exc:
            raise StoreCorruptError(f"metadata record {key!r} is not valid JSON") from exc

    def meta_keys(self) -> list[str]:
        """Names of all metadata records."""
        with self.env.begin(db=self._meta) as txn:
            return [k.decode() for k, _ in txn.cursor()]

    # tables -------------------------------------------------------------------------------
    def open_tables(self, names: list[str]) -> None:
        """Create (or open) the named databases of these tables."""
        for table in names:
            if table not in self._dbs:
                try:
                    self._dbs[table] = self.env.open_db(f"t:{table}".encode(),
                                                        create=not self.readonly)
                except lmdb.NotFoundError:
                    continue
                except lmdb.Error as exc:
                    self._raise_io(exc)

    def _db(self, table: str, create: bool = False):
        """The named database of a table, or None when it does not exist."""
        if table not in self._dbs:
            self.open_tables([table])
        return self._dbs.get(table)

    def get(self, table: str, rows: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
        """Read rows: (payload float32 [n, width], found bool [n]); missing rows are zeros."""
        n = len(rows)
        out = np.zeros((n, width), dtype=np.float32)
        found = np.zeros(n, dtype=bool)
        db = self._db(table)
        if n == 0 or db is None:
            return out, found
        order = np.argsort(rows, kind="stable")  # sorted keys read the B-tree in order
        keys = encode_keys(rows[order])
        with self.env.begin(db=db) as txn:
            vals = list(map(txn.get, keys))  # the loop runs in C; a missing key gives None
        hit = np.fromiter(map(operator.is_not, vals, repeat(None)), dtype=bool, count=n)
        nhit = int(np.count_nonzero(hit))
        if nhit:
            # filter(None) drops the misses (and an empty stored value, caught by the size check)
            data = np.frombuffer(b"".join(filter(None, vals)), dtype=np.float32)
            if data.size != nhit * width:
                raise StoreCorruptError(
                    f"table {table!r}: stored rows have the wrong size (expected {width} floats)")
            dest = order if nhit == n else order[hit]
            out[dest] = data.reshape(nhit, width)
            found[dest] = True
        return out, found

    def put(self, batches: dict[str, tuple[np.ndarray, np.ndarray]]) -> int:
        """Write {table: (rows, payload float32 [n, w])} in one transaction; returns bytes."""
        total = sum(len(r) * (8 + p.shape[1] * 4) for r, p in batches.values())
        if total == 0:
            return 0
        self._ensure_room(total)
        # open table handles first: open_db inside our write txn would wait on itself
        dbs = {table: self._db(table) for table in batches}
        while True:
            try:
                with self.env.begin(write=True) as txn:
                    for table, (rows, payload) in batches.items():
                        order = np.argsort(rows, kind="stable")
                        keys = encode_keys(rows[order])
                        blob = np.ascontiguousarray(payload[order], dtype=np.float32)
                        # one `bytes` per row from a void view; zip feeds putmulti lazily, so
                        # no list of (key, value) tuples is built (and scanned by the GC)
                        w = blob.shape[1] * 4
                        vals = (blob.view(f"V{w}").ravel().tolist() if w else
                                [b""] * len(keys))
                        txn.cursor(db=dbs[table]).putmulti(zip(keys, vals))
                return total
            except lmdb.MapFullError:
                self._grow(total)
            except lmdb.Error as exc:
                self._raise_io(exc)

    def put_meta(self, records: dict[str, dict]) -> None:
        """Write JSON metadata records in one transaction."""
        self._ensure_room(4096)
        try:
            with self.env.begin(write=True, db=self._meta) as txn:
                for key, value in records.items():
                    txn.put(key.encode(), json.dumps(value, sort_keys=True).encode())
        except lmdb.Error as exc:
            self._raise_io(exc)

    def _raise_io(self, exc: Exception) -> None:
        if isinstance(exc, lmdb.MapFullError) or getattr(exc, "errno", None) == errno.ENOSPC or \
                "No space" in str(exc):
            raise OutOfSpaceError(f"store {self.path} is out of space: {exc}") from exc
        raise StoreCorruptError(f"LMDB error in {self.path}: {exc}") from exc

    # map size --------------------------------------------------------------------------------
    def used_bytes(self) -> int:
        """Bytes of the map in use (last page number times page size)."""
        info, stat = self.env.info(), self.env.stat()
        return (info["last_pgno"] + 1) * stat["psize"]

    def _ensure_room(self, incoming: int) -> None:
        need = self.used_bytes() + 2 * incoming + (1 << 20)
        if need > self.env.info()["map_size"]:
            self._grow(incoming)

    @contextmanager
    def reading(self):
        """Register a background reader; map resizing waits until no reader is active."""
        with self._io:
            while self._resizing:
                self._io.wait()
            self._readers += 1
        try:
            yield
        finally:
            with self._io:
                self._readers -= 1
                self._io.notify_all()

    def warm(self, table: str, rows: np.ndarray) -> int:
        """Read rows and discard them, pulling their pages into the page cache; returns hits."""
        with self.reading():
            db = self._dbs.get(table)
            if db is None or len(rows) == 0 or self.env is None:
                return 0
            keys = encode_keys(np.sort(rows))
            with self.env.begin(db=db, buffers=True) as txn:
                get = txn.get
                return sum(1 for k in keys if get(k) is not None)

    def _grow(self, incoming: int) -> None:
        self.wait_for_copies()  # remapping would invalidate a snapshot being copied
        with self._io:
            self._resizing = True
            while self._readers:
                self._io.wait()
        try:
            self._grow_now(incoming)
        finally:
            with self._io:
                self._resizing = False
                self._io.notify_all()

    def _grow_now(self, incoming: int) -> None:
        cur = self.env.info()["map_size"]
        new = max(2 * cur, self.used_bytes() + 4 * incoming + (1 << 20))
        if self.map_limit is not None:
            if cur >= self.map_limit:
                raise OutOfSpaceError(
                    f"store {self.path} reached its map limit of {self.map_limit} bytes")
            new = min(new, self.map_limit)
        try:
            self.env.set_mapsize(new)
        except lmdb.Error as exc:
            self._raise_io(exc)

    # misc ----------------------------------------------------------------------------------
    def count(self, table: str) -> int:
        """Rows stored for a table."""
        db = self._db(table)
        if db is None:
            return 0
        with self.env.begin(db=db) as txn:
            return int(txn.stat(db)["entries"])

    def disk_bytes(self) -> int:
        """Size of the data file on disk (allocated blocks)."""
        p = self.path / "data.mdb"
        return p.stat().st_blocks * 512 if p.exists() else 0

    def sync(self) -> None:
        """Force written transactions to stable storage."""
        try:
            self.env.sync(True)
        except lmdb.Error as exc:
            self._raise_io(exc)

    def close(self) -> None:
        """Close the environment and release the writer lock."""
        env = getattr(self, "env", None)
        if env is not None:
            self.wait_for_copies()
            if not self.readonly:
                try:
                    env.sync(True)
                except lmdb.Error:
                    pass
            env.close()
            self.env = None
        self._release_lock()

    # snapshots (persistence) -------------------------------------------------------------
    def check_file(self) -> None:
        """Raise StoreCorruptError when data.mdb is shorter than the pages LMDB says it holds."""
        data = self.path / "data.mdb"
        need = self.used_bytes()
        have = data.stat().st_size if data.exists() else 0
        if have < need:
            raise StoreCorruptError(
                f"store {self.path}: data.mdb is truncated ({have} bytes, LMDB needs {need})")

    def snapshot(self) -> lmdb.Transaction:
        """A read transaction: an MVCC snapshot that later commits do not change."""
        # a table's database handle must exist before the transaction starts to be usable in it
        self.open_tables([k[6:] for k in self.meta_keys() if k.startswith("table:")])
        return self.env.begin()

    def snapshot_meta(self, txn: lmdb.Transaction) -> dict[str, dict]:
        """Every metadata record as seen by the read transaction `txn`."""
        try:
            return {k.decode(): json.loads(v) for k, v in txn.cursor(db=self._meta)}
        except ValueError as exc:
            raise StoreCorruptError(f"store {self.path}: metadata is not valid JSON") from exc

    def snapshot_count(self, txn: lmdb.Transaction, table: str) -> int:
        """Rows stored for a table as seen by the read transaction `txn`."""
        db = self._db(table)
        return 0 if db is None else int(txn.stat(db)["entries"])

    def copy_snapshot(self, dest: str | os.PathLike, txn: lmdb.Transaction, *,
                      compact: bool = True) -> None:
        """Write the state seen by `txn` to dest/data.mdb (dest must be an existing directory)."""
        try:
            self.env.copy(str(dest), compact=compact, txn=txn)
        except lmdb.Error as exc:
            self._raise_io(exc)

    def track_copy(self, thread: threading.Thread) -> None:
        """Register a thread copying a snapshot; map growth and close wait for it to finish."""
        self.wait_for_copies()
        self._copy_thread = thread

    def wait_for_copies(self) -> None:
        """Block until a snapshot copy running in another thread has finished."""
        t = getattr(self, "_copy_thread", None)
        if t is not None and t is not threading.current_thread():
            t.join()
            self._copy_thread = None

    def iter_rows(self, table: str, width: int, txn: lmdb.Transaction, chunk: int = 65536
                  ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Stream a table's rows in id order from read txn `txn`: (ids [k], payload [k, width])."""
        db = self._db(table)
        if db is None:
            return
        kcur, vcur = txn.cursor(db=db), txn.cursor(db=db)
        if not (kcur.first() and vcur.first()):
            return
        kit = kcur.iternext(keys=True, values=False)
        vit = vcur.iternext(keys=False, values=True)
        while True:
            keys = list(islice(kit, chunk))  # the iteration runs in C: one call per chunk
            vals = list(islice(vit, len(keys)))
            if not keys:
                return
            data = np.frombuffer(b"".join(vals), dtype=np.float32)
            if data.size != len(vals) * width:
                raise StoreCorruptError(
                    f"table {table!r}: stored rows have the wrong size ({width} floats)")
            yield decode_keys(keys), data.reshape(-1, width)
