"""Deletes from a page-chunk level, in place (`ChunkLevel.delete`): expiry on format 4.

A delete names sorted ids and a predicate given as data: a row goes only if its stored record's
stamp word (column `stamp_col` of its float32 words, read as int32) is below `cutoff`, so a row
updated since the scan that chose it stays (expiry's re-check, `expiry.delete_stale`). The ids
are taken `WINDOW_ROWS` at a time, as `chunkupdate.py` takes a merge's: each id's chunk is found
by the page walker's floor search in a read transaction, one compiled pass (`drop_rows`) checks
every touched chunk (size, count, ids' check and order) and every record's checksum, and writes
each chunk that loses rows again without them; one write transaction puts them back.

A chunk is stored under the big-endian id of its first row. A chunk that loses its first row is
put under its new first id and its old key deleted, in the same transaction (the new key lies
between the old one and the next chunk's, so the floor search still finds every row). A chunk
left empty is deleted; a range left empty drops its database and becomes an empty range (name
None, count 0) as a level's first range is before any merge: bounds never change, so a merge
interleaved between ranges (`ChunkLevel.lock` is taken a range at a time) keeps its cuts. Every
write transaction updates the ranges' counts and calls `on_publish`, as a merge's does.

`chunk_stamps` is the scan's pass: the ids and stamps of whole chunks (each chunk checked),
from which expiry picks the stale ids (`ChunkTables.chunk_stale_ids`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .._kernels import HAVE_NUMBA
from ..errors import StoreCorruptError
from .lmdb_common import encode_keys
from .pagechunks import HEAD

if TYPE_CHECKING:
    from .chunkmerge import ChunkLevel

WINDOW_ROWS = 8192  # ids a read-modify-write transaction

if HAVE_NUMBA:
    import numba

    from .chunk_kernels import words_at
    from .chunkmerge import copy_at, i64_at, open_chunk, seal_chunk
    from .record import check_row

    @numba.njit(nogil=True, cache=True)
    def stamp_at(rec, col):  # pragma: no cover - compiled
        """Word `col` of a record's uint32 words, read as int32 (the store clock's stamp)."""
        s = np.int64(rec[col])
        return s - (np.int64(1) << 32) if s >= (np.int64(1) << 31) else s

    @numba.njit(nogil=True, cache=True)
    def drop_rows(mem, offs, lens, starts, ids, cap, w, stamp_col, cutoff, out, olds, firsts,
                  kept):  # pragma: no cover - compiled
        """The chunks ids[starts[g] : starts[g + 1]] fall into (group g's at offs[starts[g]] in
        `mem`, -1: none, the ids lie below the range's first chunk) written again without the
        rows whose id is asked and whose stamp is below `cutoff`: chunk g's new value in
        out[g * value bytes:], its old first id in olds[g], its new one in firsts[g], its rows
        kept in kept[g] (-1: none dropped, the chunk stays as it is). Every chunk's size,
        count, ids' check and order, and every record's checksum, are verified. Returns (rows
        dropped, status, at): status 0; 1 the chunk of id `at` is damaged; 2 the record of id
        `at` failed its check."""
        rb = 4 * (w + 1)
        vb = HEAD + cap * (8 + rb)
        r0 = HEAD + 8 * cap
        m_at, o_at = mem.ctypes.data, out.ctypes.data
        dropped = 0
        for g in range(starts.shape[0] - 1):
            lo, hi = starts[g], starts[g + 1]
            kept[g] = -1
            off = offs[lo]
            if off < 0:
                continue
            count = open_chunk(mem, offs, lens, lo, cap, vb, np.int64(-1))
            if count < 0:
                return dropped, 1, ids[lo]
            i, k = lo, 0
            for a in range(count):
                oid = i64_at(m_at + off + HEAD + 8 * a)
                at = m_at + off + r0 + a * rb
                rec = numba.carray(words_at(at), w + 1)
                if check_row(np.uint64(oid), rec[:w]) != rec[w]:
                    return dropped, 2, oid
                while i < hi and ids[i] < oid:
                    i += 1
                if i < hi and ids[i] == oid and stamp_at(rec, stamp_col) < cutoff:
                    continue  # asked, and still stale: it goes
                q = g * vb + HEAD + 8 * k
                for b in range(8):
                    out[q + b] = np.uint8((oid >> (8 * b)) & 0xFF)
                copy_at(o_at + g * vb + r0 + k * rb, at, rb)
                if k == 0:
                    firsts[g] = oid
                k += 1
            olds[g] = i64_at(m_at + off + HEAD)
            if k == count:
                continue
            dropped += count - k
            kept[g] = k
            if k:
                seal_chunk(out, g * vb, k, cap, rb)
        return dropped, 0, 0

    @numba.njit(nogil=True, cache=True)
    def chunk_stamps(mem, offs, lens, cap, w, stamp_col, ids, stamps):  # pragma: no cover
        """The ids and stamps of the chunks at offs, in order, into ids[:rows], stamps[:rows]:
        (rows, 0), or (rows so far, 1 + the chunk) whose size, count, ids' check or order is
        wrong. Records are not checked here: a delete checks each one it reads."""
        rb = 4 * (w + 1)
        vb = HEAD + cap * (8 + rb)
        r0 = HEAD + 8 * cap
        m_at = mem.ctypes.data
        n = 0
        last = np.int64(-1)
        for c in range(offs.shape[0]):
            count = open_chunk(mem, offs, lens, c, cap, vb, last)
            if count < 0:
                return n, 1 + c
            for a in range(count):
                ids[n] = i64_at(m_at + offs[c] + HEAD + 8 * a)
                rec = numba.carray(words_at(m_at + offs[c] + r0 + a * rb), w + 1)
                stamps[n] = stamp_at(rec, stamp_col)
                n += 1
            last = ids[n - 1]
        return n, 0


def delete_range(level: ChunkLevel, r: int, ids: np.ndarray, stamp_col: int, cutoff: int,
                 tally: np.ndarray, window: int | None = None) -> None:
    """Rows `ids` (sorted, inside range r) deleted from range r where their stamp is below
    `cutoff`, `window` ids (`WINDOW_ROWS`) a write transaction; adds the rows deleted to
    tally[0] as each commits."""
    env, vb = level.env, level.vb
    window = window or WINDOW_ROWS
    for lo in range(0, len(ids), window):
        name = level.names[r]
        if name is None:  # the range is empty (or was emptied by an earlier window)
            return
        part = ids[lo : lo + window]
        n = len(part)
        with env.begin() as rtxn:  # the chunks stay put while it is open
            spans = level.reader.floor_spans(rtxn.get(name), part.astype(np.uint64))
            if spans is None:
                raise StoreCorruptError(f"table {level.table!r}: chunk range {name!r} holds a "
                                        f"layout chunks never use")
            mem, offs, lens = spans
            starts = np.concatenate([[0], np.flatnonzero(offs[1:] != offs[:-1]) + 1, [n]])
            groups = len(starts) - 1
            out = np.empty(groups * vb, dtype=np.uint8)
            olds = np.zeros(groups, dtype=np.int64)
            firsts = np.zeros(groups, dtype=np.int64)
            kept = np.full(groups, -1, dtype=np.int64)
            dropped, status, bad = drop_rows(mem, offs, lens, starts.astype(np.int64), part,
                                             level.cap, level.row_dim, int(stamp_col),
                                             int(cutoff), out, olds, firsts, kept)
        if status:
            what = "the record of row" if status == 2 else "the chunk holding row"
            raise StoreCorruptError(f"table {level.table!r}: {what} {int(bad)} in chunk range "
                                    f"{name!r} is damaged")
        if not dropped:
            continue
        touched = np.flatnonzero(kept >= 0)
        emptied = touched[kept[touched] == 0]
        moved = touched[(kept[touched] > 0) & (firsts[touched] != olds[touched])]
        rewritten = touched[kept[touched] > 0]
        values = out.reshape(groups, vb)
        counts = list(level.counts)
        counts[r] -= int(dropped)
        names = list(level.names)
        with env.begin(write=True) as txn:
            db = level.db(name)
            for key in encode_keys(olds[np.concatenate([emptied, moved])]):
                if not txn.delete(key, db=db):
                    raise StoreCorruptError(f"table {level.table!r}: a chunk of range {name!r} "
                                            f"is not under its first id")
            txn.cursor(db=db).putmulti(list(zip(encode_keys(firsts[rewritten]),
                                                [memoryview(v) for v in values[rewritten]])))
            if txn.stat(db)["entries"] == 0:  # the range is empty: its database goes
                txn.drop(db, delete=True)
                names[r], counts[r] = None, 0
            if level.on_publish is not None:
                level.on_publish(txn, list(level.bounds), list(names), list(counts))
        if names[r] is None:
            level.forget_db(name)
        level.names, level.counts = names, counts
        tally[0] += int(dropped)


if not HAVE_NUMBA:  # pragma: no cover - numba is a hard dependency
    drop_rows = chunk_stamps = None
