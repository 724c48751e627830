"""Sorted-chunk runs: one table's rows sorted by id and written whole (the levels of issue 36's LSM).

A run is a named LMDB database whose values each hold up to `CHUNK_ROWS` consecutive rows of one
table, in id order, under the 8-byte big-endian id of their first row:

    header (16 bytes: magic "TSRN", record bytes u32, count u32, crc32 of the ids) | ids int64
    [count] | records

A record is the tables' own (the row's words, then its checksum over id and words: `record.py`),
so every read verifies it as a table read does. `RunWriter` appends chunks with `MDB_APPEND`:
one LMDB put per chunk, overflow pages written whole and in sequence, instead of a B-tree update
(and a copy-on-write leaf) per row. `SortedRun.get` reads a batch of ids, one chunk lookup per
chunk touched; `merge_runs` merges runs (newest first, a base last) into a new run in one
sequential pass, keeping each id's newest record and verifying every record it copies.

These are the parts the store's format 4 would be built from (docs/design.md, "The SSD steady
state with merges"); the store does not use them yet. A base level is not written this way: a
cold read of a 4,096-row chunk costs a search of its id array before its record's page, so the
base takes page-sized chunks (`pagechunks.py`, docs/design.md, "Format 4, corrected").
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterator

import lmdb
import numpy as np

from ..errors import StoreCorruptError, TierstoreError
from .chunk_kernels import HAVE_NUMBA, gather_args, gather_records, merge_step
from .lmdb_common import decode_keys, encode_keys
from .record import CHECK_BYTES, open_records, row_checks

RUN_MAGIC = b"TSRN"
HEADER = 16  # magic, record bytes u32, count u32, crc32 of the ids u32
CHUNK_ROWS = 4096  # rows a value: ~1.1 MB of 272-byte records, a few hundred overflow pages
TXN_CHUNKS = 64  # chunks a write transaction (~70 MB of 272-byte rows: the heap copies it holds)


def parse_chunk(val, first: int, record_bytes: int, where: str) -> tuple[np.ndarray, np.ndarray]:
    """A chunk's (ids int64 [k], records uint8 [k, record bytes]) as views of `val`, checked
    against its header, its key `first` and its id order (a damaged chunk is a StoreCorruptError)."""
    if val is None:
        raise StoreCorruptError(f"{where}: a chunk of a run is missing")
    arr = np.frombuffer(val, dtype=np.uint8)
    head = arr[:HEADER].view(np.uint32) if len(arr) >= HEADER else None
    k = int(head[2]) if head is not None else 0
    if head is None or arr[:4].tobytes() != RUN_MAGIC or int(head[1]) != record_bytes or \
            not 0 < k <= CHUNK_ROWS or len(arr) != HEADER + k * (8 + record_bytes):
        raise StoreCorruptError(f"{where}: a run chunk's header does not match its size (damaged)")
    ids = arr[HEADER : HEADER + 8 * k].view("<i8")
    # a damaged id would make its row unfindable (not a checksum failure): the ids have their own
    if zlib.crc32(ids) != int(head[3]) or int(ids[0]) != first or \
            (k > 1 and not bool(np.all(ids[1:] > ids[:-1]))):
        raise StoreCorruptError(f"{where}: a run chunk's ids are out of order or not its key's "
                                f"(damaged)")
    return ids, arr[HEADER + 8 * k :].reshape(k, record_bytes)


class RunWriter:
    """Appends rows in increasing id order to an empty run database, `txn_chunks` chunks a
    write transaction (the run is whole once `finish` returns)."""

    def __init__(self, env: lmdb.Environment, db: object, record_bytes: int,
                 txn_chunks: int = TXN_CHUNKS) -> None:
        self.env, self.db, self.record_bytes = env, db, int(record_bytes)
        with env.begin(db=db) as txn:
            if txn.stat(db)["entries"]:
                raise TierstoreError("a run is written once, into an empty database")
        self.txn_chunks = max(1, int(txn_chunks))
        self.rows = self.chunks = self.bytes = 0
        self._last = -1  # the last id added
        self._open: np.ndarray | None = None  # the chunk being filled (a whole value's bytes)
        self._fill = 0  # its rows
        self._ready: list[tuple[bytes, memoryview]] = []  # chunks not yet committed
        self._ready_last = -1  # the last id of those chunks
        self._spare: list[np.ndarray] = []  # whole chunk buffers committed, to fill again
        # called inside each commit's write transaction with the last id it makes durable
        self.before_commit: Callable[[lmdb.Transaction, int], None] | None = None

    @property
    def last_id(self) -> int:
        """The largest id added so far (-1 before any)."""
        return self._last

    def add(self, ids: np.ndarray, records: np.ndarray) -> None:
        """Copy rows into chunks: ids int64 [n], increasing and above every id added before;
        records uint8 [n, record bytes]. Full chunks go to disk in transactions of `txn_chunks`."""
        ids = np.asarray(ids, dtype=np.int64)
        if records.ndim != 2 or records.shape != (len(ids), self.record_bytes):
            raise TierstoreError(f"a run's records are [n, {self.record_bytes}] bytes, got "
                                 f"{records.shape} for {len(ids)} ids")
        if not len(ids):
            return
        if int(ids[0]) <= self._last or int(ids[0]) < 0 or \
                (len(ids) > 1 and not bool(np.all(ids[1:] > ids[:-1]))):
            raise TierstoreError("a run's ids must be non-negative, increasing and above those added")
        self._last = int(ids[-1])
        rows, rb, lo = CHUNK_ROWS, self.record_bytes, 0
        while lo < len(ids):  # one copy of each row, straight into its chunk's value
            if self._open is None:
                self._open, self._fill = self._buffer(), 0
            take = min(rows - self._fill, len(ids) - lo)
            at = self._fill
            self._open[HEADER : HEADER + 8 * rows].view("<i8")[at : at + take] = ids[lo : lo + take]
            self._open[HEADER + 8 * rows :].reshape(rows, rb)[at : at + take] = records[lo : lo + take]
            self._fill += take
            lo += take
            if self._fill == rows:
                self._seal()

    def _buffer(self) -> np.ndarray:
        """A whole chunk's buffer: one committed before (its pages already faulted in), or new."""
        return self._spare.pop() if self._spare else \
            np.empty(HEADER + CHUNK_ROWS * (8 + self.record_bytes), dtype=np.uint8)

    def room(self) -> tuple[np.ndarray, np.ndarray, int]:
        """The open chunk to fill in place: (ids int64 [CHUNK_ROWS], records uint32 [CHUNK_ROWS,
        record words], rows already in it). Rows written there count once `filled` says so."""
        rows, rb = CHUNK_ROWS, self.record_bytes
        if self._open is None:
            self._open, self._fill = self._buffer(), 0
        ids = self._open[HEADER : HEADER + 8 * rows].view("<i8")
        recs = self._open[HEADER + 8 * rows :].view(np.uint32).reshape(rows, rb // 4)
        return ids, recs, self._fill

    def filled(self, n: int, last: int) -> None:
        """`n` more rows of the open chunk were written in place, the last under id `last` (the
        caller checked them: increasing, above every id before); seals the chunk when full."""
        if n <= 0:
            return
        self._fill += n
        self._last = int(last)
        if self._fill == CHUNK_ROWS:
            self._seal()

    def gather(self, ids: np.ndarray, chunks: list[np.ndarray], chunk_of: np.ndarray,
               row_of: np.ndarray, skip: int = 0, table: str = "") -> None:
        """Copy records straight out of other chunks (e.g. the log's, read in place) into this
        run's: row i is `chunks[chunk_of[i]][row_of[i], skip : skip + record words]` (uint32
        [count, stride] arrays: the row's words, then its check) under id `ids[i]` (increasing,
        above those added); each record is verified as it is copied (compiled)."""
        rw = self.record_bytes // 4
        ids, chunk_of, row_of, stride = gather_args(ids, chunks, chunk_of, row_of, skip, rw, "a run")
        if not len(ids):
            return
        if not HAVE_NUMBA:  # pragma: no cover - numba is a hard dependency
            recs = np.empty((len(ids), rw), dtype=np.uint32)
            for c in np.unique(chunk_of).tolist():
                sel = np.flatnonzero(chunk_of == c)
                recs[sel] = chunks[c][row_of[sel], skip : skip + rw]
            open_records(table, ids, recs.view(np.uint8), rw - 1)  # raises on a damaged record
            self.add(ids, recs.view(np.uint8))
            return
        chunks = [c if c.flags.c_contiguous and c.ctypes.data % 4 == 0 else np.ascontiguousarray(c)
                  for c in chunks]
        base = np.array([c.ctypes.data for c in chunks], dtype=np.int64)
        lo = 0
        while lo < len(ids):
            out_ids, out_recs, fill = self.room()
            hi = min(len(ids), lo + CHUNK_ROWS - fill)
            status, i = gather_records(ids, base, stride, chunk_of, row_of, skip, lo, hi, rw - 1,
                                       out_ids, out_recs, fill, self._last)
            if status:  # this piece is not added (pieces before it are: a merge cut short)
                if status == 3:
                    raise StoreCorruptError(f"table {table!r}: row {int(ids[i])} failed its "
                                            f"checksum on its way into a run")
                raise TierstoreError("a run's ids must be non-negative, increasing and above those "
                                     "added")
            self.filled(hi - lo, ids[hi - 1])
            lo = hi

    def finish(self) -> int:
        """Write what is buffered; returns the rows of the run."""
        if self._open is not None and self._fill:
            self._seal()
        self._commit()
        return self.rows

    def _seal(self) -> None:
        """Close the open chunk: its header, and its records moved up behind its ids when short."""
        buf, k, rows, rb = self._open, self._fill, CHUNK_ROWS, self.record_bytes
        if k < rows:
            recs = buf[HEADER + 8 * rows : HEADER + 8 * rows + k * rb].copy()
            buf = buf[: HEADER + k * (8 + rb)]
            buf[HEADER + 8 * k :] = recs
        ids = buf[HEADER : HEADER + 8 * k]
        head = buf[:HEADER].view(np.uint32)
        head[0] = np.frombuffer(RUN_MAGIC, dtype=np.uint32)[0]
        head[1], head[2], head[3] = rb, k, zlib.crc32(ids)
        first = ids[:8].view("<i8")
        self._ready.append((encode_keys(first)[0], memoryview(buf)))
        self._ready_last = int(ids[-8:].view("<i8")[0])
        self.rows += k
        self._open, self._fill = None, 0
        if len(self._ready) >= self.txn_chunks:
            self._commit()

    def _commit(self) -> None:
        if not self._ready:
            return
        with self.env.begin(write=True, db=self.db) as txn:
            _, added = txn.cursor().putmulti(self._ready, append=True)
            if added != len(self._ready):  # raised inside: the transaction is not committed
                raise StoreCorruptError("a run's chunk was refused: its database is not empty or "
                                        "not in id order")
            if self.before_commit is not None:
                self.before_commit(txn, self._ready_last)
        self.chunks += len(self._ready)
        self.bytes += sum(len(v) for _, v in self._ready)
        whole = HEADER + CHUNK_ROWS * (8 + self.record_bytes)
        self._spare = [v.obj for _, v in self._ready if len(v) == whole][: self.txn_chunks]
        self._ready = []


class SortedRun:
    """Reads of one table's run: the chunks' first ids kept in memory, one value read a chunk."""

    def __init__(self, env: lmdb.Environment, db: object, table: str, row_dim: int,
                 where: str = "run") -> None:
        self.env, self.db, self.table, self.row_dim = env, db, table, int(row_dim)
        self.record_bytes = 4 * self.row_dim + CHECK_BYTES
        self.where = where
        with env.begin(db=db) as txn:
            keys = list(txn.cursor().iternext(keys=True, values=False))
        self.firsts = decode_keys(keys, where)

    def get(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(rows float32 [n, row_dim], found bool [n]) for ids in any order, checksums verified."""
        ids = np.asarray(ids, dtype=np.int64)
        n = len(ids)
        out = np.zeros((n, self.row_dim), dtype=np.float32)
        found = np.zeros(n, dtype=bool)
        if not n or not len(self.firsts):
            return out, found
        at = np.searchsorted(self.firsts, ids, side="right") - 1
        sel = np.flatnonzero(at >= 0)
        sel = sel[np.argsort(at[sel], kind="stable")]
        used, starts = np.unique(at[sel], return_index=True)
        bounds = np.append(starts, len(sel))
        recs = np.zeros((n, self.record_bytes), dtype=np.uint8)
        keys = encode_keys(self.firsts[used])
        with self.env.begin(db=self.db, buffers=True) as txn:
            for j, c in enumerate(used.tolist()):  # one value a chunk touched, not a call a row
                mine = sel[bounds[j] : bounds[j + 1]]
                cids, crecs = parse_chunk(txn.get(keys[j]), int(self.firsts[c]), self.record_bytes,
                                          self.where)
                pos = np.minimum(np.searchsorted(cids, ids[mine]), len(cids) - 1)
                hit = cids[pos] == ids[mine]
                recs[mine[hit]] = crecs[pos[hit]]
                found[mine[hit]] = True
        if found.any():
            out[found] = open_records(self.table, ids[found], recs[found], self.row_dim,
                                      f"{self.where}, ")
        return out, found

    def chunks(self) -> Iterator[tuple[bytes, np.ndarray, np.ndarray]]:
        """The run's chunks in id order as (key, ids, records), copies with every record's
        checksum verified; each is read in a short transaction of its own, so a merge that frees
        chunks it consumed does not pin the pages they held."""
        for c, key in enumerate(encode_keys(self.firsts)):
            with self.env.begin(db=self.db, buffers=True) as txn:
                ids, recs = parse_chunk(txn.get(key), int(self.firsts[c]), self.record_bytes,
                                        self.where)
                ids, recs = ids.copy(), recs.copy()
            words = recs.view(np.uint32)
            bad = np.flatnonzero(row_checks(ids, words[:, : self.row_dim]) != words[:, self.row_dim])
            if bad.size:
                raise StoreCorruptError(f"{self.where}, table {self.table!r}: row {int(ids[bad[0]])} "
                                        f"failed its checksum; the run is damaged")
            yield key, ids, recs


def newest_order(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(distinct keys increasing, the position of each one's last occurrence) of keys int64 [n]
    in log order (a later position is a newer version): the order a run is written in. One
    `np.sort` of key and position packed in 63 bits when they fit (~5x cheaper than a stable
    argsort), else a stable argsort."""
    keys = np.asarray(keys, dtype=np.int64)
    n = len(keys)
    if not n:
        return keys.copy(), np.zeros(0, dtype=np.int64)
    shift = max(1, (n - 1).bit_length())
    if int(keys.min()) >= 0 and int(keys.max()) < 1 << (63 - shift):
        packed = np.sort((keys << shift) | np.arange(n, dtype=np.int64))
        ids, pos = packed >> shift, packed & ((1 << shift) - 1)
    else:
        pos = np.argsort(keys, kind="stable")
        ids = keys[pos]
    last = np.ones(n, dtype=bool)
    last[:-1] = ids[1:] != ids[:-1]
    return ids[last], pos[last]


def merge_runs(sources: list[SortedRun], writer: RunWriter, free: bool = False) -> int:
    """Merge runs of one table, newest first (a base last), into `writer`'s empty run: each id's
    newest record, in one sequential pass with every record verified; returns the rows written.

    Each step takes, from every source, the rows up to the smallest last id among the chunks
    loaded, so memory is a chunk or two a source. With `free` (sources and writer in one
    environment), each source chunk is deleted in the write transaction that commits the last of
    its rows: the old and the new rows never coexist whole on disk, and after any commit the
    output, then the sources newest first, read every id's newest row (a merge cut short is a
    consistent state; the caller resumes it or reads through it)."""
    if any(s.record_bytes != writer.record_bytes for s in sources):
        raise TierstoreError("runs of one merge must have one record size")
    done: list[tuple[object, bytes, int]] = []  # source chunks wholly taken: (db, key, last id)

    def drop_taken(txn: lmdb.Transaction, durable: int) -> None:
        keep = []
        for db, key, last in done:
            if last <= durable:
                txn.delete(key, db=db)
            else:
                keep.append((db, key, last))
        done[:] = keep

    if free:
        writer.before_commit = drop_taken
    if HAVE_NUMBA and sources and all(s.env is writer.env for s in sources):
        _merge_compiled(sources, writer, done)
    else:
        _merge_numpy(sources, writer, done)
    rows = writer.finish()
    if free and done:  # sources holding only ids the output already had (no commit after them)
        with writer.env.begin(write=True) as txn:
            drop_taken(txn, writer.last_id)
    return rows


def _merge_compiled(sources: list[SortedRun], writer: RunWriter,
                    done: list[tuple[object, bytes, int]]) -> None:
    """`merge_runs`'s pass in numba (`merge_step`) over the sources' chunks in place in the map
    (a chunk in overflow pages is read by address inside a read transaction: no write moves it,
    only chunks used up are freed); a short chunk, inside a leaf page, is read from a copy."""
    env, rb = writer.env, writer.record_bytes
    nsrc, psize = len(sources), int(env.stat()["psize"])
    id_addr, rec_addr, counts, pos = (np.zeros(nsrc, dtype=np.int64) for _ in range(4))
    live = np.ones(nsrc, dtype=np.uint8)
    copies: list[np.ndarray | None] = [None] * nsrc  # the chunks read from a copy
    nxt = [0] * nsrc  # the next chunk of each source
    cur: list[tuple[bytes, int] | None] = [None] * nsrc  # the loaded chunk: (key, last id)
    keys = [encode_keys(s.firsts) for s in sources]

    def load(s: int, txn: lmdb.Transaction) -> None:
        src, c = sources[s], nxt[s]
        if c == len(keys[s]):
            live[s], cur[s], copies[s] = 0, None, None
            return
        ids, recs = parse_chunk(txn.get(keys[s][c], db=src.db), int(src.firsts[c]), rb, src.where)
        copies[s] = None
        if len(ids) * (8 + rb) + HEADER <= psize or ids.ctypes.data % 8:
            # inside a leaf page: it moves when a neighbour is deleted (a copy-on-write of the
            # page), so it is read from a copy; a value in overflow pages stays put until freed
            copies[s] = np.empty(len(ids) * (8 + rb) // 8 + 1, dtype=np.int64)
            flat = copies[s].view(np.uint8)
            flat[: 8 * len(ids)] = ids.view(np.uint8)
            flat[8 * len(ids) : 8 * len(ids) + recs.size] = recs.reshape(-1)
            ids, recs = copies[s][: len(ids)], flat[8 * len(ids) :]
        id_addr[s], rec_addr[s] = ids.ctypes.data, recs.ctypes.data
        counts[s], pos[s], nxt[s] = len(ids), 0, c + 1
        cur[s] = (keys[s][c], int(ids[-1]))

    with env.begin(buffers=True) as txn:
        for s in range(nsrc):
            load(s, txn)
    while True:
        out_ids, out_recs, fill = writer.room()
        with env.begin(buffers=True) as txn:  # the chunks in use stay put inside it
            end, status, s, last = merge_step(id_addr, rec_addr, counts, pos, live, rb // 4 - 1,
                                              out_ids, out_recs, fill, writer.last_id)
            if status == 2:  # source s's chunk is used up: freed once the output holds its rows
                done.append((sources[s].db, *cur[s]))
                load(s, txn)
        if status == 3:
            raise StoreCorruptError(f"{sources[s].where}, table {sources[s].table!r}: row {last} "
                                    f"failed its checksum; the run is damaged")
        if status == 4:
            raise StoreCorruptError(f"{sources[s].where}: a run's chunks are out of id order "
                                    f"(damaged)")
        writer.filled(end - fill, last)  # may seal the chunk and commit (no reader open)
        if status == 0:
            return


def _merge_numpy(sources: list[SortedRun], writer: RunWriter,
                 done: list[tuple[object, bytes, int]]) -> None:
    """`merge_runs`'s pass in numpy (a build without numba): windows cut at the smallest last
    id loaded, concatenated and stably sorted."""
    its = [s.chunks() for s in sources]
    # per source: the rows loaded and not yet taken, and the chunk they came from
    bufs: list[tuple[bytes, np.ndarray, np.ndarray] | None] = [next(it, None) for it in its]
    while True:
        live = [i for i, b in enumerate(bufs) if b is not None]
        if not live:
            break
        bound = min(int(bufs[i][1][-1]) for i in live)
        ids_parts, rec_parts = [], []
        for i in live:
            key, ids, recs = bufs[i]
            cut = int(np.searchsorted(ids, bound, side="right"))
            ids_parts.append(ids[:cut])
            rec_parts.append(recs[:cut])
            if cut == len(ids):
                done.append((sources[i].db, key, int(ids[-1])))
                bufs[i] = next(its[i], None)
            else:
                bufs[i] = (key, ids[cut:], recs[cut:])
        ids = np.concatenate(ids_parts)  # sources newest first: a stable sort keeps that order
        order = np.argsort(ids, kind="stable")  # (k sorted runs: timsort merges them)
        ids = ids[order]
        keep = np.ones(len(ids), dtype=bool)
        keep[1:] = ids[1:] != ids[:-1]
        writer.add(ids[keep], np.concatenate(rec_parts)[order[keep]])
