"""LFU: evict the slot with the fewest accesses while cached; ties go to the least recent."""

from __future__ import annotations

import numba
import numpy as np
import torch

from .base import Evictable, Policy, as_evictable, as_numpy

# slot rows: PREV, NEXT (within its bucket, oldest first), BUCKET (-1: not cached)
# bucket rows 0..cap: FREQ, BPREV, BNEXT (buckets in ascending frequency), HEAD, TAIL;
# row cap + 1 is the sentinel of the bucket list; meta[0] is the free-bucket stack's size
_PREV, _NEXT, _BUCKET = 0, 1, 2
_FREQ, _BPREV, _BNEXT, _HEAD, _TAIL = 0, 1, 2, 3, 4


@numba.njit(cache=True, nogil=True)
def _bucket_after(bkt, free, meta, b, f):  # pragma: no cover - compiled
    """The bucket of frequency `f` right after bucket `b`, made if it does not exist."""
    nb = bkt[b, _BNEXT]
    if nb != bkt.shape[0] - 1 and bkt[nb, _FREQ] == f:
        return nb
    meta[0] -= 1
    c = free[meta[0]]
    bkt[c, _FREQ] = f
    bkt[c, _HEAD] = -1
    bkt[c, _TAIL] = -1
    bkt[c, _BPREV] = b
    bkt[c, _BNEXT] = nb
    bkt[b, _BNEXT] = c
    bkt[nb, _BPREV] = c
    return c


@numba.njit(cache=True, nogil=True)
def _unlink(slot, bkt, free, meta, s):  # pragma: no cover - compiled
    """Take slot `s` out of its bucket; an emptied bucket returns to the free stack."""
    b = slot[s, _BUCKET]
    p, nx = slot[s, _PREV], slot[s, _NEXT]
    if p >= 0:
        slot[p, _NEXT] = nx
    else:
        bkt[b, _HEAD] = nx
    if nx >= 0:
        slot[nx, _PREV] = p
    else:
        bkt[b, _TAIL] = p
    slot[s, _BUCKET] = -1
    if bkt[b, _HEAD] < 0:
        bp, bn = bkt[b, _BPREV], bkt[b, _BNEXT]
        bkt[bp, _BNEXT] = bn
        bkt[bn, _BPREV] = bp
        free[meta[0]] = b
        meta[0] += 1


@numba.njit(cache=True, nogil=True)
def _append(slot, bkt, b, s):  # pragma: no cover - compiled
    """Make `s` the most recent slot of bucket `b`."""
    t = bkt[b, _TAIL]
    slot[s, _PREV] = t
    slot[s, _NEXT] = -1
    slot[s, _BUCKET] = b
    if t >= 0:
        slot[t, _NEXT] = s
    else:
        bkt[b, _HEAD] = s
    bkt[b, _TAIL] = s


@numba.njit(cache=True, nogil=True)
def _hit(slot, bkt, free, meta, slots):  # pragma: no cover - compiled
    """Each access moves the slot to the end of the next frequency's bucket."""
    for i in range(slots.shape[0]):
        s = slots[i]
        b = slot[s, _BUCKET]
        if b < 0:
            continue
        c = _bucket_after(bkt, free, meta, b, bkt[b, _FREQ] + 1)
        _unlink(slot, bkt, free, meta, s)
        _append(slot, bkt, c, s)


@numba.njit(cache=True, nogil=True)
def _insert(slot, bkt, free, meta, slots):  # pragma: no cover - compiled
    """New slots start with one access, most recent among the once-used."""
    sent = bkt.shape[0] - 1
    for i in range(slots.shape[0]):
        s = slots[i]
        if slot[s, _BUCKET] >= 0:
            _unlink(slot, bkt, free, meta, s)
        c = _bucket_after(bkt, free, meta, sent, 1)
        _append(slot, bkt, c, s)


@numba.njit(cache=True, nogil=True)
def _remove(slot, bkt, free, meta, slots):  # pragma: no cover - compiled
    for i in range(slots.shape[0]):
        if slot[slots[i], _BUCKET] >= 0:
            _unlink(slot, bkt, free, meta, slots[i])


@numba.njit(cache=True, nogil=True)
def _victims(slot, bkt, n, pins, prot, skip, out):  # pragma: no cover - compiled
    """Allowed slots by ascending (frequency, last access)."""
    sent = bkt.shape[0] - 1
    b = bkt[sent, _BNEXT]
    k = 0
    while b != sent and k < n:
        s = bkt[b, _HEAD]
        while s >= 0 and k < n:
            if ((pins.shape[0] == 0 or pins[s] == 0) and (prot.shape[0] == 0 or not prot[s])
                    and (skip.shape[0] == 0 or not skip[s])):
                out[k] = s
                k += 1
            s = slot[s, _NEXT]
        b = bkt[b, _BNEXT]
    return k


class LFU(Policy):
    """Least frequently used (in-cache counts) with O(1) frequency buckets, ties by recency.

    Buckets of equal count are linked in ascending count; inside a bucket slots are kept in
    the order they reached that count, which is their last-access order: the victims are the
    smallest (count, last access) pairs, as libCacheSim's LFU picks them.
    """

    name = "lfu"

    def __init__(self, capacity: int, device: torch.device | str = "cpu") -> None:
        super().__init__(capacity, device)
        cap = self.capacity
        self.slot = np.full((cap, 3), -1, dtype=np.int64)
        self.bkt = np.zeros((cap + 2, 5), dtype=np.int64)
        self.bkt[cap + 1, 1] = self.bkt[cap + 1, 2] = cap + 1
        self._free = np.arange(cap, -1, -1, dtype=np.int64)
        self.meta = np.array([cap + 1], dtype=np.int64)

    def on_hit(self, slots: torch.Tensor) -> None:
        """Count the accesses (duplicates count each time)."""
        _hit(self.slot, self.bkt, self._free, self.meta, as_numpy(slots))

    def on_insert(self, slots: torch.Tensor, keys: torch.Tensor | None = None) -> None:
        """A new slot starts with one access."""
        _insert(self.slot, self.bkt, self._free, self.meta, as_numpy(slots))

    def on_evict(self, slots: torch.Tensor) -> None:
        """Forget counts of emptied slots."""
        _remove(self.slot, self.bkt, self._free, self.meta, as_numpy(slots))

    def victims(self, n: int, evictable: Evictable | torch.Tensor) -> torch.Tensor:
        """The n evictable slots with the lowest (count, last access)."""
        if n <= 0 or self.capacity == 0:
            return self._empty()
        ev = as_evictable(evictable)
        out = np.empty(n, dtype=np.int64)
        k = _victims(self.slot, self.bkt, n, ev.pins, ev.protected, ev.skip, out)
        return self._out(out[:k])

    def counts(self, slots: torch.Tensor) -> torch.Tensor:
        """In-cache access counts of slots (0 if not cached)."""
        b = self.slot[as_numpy(slots), _BUCKET]
        return torch.from_numpy(np.where(b >= 0, self.bkt[np.maximum(b, 0), _FREQ], 0))

    def check(self) -> None:
        """Buckets ascend strictly, are non-empty, and hold every cached slot once."""
        sent = self.capacity + 1
        b, last, seen = self.bkt[sent, _BNEXT], 0, 0
        while b != sent:
            assert self.bkt[b, _FREQ] > last and self.bkt[b, _HEAD] >= 0
            last = self.bkt[b, _FREQ]
            s = self.bkt[b, _HEAD]
            while s >= 0:
                assert self.slot[s, _BUCKET] == b
                seen += 1
                s = self.slot[s, _NEXT]
            b = self.bkt[b, _BNEXT]
        assert seen == int((self.slot[:, _BUCKET] >= 0).sum())
        assert int(self.meta[0]) + len(self._bucket_ids()) == self.capacity + 1

    def _bucket_ids(self) -> list[int]:
        sent, out = self.capacity + 1, []
        b = self.bkt[sent, _BNEXT]
        while b != sent:
            out.append(int(b))
            b = self.bkt[b, _BNEXT]
        return out
