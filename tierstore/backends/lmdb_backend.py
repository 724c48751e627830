"""The SSD tier: one LMDB environment, one named database per table, batched transactions.

`LmdbBackend` opens the environment, holds the writer's lock file, reads and writes the
metadata, syncs and closes; its other parts are mixins by concept: `lmdb_tables` (row reads,
writes and commits), `lmdb_log` (the write-behind log's own environment), `lmdb_map` (the map's size
and resident pages), `lmdb_compact` (compaction) and `lmdb_snapshots` (snapshots and their
copies). The module's constants stay here, where tests and benchmarks set them; the mixins read
them from this module at call time.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import threading
from contextlib import contextmanager, nullcontext
from pathlib import Path

import lmdb

from .._kernels import HAVE_NUMBA
from ..errors import OutOfSpaceError, StoreCorruptError, StoreLockedError, TierstoreError
from .format import CHUNK_FORMAT
from .lmdb_chunked import ChunkTables
from .lmdb_common import COMPACT_PREFIX, DATA_NAME, GET_CHUNK, META_DB  # noqa: F401 (re-exported)
from .lmdb_common import decode_keys as decode_keys  # re-exported
from .lmdb_common import encode_keys as encode_keys  # re-exported
from .lmdb_compact import Compaction
from .lmdb_compact import fsync_path as fsync_path  # re-exported
from .lmdb_compact import write_compact as write_compact  # re-exported
from .lmdb_log import LogIO
from .lmdb_map import MemoryMap, _file_resident
from .lmdb_snapshots import Snapshots
from .lmdb_tables import TableRows
from .pages import PageReader
from .publish import Publisher
from .writers import live_writer
from .writers import register as register_writer
from .writers import unregister as unregister_writer

LOCK_NAME = "tierstore.lock"
STORE_MARK = b"tierstore-store"  # written into the lock file once the store's metadata is durable
_INITIAL_MAP = 1 << 30
TXN_ROWS = 8192  # rows per write transaction: bounds the pages one commit frees (see docs/persistence.md)


def _map_resident_default() -> int | None:
    """`TIERSTORE_MAP_RESIDENT` (a size like "256MiB"), else None: never trim the map.

    The data file's mapped pages are the kernel's page cache (file-backed, reclaimable), not the
    process's own memory, and trimming them makes the next reads fault: off by default.
    """
    text = os.environ.get("TIERSTORE_MAP_RESIDENT", "").strip()
    if not text or text.lower() in ("none", "off", "0"):
        return None
    from ..config import parse_size

    return parse_size(text)


# file-backed resident bytes the process may gain before the data file's mapping is dropped
# (`trim_map`); None (the default): never trim (file-backed resident pages then include up to the
# whole file; they are page cache, not the process's anonymous memory)
MAP_RESIDENT = _map_resident_default()


def _writemap_default() -> bool | None:
    """`TIERSTORE_WRITEMAP`: "1"/"on" a writable map, "auto" one when the map is never trimmed;
    unset or anything else: commits write their pages with `pwrite` (the default)."""
    text = os.environ.get("TIERSTORE_WRITEMAP", "").strip().lower()
    if text == "auto":
        return None
    return text in ("1", "on", "true", "yes")


# MDB_WRITEMAP for writers (None: only when the mapping is never trimmed). Off by default: at the
# training steady state, where merges rewrite pages all over the file while reader threads map
# it, every page a commit takes becomes a write fault through the file system, and pwrite
# commits ran 1.2-1.5x faster steps (cache10, cache1); alone, a merge is ~1.2x faster with the
# writable map. Trimming a writable map makes every later write a fault (0.4x). See
# docs/persistence.md, "Write path"
WRITEMAP: bool | None = _writemap_default()
# read rows by walking the data file's pages in compiled code (pages.py) instead of one py-lmdb
# call per row; TIERSTORE_PAGE_READS=0 turns it off (used when the map is trimmed, see get)
PAGE_READS = os.environ.get("TIERSTORE_PAGE_READS", "1").strip().lower() not in ("0", "off", "no")
# compact at close when the file is this many times its compacted size; environment variable
# TIERSTORE_COMPACT_ON_CLOSE ("none" to never compact at close)
_coc = os.environ.get("TIERSTORE_COMPACT_ON_CLOSE", "").strip().lower()
COMPACT_ON_CLOSE: float | None = None if _coc in ("none", "off") else float(_coc or 1.25)
_COMPACT_MIN_BYTES = 1 << 20


def lmdb_error(exc: Exception, path: Path) -> TierstoreError:
    """The TierstoreError for an LMDB error in the store at `path` (full disk or damage)."""
    if isinstance(exc, TierstoreError):
        return exc
    if isinstance(exc, lmdb.MapFullError) or getattr(exc, "errno", None) == errno.ENOSPC or \
            "No space" in str(exc):
        return OutOfSpaceError(f"store {path} is out of space: {exc}")
    return StoreCorruptError(f"LMDB error in {path}: {exc}")


@contextmanager
def lmdb_errors(path: str | os.PathLike):
    """Translate LMDB errors raised inside the block (see `lmdb_error`)."""
    try:
        yield
    except lmdb.Error as exc:
        raise lmdb_error(exc, Path(path)) from exc


def _locked_error(path: Path) -> StoreLockedError:
    if live_writer(path) is not None:
        return StoreLockedError(
            f"store {path} is already open for writing by a handle in this process (a close() "
            f"that ran out of space leaves its store open, nothing lost: raise that handle's "
            f"map_limit and call its close() again)")
    return StoreLockedError(f"store {path} is already open for writing (by another process or handle)")


def check_unlocked(path: str | os.PathLike) -> None:
    """Raise StoreLockedError when a writer (of any process, this one included) holds the store."""
    lock = Path(path) / LOCK_NAME
    try:
        fd = os.open(lock, os.O_RDONLY)
    except OSError:
        return  # no lock file: no writer has ever held it
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        raise _locked_error(Path(path)) from exc
    finally:
        os.close(fd)  # closing the descriptor drops a lock it took


def _stored_mark(text: bytes) -> bool:
    """Whether a lock file's text says a store was created in its directory."""
    return STORE_MARK in text


class LmdbBackend(TableRows, ChunkTables, LogIO, MemoryMap, Compaction, Snapshots):
    """Rows on disk in LMDB: batched reads, batched writes in one transaction, durable sync.

    The map grows automatically before it fills (up to `map_limit` bytes when given).
    A lock file held with `flock` keeps a second writer (another process or handle) out.
    """

    def __init__(self, path: str | os.PathLike, *, readonly: bool = False,
                 map_limit: int | None = None) -> None:
        self.path = Path(path)
        self.readonly = readonly
        self.map_limit = map_limit
        self.initial_map = _INITIAL_MAP  # the first map size (tests shrink it to make the map grow)
        self.txn_rows = TXN_ROWS  # rows per write transaction
        self._lock_fd: int | None = None
        self._io = threading.Condition()  # background readers vs. map resizing
        self._readers = 0
        self._resizing = False
        self._file_base = _file_resident()  # file-backed resident bytes after the last trim
        self._map_gen = 0  # bumped whenever the mapping may move (open, resize)
        self._span: tuple[int, list[tuple[int, int]]] | None = None
        self.wrote = False  # whether this handle changed the file (compaction on close)
        self.compact_on_close: float | None = COMPACT_ON_CLOSE
        self.map_resident = MAP_RESIDENT
        if self.path.exists() and not self.path.is_dir():
            raise TierstoreError(f"store path {self.path} exists and is not a directory")
        self._marked = False
        if not readonly:
            self.path.mkdir(parents=True, exist_ok=True)
            self._acquire_lock()
            for stale in self.path.glob(COMPACT_PREFIX + "*"):  # from a compaction cut short
                shutil.rmtree(stale, ignore_errors=True)
            try:
                self._check_held()
            except BaseException:
                self._release_lock()
                raise
        elif not (self.path / DATA_NAME).exists():
            raise StoreCorruptError(f"{self.path} holds no tierstore data (no data.mdb)")
        self._dbs: dict[str, object] = {}
        self._copy_thread: threading.Thread | None = None
        self.env = None
        self.publisher: Publisher | None = None  # keeps flushed states readable (serving)
        self._open_env()
        if not readonly:  # a snapshot reader in this process shares this environment
            register_writer(self)

    def _open_env(self) -> None:
        """Open the LMDB environment and its metadata database (releases the lock on failure)."""
        self._map_gen += 1
        self._pages: PageReader | None = None
        if not hasattr(self, "quiesce"):
            # set by the store: a context in which no background thread writes (the writer is
            # drained and held), so a compaction cannot lose a write made to the old file
            self.quiesce = nullcontext
        from .snapshot import release_readers  # py-lmdb: one environment per file in a process

        release_readers(self.path)
        wm = self.map_resident is None if WRITEMAP is None else WRITEMAP
        self.writemap = wm and not self.readonly
        try:
            if self.writemap and (self.path / DATA_NAME).exists():
                # a writable map extends the file to the map size: check for truncation first
                check = lmdb.open(str(self.path), readonly=True, lock=False, subdir=True,
                                  max_dbs=4096, readahead=False)
                try:
                    self._check_file(check)
                finally:
                    check.close()
            start = self.initial_map if self.map_limit is None else min(self.initial_map, self.map_limit)
            self.env = lmdb.open(str(self.path), map_size=start, max_dbs=4096, subdir=True,
                                 readonly=self.readonly, lock=not self.readonly, sync=False,
                                 metasync=False, readahead=False, meminit=False,
                                 writemap=self.writemap)
        except StoreCorruptError:
            self._release_lock()
            raise
        except lmdb.Error as exc:
            self._release_lock()
            raise StoreCorruptError(f"cannot open LMDB store at {self.path}: {exc}") from exc
        self._page_reads = PAGE_READS  # rows read by the page walker (else py-lmdb)
        self.forget_levels()  # chunk levels hold the environment and a mapping of its file
        if HAVE_NUMBA:  # also checks the search paths of py-lmdb's misses (check_missing)
            self._pages = PageReader(self.path / DATA_NAME, self.env.stat()["psize"])
        try:
            self.check_file()
            self._meta = self.env.open_db(META_DB, create=not self.readonly)
            if self._marked and not self.meta_keys():
                raise StoreCorruptError(
                    f"store {self.path} held a tierstore store but its metadata is gone; restore "
                    f"it from a checkpoint (TierStore.restore) or remove the directory")
            if not self._marked and not self.readonly and self.meta_keys():
                self.mark_stored()  # a store made before the mark existed
            with self.env.begin(db=self._meta) as txn:  # (not get_meta: a reopen inside a
                raw = txn.get(b"store")  # compaction holds the readers out)
            try:
                store = json.loads(raw) if raw is not None else {}
            except ValueError as exc:
                raise StoreCorruptError(f"store {self.path}: its store record is not valid JSON") from exc
            self.chunked = store.get("format_version") == CHUNK_FORMAT  # format 4: chunk levels
            # its tables kept as B-trees (rows too wide for a chunk): those with a `t:` database
            self.btree_tables = self.find_btree_tables() if self.chunked else frozenset()
            if not self.readonly:
                if self.publisher is not None:
                    self.publisher.close()
                self.publisher = Publisher(self.path, self.env, self._meta, META_DB)
        except StoreCorruptError:
            self.close()
            raise
        except lmdb.Error as exc:
            self.close()
            raise StoreCorruptError(
                f"store at {self.path} has no tierstore metadata: {exc}") from exc

    def _check_held(self) -> None:
        """Refuse to create a new store where one was (the lock file says so) but data.mdb is gone.

        LMDB would silently start an empty store over a missing or empty data file; a store that
        held rows must come back with them or raise StoreCorruptError.
        """
        if not self._marked:
            return
        data = self.path / DATA_NAME
        size = data.stat().st_size if data.exists() else -1
        if size < 2 * 4096:  # an LMDB file holds at least its two meta pages
            what = "missing" if size < 0 else f"{size} bytes long"
            raise StoreCorruptError(
                f"store {self.path} held a tierstore store but its {DATA_NAME} is {what}; restore "
                f"it from a checkpoint (TierStore.restore) or remove the directory to start over")

    # locking ------------------------------------------------------------------------
    def _acquire_lock(self) -> None:
        fd = os.open(self.path / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            raise _locked_error(self.path) from exc
        self._marked = _stored_mark(os.pread(fd, 256, 0))
        self._lock_fd = fd
        self._write_lock_text()

    def _write_lock_text(self) -> None:
        """The lock file's text: the holder's pid, and the store mark once the store exists."""
        text = str(os.getpid()).encode() + (b"\n" + STORE_MARK + b"\n" if self._marked else b"")
        os.ftruncate(self._lock_fd, 0)
        os.pwrite(self._lock_fd, text, 0)

    def mark_stored(self) -> None:
        """Record in the lock file that this directory holds a store (after its metadata is synced)."""
        if self._marked or self._lock_fd is None:
            return
        self._marked = True
        self._write_lock_text()
        os.fsync(self._lock_fd)

    def _release_lock(self) -> None:
        if self._lock_fd is not None:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            os.close(self._lock_fd)
            self._lock_fd = None

    # metadata ---------------------------------------------------------------------------
    def get_meta(self, key: str) -> dict | None:
        """A JSON metadata record, or None."""
        with self.reading(), self.env.begin(db=self._meta) as txn:
            raw = txn.get(key.encode())
        if raw is None:
            return None
        try:
            return json.loads(raw)
        except ValueError as exc:
            raise StoreCorruptError(f"store {self.path}: metadata record {key!r} is not valid JSON") from exc

    def meta_keys(self) -> list[str]:
        """Names of all metadata records."""
        with self.env.begin(db=self._meta) as txn:
            return [k.decode() for k, _ in txn.cursor()]

    def put_meta(self, records: dict[str, dict]) -> None:
        """Write JSON metadata records in one transaction."""
        self.ensure_room(4096)
        self.wrote = True
        self._check_space(len(records))
        try:
            with self.env.begin(write=True, db=self._meta) as txn:
                for key, value in records.items():
                    txn.put(key.encode(), json.dumps(value, sort_keys=True).encode())
        except lmdb.Error as exc:
            self._raise_io(exc)

    def _raise_io(self, exc: Exception) -> None:
        raise lmdb_error(exc, self.path) from exc

    # misc ----------------------------------------------------------------------------------
    def use_chunks(self) -> None:
        """Store this new store's tables as page-chunk levels (format 4), before any table opens."""
        if self._dbs:
            raise TierstoreError(f"store {self.path}: the table format is chosen before tables open")
        self.chunked = True

    def count(self, table: str) -> int:
        """Rows stored for a table."""
        if self.is_chunked(table):
            return self.chunk_count(table)
        with self.reading():
            db = self.table_db(table)
            if db is None:
                return 0
            with self.env.begin(db=db) as txn:
                return int(txn.stat(db)["entries"])

    def tree_pages(self, tables: list[str]) -> dict[str, int]:
        """The tables' B-tree pages, and the leaf pages their rows would take packed full
        (`dense_leaf_pages`, what a compaction writes): their ratio is the leaves' fill."""
        out = self.chunk_tree_pages([t for t in tables if self.is_chunked(t)])
        with self.reading():
            psize = self.env.stat()["psize"]
            for table in [t for t in tables if not self.is_chunked(t)]:
                db = self.table_db(table)
                if db is None:
                    continue
                with self.env.begin(db=db) as txn:
                    st = txn.stat(db)
                    cur = txn.cursor()
                    if not st["entries"] or not cur.first():
                        continue
                    # a leaf node: 8-byte header, key, value (2-byte aligned) + a 2-byte pointer
                    node = 8 + len(cur.key()) + len(cur.value())
                    per_leaf = (psize - 16) // (node + (node & 1) + 2)
                out["leaf_pages"] += st["leaf_pages"]
                out["branch_pages"] += st["branch_pages"]
                out["dense_leaf_pages"] += -(-st["entries"] // max(per_leaf, 1))
        return out

    def disk_bytes(self) -> int:
        """Bytes the store takes on disk: the tables' file and the write-behind log's (allocated)."""
        return self.data_bytes() + self.log_bytes()

    def data_bytes(self) -> int:
        """Size of the tables' data file on disk (allocated blocks)."""
        try:  # one stat: the log's bound reads it at every writer batch (wal/budget.py)
            return (self.path / DATA_NAME).stat().st_blocks * 512
        except FileNotFoundError:
            return 0

    def sync(self) -> None:
        """Force written transactions to stable storage."""
        try:
            self.env.sync(True)
        except lmdb.Error as exc:
            self._raise_io(exc)
        if not self._marked and not self.readonly and self.wrote:
            self.mark_stored()  # the metadata is durable: from now on data.mdb must stay

    def close(self) -> None:
        """Close the environment and release the writer lock.

        A handle that wrote rows first compacts the file when it is more than `compact_on_close`
        times its estimated compacted size (best effort: on any failure the file stays as it is).
        """
        unregister_writer(self)
        env = getattr(self, "env", None)
        if env is not None:
            self.wait_for_copies()
            if not self.readonly:
                try:
                    env.sync(True)
                    if self.log_is_empty():  # merged and synced: the log's file goes
                        self.drop_log_env()
                except (lmdb.Error, TierstoreError, OSError):
                    pass
                self.close_log_env()  # a log not merged stays for the next open's replay
                if self.wrote and self.chunked:  # in-place updates thinned some ranges
                    try:
                        if self.repack_levels():
                            env.sync(True)
                    except (TierstoreError, OSError, lmdb.Error):
                        pass  # best effort: the ranges stay as they are, readable
                if self.wrote and self.compact_on_close is not None:
                    try:
                        disk = self.data_bytes()
                        if disk >= _COMPACT_MIN_BYTES and \
                                disk > self.compact_on_close * self.estimate_compact_bytes():
                            self.compact(reopen=False)
                    except (TierstoreError, OSError, lmdb.Error):
                        pass
            if self.env is not None:
                used = self.used_bytes() if self.writemap else 0
                self.env.close()
                if used:  # a writable map extended the file to the map size: give the tail back
                    try:
                        data = self.path / DATA_NAME
                        if data.stat().st_size > used:
                            os.truncate(data, used)
                    except OSError:
                        pass
            self.env = None
        if self.publisher is not None:
            self.publisher.close()
            self.publisher = None
        self._release_lock()
