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

if HAVE_NUMBA:

    @numba.njit(cache=True, nogil=True)
    def _home(tab, row, mask):  # pragma: no cover - compiled
        h = row * _C1 + tab * _C2
        h = h ^ (h >> 31)
        h = h * _C3
        h = h ^ (h >> 29)
        return h & mask

    @numba.njit(cache=True, nogil=True)
    def hash_find(table, row_of, tab_of, tabs, rows, out, mask):  # pragma: no cover
        """Write the slot of each (tab, row) into out, or -1."""
        for i in range(rows.shape[0]):
            t = tabs[i] if tabs.shape[0] > 1 else tabs[0]
            r = rows[i]
            p = _home(t, r, mask)
            res = -1
            while True:
                s = table[p]
                if s == -1:
                    break
                if s >= 0 and row_of[s] == r and tab_of[s] == t:
                    res = s
                    break
                p = (p + 1) & mask
            out[i] = res

    @numba.njit(cache=True, nogil=True)
    def hash_add(table, row_of, tab_of, pos_of, tabs, rows, slots, mask):  # pragma: no cover
        """Insert absent keys; return (tombstones reused, max probe distance)."""
        reused = 0
        maxd = 0
        for i in range(rows.shape[0]):
            t = tabs[i] if tabs.shape[0] > 1 else tabs[0]
            r = rows[i]
            s = slots[i]
            h = _home(t, r, mask)
            p = h
            while table[p] >= 0:
                p = (p + 1) & mask
            if table[p] == -2:
                reused += 1
            table[p] = s
            pos_of[s] = p
            row_of[s] = r
            tab_of[s] = t
            d = (p - h) & mask
            if d > maxd:
                maxd = d
        return reused, maxd
