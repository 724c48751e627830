"""Row lookups straight from the LMDB data file's B-tree pages, in numba, without the GIL.

py-lmdb's `txn.get` costs ~1.1 us a row, almost all of it Python-level work under the GIL, so
reader threads do not run in parallel and slow the training thread. The data file's format is
stable (LMDB 0.9: 16-byte page headers, sorted node pointers, nodes of [data size, flags, key
size, key, data]), and our tables have one shape: 8-byte big-endian keys and fixed-size values
stored inline in leaf pages. So a read transaction pins a snapshot (its pages are never reused
while it is open), we take the table's root page from the snapshot's record of the named
database, and a compiled loop walks branch pages down to the leaves and copies the values out
of our own read-only mapping of the file (the kernel's page cache, shared with LMDB's map).

Anything unexpected (a page type we do not write, a value of another size, a page past the file)
returns a status instead of raising: the caller then reads the batch through py-lmdb, which
reports damage with its own checks. The fast path never decides that a store is corrupt.
"""

from __future__ import annotations

import mmap
import os
import struct
import threading
from pathlib import Path

import numpy as np

from .._kernels import HAVE_NUMBA

P_INVALID = (1 << 64) - 1  # md_root of an empty database
# MDB_db: pad, flags, depth, branch/leaf/overflow page counts, entries, root page
_DB_RECORD = struct.Struct("<IHHQQQQQ")
OK, SHORT_MAP, UNEXPECTED = 0, 1, 2

if HAVE_NUMBA:
    import numba

    @numba.njit(nogil=True, cache=True)
    def _u16(mem, pos):  # pragma: no cover - compiled
        return np.int64(mem[pos]) | (np.int64(mem[pos + 1]) << 8)

    @numba.njit(nogil=True, cache=True)
    def _key(mem, pos):  # pragma: no cover - compiled
        v = np.uint64(0)
        for j in range(8):
            v = (v << np.uint64(8)) | np.uint64(mem[pos + j])
        return v

    @numba.njit(nogil=True, cache=True)
    def find_spans(mem, psize, root, keys, offs, lens):  # pragma: no cover - compiled
        """Where each key's value lies in `mem` (offs[i], lens[i]; offs[i] = -1 when absent).

        Returns OK, SHORT_MAP (a page lies past the mapping: remap and retry) or UNEXPECTED.
        """
        limit = mem.shape[0]
        for i in range(keys.shape[0]):
            k = keys[i]
            pg = root
            offs[i] = -1
            done = False
            for _ in range(64):  # deeper than any B-tree of 2^64 keys: a cycle means damage
                base = pg * psize
                if base + psize > limit:
                    return 1
                own = np.uint64(0)  # the page's own number (mp_pgno): a misdirected pointer fails
                for j in range(8):
                    own |= np.uint64(mem[base + j]) << np.uint64(8 * j)
                if own != np.uint64(pg):
                    return 2
                flags = _u16(mem, base + 10) & 0x3FEF  # without P_DIRTY, P_LOOSE, P_KEEP
                lower = _u16(mem, base + 12)
                if lower < 16 or lower > psize:
                    return 2
                n = (lower - 16) >> 1
                if n == 0:
                    return 2
                if flags == 1:  # a branch page
                    lo, hi = 0, n - 1  # the last node whose key <= k; node 0's key is -infinity
                    while lo < hi:
                        mid = (lo + hi + 1) >> 1
                        node = base + _u16(mem, base + 16 + 2 * mid)
                        if node + 16 > base + psize or _u16(mem, node + 6) != 8:
                            return 2
                        if _key(mem, node + 8) <= k:
                            lo = mid
                        else:
                            hi = mid - 1
                    node = base + _u16(mem, base + 16 + 2 * lo)
                    if node + 8 > base + psize:
                        return 2
                    pg = _u16(mem, node) | (_u16(mem, node + 2) << 16) | (_u16(mem, node + 4) << 32)
                elif flags == 2:  # a leaf page (not LEAF2, not a sub-page)
                    lo, hi = 0, n - 1
                    while lo <= hi:
                        mid = (lo + hi) >> 1
                        node = base + _u16(mem, base + 16 + 2 * mid)
                        if node + 16 > base + psize or _u16(mem, node + 6) != 8:
                            return 2
                        key = _key(mem, node + 8)
                        if key == k:
                            if _u16(mem, node + 4) != 0:  # overflow or sub-database data
                                return 2
                            dsize = _u16(mem, node) | (_u16(mem, node + 2) << 16)
                            if node + 16 + dsize > base + psize:
                                return 2
                            offs[i] = node + 16
                            lens[i] = dsize
                            break
                        if key < k:
                            lo = mid + 1
                        else:
                            hi = mid - 1
                    done = True
                    break
                else:
                    return 2
            if not done:
                return 2
        return 0

    @numba.njit(nogil=True, cache=True)
    def gather_spans(mem, offs, pick, out):  # pragma: no cover - compiled
        """out[j] = the value at offs[pick[j]] (each exactly out.shape[1] bytes)."""
        size = out.shape[1]
        for j in range(pick.shape[0]):
            o = offs[pick[j]]
            out[j, :] = mem[o : o + size]

    def find_values(mem, psize, root, keys, out, found):
        """Copy each key's value (all of out.shape[1] bytes) into out[i]; found[i] when present.

        Returns OK, SHORT_MAP or UNEXPECTED (also when a value has another size).
        """
        offs = np.empty(len(keys), dtype=np.int64)
        lens = np.empty(len(keys), dtype=np.int64)
        status = find_spans(mem, psize, root, keys, offs, lens)
        if status != OK:
            return status
        hit = offs >= 0
        if (lens[hit] != out.shape[1]).any():
            return UNEXPECTED
        found[:] = hit
        pick = np.flatnonzero(hit)
        tmp = np.empty((len(pick), out.shape[1]), dtype=np.uint8)
        gather_spans(mem, offs, pick, tmp)
        out[pick] = tmp
        return OK


class PageReader:
    """A read-only mapping of one LMDB data file and the compiled lookup over its pages."""

    def __init__(self, path: str | os.PathLike, psize: int) -> None:
        self.path = Path(path)
        self.psize = psize
        self._lock = threading.Lock()
        self._mem: np.ndarray | None = None
        self._mm: mmap.mmap | None = None
        self._ino: tuple[int, int] | None = None

    def _mapping(self, remap: bool = False) -> np.ndarray | None:
        """The file's mapping; remapped when asked or when the file was replaced."""
        with self._lock:
            try:
                st = os.stat(self.path)
            except OSError:
                return None
            ino = (st.st_dev, st.st_ino)
            if self._mem is None or remap or ino != self._ino:
                if st.st_size == 0:
                    return None
                with open(self.path, "rb") as f:
                    mm = mmap.mmap(f.fileno(), st.st_size, prot=mmap.PROT_READ)
                self._mm = mm
                self._mem = np.frombuffer(mm, dtype=np.uint8)  # the array keeps the map alive
                self._ino = ino
            return self._mem

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
        for remap in (False, True):
            mem = self._mapping(remap)
            if mem is None:
                return None
            status = find_values(mem, self.psize, root, keys, out, found)
            if status == OK:
                return out, found
            if status != SHORT_MAP:
                return None
        return None
