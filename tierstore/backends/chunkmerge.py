"""The merge of sorted rows into a level of page chunks (format 4's base), range by range.

A `ChunkLevel` is one table's rows as page-sized chunks (`pagechunks.py`) split into ranges:
LMDB databases holding the ids in `[bounds[r], bounds[r + 1])`, each of about `range_rows` rows
(a range grown past twice that is cut into parts of about `range_rows` as it is written).
`merge` takes a batch of sorted distinct (id, record) rows (the merged half of the log) and
writes every range they touch again, sequentially: the range's old chunks are walked in place in
the data file's map (`chunkwalk.leaf_spans`, one compiled pass over its leaf pages, every page
checked), merged with the batch's rows in a compiled two-way merge
(`chunkmerge_kernels.merge_into`: a batch row replaces the old one of its id), and the output is
packed into full chunks appended with `MDB_APPEND` into a fresh database, a write transaction
every `window` chunks. The range's last transaction also drops its old database: the file holds
the old and the new copy of one range at a time, and the next range is written into the pages it
freed (a window later: no snapshot is held through a rewrite, the old range is read in place under
`lock`), so a merge of an 8 M-row table in 1 M-row ranges peaks near `T + range_rows`, not `2 T`
(`T + 2 range_rows` while each rewrite held a read transaction). A range no row touches is kept as it
is; with `in_place` (or None and a sparse batch) a range is updated chunk by chunk instead
(`chunkupdate.py`). Rows are deleted in place, chunk by chunk (`delete`, `chunkupdate.py`:
expiry's stale rows).

This is the regime the design chose for tables up to ~4x the batch (docs/design.md, "Format 4,
corrected"): each merge copies every row of the ranges it touches. Every chunk's count and ids
check are verified as it is read (a damaged id must not be sealed under a fresh check); with
`verify` every record copied is checked too, old and new (without it a damaged record keeps the
checksum that does not match it, and the next read of the row fails). The level's bounds,
names and row counts live in memory; `on_publish` runs inside every transaction that changes
them, where the store writes its manifest (`lmdb_chunked.py`).
"""

from __future__ import annotations

import bisect
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import lmdb
import numpy as np

from .._kernels import HAVE_NUMBA
from ..errors import StoreCorruptError, TierstoreError
from .chunk_kernels import gather_args
from .lmdb_common import encode_keys
from .pagechunks import HEAD, capacity, lookup, value_bytes
from .pages import REASONS, PageReader

RANGE_ROWS = 1 << 20  # rows a range database holds (about: a range is cut at a chunk boundary)
WINDOW = 4096  # chunks a write transaction (~8 MB)
REWRITE_SHARE = 4  # `in_place=None`: a range is rewritten when the batch holds >= 1 row in 4 of it
REFILL = 0.85  # `in_place=None`: ... or when its chunks are on average under this full
REWRITE_MAX = 24  # ... unless the rewrite would copy more than this many rows a batch row
# a named database's record in the main database: pad, flags, depth, branch, leaf and overflow
# pages, entries, root page
MDB_DB_RECORD = struct.Struct("<IHHQQQQQ")
_P_INVALID = (1 << 64) - 1

if HAVE_NUMBA:
    from .chunkmerge_kernels import _C, _CPOS, _FILL, _I, merge_into, seal_chunk
    from .chunkwalk import count_rows, leaf_spans


@dataclass(frozen=True)
class MergeStats:
    """What one `ChunkLevel.merge` did: rows of the batch, old rows read, rows written, ranges."""

    batch_rows: int
    old_rows: int
    rows_written: int
    chunks_written: int
    ranges_rewritten: int
    ranges_kept: int


class RangeGuard(Protocol):
    """What a level asks before it changes a range database in place or drops it."""

    def keep(self, name: bytes) -> bool:
        """Whether range database `name` must stay as it is (a reader may read it)."""

    def retire(self, txn: lmdb.Transaction, name: bytes, db: object) -> None:
        """In the write txn replacing range `name`: keep it (dropped when no reader needs it)."""

    def changed(self, txn: lmdb.Transaction, name: bytes | None) -> None:
        """In a write txn that changes or drops range `name` in place (None: none)."""


class ChunkLevel:
    """One table's rows as page chunks in ranges of LMDB databases, merged with sorted batches."""

    def __init__(self, env: lmdb.Environment, table: str, row_dim: int, prefix: str,
                 range_rows: int = RANGE_ROWS, window: int = WINDOW) -> None:
        if not HAVE_NUMBA:  # pragma: no cover - numba is a hard dependency
            raise TierstoreError("page-chunk merges need numba")
        if range_rows < 1 or window < 1:
            raise TierstoreError("a chunk level needs range_rows >= 1 and window >= 1")
        self.env, self.table, self.row_dim = env, table, int(row_dim)
        self.record_bytes = 4 * self.row_dim + 4
        self.cap = capacity(self.record_bytes)
        self.vb = value_bytes(self.record_bytes)
        self.prefix, self.range_rows, self.window = prefix, int(range_rows), int(window)
        self.bounds: list[int] = [0]  # range r holds the ids in [bounds[r], bounds[r + 1])
        self.names: list[bytes | None] = [None]  # None: an empty range (no database yet)
        self.counts: list[int] = [0]  # rows of each range
        self._dbs: dict[bytes, object] = {}
        self._seq = 0
        self.reader = PageReader(Path(env.path()) / "data.mdb", int(env.stat()["psize"]))
        # held a range at a time by merges and deletes (a merge and expiry's deleter run on
        # different threads); deletes never move bounds, so a merge's cuts stay valid between
        self.lock = threading.RLock()
        # called inside every write transaction that changes the ranges, with the bounds, names
        # and row counts they have once it commits (where the store writes its manifest)
        self.on_publish: Callable[[lmdb.Transaction, list[int], list[bytes | None], list[int]],
                                  None] | None = None
        # which ranges readers may be reading (the store's publisher, publish.py; None: no
        # reader): a range it keeps is never changed in place nor dropped, but copied and retired
        self.guard: RangeGuard | None = None

    def restore(self, bounds: list[int], names: list[bytes | None], counts: list[int],
                open_db: Callable[[bytes], object] | None = None) -> None:
        """Take the ranges a manifest recorded (bounds, database names, row counts), and open
        their databases (`open_db(name)`, else the environment's own `open_db`: never inside a
        transaction of this thread); StoreCorruptError when they do not describe ranges."""
        if not (len(bounds) == len(names) == len(counts)) or not bounds or bounds[0] != 0 or \
                any(a >= b for a, b in zip(bounds, bounds[1:])) or min(counts) < 0:
            raise StoreCorruptError(f"table {self.table!r}: its chunk manifest is damaged")
        with self.env.begin() as txn:
            for name in names:
                if name is not None and txn.get(name) is None:
                    raise StoreCorruptError(f"table {self.table!r}: the chunk range {name!r} "
                                            f"its manifest names is missing")
        for name in names:
            if name is not None:
                self._dbs[name] = open_db(name) if open_db is not None else \
                    self.env.open_db(name, create=False)
        self.bounds, self.names, self.counts = list(bounds), list(names), [int(c) for c in counts]
        seqs = [int(n.rsplit(b".", 1)[1]) for n in names if n is not None]
        self._seq = max(seqs, default=-1) + 1

    def rows(self) -> int:
        """Rows stored in the level (the ranges' counts)."""
        return sum(self.counts)

    def walked_rows(self) -> int:
        """Rows stored in the level, counted by walking every chunk (a check of `counts`)."""
        with self.env.begin() as txn:
            return sum(self._count(txn, name) for name in self.names)

    def _count(self, txn: lmdb.Transaction, name: bytes | None) -> int:
        """Rows of range `name` (its chunks' counts, walked in place)."""
        mem, offs, _ = self.leaves(txn, name)
        return int(count_rows(mem, offs)) if len(offs) else 0

    def db(self, name: bytes) -> object:
        """The open handle of range database `name`."""
        return self._dbs[name]

    def forget_db(self, name: bytes) -> None:
        """Forget the handle of range database `name` (dropped by a committed transaction)."""
        self._dbs.pop(name, None)

    def _record(self, txn: lmdb.Transaction, name: bytes) -> tuple[int, int]:
        """(entries, root page) of database `name` in `txn`'s snapshot."""
        rec = txn.get(name)
        if rec is None or len(rec) != MDB_DB_RECORD.size:
            raise StoreCorruptError(f"table {self.table!r}: the chunk range {name!r} is missing")
        fields = MDB_DB_RECORD.unpack(rec)
        return int(fields[6]), int(fields[7])

    def leaves(self, txn: lmdb.Transaction, name: bytes | None) -> tuple[np.ndarray, np.ndarray,
                                                                           np.ndarray]:
        """(mapping, offsets, sizes) of every chunk of range `name`, in id order, in place."""
        empty = np.zeros(0, dtype=np.int64)
        if name is None:
            return np.zeros(0, dtype=np.uint8), empty, empty
        entries, root = self._record(txn, name)
        offs = np.zeros(entries, dtype=np.int64)
        lens = np.zeros(entries, dtype=np.int64)
        if root == _P_INVALID:
            if entries:
                raise StoreCorruptError(f"table {self.table!r}: chunk range {name!r} has no root")
            return np.zeros(0, dtype=np.uint8), empty, empty
        info = np.zeros(2, dtype=np.int64)
        for remap in (False, True):
            mem = self.reader.mapping(remap)
            if mem is None:
                raise StoreCorruptError(f"{self.reader.path}: the data file cannot be mapped")
            status, count = leaf_spans(mem, self.reader.psize, root, offs, lens, info)
            if status == 0 and count == entries:
                return mem, offs, lens
            if status == 1:
                continue
            why = REASONS.get(int(info[1]), "more values than its database counts") \
                if status == 3 else "a layout chunks never use" if status == 2 else \
                f"{count} chunks where its database counts {entries}"
            raise StoreCorruptError(f"{self.reader.path}: chunk range {name!r} of table "
                                    f"{self.table!r}, page {int(info[0])}: {why}")
        raise StoreCorruptError(f"{self.reader.path}: a page of chunk range {name!r} lies past "
                                f"the file's end")

    def new_db(self, txn: lmdb.Transaction) -> bytes:
        """A fresh range database, created in the write transaction `txn`; returns its name."""
        while True:
            name = f"{self.prefix}.{self._seq}".encode()
            self._seq += 1
            if txn.get(name) is None:
                self._dbs[name] = self.env.open_db(name, txn=txn)
                return name

    def merge(self, ids: np.ndarray, records: np.ndarray, verify: bool = True,
              in_place: bool | None = False) -> MergeStats:
        """Merge sorted distinct rows (ids int64 [n] >= 0, records uint8 [n, record bytes]) into
        the level: every id's newest record, each touched range rewritten into a fresh database
        (or, `in_place`, each touched chunk read, merged and put back: `chunkupdate.py`; None:
        in place where the batch holds under 1 row in `REWRITE_SHARE` of the range's)."""
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        records = np.ascontiguousarray(records)
        n = len(ids)
        if ids.ndim != 1 or records.dtype != np.uint8 or records.shape != (n, self.record_bytes):
            raise TierstoreError(f"a merge takes ids [n] and records uint8 [n, {self.record_bytes}], "
                                 f"got {ids.shape} and {records.dtype} {records.shape}")
        src = records.ctypes.data + self.record_bytes * np.arange(n, dtype=np.int64)
        return self._merge(ids, src, verify, in_place)

    def merge_gather(self, ids: np.ndarray, chunks: list[np.ndarray], chunk_of: np.ndarray,
                     row_of: np.ndarray, skip: int = 0, verify: bool = True,
                     in_place: bool | None = False) -> MergeStats:
        """`merge` of rows whose records lie in other chunks (the log's, read in place inside the
        caller's read transaction): row i's record is `chunks[chunk_of[i]][row_of[i], skip : skip
        + record words]` (uint32 [count, stride] arrays), copied once, straight into the level."""
        ids, chunk_of, row_of, stride = gather_args(ids, chunks, chunk_of, row_of, skip,
                                                    self.record_bytes // 4, "a merge")
        chunks = [c if c.flags.c_contiguous else np.ascontiguousarray(c) for c in chunks]
        base = np.array([c.ctypes.data for c in chunks] or [0], dtype=np.int64)
        src = base[chunk_of] + 4 * (row_of * stride + skip)
        return self._merge(ids, src, verify, in_place)

    def _merge(self, ids: np.ndarray, src: np.ndarray, verify: bool,
               in_place: bool | None) -> MergeStats:
        """`merge`'s pass over the ranges; row i's record lies at address src[i]."""
        n = len(ids)
        if ids.ndim != 1 or (n and (int(ids[0]) < 0 or not bool(np.all(ids[1:] > ids[:-1])))):
            raise TierstoreError("a merge's ids must be non-negative, increasing and distinct")
        cuts = np.searchsorted(ids, np.array(self.bounds[1:], dtype=np.int64)).tolist()
        cuts = [0, *cuts, n]
        totals = np.zeros(3, dtype=np.int64)  # old rows, rows written, chunks written
        rewritten = kept = 0
        r = 0
        while r < len(self.names):
            lo, hi = cuts[r], cuts[r + 1]
            if lo == hi:
                kept += 1
                r += 1
                continue
            with self.lock:
                if not self._kept(r) and (in_place or (in_place is None and
                                                       self._sparse(r, hi - lo))):
                    from .chunkupdate import update_range  # (it imports this module's kernels)

                    update_range(self, r, ids[lo:hi], src[lo:hi], verify, totals)
                    made = [r]
                else:
                    made = self._rewrite(r, ids, src, lo, hi, verify, totals)
            cuts[r + 1 : r + 1] = [hi] * (len(made) - 1)  # new ranges take no more of the batch
            r += len(made)
            rewritten += 1
        return MergeStats(n, int(totals[0]), int(totals[1]), int(totals[2]), rewritten, kept)

    def repack(self, min_fill: float = 0.97) -> int:
        """Rewrite, packed, every range whose chunks are under `min_fill` full on average (the
        splits of in-place updates thin them); returns the ranges rewritten."""
        done = 0
        r = 0
        empty_ids = np.zeros(0, dtype=np.int64)
        while r < len(self.names):
            with self.lock:  # (expiry's deleter may share the level)
                name = self.names[r]
                made = [r]
                if name is not None:
                    with self.env.begin() as txn:
                        entries, _ = self._record(txn, name)
                    packed = -(-self.counts[r] // self.cap)  # the fewest chunks its rows take
                    if entries > packed and self.counts[r] < min_fill * entries * self.cap:
                        made = self._rewrite(r, empty_ids, empty_ids, 0, 0, False,
                                             np.zeros(3, np.int64))
                        done += 1
            r += len(made)
        return done

    def _kept(self, r: int) -> bool:
        """Whether range r's database must stay as it is (`guard`): changes go to a copy."""
        name = self.names[r]
        return name is not None and self.guard is not None and self.guard.keep(name)

    def copy_kept(self, r: int) -> None:
        """Range r copied into a fresh database (one range: bounds stay) when `guard` keeps its
        database, so that in-place changes go to the copy."""
        if self._kept(r):
            empty = np.zeros(0, dtype=np.int64)
            self._rewrite(r, empty, empty, 0, 0, False, np.zeros(3, np.int64), split=False)

    def _sparse(self, r: int, rows: int) -> bool:
        """Whether `rows` batch rows are under 1 in `REWRITE_SHARE` of range r's (by its chunks)
        and the range's chunks stay `REFILL` full on average even if every batch row splits the
        chunk it lands in (a B-tree's fill otherwise), or the batch is too small to pay for a
        rewrite (the range holds over `REWRITE_MAX` rows a batch row): else it is rewritten."""
        if self.names[r] is None:
            return False
        with self.env.begin() as txn:
            entries, _ = self._record(txn, self.names[r])
        # each batch row may split the chunk it lands in: the fill after, at worst; but a batch
        # too small to pay for the range's rewrite goes in place however thin it leaves it
        return rows * REWRITE_SHARE < entries * self.cap and (
            self.counts[r] + rows >= REFILL * (entries + rows) * self.cap
            or self.counts[r] > REWRITE_MAX * rows)

    def _rewrite(self, r: int, ids: np.ndarray, src: np.ndarray, lo: int, hi: int, verify: bool,
                 totals: np.ndarray, split: bool = True) -> list[int]:
        """Range r merged with batch rows [lo, hi) into fresh databases (one a `range_rows`),
        the old one dropped in the last one's transaction; returns the new ranges' indexes."""
        env = self.env
        old = self.names[r]
        bounds, names = [self.bounds[r]], [None]  # None: opened by the next write transaction
        try:
            return self._write_range(r, old, ids, src, lo, hi, verify, totals, bounds, names, [],
                                     split)
        except BaseException:  # the fresh databases of a merge cut short go: nothing changed
            with env.begin(write=True) as txn:
                for name in names:
                    if name is not None and name in self._dbs:
                        txn.drop(self._dbs.pop(name), delete=True)
            raise

    def _write_range(self, r: int, old: bytes | None, ids: np.ndarray, src: np.ndarray, lo: int,
                     hi: int, verify: bool, totals: np.ndarray, bounds: list[int],
                     names: list[bytes | None], counts: list[int], split: bool = True) -> list[int]:
        """`_rewrite`'s pass: the new databases' names, bounds and row counts go into `names`,
        `bounds` and `counts` (one range, without `split`)."""
        env, cap, vb = self.env, self.cap, self.vb
        out = np.empty(self.window * vb, dtype=np.uint8)
        values = [memoryview(v) for v in out.reshape(self.window, vb)]  # made once: cheap puts
        state = np.array([0, 0, lo, -1, 0], dtype=np.int64)
        in_db = 0  # rows in the newest output database
        with env.begin() as rtxn:  # the old range's chunks, found in a snapshot
            mem, offs, lens = self.leaves(rtxn, old)
        # ... and read in place without one: nothing changes or frees the old range's pages
        # before this rewrite's last commit drops it (writers of a range hold `lock`, which our
        # callers hold; other threads' readers pin what they read themselves), and a snapshot
        # held through the rewrite would keep LMDB from reusing the pages the range before
        # freed, one more range of file (`T + 2 range_rows` at the peak, not `T + range_rows`)
        had = int(count_rows(mem, offs)) if len(offs) else 0
        totals[0] += had
        nc = len(offs)
        # a range grown past twice its size is cut into parts of about `range_rows`
        est = had + hi - lo
        parts = -(-est // self.range_rows) if split and est > 2 * self.range_rows else 1
        target = -(-est // parts)
        while True:  # a window stops where the output range reaches its target
            room = min(self.window, max(1, -(-(target - in_db) // cap)))
            made, status, at = merge_into(mem, offs, lens, ids, src, hi, cap, self.row_dim,
                                          verify, out[: room * vb], state)
            if status:
                self._fail(old, status, at, ids)
            done = state[_C] == nc and state[_I] == hi
            fill = int(state[_FILL])
            roll = not done and in_db + made * cap >= target
            full = made  # (an open chunk is never the buffer's last: that one was sealed)
            if (done or roll) and fill:  # a range's last chunk may be short
                seal_chunk(out, made * vb, fill, cap, self.record_bytes)
                full = made + 1
                state[_FILL] = 0
            rows = made * cap + (fill if full > made else 0)
            with env.begin(write=True) as txn:
                if names[-1] is None:
                    names[-1] = self.new_db(txn)
                db = self._dbs[names[-1]]
                if full:
                    chunks = out[: full * vb].reshape(full, vb)
                    firsts = chunks[:, HEAD : HEAD + 8].copy().view(np.int64).ravel()
                    # a lazy zip: its pair tuple is reused, none piles up for the collector
                    _, added = txn.cursor(db=db).putmulti(
                        zip(encode_keys(firsts), values), append=True)
                    if added != full:
                        raise StoreCorruptError(f"table {self.table!r}: a chunk was refused "
                                                f"by its fresh range (out of id order)")
                if done:  # the range's new databases replace its old one, in one commit
                    new_bounds = self.bounds[:r] + bounds + self.bounds[r + 1 :]
                    new_names = self.names[:r] + names + self.names[r + 1 :]
                    new_counts = self.counts[:r] + counts + [in_db + rows] + self.counts[r + 1 :]
                    gone = old
                    if old is not None and self.guard is not None and self.guard.keep(old):
                        self.guard.retire(txn, old, self._dbs[old])  # readers read it
                        gone = None
                    elif old is not None:
                        txn.drop(self._dbs[old], delete=True)
                    if self.guard is not None:
                        self.guard.changed(txn, gone)
                    if self.on_publish is not None:
                        self.on_publish(txn, list(new_bounds), list(new_names), list(new_counts))
            if done:
                self.bounds, self.names, self.counts = new_bounds, new_names, new_counts
                self._dbs.pop(old, None)
            totals[1] += rows
            totals[2] += full
            in_db += rows
            if full == made and made and fill:  # the open chunk moves to the buffer's front
                out[:vb] = out[made * vb : (made + 1) * vb]
            if done:
                return list(range(r, r + len(names)))
            if roll:  # the next rows go to a range of their own
                bounds.append(self._next_id(mem, offs, ids, state, hi))
                names.append(None)
                counts.append(in_db)
                in_db = 0

    def _next_id(self, mem: np.ndarray, offs: np.ndarray, ids: np.ndarray, state: np.ndarray,
                 hi: int) -> int:
        """The smallest id the merge has yet to write (the next output range's bound)."""
        nxt = []
        if state[_I] < hi:
            nxt.append(int(ids[state[_I]]))
        if state[_C] < len(offs):
            at = int(offs[state[_C]]) + HEAD + 8 * int(state[_CPOS])
            nxt.append(int(mem[at : at + 8].view(np.int64)[0]))
        return min(nxt)

    def _fail(self, old: bytes | None, status: int, at: int, ids: np.ndarray) -> None:
        if status == 3:
            raise TierstoreError(f"table {self.table!r}: the record of row {int(ids[at])} given to "
                                 f"the merge fails its checksum")
        if status == 2:
            raise StoreCorruptError(f"table {self.table!r}: row {at} failed its checksum in chunk "
                                    f"range {old!r}; the store file is damaged")
        raise StoreCorruptError(f"table {self.table!r}: chunk {at} of range {old!r} is damaged "
                                f"(its size, count or ids)")

    def delete(self, ids: np.ndarray, stamp_col: int, cutoff: int,
               tally: np.ndarray | None = None) -> int:
        """Delete the rows of sorted distinct `ids` whose stored stamp (record word `stamp_col`,
        as int32) is below `cutoff` (2**31: every row asked), in place, chunk by chunk
        (`chunkupdate.py`); returns the rows deleted (also added to tally[0] as each write
        transaction commits: what a caller interrupted by an error keeps). Absent ids are skipped."""
        ids = np.asarray(ids)
        if ids.ndim != 1 or (len(ids) and ids.dtype.kind not in "iu"):
            raise TierstoreError(f"a delete takes ids int64 [n], got {ids.dtype} {ids.shape}")
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        n = len(ids)
        if n and (int(ids[0]) < 0 or not bool(np.all(ids[1:] > ids[:-1]))):
            raise TierstoreError("a delete's ids must be non-negative, increasing and distinct")
        if isinstance(stamp_col, bool) or not isinstance(stamp_col, (int, np.integer)) or \
                not 0 <= stamp_col < self.row_dim:
            raise TierstoreError(f"a delete's stamp_col must be a column in [0, {self.row_dim}), "
                                 f"got {stamp_col!r}")
        if isinstance(cutoff, bool) or not isinstance(cutoff, (int, np.integer)) or \
                not -(2**31) <= cutoff <= 2**31:
            raise TierstoreError(f"a delete's cutoff must be an int in [-2**31, 2**31], got {cutoff!r}")
        from .chunkupdate import delete_range  # (it imports this module's kernels)

        tally = np.zeros(1, dtype=np.int64) if tally is None else tally
        start = int(tally[0])
        lo = 0
        while lo < n:  # a range at a time, its bounds read under the lock (a merge may cut one)
            with self.lock:
                r = bisect.bisect_right(self.bounds, int(ids[lo])) - 1
                self.copy_kept(r)  # a range readers may read is copied first (bounds stay)
                hi = n if r + 1 == len(self.bounds) else \
                    int(np.searchsorted(ids, self.bounds[r + 1]))
                delete_range(self, r, ids[lo:hi], int(stamp_col), int(cutoff), tally)
            lo = hi
        return int(tally[0]) - start

    def get(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(rows float32 [n, row_dim], found bool [n]) of sorted distinct `ids`, checksums verified."""
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        n = len(ids)
        if n and (int(ids[0]) < 0 or not bool(np.all(ids[1:] > ids[:-1]))):
            raise TierstoreError("a chunk level reads sorted, distinct, non-negative ids")
        rows = np.zeros((n, self.row_dim), dtype=np.float32)
        found = np.zeros(n, dtype=bool)
        cuts = [0, *np.searchsorted(ids, np.array(self.bounds[1:], dtype=np.int64)).tolist(), n]
        with self.env.begin() as txn:
            for r, name in enumerate(self.names):
                lo, hi = cuts[r], cuts[r + 1]
                if name is None or lo == hi:
                    continue
                got = lookup(self.reader, txn, name, self.table, ids[lo:hi], self.row_dim)
                if got is None:
                    raise StoreCorruptError(f"table {self.table!r}: chunk range {name!r} holds a "
                                            f"layout chunks never use")
                rows[lo:hi], found[lo:hi] = got
        return rows, found
