"""The SSD tier's tables: named database handles, batched row reads and writes, commits.

`TableRows` is the `LmdbBackend` mixin that holds one named database per table: `get` reads a
batch of rows (through the compiled page reader when it can, else py-lmdb) and verifies each
record's checksum; `put` writes a batch sorted by key in transactions of at most `TXN_ROWS`
rows (`_commit`), growing the map as needed; `publish` commits the flushed state for readers.
`TXN_ROWS` and `GET_CHUNK` are read from `lmdb_backend` at call time, where tests set them.
"""

from __future__ import annotations

import operator
import os
from itertools import repeat

import lmdb
import numpy as np

from ..errors import OutOfSpaceError
from .lmdb_common import GET_CHUNK, encode_keys
from .record import CHECK_BYTES, open_records, open_values, seal


class TableRows:
    """Rows of the tables' named databases (an `LmdbBackend` mixin)."""

    def open_named(self, name: bytes, *, create: bool, **flags: bool) -> object:
        """A named database's handle; never call it inside a transaction of this thread.

        py-lmdb's `open_db` without a transaction begins its own write transaction while holding
        the GIL: if another thread holds LMDB's writer lock and needs the GIL to finish (the
        write-behind writer, the ttl deleter), both wait forever. `begin` waits for the writer
        lock with the GIL released, so the handle is opened inside a transaction begun here.
        A read-only handle takes no writer lock.
        """
        if self.readonly:
            return self.env.open_db(name, create=create, **flags)
        with self.env.begin(write=True) as txn:
            return self.env.open_db(name, txn=txn, create=create, **flags)

    def open_tables(self, names: list[str]) -> None:
        """Create (or open) the named databases of these tables (chunked ones have ranges)."""
        for table in names:
            if self.is_chunked(table):
                continue
            if table not in self._dbs:
                try:
                    self._dbs[table] = self.open_named(f"t:{table}".encode(),
                                                       create=not self.readonly)
                    if self.publisher is not None:
                        self.publisher.attach(table, self._dbs[table])
                except lmdb.NotFoundError:
                    continue
                except lmdb.Error as exc:
                    self._raise_io(exc)

    def table_db(self, table: str, create: bool = False):
        """The named database of a table, or None when it does not exist."""
        if table not in self._dbs:
            self.open_tables([table])
        return self._dbs.get(table)

    def get(self, table: str, rows: np.ndarray, width: int,
            ahead: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """Read rows: (row float32 [n, width], found bool [n]); missing rows are zeros.

        Every stored record's checksum is verified (`StoreCorruptError` on damage). `ahead`: the
        reads will wait on the disk, so first ask it for all their pages at once, in page order
        (`PageReader.ask_ahead`), rather than one page fault at a time.
        """
        if self.is_chunked(table):
            return self.chunk_get(table, rows, width)
        n = len(rows)
        out = np.zeros((n, width), dtype=np.float32)
        found = np.zeros(n, dtype=bool)
        if n == 0:
            return out, found
        order = np.argsort(rows, kind="stable")  # sorted keys read the B-tree in order
        with self.reading():  # any thread: map growth by the writer waits for this read
            db = self.table_db(table) if self.env is not None else None
            if db is None:
                return out, found
            pages = self._pages if self.map_resident is None and self._page_reads else None
            got = None
            srt = rows[order]
            if pages is not None:
                try:
                    with self.env.begin() as txn:  # pins the snapshot the pages belong to
                        record = txn.get(b"t:" + table.encode())
                        if ahead:
                            pages.ask_ahead(record, srt.astype(np.uint64))
                            ahead = False  # asked: a fallback to py-lmdb does not ask again
                        got = pages.lookup(record, srt.astype(np.uint64), width * 4 + CHECK_BYTES)
                except lmdb.Error as exc:
                    self._raise_io(exc)
            if got is None:
                keys = encode_keys(rows[order])
                vals: list = []
                try:
                    with self.env.begin(db=db) as txn:
                        if self._pages is not None:  # LMDB trusts its pages: check them first
                            record = txn.get(b"t:" + table.encode(), db=self.env.open_db(None))
                            if ahead:
                                self._pages.ask_ahead(record, srt.astype(np.uint64))
                            self._pages.check_paths(record, srt.astype(np.uint64), txn.id())
                        for i in range(0, n, GET_CHUNK):  # bounded pieces: trim the map in between
                            vals += map(txn.get, keys[i:i + GET_CHUNK])  # a C loop; None if missing
                            self._note_touch()
                except lmdb.Error as exc:
                    self._raise_io(exc)
        if got is not None:  # copied out of the snapshot's pages: checked outside the read
            data, hit = got
            if hit.any():
                every = bool(hit.all())
                dest = order if every else order[hit]
                out[dest] = open_records(table, srt if every else srt[hit],
                                         (data if every else data[hit]).ravel(), width,
                                         f"store {self.path}, ")
                found[dest] = True
            return out, found
        # an empty stored value counts as stored: the size check reports it
        hit = np.fromiter(map(operator.is_not, vals, repeat(None)), dtype=bool, count=n)
        open_values(table, rows, order, vals, hit, out, found, f"store {self.path}, ")
        return out, found

    def put(self, batches: dict[str, tuple[np.ndarray, np.ndarray]], sealed: bool = False) -> int:
        """Write {table: (rows, payload float32 [n, w])}; returns bytes. With `sealed` the payloads
        are already records (uint8 [n, 4w + 4], `record.seal`), written as they are.

        Rows are sorted by key and committed in transactions of at most `TXN_ROWS` rows, each a
        key range: a transaction rewrites only the leaf pages of its range, so the pages it
        frees (which LMDB cannot reuse for two commits) stay few. A put of at most `TXN_ROWS`
        rows is one transaction; larger ones are not atomic (flush() syncs after all of them).
        Rows beyond a table's last key are appended (`MDB_APPEND`: full pages).
        """
        merged = 0
        if self.chunked:  # merges into the tables' chunk levels (wide tables stay B-trees)
            merged = sum(self.chunk_put(t, r, p, sealed, (p.shape[1] * p.itemsize - CHECK_BYTES) // 4
                                        if sealed else p.shape[1])
                         for t, (r, p) in batches.items() if self.is_chunked(t))
            batches = {t: b for t, b in batches.items() if not self.is_chunked(t)}
        return merged + self._put_btrees(batches, sealed)

    def _put_btrees(self, batches: dict[str, tuple[np.ndarray, np.ndarray]], sealed: bool) -> int:
        """`put` into B-tree tables: sorted rows, transactions of at most `TXN_ROWS` rows."""
        total = sum(len(r) * (8 + (p.shape[1] * p.itemsize if sealed else p.shape[1] * 4 + CHECK_BYTES))
                    for r, p in batches.values())
        if total == 0:
            return 0
        self.ensure_room(total)
        # open table handles first: open_db inside our write txn would wait on itself
        segs = []
        for table, (rows, payload) in batches.items():
            if len(rows) == 0:
                continue
            unique = len(rows) < 2 or bool((rows[1:] > rows[:-1]).all())
            if unique:  # already in key order (a merge's pieces): no sort, no gathered copy
                srt, ordered = rows, payload
            else:
                order = np.argsort(rows, kind="stable")
                srt, ordered = rows[order], payload[order]
                unique = bool((srt[1:] > srt[:-1]).all())
            keys = encode_keys(srt)
            blob = np.ascontiguousarray(ordered).view(np.uint8) if sealed else \
                seal(srt, np.ascontiguousarray(ordered, dtype=np.float32))
            # one `bytes` per row from a void view (a C loop, no per-row Python)
            vals = blob.view(f"V{blob.shape[1]}").ravel().tolist()
            segs.append((self.table_db(table), keys, vals, unique))
        part: list = []
        room = self.txn_rows
        for db, keys, vals, unique in segs:
            for i in range(0, len(keys), self.txn_rows):  # whole chunks, then split at the txn edge
                k, v = keys[i:i + self.txn_rows], vals[i:i + self.txn_rows]
                while k:
                    take = min(room, len(k))
                    part.append((db, k[:take], v[:take], unique))
                    k, v, room = k[take:], v[take:], room - take
                    if room == 0:
                        self._commit(part, total)
                        part, room = [], self.txn_rows
        if part:
            self._commit(part, total)
        return total

    def _commit(self, parts: list, total: int) -> None:
        """One write transaction of sorted (db, keys, values, unique) parts; grows the map as needed."""
        self.wrote = True
        self._check_space(sum(len(p[1]) for p in parts))
        while True:
            try:
                with self.env.begin(write=True) as txn:
                    if self.publisher is not None:
                        self.publisher.before_commit(txn, parts)
                    for db, keys, vals, unique in parts:
                        cur = txn.cursor(db=db)
                        # zip feeds putmulti lazily: no list of (key, value) tuples is built
                        append = unique and (not cur.last() or cur.key() < keys[0])
                        for i in range(0, len(keys), GET_CHUNK):  # check the mapped pages between
                            cur.putmulti(zip(keys[i:i + GET_CHUNK], vals[i:i + GET_CHUNK]),
                                         append=append)
                            self._note_touch()
                return
            except lmdb.MapFullError:
                self._grow(total)
            except lmdb.Error as exc:
                self._raise_io(exc)

    def publish(self) -> int | None:
        """Mark the rows written so far as the published (flushed) state for readers; the epoch."""
        if self.publisher is None or not self.publisher.dirty:
            return None
        self.ensure_room(4096)
        self.wrote = True
        while True:
            try:
                with self.env.begin(write=True) as txn:
                    epoch = self.publisher.publish(txn)
                self.publisher.committed()
                return epoch
            except lmdb.MapFullError:
                self._grow(4096)
            except lmdb.Error as exc:
                self._raise_io(exc)

    def _check_space(self, rows: int) -> None:
        """With a writable map, refuse a commit the disk may not hold (OutOfSpaceError).

        Writing to a mapped page of a sparse file on a full disk raises SIGBUS instead of
        ENOSPC, so every commit first checks that the disk has room for a new page per row
        (conservative: most pages are reused). Another process filling the disk between the
        check and the commit can still kill the process; committed data survives that.
        """
        if not self.writemap:
            return
        try:
            st = os.statvfs(self.path)
        except OSError:
            return
        need = (rows + 64) * 4096 + (8 << 20)
        if st.f_bavail * st.f_frsize < need:
            raise OutOfSpaceError(
                f"store {self.path}: the disk has {st.f_bavail * st.f_frsize} bytes free, a commit "
                f"of {rows} rows may need {need}")
