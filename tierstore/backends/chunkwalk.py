"""A compiled walk over every leaf of a page-chunk range, in the data file's map.

`leaf_spans` visits the B-tree of one LMDB database from its root in key order and returns
where each value lies in the map: one pass over its pages, each checked whole by the page
walker's `check_page` (node pointers and sizes, keys in order and inside the range the parent
gives), so a range's rewrite (`chunkmerge.py`) reads its chunks in place, without a py-lmdb call
a chunk. `count_rows` sums the counts of the chunks found.
"""

from __future__ import annotations

import numpy as np

from .._kernels import HAVE_NUMBA

if HAVE_NUMBA:
    import numba

    from .pages import check_page, key_at, u16

    @numba.njit(nogil=True, cache=True)
    def leaf_spans(mem, psize, root, offs, lens, info):  # pragma: no cover - compiled
        """Every value of the tree under page `root`, in key order: (status, values), their
        offsets in `mem` in offs[:values] and sizes in lens. Status 0; 1 a page lies past the
        mapping (remap, retry); 2 a layout chunks never use (a value in overflow pages, a page
        of another kind); 3 damaged (info: the page and the reason, pages.REASONS; reason 8:
        more values than the database counts). Every page is checked whole (`check_page`:
        node pointers, node sizes, keys in order and inside the range its parent gives)."""
        limit = mem.shape[0]
        st_pg = np.zeros(64, dtype=np.int64)
        st_slot = np.zeros(64, dtype=np.int64)
        st_n = np.zeros(64, dtype=np.int64)
        st_lb = np.zeros(64, dtype=np.uint64)
        st_ub = np.zeros(64, dtype=np.uint64)
        st_hlb = np.zeros(64, dtype=np.bool_)
        st_hub = np.zeros(64, dtype=np.bool_)
        depth = 0
        count = 0
        pg = root
        lb, hlb, ub, hub = np.uint64(0), False, np.uint64(0), False
        while True:
            base = pg * psize
            if base + psize > limit:
                return 1, count
            own = np.uint64(0)
            for j in range(8):
                own |= np.uint64(mem[base + j]) << np.uint64(8 * j)
            if own != np.uint64(pg):
                info[0], info[1] = pg, 1
                return 3, count
            flags = u16(mem, base + 10) & 0x3FEF
            lower = u16(mem, base + 12)
            upper = u16(mem, base + 14)
            if lower < 18 or lower > upper or upper > psize or (lower & 1):
                info[0], info[1] = pg, 3
                return 3, count
            n = (lower - 16) >> 1
            if flags == 1:  # a branch: checked whole, then its children in order
                if psize - upper != 8 + 16 * (n - 1):
                    info[0], info[1] = pg, 4
                    return 3, count
                st = check_page(mem, base, psize, upper, n, False, 0, lb, hlb, ub, hub, info, pg)
                if st != 0:
                    return st, count
                if depth == 64:  # deeper than any tree of 2^64 keys: a cycle
                    info[0], info[1] = pg, 5
                    return 3, count
                st_pg[depth], st_slot[depth], st_n[depth] = pg, 0, n
                st_lb[depth], st_hlb[depth], st_ub[depth], st_hub[depth] = lb, hlb, ub, hub
                depth += 1
            elif flags == 2:  # a leaf: equal-sized nodes, values inline
                first = base + u16(mem, base + 16)
                if first < base + upper or first + 16 > base + psize:
                    info[0], info[1] = pg, 5
                    return 3, count
                if u16(mem, first + 4) & 1:
                    return 2, count
                dsize = u16(mem, first) | (u16(mem, first + 2) << 16)
                align = (8 + u16(mem, first + 6) + dsize + 1) & ~1
                if psize - upper != n * align:
                    info[0], info[1] = pg, 4
                    return 3, count
                st = check_page(mem, base, psize, upper, n, True, align, lb, hlb, ub, hub, info, pg)
                if st != 0:
                    return st, count
                if count + n > offs.shape[0]:
                    info[0], info[1] = pg, 8
                    return 3, count
                for s in range(n):
                    node = base + u16(mem, base + 16 + 2 * s)
                    offs[count] = node + 16
                    lens[count] = u16(mem, node) | (u16(mem, node + 2) << 16)
                    count += 1
            else:
                return 2, count
            while depth > 0 and st_slot[depth - 1] == st_n[depth - 1]:
                depth -= 1
            if depth == 0:
                return 0, count
            t = depth - 1
            s = st_slot[t]
            st_slot[t] = s + 1
            bb = st_pg[t] * psize
            node = bb + u16(mem, bb + 16 + 2 * s)
            pg = u16(mem, node) | (u16(mem, node + 2) << 16) | (u16(mem, node + 4) << 32)
            if s > 0:  # the child's range: [its key, the next key)
                lb, hlb = key_at(mem, node + 8), True
            else:
                lb, hlb = st_lb[t], st_hlb[t]
            if s + 1 < st_n[t]:
                ub, hub = key_at(mem, bb + u16(mem, bb + 16 + 2 * (s + 1)) + 8), True
            else:
                ub, hub = st_ub[t], st_hub[t]

    @numba.njit(nogil=True, cache=True)
    def count_rows(mem, offs):  # pragma: no cover - compiled
        """The rows of the chunks at offs (their counts; the merge checks each one it reads)."""
        n = 0
        for c in range(offs.shape[0]):
            o = offs[c]
            n += np.int64(mem[o]) | (np.int64(mem[o + 1]) << 8) | (np.int64(mem[o + 2]) << 16) | \
                (np.int64(mem[o + 3]) << 24)
        return n
else:  # pragma: no cover - numba is a hard dependency
    leaf_spans = count_rows = None


if HAVE_NUMBA:
    @numba.njit(nogil=True, cache=True)
    def unpack_chunks(mem, offs, lens, cap, rb, vb, ids, recs):  # pragma: no cover - compiled
        """The rows of the chunks at offs, in order, into ids[:rows] and recs[:rows]: (rows, 0),
        or (0, 1 + the chunk) whose size, count or id order is wrong. Records are copied as
        they are: the reader checks each one's checksum (over its id and words)."""
        n = 0
        for c in range(offs.shape[0]):
            o = offs[c]
            if lens[c] != vb:
                return 0, 1 + c
            count = np.int64(mem[o]) | (np.int64(mem[o + 1]) << 8) | (np.int64(mem[o + 2]) << 16) | \
                (np.int64(mem[o + 3]) << 24)
            if count < 1 or count > cap or n + count > ids.shape[0]:
                return 0, 1 + c
            cid = mem[o + 16 : o + 16 + 8 * cap].view(np.int64)
            for i in range(count):
                if i and cid[i] <= cid[i - 1] or (n and i == 0 and cid[0] <= ids[n - 1]):
                    return 0, 1 + c
                ids[n + i] = cid[i]
            at = o + 16 + 8 * cap
            recs[n : n + count, :] = mem[at : at + count * rb].reshape(count, rb)
            n += count
        return n, 0
else:  # pragma: no cover - numba is a hard dependency
    unpack_chunks = None
