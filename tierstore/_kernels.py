"""Numba CPU kernels for the hot loops that torch ops cannot vectorize well (hash probing).

Each kernel has a pure-torch twin (used on CUDA and compared in the tests).
"""

from __future__ import annotations

import numpy as np

try:  # numba is a hard dependency, but keep the torch path usable without it
    import numba

    HAVE_NUMBA = True
except ImportError:  # pragma: no cover
    HAVE_NUMBA = False

_C1 = np.int64(-7046029254386353131)
_C2 = np.int64(-4658895280553007687)
_C3 = np.int64(-7723592293110705685)
SLOT_BITS = 40  # a hash entry packs (table index << SLOT_BITS) | slot
SLOT_MASK = np.int64((1 << SLOT_BITS) - 1)

def _compile_prefetch():
    """An LLVM software-prefetch intrinsic for numba kernels (a no-op where LLVM lacks it)."""
    from llvmlite import ir
    from numba import types
    from numba.core import cgutils
    from numba.extending import intrinsic

    @intrinsic
    def prefetch(typingctx, arr, i, j):
        """Hint the CPU to load the cache line holding arr[i, j] (2-D array), for reading."""

        def codegen(context, builder, sig, args):
            aryty = sig.args[0]
            ary = context.make_array(aryty)(context, builder, args[0])
            idx = [context.cast(builder, args[k], sig.args[k], types.intp) for k in (1, 2)]
            ptr = cgutils.get_item_pointer2(context, builder, ary.data,
                                            cgutils.unpack_tuple(builder, ary.shape),
                                            cgutils.unpack_tuple(builder, ary.strides),
                                            aryty.layout, idx, wraparound=False, boundscheck=False)
            i8p = ir.IntType(8).as_pointer()
            i32 = ir.IntType(32)
            fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
            fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0i8")
            builder.call(fn, [builder.bitcast(ptr, i8p), i32(0), i32(3), i32(1)])
            return context.get_dummy_value()

        return types.void(arr, i, j), codegen

    @numba.njit
    def _probe(a):  # pragma: no cover - compiled
        prefetch(a, 0, 0)

    _probe(np.zeros((1, 1), dtype=np.float32))
    return prefetch


if HAVE_NUMBA:
    try:
        prefetch = _compile_prefetch()
    except Exception:  # pragma: no cover - an LLVM without the intrinsic: skip the hint

        @numba.njit(inline="always")
        def prefetch(arr, i, j):
            """No-op stand-in for the prefetch hint."""

    PREFETCH_AHEAD = 8  # rows ahead of the one being read; measured best on random rows

    @numba.njit(cache=True, nogil=True, inline="always")
    def prefetch_row(arr, i):  # pragma: no cover - compiled
        """Prefetch every cache line (16 float32) of row `i` of a 2-D float32 array."""
        for j in range(0, arr.shape[1], 16):
            prefetch(arr, i, j)

    @numba.njit(cache=True, nogil=True)
    def dedup_table(ids, bits):  # pragma: no cover - compiled
        """`dedup`, also giving its hash set: (uniq, inverse, keys, vals), vals[h] the position
        in `uniq` of the id at keys[h] (-1: an empty slot)."""
        n = ids.shape[0]
        mask = (1 << bits) - 1
        keys = np.empty(mask + 1, dtype=np.int64)
        vals = np.full(mask + 1, -1, dtype=np.int64)
        uniq = np.empty(n, dtype=np.int64)
        inverse = np.empty(n, dtype=np.int64)
        u = 0
        for i in range(n):
            k = ids[i]
            h = k * _C1
            h = (h ^ (h >> 29)) & mask
            while True:
                v = vals[h]
                if v < 0:
                    vals[h] = u
                    keys[h] = k
                    uniq[u] = k
                    inverse[i] = u
                    u += 1
                    break
                if keys[h] == k:
                    inverse[i] = v
                    break
                h = (h + 1) & mask
        return uniq[:u], inverse, keys, vals

    @numba.njit(cache=True, nogil=True)
    def dedup(ids, bits):  # pragma: no cover - compiled
        """Unique ids in first-occurrence order and the inverse map, by a 2**bits-slot hash set."""
        uniq, inverse, _, _ = dedup_table(ids, bits)
        return uniq, inverse

    @numba.njit(cache=True, nogil=True)
    def ranked(sorted_uniq, first, keys, vals):  # pragma: no cover - compiled
        """The inverse map into `sorted_uniq` (the distinct ids ascending), from `dedup_table`'s
        first-occurrence inverse `first` and hash set (keys, vals): each id's rank is found
        once through the set, then mapped per id."""
        mask = keys.shape[0] - 1
        u = sorted_uniq.shape[0]
        rank = np.empty(u, dtype=np.int64)  # first-occurrence position -> rank
        for j in range(u):
            k = sorted_uniq[j]
            h = k * _C1
            h = (h ^ (h >> 29)) & mask
            while vals[h] < 0 or keys[h] != k:
                h = (h + 1) & mask
            rank[vals[h]] = j
        inverse = np.empty(first.shape[0], dtype=np.int64)
        for i in range(first.shape[0]):
            inverse[i] = rank[first[i]]
        return inverse

    @numba.njit(cache=True, nogil=True)
    def _home(tab, row, mask):  # pragma: no cover - compiled
        h = row * _C1 + tab * _C2
        h = h ^ (h >> 31)
        h = h * _C3
        h = h ^ (h >> 29)
        return h & mask

    @numba.njit(cache=True, nogil=True, inline="always")
    def _slot_of(table, mask, t, r):  # pragma: no cover - compiled
        """The slot the index holds key (t, r) at, or -1 (entries: [tab << 40 | slot, row])."""
        p = _home(t, r, mask)
        while True:
            e = table[p, 0]
            if e == -1:
                return -1
            if e >= 0 and table[p, 1] == r and (e >> SLOT_BITS) == t:
                return e & SLOT_MASK
            p = (p + 1) & mask

    @numba.njit(cache=True, nogil=True)
    def hash_find(table, tabs, rows, out, mask, lo, hi):  # pragma: no cover
        """Write the slot of each key i in [lo, hi) into out, or -1 (entries: [tab << 40 | slot, row])."""
        n = hi
        one = tabs.shape[0] == 1
        for i in range(lo, hi):
            j = i + PREFETCH_AHEAD
            if j < n:
                prefetch(table, _home(tabs[0] if one else tabs[j], rows[j], mask), 0)
            out[i] = _slot_of(table, mask, tabs[0] if one else tabs[i], rows[i])

    @numba.njit(cache=True, nogil=True)
    def hash_add(table, pos_of, tabs, rows, slots, mask):  # pragma: no cover
        """Insert absent keys; return (tombstones reused, max probe distance)."""
        reused = 0
        maxd = 0
        n = rows.shape[0]
        for i in range(n):
            j = i + PREFETCH_AHEAD
            if j < n:
                prefetch(table, _home(tabs[j] if tabs.shape[0] > 1 else tabs[0], rows[j], mask), 0)
            t = tabs[i] if tabs.shape[0] > 1 else tabs[0]
            r = rows[i]
            s = slots[i]
            h = _home(t, r, mask)
            p = h
            while table[p, 0] >= 0:
                p = (p + 1) & mask
            if table[p, 0] == -2:
                reused += 1
            table[p, 0] = (t << SLOT_BITS) | s
            table[p, 1] = r
            pos_of[s] = p
            d = (p - h) & mask
            if d > maxd:
                maxd = d
        return reused, maxd

    @numba.njit(cache=True, nogil=True, inline="always")
    def _delete_at(table, pos_of, i, mask):  # pragma: no cover - compiled
        """Empty position i of the table by backward shift; return 1 if it became a tombstone."""
        j = i
        while True:
            j = (j + 1) & mask
            e = table[j, 0]
            if e == -1:
                table[i, 0] = -1
                return 0
            if e == -2:
                table[i, 0] = -2
                return 1
            h = _home(e >> SLOT_BITS, table[j, 1], mask)
            if ((j - h) & mask) >= ((j - i) & mask):  # home not in (i, j]: may move to i
                table[i, 0] = e
                table[i, 1] = table[j, 1]
                pos_of[e & SLOT_MASK] = i
                i = j

    @numba.njit(cache=True, nogil=True)
    def hash_remove(table, pos_of, slots, mask):  # pragma: no cover
        """Delete the keys held by `slots` by backward shift; return tombstones left (see below).

        Later entries of the probe run move back into the hole when their home allows it, so
        deletion leaves no tombstone. Only when the run reaches a tombstone left by the torch
        path does the hole become a tombstone too (the run past it must stay unbroken).
        """
        tombs = 0
        n = slots.shape[0]
        pos2 = pos_of.reshape(-1, 1)  # a 2-D view for the prefetch hint
        for k in range(n):
            if k + 2 * PREFETCH_AHEAD < n:  # two stages: the slot's position, then its entry
                prefetch(pos2, slots[k + 2 * PREFETCH_AHEAD], 0)
            if k + PREFETCH_AHEAD < n:
                q = pos_of[slots[k + PREFETCH_AHEAD]]
                if q >= 0:
                    prefetch(table, q, 0)
            s = slots[k]
            i = pos_of[s]
            pos_of[s] = -1
            tombs += _delete_at(table, pos_of, i, mask)
        return tombs

    @numba.njit(cache=True, nogil=True)
    def hash_assign(table, pos_of, tabs, rows, slots, mask, moved):  # pragma: no cover - compiled
        """Map each key (distinct) to its slot in one probe: a slot that held another key drops
        it first, and a key already present moves to its new slot in place (else it is
        inserted); with a `moved` array, moved[i] = the slot key i left, or -1. Return (live
        keys added, tombstones left minus reused, max probe distance)."""
        added = 0
        tombs = 0
        maxd = 0
        n = rows.shape[0]
        pos2 = pos_of.reshape(-1, 1)  # a 2-D view for the prefetch hint
        for i in range(n):
            j = i + PREFETCH_AHEAD
            if j + PREFETCH_AHEAD < n:  # two stages: the slot's position, then its old entry
                prefetch(pos2, slots[j + PREFETCH_AHEAD], 0)
            if j < n:
                prefetch(table, _home(tabs[j], rows[j], mask), 0)
                if pos_of[slots[j]] >= 0:
                    prefetch(table, pos_of[slots[j]], 0)
            t = tabs[i]
            r = rows[i]
            s = slots[i]
            q = pos_of[s]
            if q >= 0:  # the slot's previous key leaves the index
                pos_of[s] = -1
                tombs += _delete_at(table, pos_of, q, mask)
                added -= 1
            h = _home(t, r, mask)
            p = h
            free = -1
            while True:
                e = table[p, 0]
                if e == -1:
                    break
                if e == -2:
                    if free < 0:
                        free = p
                elif table[p, 1] == r and (e >> SLOT_BITS) == t:
                    break
                p = (p + 1) & mask
            e = table[p, 0]
            if moved.shape[0]:
                moved[i] = (e & SLOT_MASK) if e >= 0 else -1
            if e >= 0:  # present: the key moves to slot s in place
                pos_of[e & SLOT_MASK] = -1
                added -= 1
            elif free >= 0:
                p = free
                tombs -= 1
            table[p, 0] = (t << SLOT_BITS) | s
            table[p, 1] = r
            pos_of[s] = p
            added += 1
            d = (p - h) & mask
            if d > maxd:
                maxd = d
        return added, tombs, maxd

    @numba.njit(cache=True, nogil=True)
    def distinct(ids, bits):  # pragma: no cover - compiled
        """The distinct ids in first-occurrence order, by a 2**bits-slot hash set (`dedup` without
        the inverse map)."""
        n = ids.shape[0]
        mask = (1 << bits) - 1
        keys = np.empty(mask + 1, dtype=np.int64)
        used = np.zeros(mask + 1, dtype=np.bool_)
        uniq = np.empty(n, dtype=np.int64)
        u = 0
        for i in range(n):
            k = ids[i]
            h = k * _C1
            h = (h ^ (h >> 29)) & mask
            while True:
                if not used[h]:
                    used[h] = True
                    keys[h] = k
                    uniq[u] = k
                    u += 1
                    break
                if keys[h] == k:
                    break
                h = (h + 1) & mask
        return uniq[:u]

    @numba.njit(cache=True, nogil=True)
    def add_pins(pins, slots, delta, transient, out):  # pragma: no cover - compiled
        """pins[s] += delta for each slot (repeats add up); with delta < 0 never below zero.
        With `transient` (else empty), an unpin writes the transient slots whose pins reach
        zero to `out` (a slot may appear twice); returns how many."""
        n = slots.shape[0]
        k = 0
        pins2 = pins.reshape(-1, 1)  # a 2-D view for the prefetch hint
        for i in range(n):
            if i + PREFETCH_AHEAD < n:
                prefetch(pins2, slots[i + PREFETCH_AHEAD], 0)
            s = slots[i]
            v = pins[s] + delta
            if delta < 0 and v <= 0:
                pins[s] = 0
                if transient.shape[0] and transient[s]:
                    out[k] = s
                    k += 1
            else:
                pins[s] = v
        return k

    @numba.njit(cache=True, nogil=True, inline="always")
    def _holds(table, mask, t, r):  # pragma: no cover - compiled
        """Whether hash table `table` holds the key (t, r)."""
        return _slot_of(table, mask, t, r) >= 0

    @numba.njit(cache=True, nogil=True)
    def hash_absent(t1, m1, t2, m2, t3, m3, tabs, rows, out):  # pragma: no cover - compiled
        """out[i] = key (tabs[i], rows[i]) is in none of three hash tables (masks m1..m3; one
        table index for all keys when `tabs` has one entry); a key found in one is not probed
        in the next ones. Two passes: every key in the first index, then only those it lacks
        in the others (each pass prefetches the lines it will probe, none wasted)."""
        n = rows.shape[0]
        one = tabs.shape[0] == 1
        rest = np.empty(n, dtype=np.int64)
        nr = 0
        for i in range(n):
            j = i + PREFETCH_AHEAD
            if j < n:
                prefetch(t1, _home(tabs[0] if one else tabs[j], rows[j], m1), 0)
            t = tabs[0] if one else tabs[i]
            if _holds(t1, m1, t, rows[i]):
                out[i] = False
            else:
                rest[nr] = i
                nr += 1
        for k in range(nr):
            if k + PREFETCH_AHEAD < nr:  # the last index's line (where a missing key ends)
                j = rest[k + PREFETCH_AHEAD]
                prefetch(t3, _home(tabs[0] if one else tabs[j], rows[j], m3), 0)
            i = rest[k]
            t = tabs[0] if one else tabs[i]
            out[i] = not (_holds(t2, m2, t, rows[i]) or _holds(t3, m3, t, rows[i]))

    @numba.njit(cache=True, nogil=True)
    def scatter_rows(dst, idx, src):  # pragma: no cover - compiled
        """dst[idx[i]] = src[i] for each i (rows of 2-D float32 arrays; idx distinct)."""
        n = idx.shape[0]
        for i in range(n):
            j = i + PREFETCH_AHEAD
            if j < n:
                prefetch_row(dst, idx[j])
            dst[idx[i], :] = src[i, :]

    @numba.njit(cache=True, nogil=True)
    def hash_keys(table, pos_of, slots, tabs, rows):  # pragma: no cover - compiled
        """(table index, row id) of the key each present slot holds, into tabs and rows."""
        n = slots.shape[0]
        pos2 = pos_of.reshape(-1, 1)  # a 2-D view for the prefetch hint
        for k in range(n):
            if k + 2 * PREFETCH_AHEAD < n:  # two stages: the slot's position, then its entry
                prefetch(pos2, slots[k + 2 * PREFETCH_AHEAD], 0)
            if k + PREFETCH_AHEAD < n:
                prefetch(table, pos_of[slots[k + PREFETCH_AHEAD]], 0)
            e = table[pos_of[slots[k]]]
            tabs[k] = e[0] >> SLOT_BITS
            rows[k] = e[1]

    @numba.njit(cache=True, nogil=True)
    def gather_rows(src, idx):  # pragma: no cover - compiled
        """src[idx] (rows of a 2-D float32 array) as a new array, prefetching rows ahead."""
        n = idx.shape[0]
        w = src.shape[1]
        out = np.empty((n, w), dtype=np.float32)
        for i in range(n):
            j = i + PREFETCH_AHEAD
            if j < n:
                prefetch_row(src, idx[j])
            r = idx[i]
            for c in range(w):
                out[i, c] = src[r, c]
        return out

    @numba.njit(cache=True, nogil=True)
    def hash_probe(table, mask, tabs, rows, slots, miss, hits):  # pragma: no cover - compiled
        """Each key's slot (or -1) into `slots`, the positions of the missing keys into `miss`
        and the found slots, in key order, into `hits`; returns the number of misses."""
        n = rows.shape[0]
        nm = nh = 0
        for i in range(n):
            j = i + PREFETCH_AHEAD
            if j < n:
                prefetch(table, _home(tabs[j], rows[j], mask), 0)
            res = _slot_of(table, mask, tabs[i], rows[i])
            slots[i] = res
            if res < 0:
                miss[nm] = i
                nm += 1
            else:
                hits[nh] = res
                nh += 1
        return nm

    @numba.njit(cache=True, nogil=True)
    def hash_gather(table, mask, tab, rows, src, data, found, known):  # pragma: no cover
        """For each key (tab, rows[i]) an index holds: copy row `src[slot, :w]` into `data[i]`
        (w = data's width) and set found[i] and known[i]; returns how many were held."""
        n = rows.shape[0]
        w = data.shape[1]
        k = 0
        at = np.empty(n, dtype=np.int64)  # the slots first (hash lines prefetched), then the
        for i in range(n):  # rows (their lines prefetched): two passes of independent misses
            j = i + PREFETCH_AHEAD
            if j < n:
                prefetch(table, _home(tab, rows[j], mask), 0)
            at[i] = _slot_of(table, mask, tab, rows[i])
        for i in range(n):
            j = i + PREFETCH_AHEAD
            if j < n and at[j] >= 0:
                prefetch_row(src, at[j])
            s = at[i]
            if s >= 0:
                for c in range(w):
                    data[i, c] = src[s, c]
                found[i] = True
                known[i] = True
                k += 1
        return k

    @numba.njit(cache=True, nogil=True)
    def sorted_gather(brows, bdata, bfound, rows, todo, data, found, known):  # pragma: no cover
        """For each position `todo[i]` whose row is in `brows` (sorted): copy its buffered row
        and found flag into `data`/`found` and set `known`. Returns (positions left unknown,
        in order, in a new array; rows found among those copied). Rows asked in increasing
        order (the usual case) search only past the last one found."""
        n = todo.shape[0]
        m = brows.shape[0]
        w = data.shape[1]
        left = np.empty(n, dtype=np.int64)
        nl = 0
        nf = 0
        start = 0
        for i in range(n):
            at = todo[i]
            r = rows[at]
            if i and r < rows[todo[i - 1]]:  # out of order: search the whole buffer
                start = 0
            lo, hi = start, m
            while lo < hi:
                mid = (lo + hi) >> 1
                if brows[mid] < r:
                    lo = mid + 1
                else:
                    hi = mid
            start = lo
            if lo < m and brows[lo] == r:
                for c in range(w):
                    data[at, c] = bdata[lo, c]
                found[at] = bfound[lo]
                known[at] = True
                if bfound[lo]:
                    nf += 1
            else:
                left[nl] = at
                nl += 1
        return left[:nl], nf

    home = _home  # the index's home position of a key (for kernels elsewhere)
    delete_at = _delete_at  # backward-shift deletion at a position (for kernels elsewhere)
