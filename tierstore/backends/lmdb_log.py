"""The SSD tier's side of the write-behind log: its own LMDB environment (the log itself is the wal package).

`LogIO` is the `LmdbBackend` mixin that the log (the `wal` package) calls. The log lives in a second LMDB
environment, `<store>/wlog/`, beside the tables' `data.mdb`: its free list then holds only
whole freed chunks, each a run of the pages a new chunk needs, instead of the pages the merges'
copy-on-writes fragment (a shared file spent a third of the writer's time searching that free
list: BENCHMARKS.md, session 8). The mixin opens that environment on demand, appends chunks past
the log's end (`MDB_APPEND`, growing its map as needed), reads chunks as zero-copy buffers
inside one read transaction, deletes merged ones, and removes the environment's files once the
log is empty (`drop_log_env`). Its commits are never synced: what the log's file holds after an
OS crash is bounded by the tables' record of the log merged through (`wal.MERGED_KEY`), so only
the tables' environment needs a sync for a flush to be durable (docs/persistence.md).
"""

from __future__ import annotations

import shutil
from collections import deque
from collections.abc import Callable
from pathlib import Path

import lmdb

from ..errors import LogCorruptError, StoreCorruptError
from .lmdb_common import DATA_NAME
from .lmdb_compact import fsync_path
from .lmdb_meta import LOG_DIR  # the log's environment, inside the store's directory
from .pagecheck import check_file

LOG_DB = b"__tierstore_log__"  # the log's database (in the tables' environment before format 3)
OWNER_DB = b"__tierstore_log_owner__"  # the identity of the store whose log this is (key b"store")
DROP_HINT = ("; at stake are the rows written back after the store's last flush (the entries of "
             "the log in {} past those the tables hold); TierStore.open(path, "
             "damaged_log=\"last_flush\") opens the store without them, as its tables hold it (its "
             "last flush or later)")


class LogIO:
    """The write-behind log's environment and its transactions (an `LmdbBackend` mixin)."""

    _wlog: lmdb.Environment | None = None
    _wlog_db: object = None

    @property
    def log_path(self) -> Path:
        """Directory of the log's LMDB environment."""
        return self.path / LOG_DIR

    def log_env(self, create: bool = True) -> lmdb.Environment | None:
        """The log's environment (opened on demand; None when it does not exist and not `create`)."""
        if self._wlog is None:
            path = self.log_path
            data = path / DATA_NAME
            if not data.exists() and (not create or self.readonly):
                return None
            if data.exists():  # left by a crash: LMDB must never walk a damaged page (it aborts)
                try:
                    check_file(data, f"write-behind log of {self.path}")
                except StoreCorruptError as exc:
                    raise LogCorruptError(f"{exc}{DROP_HINT.format(path)}") from None
            start = self.initial_map if self.map_limit is None else min(self.initial_map, self.map_limit)
            try:
                path.mkdir(exist_ok=True)
                env = lmdb.open(str(path), map_size=start, max_dbs=4, subdir=True, sync=False,
                                metasync=False, readahead=False, meminit=False)
            except (lmdb.Error, OSError) as exc:
                raise LogCorruptError(f"cannot open the write-behind log of {self.path}: {exc}"
                                      f"{DROP_HINT.format(path)}") from exc
            try:
                self._check_file(env, data)
            except StoreCorruptError as exc:
                env.close()
                raise LogCorruptError(f"{exc}{DROP_HINT.format(path)}") from exc
            self._wlog = env
        return self._wlog

    def log_db(self, name: bytes, create: bool = True) -> object:
        """The log database's handle in the log's environment (None when it does not exist)."""
        if self._wlog_db is None:
            env = self.log_env(create)
            if env is None:
                return None
            try:
                with env.begin(write=True) as txn:  # see `open_named`: never open_db without one
                    self._wlog_db = env.open_db(name, txn=txn, create=create)
            except lmdb.NotFoundError:
                return None
            except lmdb.Error as exc:
                self._raise_io(exc)
        return self._wlog_db

    def log_owner(self) -> str | None:
        """The identity of the store the log's environment was written for (None: not recorded)."""
        env = self.log_env(create=False)
        if env is None:
            return None
        try:
            with self.reading(), env.begin() as txn:
                db = env.open_db(OWNER_DB, txn=txn, create=False)
                value = txn.get(b"store", db=db)
        except lmdb.NotFoundError:
            return None
        except lmdb.Error as exc:
            self._raise_io(exc)
        return None if value is None else bytes(value).decode("ascii", "replace")

    def set_log_owner(self, owner: str) -> None:
        """Record in the log's environment the identity of the store it belongs to."""
        env = self.log_env()
        try:
            with env.begin(write=True) as txn:
                db = env.open_db(OWNER_DB, txn=txn)
                txn.put(b"store", owner.encode("ascii"), db=db)
        except lmdb.Error as exc:
            self._raise_io(exc)

    def append_log(self, db: object, keys: list[bytes], vals: list[bytes]) -> int:
        """Append entries under increasing keys past the log's end in one transaction; returns bytes."""
        total = sum(map(len, vals)) + 8 * len(keys)
        env = self.log_env()
        self.ensure_room(total, env)
        while True:
            try:
                with env.begin(write=True, db=db) as txn:
                    txn.cursor().putmulti(zip(keys, vals), append=True)
                return total
            except lmdb.MapFullError:
                self._grow(total, env)  # `map_limit` caps this map too
            except lmdb.Error as exc:
                self._raise_io(exc)

    def log_chunks(self, db: object, keys: list[bytes], use: Callable[[list], object],
                   env: lmdb.Environment | None = None) -> object:
        """`use(values)` of log keys inside one read transaction (values are zero-copy buffers of
        the map, valid only inside `use`; None where absent: merged meanwhile); returns its result.
        `env`: the environment holding `db` (None: the log's own)."""
        with self.reading():
            try:
                with (env or self._wlog).begin(db=db, buffers=True) as txn:
                    return use([txn.get(k) for k in keys])
            except lmdb.Error as exc:
                self._raise_io(exc)

    def delete_log(self, db: object, keys: list[bytes]) -> None:
        """Delete merged log chunks in one transaction."""
        try:
            with self._wlog.begin(write=True, db=db) as txn:
                deque(map(txn.delete, keys), maxlen=0)  # a C loop over the keys
        except lmdb.Error as exc:
            self._raise_io(exc)

    def log_bytes(self) -> int:
        """Allocated bytes of the log's file on disk (0 when there is none)."""
        p = self.log_path / DATA_NAME
        return p.stat().st_blocks * 512 if p.exists() else 0

    def close_log_env(self) -> None:
        """Close the log's environment (its file stays)."""
        if self._wlog is not None:
            self._wlog.close()
        self._wlog = None
        self._wlog_db = None

    def drop_log_env(self) -> None:
        """Close the log's environment and remove its files; callers check the log is merged
        (the tables record it merged through its last entry), so nothing in it is needed.

        Best effort: a log that cannot be removed holds only entries at or below the record,
        which the next replay skips (and new entries go past them).
        """
        self.close_log_env()
        try:
            unlink_log_dir(self.path)
        except OSError:
            pass

    def log_is_empty(self) -> bool:
        """Whether the log's environment holds no entry (or does not exist)."""
        db = self.log_db(LOG_DB, create=False)
        if db is None:
            return True
        with self.reading(), self._wlog.begin(db=db) as txn:
            return not txn.stat(db)["entries"]


def unlink_log_dir(path: Path) -> None:
    """Remove a closed store's log environment (before its tables' file is replaced: restore)."""
    log = Path(path) / LOG_DIR
    if log.exists():
        shutil.rmtree(log)
        fsync_path(Path(path))
