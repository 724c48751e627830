"""The in-place regime of a page-chunk level's merge (`ChunkLevel.merge(..., in_place=True)`).

For a table far larger than the batch (T >> N: 10^9-10^11 rows against a log's few million),
rewriting the base costs T / N rows copied a row fed. Instead each chunk a batch row falls into
is read, merged with the batch rows of its id range, and put back (a read-modify-write: about
one leaf page a row when the rows are sparse, the floor of any in-place layout). A chunk that
overflows is split into chunks of near-equal counts, the first under the old chunk's key, the
others under their own first ids, all inside the old chunk's id range, so no other chunk's key
moves and nothing is deleted. Batch ids below a range's first chunk make chunks of their own.
Split chunks are not full (a level updated in place settles near 3/4 full, as a B-tree does);
the next sequential rewrite of a range packs it again.

The batch is taken `WINDOW_ROWS` rows at a time: the chunks are found by the page walker's
floor search (`PageReader.floor_spans`) in a read transaction, merged into new values by one
compiled pass (every old chunk's size, count, ids' check and order verified; with `verify`,
every record copied), and put in one write transaction, which the next window's search sees.

Deletes (`ChunkLevel.delete`: expiry on format 4) are in-place updates too. A delete names
sorted ids and a predicate given as data: a row goes only if its stored record's stamp word
(column `stamp_col` of its float32 words, read as int32) is below `cutoff`, so a row updated
since the scan that chose it stays (expiry's re-check, `expiry.delete_stale`). The ids are
taken `DELETE_WINDOW_ROWS` at a time, as a merge's rows are: each id's chunk is found by the
floor search in a read transaction, one compiled pass (`drop_rows`) checks every touched chunk
(size, count, ids' check and order) and every record's checksum, and writes
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
from ..errors import StoreCorruptError, TierstoreError
from .lmdb_common import encode_keys
from .pagechunks import HEAD

if TYPE_CHECKING:
    import lmdb

    from .chunkmerge import ChunkLevel

WINDOW_ROWS = 8192  # batch rows a read-modify-write transaction
DELETE_WINDOW_ROWS = 8192  # ids a delete's read-modify-write transaction

if HAVE_NUMBA:
    import numba

    from .chunk_kernels import words_at
    from .chunkmerge_kernels import copy_at, i64_at, open_chunk, seal_chunk
    from .record import check_row

    @numba.njit(nogil=True, cache=True)
    def update_chunks(mem, offs, lens, starts, ids, src, cap, w, verify, scratch_id, scratch_at,
                      out, firsts):  # pragma: no cover - compiled
        """New values for the chunks the batch rows ids[starts[g] : starts[g + 1]] fall into
        (group g's old chunk at offs[starts[g]] in `mem`, -1: none; row i's record at address
        src[i]): each group's old rows and batch rows merged (a batch row replaces the old one
        of its id) and cut into chunks of near-equal counts, written back to back into `out`
        with their first ids in `firsts`. Returns (chunks, old rows, rows written, status, at):
        status 0; 1
        the old chunk of row `at` is damaged; 2 the old record of id `at` failed its check; 3
        batch row `at`'s record failed its check."""
        rb = 4 * (w + 1)
        vb = HEAD + cap * (8 + rb)
        r0 = HEAD + 8 * cap
        m_at, o_at = mem.ctypes.data, out.ctypes.data
        oc = 0
        old_rows = 0
        written = 0
        for g in range(starts.shape[0] - 1):
            lo, hi = starts[g], starts[g + 1]
            off = offs[lo]
            count = 0
            if off >= 0:
                count = open_chunk(mem, offs, lens, lo, cap, vb, np.int64(-1))
                if count < 0:
                    return oc, old_rows, written, 1, lo
            old_rows += count
            a, i, k = 0, lo, 0
            while a < count or i < hi:
                oid = i64_at(m_at + off + HEAD + 8 * a) if a < count else np.int64(0)
                if i < hi and (a >= count or ids[i] <= oid):
                    if a < count and ids[i] == oid:  # the batch's row replaces the old one
                        a += 1
                    if verify:
                        rec = numba.carray(words_at(src[i]), w + 1)
                        if check_row(np.uint64(ids[i]), rec[:w]) != rec[w]:
                            return oc, old_rows, written, 3, i
                    scratch_id[k], scratch_at[k] = ids[i], src[i]
                    i += 1
                else:
                    at = m_at + off + r0 + a * rb
                    if verify:
                        rec = numba.carray(words_at(at), w + 1)
                        if check_row(np.uint64(oid), rec[:w]) != rec[w]:
                            return oc, old_rows, written, 2, oid
                    scratch_id[k], scratch_at[k] = oid, at
                    a += 1
                k += 1
            written += k
            parts = (k + cap - 1) // cap
            j = 0
            for p in range(parts):
                size = k // parts + (1 if p < k % parts else 0)
                for t in range(size):
                    x = scratch_id[j + t]
                    q = oc * vb + HEAD + 8 * t
                    for b in range(8):
                        out[q + b] = np.uint8((x >> (8 * b)) & 0xFF)
                    copy_at(o_at + oc * vb + r0 + t * rb, scratch_at[j + t], rb)
                seal_chunk(out, oc * vb, size, cap, rb)
                firsts[oc] = scratch_id[j]
                j += size
                oc += 1
        return oc, old_rows, written, 0, 0


def _floor_chunks(level: ChunkLevel, rtxn: lmdb.Transaction, name: bytes,
                  ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(mapping, offsets, sizes) of the chunk each sorted id falls in (the page walker's floor
    search in range `name`, inside `rtxn`)."""
    spans = level.reader.floor_spans(rtxn.get(name), ids.astype(np.uint64))
    if spans is None:
        raise StoreCorruptError(f"table {level.table!r}: chunk range {name!r} holds a layout "
                                f"chunks never use")
    return spans


def _chunk_starts(offs: np.ndarray) -> np.ndarray:
    """Where each run of ids sharing one chunk starts in `offs`, and the end."""
    n = len(offs)
    return np.concatenate([[0], np.flatnonzero(offs[1:] != offs[:-1]) + 1, [n]])


def update_range(level: ChunkLevel, r: int, ids: np.ndarray, src: np.ndarray, verify: bool,
                 totals: np.ndarray, window: int = WINDOW_ROWS) -> None:
    """Batch rows `ids` (sorted, inside range r; records at addresses `src`) merged into range r
    in place, `window` rows a write transaction; adds old rows read, rows and chunks written to
    `totals`."""
    env, cap, vb = level.env, level.cap, level.vb
    for lo in range(0, len(ids), window):
        part, at = ids[lo : lo + window], src[lo : lo + window]
        n = len(part)
        name = level.names[r]
        with env.begin() as rtxn:  # the old chunks stay put while it is open
            if name is None:
                mem, offs = np.zeros(0, dtype=np.uint8), np.full(n, -1, dtype=np.int64)
                lens = np.zeros(n, dtype=np.int64)
            else:
                mem, offs, lens = _floor_chunks(level, rtxn, name, part)
            starts = _chunk_starts(offs)
            most = int(np.diff(starts).max()) + cap
            out = np.empty((2 * (len(starts) - 1) + n // cap + 1) * vb, dtype=np.uint8)
            firsts = np.empty(len(out) // vb, dtype=np.int64)
            made, old, rows, status, bad = update_chunks(
                mem, offs, lens, starts.astype(np.int64), part, at, cap, level.row_dim, verify,
                np.empty(most, dtype=np.int64), np.empty(most, dtype=np.int64), out, firsts)
        if status == 3:
            raise TierstoreError(f"table {level.table!r}: the record of row {int(part[bad])} given "
                                 f"to the merge fails its checksum")
        if status:
            raise StoreCorruptError(f"table {level.table!r}: chunk range {name!r} is damaged "
                                    f"(a chunk's size, count or ids, or row {int(bad)}'s checksum)")
        values = out[: made * vb].reshape(made, vb)
        counts = list(level.counts)
        counts[r] += rows - old  # the touched chunks held `old` rows and now hold `rows`
        with env.begin(write=True) as txn:
            fresh = level.new_db(txn) if name is None else name
            txn.cursor(db=level.db(fresh)).putmulti(zip(encode_keys(firsts[:made]), values))
            if level.guard is not None:
                level.guard.changed(txn, name)
            if level.on_publish is not None:
                names = level.names[:r] + [fresh] + level.names[r + 1 :]
                level.on_publish(txn, list(level.bounds), names, counts)
        level.names[r] = fresh
        level.counts = counts
        totals += (old, rows, made)


if HAVE_NUMBA:
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
    `cutoff`, `window` ids (`DELETE_WINDOW_ROWS`) a write transaction; adds the rows deleted to
    tally[0] as each commits."""
    env, vb = level.env, level.vb
    window = window or DELETE_WINDOW_ROWS
    for lo in range(0, len(ids), window):
        name = level.names[r]
        if name is None:  # the range is empty (or was emptied by an earlier window)
            return
        part = ids[lo : lo + window]
        with env.begin() as rtxn:  # the chunks stay put while it is open
            mem, offs, lens = _floor_chunks(level, rtxn, name, part)
            starts = _chunk_starts(offs)
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
            txn.cursor(db=db).putmulti(zip(encode_keys(firsts[rewritten]),
                                           map(memoryview, values[rewritten])))
            if txn.stat(db)["entries"] == 0:  # the range is empty: its database goes
                txn.drop(db, delete=True)
                names[r], counts[r] = None, 0
            if level.guard is not None:
                level.guard.changed(txn, name)
            if level.on_publish is not None:
                level.on_publish(txn, list(level.bounds), list(names), list(counts))
        if names[r] is None:
            level.forget_db(name)
        level.names, level.counts = names, counts
        tally[0] += int(dropped)


if not HAVE_NUMBA:  # pragma: no cover - numba is a hard dependency
    update_chunks = drop_rows = chunk_stamps = None
