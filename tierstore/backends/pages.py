"""Row lookups straight from the LMDB data file's B-tree pages, in numba, without the GIL.

py-lmdb's `txn.get` costs ~1.1 us a row, almost all of it Python-level work under the GIL, so
reader threads do not run in parallel and slow the training thread. The data file's format is
stable (LMDB 0.9: 16-byte page headers, sorted node pointers, nodes of [data size, flags, key
size, key, data]), and our tables have one shape: 8-byte big-endian keys and fixed-size values
stored inline in leaf pages. So a read transaction pins a snapshot (its pages are never reused
while it is open), we take the table's root page from the snapshot's record of the named
database, and a compiled loop walks branch pages down to the leaves and copies the values out
of our own read-only mapping of the file (the kernel's page cache, shared with LMDB's map).

A layout we do not write (another page type, a value in overflow pages) returns a status and
the caller reads the batch through py-lmdb. Damage is a `StoreCorruptError` naming the page
(issue 38): every page on a key's path is checked for structure (its number, `mp_lower` /
`mp_upper`, nodes tiling the node area, node pointers on node boundaries, keys in order along
the binary search and within the range the parent gives), and a miss checks the keys beside
its place, so a flipped byte in a leaf's pointer array or `mp_lower` cannot hide a stored row
(which would read as its lazy init). Reads through py-lmdb run the same walk over their misses
(`check_missing`).
"""

from __future__ import annotations

import mmap
import os
import struct
import threading
from pathlib import Path

import numpy as np

from .._kernels import HAVE_NUMBA
from ..errors import StoreCorruptError
from .pageahead import ask_ahead

P_INVALID = (1 << 64) - 1  # md_root of an empty database
# MDB_db: pad, flags, depth, branch/leaf/overflow page counts, entries, root page
_DB_RECORD = struct.Struct("<IHHQQQQQ")
OK, SHORT_MAP, UNEXPECTED, CORRUPT = 0, 1, 2, 3
REASONS = {1: "it carries another page number", 3: "mp_lower/mp_upper out of bounds",
           4: "its nodes do not tile the node area", 5: "a node pointer out of place",
           6: "keys out of order", 7: "a key of another size"}

if HAVE_NUMBA:
    import numba

    from .._kernels import prefetch

    @numba.njit(nogil=True, cache=True)
    def u16(mem, pos):  # pragma: no cover - compiled
        """The little-endian uint16 at mem[pos], as int64."""
        return np.int64(mem[pos]) | (np.int64(mem[pos + 1]) << 8)

    @numba.njit(nogil=True, cache=True)
    def key_at(mem, pos):  # pragma: no cover - compiled
        """The 8-byte big-endian key at mem[pos], as uint64."""
        v = np.uint64(0)
        for j in range(8):
            v = (v << np.uint64(8)) | np.uint64(mem[pos + j])
        return v

    @numba.njit(nogil=True, cache=True)
    def _node_key(mem, base, psize, upper, align, slot, info, pg):  # pragma: no cover - compiled
        """The 8-byte key of node `slot` of the page at `base`, or -1 (info set) when the node
        pointer or the node is out of place; `align` > 0: leaf nodes all `align` bytes long."""
        node = base + u16(mem, base + 16 + 2 * slot)
        if node < base + upper or node + 16 > base + psize or \
                (align > 0 and (node - base - upper) % align != 0):
            info[0], info[1] = pg, 5
            return -1
        if u16(mem, node + 6) != 8:
            info[0], info[1] = pg, 7
            return -1
        return node

    @numba.njit(nogil=True, cache=True)
    def _whole_page(mem, base, psize, upper, n, leaf, align, lb, has_lb, ub, has_ub, info,
                    pg):  # pragma: no cover - compiled
        """Check every node of a page (before py-lmdb reads it: LMDB trusts its pages, and a
        bad node pointer or size makes it read past the page, or the file): 0, or 1 (a page past
        the mapping: remap and retry), or 3 (damaged, info set)."""
        pages = mem.shape[0] // psize
        prev, has_prev = np.uint64(0), False
        for slot in range(n):
            node = base + u16(mem, base + 16 + 2 * slot)
            if not leaf and slot == 0:  # a branch's key-less first node
                if node < base + upper or node + 8 > base + psize or u16(mem, node + 6) != 0:
                    info[0], info[1] = pg, 5
                    return 3
            else:
                node = _node_key(mem, base, psize, upper, align if leaf else 0, slot, info, pg)
                if node < 0:
                    return 3
                key = key_at(mem, node + 8)
                if (has_prev and key <= prev) or (has_lb and key < lb) or (has_ub and key >= ub):
                    info[0], info[1] = pg, 6
                    return 3
                prev, has_prev = key, True
            if leaf:
                fl = u16(mem, node + 4)
                dsize = u16(mem, node) | (u16(mem, node + 2) << 16)
                if fl & 1:  # the value lies in overflow pages: their run must be in the file
                    ov = u16(mem, node + 16) | (u16(mem, node + 18) << 16) | \
                        (u16(mem, node + 20) << 32)
                    if ov < 2:
                        info[0], info[1] = pg, 5
                        return 3
                    if ov * psize + 16 + dsize > pages * psize:
                        return 1
                elif fl != 0 or node + 16 + dsize > base + psize:
                    info[0], info[1] = pg, 4
                    return 3
            else:
                child = u16(mem, node) | (u16(mem, node + 2) << 16) | (u16(mem, node + 4) << 32)
                if child < 2:
                    info[0], info[1] = pg, 5
                    return 3
                if child >= pages:
                    return 1
        return 0

    @numba.njit(nogil=True, cache=True, inline="always")
    def _spread(k, lb, has_lb, ub, has_ub, n):  # pragma: no cover - compiled
        """Node index of key k were a page's n keys spread evenly over [lb, ub); -1 unknown."""
        if not (has_lb and has_ub and ub > lb and n > 1):
            return -1
        return int(np.float64(k - lb) * np.float64(n) / np.float64(ub - lb))

    @numba.njit(nogil=True, cache=True, inline="always")
    def _probe(mem, base, psize, upper, align, slot, info, pg, lb, has_lb, ub, has_ub):  # pragma: no cover
        """Node `slot` of a page and its key, checked to lie in the page's range [lb, ub):
        (node, key), node -1 when it is out of place or out of range (info set)."""
        node = _node_key(mem, base, psize, upper, align, slot, info, pg)
        if node < 0:
            return -1, np.uint64(0)
        key = key_at(mem, node + 8)
        if (has_lb and key < lb) or (has_ub and key >= ub):
            info[0], info[1] = pg, 6
            return -1, np.uint64(0)
        return node, key

    @numba.njit(nogil=True, cache=True)
    def _page_step(mem, psize, i, k, pg, bounds, has, offs, lens, info, full, verified,
                   out, floor):  # pragma: no cover - compiled
        """One page of key `k`'s walk (key index `i`): the page `pg` checked, then, a branch,
        the child to go on to (returned; `bounds`/`has` become the child's key range), or, a
        leaf, the key's value found (offs[i], lens[i], copied into out[i]) and -1 returned;
        with `floor`, the value of the leaf's last key <= k (none when the leaf's first key is
        above k: a key below the tree's, or one whose floor a delete took).
        A status below -1 ends the walk: -(2 + status) for SHORT_MAP, UNEXPECTED or CORRUPT."""
        limit = mem.shape[0]
        lb, has_lb, ub, has_ub = bounds[i, 0], has[i, 0], bounds[i, 1], has[i, 1]
        base = pg * psize
        if base + psize > limit:
            return -3
        own = np.uint64(0)  # the page's own number (mp_pgno): a misdirected pointer fails
        for j in range(8):
            own |= np.uint64(mem[base + j]) << np.uint64(8 * j)
        if own != np.uint64(pg):
            info[0], info[1] = pg, 1
            return -5
        flags = u16(mem, base + 10) & 0x3FEF  # without P_DIRTY, P_LOOSE, P_KEEP
        lower = u16(mem, base + 12)
        upper = u16(mem, base + 14)
        if lower < 18 or lower > upper or upper > psize or (lower & 1):
            info[0], info[1] = pg, 3
            return -5
        n = (lower - 16) >> 1
        if flags == 1:  # a branch page: node 0 (key-less, 8 bytes), then 16-byte nodes
            if psize - upper != 8 + 16 * (n - 1):
                info[0], info[1] = pg, 4
                return -5
            if full and not verified[pg]:
                st = _whole_page(mem, base, psize, upper, n, False, 0, lb, has_lb, ub, has_ub, info, pg)
                if st != 0:
                    return -2 - st
                verified[pg] = True
            lo, hi = 0, n - 1  # the last node whose key <= k; node 0's key is -infinity
            clb, has_clb = lb, has_lb
            # probe first where the keys spread evenly would put k, then its neighbour on the
            # side the probe leaves open (child ranges are near even: 2 probes)
            guess = _spread(k, lb, has_lb, ub, has_ub, n)
            while lo < hi:
                if lo < guess <= hi:
                    mid = guess
                else:
                    mid = (lo + hi + 1) >> 1
                guess = -1
                node, key = _probe(mem, base, psize, upper, 0, mid, info, pg, lb, has_lb, ub, has_ub)
                if node < 0:
                    return -5
                if key <= k:
                    lo = mid
                    clb, has_clb = key, True
                    lb, has_lb = key + np.uint64(1), True
                    guess = mid + 1 if mid < hi else -1
                else:
                    hi = mid - 1
                    ub, has_ub = key, True
                    guess = mid - 1 if mid - 1 > lo else -1
            node = base + u16(mem, base + 16 + 2 * lo)
            if node < base + upper or node + 8 > base + psize:
                info[0], info[1] = pg, 5
                return -5
            # the child's range: [its key, the next key)
            bounds[i, 0], has[i, 0], bounds[i, 1], has[i, 1] = clb, has_clb, ub, has_ub
            return u16(mem, node) | (u16(mem, node + 2) << 16) | (u16(mem, node + 4) << 32)
        if flags != 2:  # not a leaf either (LEAF2, a sub-page): a layout we do not write
            return -4
        first = base + u16(mem, base + 16)  # a leaf page: equal-sized nodes
        if first < base + upper or first + 16 > base + psize:
            info[0], info[1] = pg, 5
            return -5
        big = (u16(mem, first + 4) & 1) != 0
        body = 8 if big else (u16(mem, first) | (u16(mem, first + 2) << 16))
        align = (8 + u16(mem, first + 6) + body + 1) & ~1
        if psize - upper != n * align:
            info[0], info[1] = pg, 4
            return -5
        if full and not verified[pg]:
            st = _whole_page(mem, base, psize, upper, n, True, align, lb, has_lb, ub, has_ub, info, pg)
            if st != 0:
                return -2 - st
            verified[pg] = True
        lo, hi = 0, n - 1
        # first probe where the key would sit were the leaf's keys spread evenly over the range
        # its parent gives (row ids are dense: often the key itself)
        guess = _spread(k, lb, has_lb, ub, has_ub, n)
        while lo <= hi:
            if lo <= guess <= hi:
                mid = guess
                guess = -1
            else:
                mid = (lo + hi) >> 1
            node, key = _probe(mem, base, psize, upper, align, mid, info, pg, lb, has_lb, ub, has_ub)
            if node < 0:
                return -5
            if key == k:
                return _take_value(mem, base, psize, node, i, offs, lens, info, pg, out)
            if key < k:
                lo = mid + 1
                lb, has_lb = key + np.uint64(1), True
            else:
                hi = mid - 1
                ub, has_ub = key, True
        # a miss: the keys beside its place are in order too
        for a, b in ((hi - 1, hi), (lo, lo + 1)):
            if a < 0 or b >= n:
                continue
            na = _node_key(mem, base, psize, upper, align, a, info, pg)
            nb = _node_key(mem, base, psize, upper, align, b, info, pg)
            if na < 0 or nb < 0:
                return -5
            if key_at(mem, na + 8) >= key_at(mem, nb + 8):
                info[0], info[1] = pg, 6
                return -5
        if floor and hi >= 0:  # the last key below k (checked in order just above)
            node = _node_key(mem, base, psize, upper, align, hi, info, pg)
            if node < 0:
                return -5
            return _take_value(mem, base, psize, node, i, offs, lens, info, pg, out)
        return -1

    @numba.njit(nogil=True, cache=True)
    def _take_value(mem, base, psize, node, i, offs, lens, info, pg, out):  # pragma: no cover
        """A leaf node's inline value as key i's (offs[i], lens[i], copied into out[i] when it
        has out's row size): -1, or -4 (a value not inline) / -5 (damaged, info set)."""
        if u16(mem, node + 4) != 0:  # overflow or sub-database data
            return -4
        dsize = u16(mem, node) | (u16(mem, node + 2) << 16)
        if node + 16 + dsize > base + psize:
            info[0], info[1] = pg, 4
            return -5
        offs[i] = node + 16
        lens[i] = dsize
        if out.shape[0] and dsize == out.shape[1]:
            out[i, :] = mem[node + 16 : node + 16 + dsize]
        return -1

    WALK_AHEAD = 8  # keys between the prefetch stages of the leaves (measured: 4-16 alike)

    @numba.njit(nogil=True, cache=True)
    def find_spans(mem, psize, root, keys, offs, lens, info, full, verified, out,
                   floor=False):  # pragma: no cover
        """Where each key's value lies in `mem` (offs[i], lens[i]; offs[i] = -1 when absent);
        with `floor`, the value of the greatest key <= it in the key's leaf (`_page_step`).

        Returns OK, SHORT_MAP (a page lies past the mapping: remap and retry), UNEXPECTED (a
        layout we do not write: py-lmdb reads it) or CORRUPT, with info = (page, reason): the
        page number it carries (1), its mp_lower/mp_upper (3), nodes not tiling the node area
        (4), a node pointer out of place (5), keys out of order along the search (6), a key
        of another size (7). Every page on a key's path is checked; on a miss, the keys beside
        where it would be are too, so a damaged pointer array cannot hide a stored key. `full`:
        every node of each page on the paths is checked, as py-lmdb needs, once per page while
        `verified[page]` (pages of one snapshot: immutable) remembers it. `out` (n rows, or
        empty): each value of exactly `out.shape[1]` bytes is copied into its row as it is
        found, while its page is at hand.

        Two passes. The branch pages first, key by key: keys come sorted, so a key starts at
        the deepest page of the last key's path whose key range holds it (the pages above were
        checked on the way there, and the range, from checked keys, names this page for it).
        Then the leaves, with the pages of later keys asked from memory while earlier keys are
        searched: the leaf's header, then (`WALK_AHEAD` keys later) the node its search probes
        first, then the search; the misses of several keys overlap instead of following one
        another.
        """
        n = keys.shape[0]
        limit = mem.shape[0]
        leaf = np.empty(n, dtype=np.int64)
        bounds = np.zeros((n, 2), dtype=np.uint64)  # each key's leaf's key range [lb, ub) ...
        has = np.zeros((n, 2), dtype=np.bool_)  # ... and which ends it has
        path = np.zeros(64, dtype=np.int64)  # the last key's pages from the root down ...
        pbounds = np.zeros((64, 2), dtype=np.uint64)  # ... their ranges ...
        phas = np.zeros((64, 2), dtype=np.bool_)
        depth = 0  # ... and how many
        for i in range(n):
            offs[i] = -1
            k = keys[i]
            lev = depth - 1
            while lev > 0 and not ((not phas[lev, 0] or k >= pbounds[lev, 0])
                                   and (not phas[lev, 1] or k < pbounds[lev, 1])):
                lev -= 1
            if lev <= 0:
                lev, pg = 0, root
                has[i, 0] = has[i, 1] = False
            else:
                pg = path[lev]
                bounds[i, 0], bounds[i, 1] = pbounds[lev, 0], pbounds[lev, 1]
                has[i, 0], has[i, 1] = phas[lev, 0], phas[lev, 1]
            while True:
                if lev >= 64:  # deeper than any B-tree of 2^64 keys: a cycle means damage
                    return 2
                path[lev] = pg
                pbounds[lev, 0], pbounds[lev, 1] = bounds[i, 0], bounds[i, 1]
                phas[lev, 0], phas[lev, 1] = has[i, 0], has[i, 1]
                base = pg * psize
                if base + psize > limit:
                    return 1
                if u16(mem, base + 10) & 0x3FEF != 1:  # not a branch: the leaf's pass checks it
                    break
                nxt = _page_step(mem, psize, i, k, pg, bounds, has, offs, lens, info, full,
                                 verified, out, floor)
                if nxt < -1:
                    return -2 - nxt
                pg = nxt
                lev += 1
            depth = lev + 1
            leaf[i] = pg
        m2 = mem.reshape((1, limit))
        d = WALK_AHEAD
        for t in range(n + 2 * d):
            j = t  # the leaf's header and the start of its node pointers
            if j < n:
                base = leaf[j] * psize
                prefetch(m2, 0, base)
                prefetch(m2, 0, base + 64)
            j = t - d  # the node the search probes first (its first lines)
            if 0 <= j < n:
                base = leaf[j] * psize
                lower = u16(mem, base + 12)
                g = _spread(keys[j], bounds[j, 0], has[j, 0], bounds[j, 1], has[j, 1], (lower - 16) >> 1)
                if 0 <= g and 16 + 2 * g + 2 <= psize:
                    node = base + u16(mem, base + 16 + 2 * g)
                    if node + 192 <= limit:
                        prefetch(m2, 0, node)
                        prefetch(m2, 0, node + 64)
                        prefetch(m2, 0, node + 128)
            j = t - 2 * d
            if 0 <= j < n:
                nxt = _page_step(mem, psize, j, keys[j], leaf[j], bounds, has, offs, lens, info,
                                 full, verified, out, floor)
                if nxt < -1:  # (a page pass 1 stopped at is no branch: never a child here)
                    return -2 - nxt
        return 0

    check_page = _whole_page  # every node of a page checked: the leaf walk of chunkwalk.py

    _NONE = np.zeros(0, dtype=np.bool_)
    _NO_OUT = np.zeros((0, 0), dtype=np.uint8)  # find_spans copying nothing

    def find_values(mem, psize, root, keys, out, found, info):
        """Copy each key's value (all of out.shape[1] bytes) into out[i]; found[i] when present.

        Returns OK, SHORT_MAP, UNEXPECTED (also when a value has another size) or CORRUPT
        (info: the page and the reason).
        """
        offs = np.empty(len(keys), dtype=np.int64)
        lens = np.empty(len(keys), dtype=np.int64)
        status = find_spans(mem, psize, root, keys, offs, lens, info, False, _NONE, out)
        if status != OK:
            return status
        hit = offs >= 0
        if (lens[hit] != out.shape[1]).any():
            return UNEXPECTED
        found[:] = hit  # every value found was copied into `out` by the walk
        return OK


class PageReader:
    """A read-only mapping of one LMDB data file and the compiled lookup over its pages.

    The file is opened once, when the reader is made (right after the environment it serves),
    and mapped through that descriptor: a compaction that renames a new file in is never mixed
    with the old environment's snapshots (the environment's owner makes a new reader).
    """

    def __init__(self, path: str | os.PathLike, psize: int) -> None:
        self.path = Path(path)
        self.psize = psize
        self._lock = threading.Lock()
        self._mem: np.ndarray | None = None
        self._mm: mmap.mmap | None = None
        self._size = -1
        self._verified = np.zeros(0, dtype=np.bool_)  # pages check_paths checked, of one snapshot
        self._verified_for = -1
        try:
            self._fd: int | None = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            self._fd = None

    def __del__(self) -> None:
        fd, self._fd = getattr(self, "_fd", None), None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass

    def _mapping(self, remap: bool = False) -> np.ndarray | None:
        """The file's mapping; remapped when asked and the file has grown."""
        with self._lock:
            if self._fd is None:
                return None
            try:
                size = os.fstat(self._fd).st_size
            except OSError:
                return None
            if self._mem is None or (remap and size != self._size):
                if size == 0:
                    return None
                mm = mmap.mmap(self._fd, size, prot=mmap.PROT_READ)
                if hasattr(mmap, "MADV_RANDOM"):  # as LMDB's own map (readahead=False): a
                    mm.madvise(mmap.MADV_RANDOM)  # fault reads its page, not 128 KiB around it
                self._mm = mm
                self._mem = np.frombuffer(mm, dtype=np.uint8)  # the array keeps the map alive
                self._size = size
            return self._mem

    def mapping(self, remap: bool = False) -> np.ndarray | None:
        """The file's read-only mapping (uint8), remapped first when asked and the file has grown."""
        return self._mapping(remap)

    def drop(self) -> int:
        """Drop this mapping's resident pages (they stay in the page cache); returns bytes advised."""
        with self._lock:
            if self._mem is None or not hasattr(mmap, "MADV_DONTNEED"):
                return 0
            self._mm.madvise(mmap.MADV_DONTNEED)
            return len(self._mm)

    def lookup(self, record: bytes | None, keys: np.ndarray, size: int
               ) -> tuple[np.ndarray, np.ndarray] | None:
        """Values [n, size] uint8 and found [n] of uint64 `keys` in the database whose main-DB
        record (as read in the caller's open read transaction) is `record`; None: use py-lmdb."""
        n = len(keys)
        out = np.empty((n, size), dtype=np.uint8)
        found = np.zeros(n, dtype=bool)
        if record is None or len(record) != _DB_RECORD.size:
            return None
        root = _DB_RECORD.unpack(record)[-1]
        if root == P_INVALID:
            return out, found
        info = np.zeros(2, dtype=np.int64)
        for remap in (False, True):
            mem = self._mapping(remap)
            if mem is None:
                return None
            status = find_values(mem, self.psize, root, keys, out, found, info)
            if status == OK:
                return out, found
            if status == CORRUPT:
                self._corrupt(info)
            if status != SHORT_MAP:
                return None
        return None

    def floor_spans(self, record: bytes | None, keys: np.ndarray
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """(mapping, offsets, lengths) of the value under the greatest key <= each of the sorted
        uint64 `keys` (offset -1: none) in the database whose main-DB record (in the caller's
        open read transaction) is `record`; the values stay valid while it is open. None: the
        walk met a layout it does not read (the caller reads through py-lmdb)."""
        n = len(keys)
        offs = np.full(n, -1, dtype=np.int64)
        lens = np.zeros(n, dtype=np.int64)
        if record is None or len(record) != _DB_RECORD.size:
            return None
        root = _DB_RECORD.unpack(record)[-1]
        info = np.zeros(2, dtype=np.int64)
        for remap in (False, True):
            mem = self._mapping(remap)
            if mem is None:
                return None
            if root == P_INVALID:
                return mem, offs, lens
            status = find_spans(mem, self.psize, root, keys, offs, lens, info, False, _NONE,
                                _NO_OUT, True)
            if status == OK:
                return mem, offs, lens
            if status == CORRUPT:
                self._corrupt(info)
            if status != SHORT_MAP:
                return None
        return None

    def ask_ahead(self, record: bytes | None, keys: np.ndarray) -> int:
        """Queue the disk reads of every page on the search paths of sorted uint64 `keys` (in
        the caller's read transaction, whose main-DB record of the table is `record`), level by
        level in page order, without waiting for the leaves (`pageahead`); returns pages asked."""
        if record is None or len(record) != _DB_RECORD.size or self._fd is None:
            return 0
        _, _, depth, *_, root = _DB_RECORD.unpack(record)
        mem = self._mapping(remap=True)
        if root == P_INVALID or mem is None:
            return 0
        return ask_ahead(mem, self._fd, self.psize, root, depth, keys)

    def check_paths(self, record: bytes | None, keys: np.ndarray, snapshot: int) -> None:
        """Check every node of every page on the search paths of sorted uint64 `keys` before
        py-lmdb walks them (in the caller's read transaction, whose main-DB record of the table
        is `record`): StoreCorruptError naming a damaged page. LMDB trusts its pages: a flipped
        byte in a node pointer or `mp_lower` hides keys silently or reads past the file (SIGBUS).
        `snapshot`: the transaction's id; pages checked for it are not checked again (a snapshot's
        pages do not change) until another snapshot comes."""
        if len(keys) == 0 or record is None or len(record) != _DB_RECORD.size:
            return
        root = _DB_RECORD.unpack(record)[-1]
        if root == P_INVALID:
            return
        offs = np.empty(len(keys), dtype=np.int64)
        lens = np.empty(len(keys), dtype=np.int64)
        info = np.zeros(2, dtype=np.int64)
        for remap in (False, True):
            mem = self._mapping(remap)
            if mem is None:
                return
            pages = len(mem) // self.psize
            if self._verified_for != snapshot or len(self._verified) != pages:
                self._verified = np.zeros(pages, dtype=np.bool_)
                self._verified_for = snapshot
            status = find_spans(mem, self.psize, root, keys, offs, lens, info, True, self._verified,
                                _NO_OUT)
            if status == CORRUPT:
                self._corrupt(info)
            if status != SHORT_MAP:
                return
        raise StoreCorruptError(f"{self.path}: a page on a row's path lies past the file's end")

    def _corrupt(self, info: np.ndarray) -> None:
        raise StoreCorruptError(f"{self.path}: page {int(info[0])} is damaged: "
                                f"{REASONS.get(int(info[1]), 'bad structure')}")
