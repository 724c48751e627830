"""The SSD tier's side of the write-behind log: the log database's I/O (the log itself is wal.py).

`LogIO` is the `LmdbBackend` mixin that the log (wal.py) calls: it opens the log's database in
the current environment, appends chunks past the log's end (`MDB_APPEND`, growing the map as
needed), reads chunks as zero-copy buffers inside one read transaction, and deletes merged ones.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import lmdb


class LogIO:
    """Transactions on the write-behind log's database (an `LmdbBackend` mixin)."""

    def log_db(self, name: bytes) -> object:
        """The write-behind log's database handle in the current environment (opened on demand)."""
        if self._log_db is None:
            self._log_db = self.open_named(name, create=not self.readonly)
        return self._log_db

    def append_log(self, db: object, keys: list[bytes], vals: list[bytes]) -> int:
        """Append entries under increasing keys past the log's end in one transaction; returns bytes."""
        total = sum(map(len, vals)) + 8 * len(keys)
        self._ensure_room(total)
        self._wrote = True
        self._check_space(total // 4096 + len(keys) + 1)  # pages: values this large overflow
        while True:
            try:
                with self.env.begin(write=True, db=db) as txn:
                    txn.cursor().putmulti(zip(keys, vals), append=True)
                return total
            except lmdb.MapFullError:
                self._grow(total)
            except lmdb.Error as exc:
                self._raise_io(exc)

    def log_chunks(self, db: object, keys: list[bytes], use: Callable[[list], object]) -> object:
        """`use(values)` of log keys inside one read transaction (values are zero-copy buffers of
        the map, valid only inside `use`; None where absent: merged meanwhile); returns its result."""
        with self.reading():
            try:
                with self.env.begin(db=db, buffers=True) as txn:
                    return use([txn.get(k) for k in keys])
            except lmdb.Error as exc:
                self._raise_io(exc)

    def delete_log(self, db: object, keys: list[bytes]) -> None:
        """Delete merged log chunks in one transaction."""
        self._wrote = True
        try:
            with self.env.begin(write=True, db=db) as txn:
                deque(map(txn.delete, keys), maxlen=0)  # a C loop over the keys
        except lmdb.Error as exc:
            self._raise_io(exc)
