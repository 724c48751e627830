"""Ghost queues: bounded FIFOs of evicted rows' key hashes with O(1) membership (numba)."""

from __future__ import annotations

import numba
import numpy as np

_C = np.int64(-7046029254386353131)


@numba.njit(cache=True, nogil=True, inline="always")
def _home(h, mask):  # pragma: no cover - compiled
    x = h * _C
    return (x ^ (x >> 29)) & mask


@numba.njit(cache=True, nogil=True)
def _find(ring, table, h):  # pragma: no cover - compiled
    """Table position of hash `h`, or -1."""
    mask = table.shape[0] - 1
    p = _home(h, mask)
    while table[p] >= 0:
        if ring[table[p] % ring.shape[0]] == h:
            return p
        p = (p + 1) & mask
    return -1


@numba.njit(cache=True, nogil=True)
def _delete(ring, table, p):  # pragma: no cover - compiled
    """Empty table position `p` by backward shift (no tombstones)."""
    mask = table.shape[0] - 1
    j = p
    while True:
        j = (j + 1) & mask
        e = table[j]
        if e < 0:
            break
        home = _home(ring[e % ring.shape[0]], mask)
        if ((j - home) & mask) >= ((j - p) & mask):
            table[p] = e
            p = j
    table[p] = -1


@numba.njit(cache=True, nogil=True)
def take(ring, table, meta, h):  # pragma: no cover - compiled
    """Remove `h` from the ghost queue; return whether it was there."""
    p = _find(ring, table, h)
    if p < 0:
        return False
    _delete(ring, table, p)
    meta[2] -= 1
    return True


@numba.njit(cache=True, nogil=True)
def push(ring, table, meta, limit, h):  # pragma: no cover - compiled
    """Append `h` (not present), dropping the oldest entries beyond `limit` live ones."""
    if limit <= 0:
        return
    r = ring.shape[0]
    while meta[2] >= limit or meta[1] - meta[0] >= r:
        seq = meta[0]
        p = _find(ring, table, ring[seq % r])
        if p >= 0 and table[p] == seq:
            _delete(ring, table, p)
            meta[2] -= 1
        meta[0] += 1
    seq = meta[1]
    ring[seq % r] = h
    mask = table.shape[0] - 1
    p = _home(h, mask)
    while table[p] >= 0:
        p = (p + 1) & mask
    table[p] = seq
    meta[1] += 1
    meta[2] += 1


@numba.njit(cache=True, nogil=True)
def push_many(ring, table, meta, limit, hashes):  # pragma: no cover - compiled
    """Append hashes in order (see `push`)."""
    for i in range(hashes.shape[0]):
        push(ring, table, meta, limit, hashes[i])


@numba.njit(cache=True, nogil=True)
def pop_oldest(ring, table, meta):  # pragma: no cover - compiled
    """Drop the oldest live entry (if any)."""
    r = ring.shape[0]
    while meta[2] > 0 and meta[0] < meta[1]:
        seq = meta[0]
        meta[0] += 1
        p = _find(ring, table, ring[seq % r])
        if p >= 0 and table[p] == seq:
            _delete(ring, table, p)
            meta[2] -= 1
            return


class Ghost:
    """A FIFO of at most `limit` key hashes with membership tests (S3-FIFO's and ARC's ghosts)."""

    def __init__(self, limit: int) -> None:
        self.limit = max(0, int(limit))
        self.ring = np.zeros(2 * self.limit + 1, dtype=np.int64)
        size = 1 << max(2, int(2 * self.limit + 1).bit_length())
        self.table = np.full(size, -1, dtype=np.int64)
        self.meta = np.zeros(3, dtype=np.int64)  # oldest seq, next seq, live entries

    def __len__(self) -> int:
        return int(self.meta[2])

    def take(self, h: int) -> bool:
        """Remove `h`; True if it was a ghost."""
        return bool(take(self.ring, self.table, self.meta, h))

    def push(self, h: int) -> None:
        """Remember `h`, forgetting the oldest beyond the limit."""
        push(self.ring, self.table, self.meta, self.limit, h)
