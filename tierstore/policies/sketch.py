"""A 4-bit count-min frequency sketch with periodic halving (W-TinyLFU's admission filter)."""

from __future__ import annotations

import numba
import numpy as np

_SEEDS = np.array([-7046029254386353131, -4658895280553007687, -7723592293110705685,
                   -2846782150143539227], dtype=np.int64)
DEPTH = 4
MAX_COUNT = 15


@numba.njit(cache=True, nogil=True, inline="always")
def _index(h, row, mask):  # pragma: no cover - compiled
    x = (h + row) * _SEEDS[row]
    x = x ^ (x >> 31)
    x = x * _SEEDS[(row + 1) & 3]
    return (x ^ (x >> 29)) & mask


@numba.njit(cache=True, nogil=True)
def estimate(table, h):  # pragma: no cover - compiled
    """The sketch's count for hash `h` (never below the true count since the last halving)."""
    mask = table.shape[1] - 1
    best = MAX_COUNT
    for r in range(DEPTH):
        c = table[r, _index(h, r, mask)]
        if c < best:
            best = c
    return best


@numba.njit(cache=True, nogil=True)
def add(table, meta, h):  # pragma: no cover - compiled
    """Count one access of `h`; every `meta[1]` accesses all counters are halved (aging)."""
    mask = table.shape[1] - 1
    for r in range(DEPTH):
        i = _index(h, r, mask)
        if table[r, i] < MAX_COUNT:
            table[r, i] += 1
    meta[0] += 1
    if meta[0] >= meta[1]:
        for r in range(DEPTH):
            for i in range(table.shape[1]):
                table[r, i] >>= 1
        meta[0] //= 2


def new_sketch(capacity: int, period: float) -> tuple[np.ndarray, np.ndarray]:
    """Counters for a cache of `capacity` entries: width >= capacity, halved every
    `period` x capacity accesses."""
    width = 1 << max(4, int(max(1, capacity) - 1).bit_length())
    return (np.zeros((DEPTH, width), dtype=np.uint8),
            np.array([0, max(1, int(period * max(1, capacity)))], dtype=np.int64))
