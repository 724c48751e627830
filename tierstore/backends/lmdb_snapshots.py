"""The SSD tier's snapshots: MVCC read transactions, their metadata and rows, and copies of them.

`Snapshots` is the `LmdbBackend` mixin that checkpoints and exports use: `snapshot()` opens a
read transaction that later commits do not change, `copy_snapshot` writes the state it sees to
a new file (in another thread, tracked so that map growth and close wait for it), `iter_rows`
streams a table's rows from it in id order; `check_file` refuses a truncated data file.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from itertools import islice
from pathlib import Path

import lmdb
import numpy as np

from ..errors import StoreCorruptError
from .lmdb_common import DATA_NAME, decode_keys
from .lmdb_compact import write_compact
from .lmdb_meta import check_file_size
from .record import open_records


class Snapshots:
    """Snapshots of the environment and copies of them (an `LmdbBackend` mixin)."""

    def check_file(self) -> None:
        """Raise StoreCorruptError when data.mdb is shorter than the pages LMDB says it holds."""
        self._check_file(self.env)

    def _check_file(self, env: lmdb.Environment, data: Path | None = None) -> None:
        """Raise StoreCorruptError when `data` (the tables' data.mdb by default), the file of
        `env`, is shorter than the pages LMDB says it holds."""
        check_file_size(env, data or self.path / DATA_NAME, self.path)

    def snapshot(self) -> lmdb.Transaction:
        """A read transaction: an MVCC snapshot that later commits do not change."""
        # a table's database handle must exist before the transaction starts to be usable in it
        self.open_tables([k[6:] for k in self.meta_keys() if k.startswith("table:")])
        self.snap_dbs = self._named_dbs()
        return self.env.begin()

    def snapshot_meta(self, txn: lmdb.Transaction) -> dict[str, dict]:
        """Every metadata record as seen by the read transaction `txn`."""
        try:
            return {k.decode(): json.loads(v) for k, v in txn.cursor(db=self._meta)}
        except ValueError as exc:
            raise StoreCorruptError(f"store {self.path}: metadata is not valid JSON") from exc

    def snapshot_count(self, txn: lmdb.Transaction, table: str) -> int:
        """Rows stored for a table as seen by the read transaction `txn`."""
        if self.is_chunked(table):
            return self.chunk_count(table, txn)
        db = self.table_db(table)
        return 0 if db is None else int(txn.stat(db)["entries"])

    def copy_snapshot(self, dest: str | os.PathLike, txn: lmdb.Transaction, *,
                      compact: bool = True) -> None:
        """Write the state seen by `txn` (from `snapshot()`) to dest/data.mdb, an existing directory.

        `compact`: rewrite every database in key order with `MDB_APPEND` (full pages, about
        1.3x the raw bytes of 68-byte rows); otherwise LMDB's page-by-page copy.
        """
        try:
            if compact and self.chunked:  # LMDB's compacting copy: no database handle to hold
                self.env.copy(str(dest), compact=True, txn=txn)  # (a merge may drop a range's)
            elif compact:
                write_compact(txn, self.snap_dbs, Path(dest), progress=self._note_touch)
            else:
                self.env.copy(str(dest), txn=txn)
        except lmdb.Error as exc:
            self._raise_io(exc)
        finally:
            self.trim_map()

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
        if self.is_chunked(table):
            yield from self.chunk_iter(table, width, txn, chunk)
            return
        db = self.table_db(table)
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
            ids = decode_keys(keys, f"store {self.path}, table {table!r}")
            yield ids, open_records(table, ids, np.frombuffer(b"".join(vals), dtype=np.uint8), width,
                                   f"store {self.path}, ")
