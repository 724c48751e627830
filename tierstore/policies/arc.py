"""ARC: recency (T1) and frequency (T2) LRU lists whose split adapts to ghost-list hits."""

from __future__ import annotations

import numba
import numpy as np
import torch

import tierstore.policies.ghost as _ghost
import tierstore.policies.queues as q

from .base import Evictable, QueuePolicy, as_numpy

_T1, _T2 = 0, 1
_KEY = q.FIRST_FREE


@numba.njit(cache=True, nogil=True)
def _hit(S, cap, slots):  # pragma: no cover - compiled
    """A hit moves the slot to T2's most recent end."""
    nlog = np.zeros(1, dtype=np.int64)
    log = np.empty((0, 3), dtype=np.int64)
    for i in range(slots.shape[0]):
        s = slots[i]
        if S[s, q.LIST] >= 0:
            q.move(S, cap, _T2, s, log, nlog)


@numba.njit(cache=True, nogil=True)
def _insert(S, cap, p, slots, keys, r1, tb1, m1, r2, tb2, m2):  # pragma: no cover - compiled
    """A ghost hit adapts the target `p` of T1 and enters T2; other new slots enter T1."""
    nlog = np.zeros(1, dtype=np.int64)
    log = np.empty((0, 3), dtype=np.int64)
    for i in range(slots.shape[0]):
        s = slots[i]
        if S[s, q.LIST] >= 0:
            q.unlink(S, s, log, nlog)
        h = keys[i] if keys.shape[0] else 0
        S[s, _KEY] = h
        b1, b2 = max(m1[2], 1), max(m2[2], 1)
        if keys.shape[0] and _ghost.take(r1, tb1, m1, h):
            p[0] = min(float(cap), p[0] + max(b2 / b1, 1.0))
            q.push(S, cap, _T2, s, log, nlog)
        elif keys.shape[0] and _ghost.take(r2, tb2, m2, h):
            p[0] = max(0.0, p[0] - max(b1 / b2, 1.0))
            q.push(S, cap, _T2, s, log, nlog)
        else:
            q.push(S, cap, _T1, s, log, nlog)


@numba.njit(cache=True, nogil=True)
def _walk(S, cap, p, n, mode, pins, prot, skip, mark, out, origin, log,
          nlog):  # pragma: no cover - compiled
    """REPLACE: T1's LRU while T1 is over its target `p`, else T2's LRU."""
    g = S.shape[0] - 1
    t1, t2 = cap + _T1, cap + _T2
    k1, k2 = t1, t2
    k = 0
    while k < n:
        if q.log_full(log, nlog):
            return k, False
        a, b = S[k1, q.NEXT], S[k2, q.NEXT]
        if a == t1 and b == t2:
            break
        first = a != t1 and (S[g, _T1] > p or b == t2)
        c = a if first else b
        if q.allowed(c, mode, pins, prot, skip, mark):
            out[k] = c
            origin[k] = _T1 if first else _T2
            k += 1
            q.unlink(S, c, log, nlog)
        elif first:
            k1 = c
        else:
            k2 = c
    return k, True


@numba.njit(cache=True, nogil=True)
def _remember(keys, origin, t1_len, cap, r1, tb1, m1, r2, tb2, m2):  # pragma: no cover
    """Evicted keys join B1 (from T1) or B2 (from T2); |T1| + |B1| <= c, |B1| + |B2| <= c."""
    for i in range(keys.shape[0]):
        if origin[i] == _T1:
            _ghost.push(r1, tb1, m1, cap, keys[i])
        else:
            _ghost.push(r2, tb2, m2, cap, keys[i])
    while m1[2] > 0 and m1[2] + t1_len > cap:
        _ghost.pop_oldest(r1, tb1, m1)
    while m2[2] > 0 and m1[2] + m2[2] > cap:
        _ghost.pop_oldest(r2, tb2, m2)


class ARC(QueuePolicy):
    """Adaptive Replacement Cache (Megiddo & Modha, FAST'03) for batched tiers.

    T1 holds slots used once since they entered, T2 slots used again; B1 and B2 remember
    the key hashes recently evicted from each. A new row whose key is in B1 grows T1's
    target `p`, one in B2 shrinks it; both enter T2. Victims come from T1 while it is over
    `p`, else from T2. Keys are the tier's row hashes; without them the ghosts stay empty.
    """

    name = "arc"
    lists = 2
    columns = 1
    wants_keys = True

    def __init__(self, capacity: int, device: torch.device | str = "cpu") -> None:
        super().__init__(capacity, device)
        self.p = np.zeros(1, dtype=np.float64)
        self.b1 = _ghost.Ghost(self.capacity)
        self.b2 = _ghost.Ghost(self.capacity)

    def _ghosts(self) -> tuple:
        return (self.b1.ring, self.b1.table, self.b1.meta, self.b2.ring, self.b2.table,
                self.b2.meta)

    def on_hit(self, slots: torch.Tensor) -> None:
        """Hit slots move to T2's most recent end."""
        _hit(self.state, self.capacity, as_numpy(slots))

    def on_insert(self, slots: torch.Tensor, keys: torch.Tensor | None = None) -> None:
        """New slots enter T1, or T2 on a ghost hit (adapting `p`)."""
        k = as_numpy(keys) if keys is not None else np.empty(0, dtype=np.int64)
        _insert(self.state, self.capacity, self.p, as_numpy(slots), k, *self._ghosts())

    def walk(self, n: int, mode: int, ev: Evictable, mark: np.ndarray, out: np.ndarray,
              origin: np.ndarray, log: np.ndarray, nlog: np.ndarray) -> tuple[int, bool]:
        return _walk(self.state, self.capacity, float(self.p[0]), n, mode, ev.pins,
                     ev.protected, ev.skip, mark, out, origin, log, nlog)

    def _evicted(self, slots: np.ndarray, origin: np.ndarray) -> None:
        keys = self.state[slots, _KEY]
        keep = keys != 0
        _remember(keys[keep], origin[keep], int(self.g[_T1]), self.capacity, *self._ghosts())

    def check(self) -> None:
        """Queues are consistent; 0 <= p <= c; ghosts within their bounds."""
        super().check()
        assert 0.0 <= float(self.p[0]) <= self.capacity
        assert len(self.b1) + len(self.b2) <= self.capacity
