"""Compiled loops of the chunked value formats: the log's append and the sorted runs' merge.

`pack_log` builds the write-behind log's chunk values (wal/chunks.py's format) in one pass: each
entry's header, its row's words copied once, and its checksum computed while the words are in
cache. `merge_step` is the k-way merge of sorted runs (runs.py) over chunks read in place from
the map, and `gather_records` copies verified records from the log's mapped entries into a run's
chunk. They exist only with numba; callers keep their numpy path for a build without it.
`gather_args` checks a gather's arguments, for runs and page-chunk merges alike.
"""

from __future__ import annotations

import numpy as np

from .._kernels import HAVE_NUMBA
from ..errors import TierstoreError

AHEAD = 8  # rows a gather asks the CPU for before it copies them (their records lie anywhere)


def gather_args(ids: np.ndarray, chunks: list[np.ndarray], chunk_of: np.ndarray, row_of: np.ndarray,
                skip: int, rw: int, what: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """A gather's arguments checked (records of `rw` words at word `skip` of uint32 chunks of one
    row stride, every row inside its chunk; `what` names the gatherer in the error): returns ids,
    chunk_of and row_of as int64 arrays, and the stride."""
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    chunk_of = np.ascontiguousarray(chunk_of, dtype=np.int64)
    row_of = np.ascontiguousarray(row_of, dtype=np.int64)
    stride = chunks[0].shape[1] if chunks else rw
    if any(c.ndim != 2 or c.dtype != np.uint32 or c.shape[1] != stride for c in chunks) or \
            not 0 <= skip <= stride - rw or not len(chunk_of) == len(row_of) == len(ids):
        raise TierstoreError(f"{what} gathers records of {rw} words from uint32 chunks of one row "
                             f"stride")
    if len(ids):
        counts = np.array([len(c) for c in chunks], dtype=np.int64)
        if not chunks or int(chunk_of.min()) < 0 or int(chunk_of.max()) >= len(chunks) or \
                int(row_of.min()) < 0 or bool((row_of >= counts[chunk_of]).any()):
            raise TierstoreError(f"{what}'s gathered rows must lie inside their chunks")
    return ids, chunk_of, row_of, stride

if HAVE_NUMBA:
    import numba

    from .record import check_row

    @numba.njit(nogil=True, cache=True)
    def pack_log(tids, rows, words, w, chunk_rows, magic, out):  # pragma: no cover - compiled
        """Fill `out` (uint32, `n // chunk_rows` whole chunks and a last one, back to back) with
        log chunks of entries `table id u32 | 0 u32 | row i64 | words[:w] | check`."""
        n = len(rows)
        ew = 4 + w + 1
        for i in range(n):
            c = i // chunk_rows
            at = 4 * (c + 1) + i * ew
            if i % chunk_rows == 0:
                head = 4 * c + i * ew
                out[head] = magic
                out[head + 1] = 4 * ew
                out[head + 2] = min(chunk_rows, n - i)
                out[head + 3] = 0
            r = np.uint64(rows[i])
            out[at] = tids[i]
            out[at + 1] = 0
            out[at + 2] = np.uint32(r & np.uint64(0xFFFFFFFF))
            out[at + 3] = np.uint32(r >> np.uint64(32))
            for j in range(w):
                out[at + 4 + j] = words[i, j]
            out[at + 4 + w] = check_row(r, out[at + 4 : at + 4 + w])

    from llvmlite import ir
    from numba import types
    from numba.core import cgutils
    from numba.extending import intrinsic

    @intrinsic
    def _ids_at(typingctx, addr):
        """The int64 pointer at an address (of a buffer the caller keeps alive and in place)."""
        def codegen(context, builder, sig, args):
            return builder.inttoptr(args[0], context.get_value_type(sig.return_type))
        return types.CPointer(types.int64)(types.int64), codegen

    @intrinsic
    def _words_at(typingctx, addr):
        """The uint32 pointer at an address (of a buffer the caller keeps alive and in place)."""
        def codegen(context, builder, sig, args):
            return builder.inttoptr(args[0], context.get_value_type(sig.return_type))
        return types.CPointer(types.uint32)(types.int64), codegen

    @intrinsic
    def _bytes_at(typingctx, addr):
        """The uint8 pointer at an address (of a buffer the caller keeps alive and in place)."""
        def codegen(context, builder, sig, args):
            return builder.inttoptr(args[0], context.get_value_type(sig.return_type))
        return types.CPointer(types.uint8)(types.int64), codegen

    @intrinsic
    def _prefetch(typingctx, addr):
        """Hint the CPU to load the cache line at an address, for reading (never faults)."""
        def codegen(context, builder, sig, args):
            i8p = ir.IntType(8).as_pointer()
            i32 = ir.IntType(32)
            fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
            fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0i8")
            builder.call(fn, [builder.inttoptr(args[0], i8p), i32(0), i32(3), i32(1)])
            return context.get_dummy_value()
        return types.void(types.int64), codegen

    @numba.njit(nogil=True, cache=True)
    def pick_entries(val, count, size, first, seqs, mine, magic, entries, got_size, found
                     ):  # pragma: no cover - compiled
        """Copy the entries `seqs[mine] - first` of one log chunk (`val`, uint8, wal/chunks.py's
        format) into rows `mine` of `entries`, after checking the chunk's header against its
        `count` and entry `size`; False (nothing copied) when the header does not match."""
        if val.shape[0] != 16 + count * size:
            return False
        for b in range(4):
            if val[b] != magic[b]:
                return False
        head_size = val[4] | (val[5] << 8) | (val[6] << 16) | (np.int64(val[7]) << 24)
        head_count = val[8] | (val[9] << 8) | (val[10] << 16) | (np.int64(val[11]) << 24)
        if head_size != size or head_count != count:
            return False
        for j in range(mine.shape[0]):
            i = mine[j]
            at = 16 + (seqs[i] - first) * size
            for b in range(size):
                entries[i, b] = val[at + b]
            got_size[i] = size
            found[i] = True
        return True

    @numba.njit(nogil=True, cache=True)
    def pick_chunks(addrs, lens, counts, sizes, firsts, bounds, want, seqs, magic, entries,
                    got_size, found):  # pragma: no cover - compiled
        """`pick_entries` of many log chunks in one call: chunk j's value lies at address
        `addrs[j]` (`lens[j]` bytes, in the caller's read transaction) and holds the entries
        `want[bounds[j] : bounds[j + 1]]`. Returns -1, or the first chunk whose header does not
        match (the entries of the chunks before it are copied)."""
        for j in range(addrs.shape[0]):
            val = numba.carray(_bytes_at(addrs[j]), lens[j])
            if not pick_entries(val, counts[j], sizes[j], firsts[j], seqs,
                                want[bounds[j] : bounds[j + 1]], magic, entries, got_size, found):
                return j
        return -1

    @numba.njit(nogil=True, cache=True)
    def merge_step(id_addr, rec_addr, counts, pos, live, w, out_ids, out_recs, fill, last
                   ):  # pragma: no cover - compiled
        """Merge sources (newest first) into the output chunk from row `fill`: each id's newest
        record, every record read verified. Source `s`'s current chunk holds `counts[s]` rows,
        its ids (int64) at address `id_addr[s]` and its records (w words and a check, uint32)
        at `rec_addr[s]` (buffers the caller keeps in place); `pos[s]` is its next row, `live[s]`
        whether it has rows left. Returns (fill, status, source, last id written): status 0
        every source is done, 1 the output is full, 2 `source`'s chunk is used up (load its
        next), 3 `source`'s record of the id returned failed its check, 4 an id out of order (damaged)."""
        nsrc = len(counts)
        rw = w + 1
        cap = len(out_ids)
        while fill < cap:
            best = -1
            bid = np.int64(0)
            for s in range(nsrc):
                if not live[s]:
                    continue
                if pos[s] == counts[s]:
                    return fill, 2, s, last
                x = _ids_at(id_addr[s])[pos[s]]
                if best < 0 or x < bid:
                    bid, best = x, s
            if best < 0:
                return fill, 0, -1, last
            if bid <= last:
                return fill, 4, best, last
            for s in range(best, nsrc):  # the newest (the first at bid) is copied, every one checked
                if not live[s] or _ids_at(id_addr[s])[pos[s]] != bid:
                    continue
                rec = numba.carray(_words_at(rec_addr[s] + 4 * rw * pos[s]), rw)
                if check_row(np.uint64(bid), rec[:w]) != rec[w]:
                    return fill, 3, s, bid
                if s == best:  # an explicit loop: ~25% cheaper than numba's slice copy here
                    for j in range(rw):
                        out_recs[fill, j] = rec[j]
                pos[s] += 1
            out_ids[fill] = bid
            last = bid
            fill += 1
        return fill, 1, -1, last

    @numba.njit(nogil=True, cache=True)
    def gather_records(ids, base, stride, chunk_of, row_of, skip, lo, hi, w, out_ids, out_recs,
                       fill, last):  # pragma: no cover - compiled
        """Copy the records of ids[lo:hi] (increasing, above `last`) into the output chunk from
        row `fill`, each verified: row i's record (w words and a check, uint32) starts `skip`
        words into row `row_of[i]` of chunk `chunk_of[i]`, whose rows of `stride` words start at
        address `base[chunk]` (buffers the caller keeps in place). Returns (status, i): 0 done,
        3 row i failed its check, 4 id i is out of order."""
        rw = w + 1
        for i in range(lo, hi):
            x = ids[i]
            if x <= last:
                return 4, i
            if i + AHEAD < hi:  # records lie anywhere (log order): ask for one AHEAD rows on
                ahead = base[chunk_of[i + AHEAD]] + 4 * (row_of[i + AHEAD] * stride + skip)
                for b in range(0, 4 * rw + 63, 64):
                    _prefetch(ahead + b)
            rec = numba.carray(_words_at(base[chunk_of[i]] + 4 * (row_of[i] * stride + skip)), rw)
            if check_row(np.uint64(x), rec[:w]) != rec[w]:
                return 3, i
            for j in range(rw):
                out_recs[fill, j] = rec[j]
            out_ids[fill] = x
            fill += 1
            last = x
        return 0, hi

    words_at, prefetch_at = _words_at, _prefetch  # for chunkmerge.py's merge of log records
else:  # pragma: no cover - numba is a hard dependency; callers check HAVE_NUMBA first
    pack_log = merge_step = gather_records = None
