"""W-TinyLFU: a small LRU window, a segmented-LRU main cache, a frequency-sketch admission duel."""

from __future__ import annotations

import numba
import numpy as np
import torch

import tierstore.policies.queues as q
import tierstore.policies.sketch as _sketch

from .base import Evictable, QueuePolicy, as_numpy

_WINDOW, _PROBATION, _PROTECTED = 0, 1, 2
_KEY = q.FIRST_FREE


@numba.njit(cache=True, nogil=True)
def access_kernel(S, cap, prot_target, slots, table, meta, log, nlog):  # pragma: no cover
    """Hits: count in the sketch; window and protected hits refresh, probation hits promote."""
    g = S.shape[0] - 1
    for i in range(slots.shape[0]):
        s = slots[i]
        lst = S[s, q.LIST]
        if lst < 0:
            continue
        _sketch.add(table, meta, S[s, _KEY])
        if lst == _PROBATION:
            q.move(S, cap, _PROTECTED, s, log, nlog)
            if S[g, _PROTECTED] > prot_target:  # demote the protected segment's LRU
                q.move(S, cap, _PROBATION, S[cap + _PROTECTED, q.NEXT], log, nlog)
        else:
            q.move(S, cap, lst, s, log, nlog)


@numba.njit(cache=True, nogil=True)
def insert_kernel(S, cap, w_target, main_target, slots, keys, table, meta, log,
            nlog):  # pragma: no cover - compiled
    """New slots enter the window and are counted; while main has room, overflow moves there."""
    g = S.shape[0] - 1
    for i in range(slots.shape[0]):
        s = slots[i]
        if S[s, q.LIST] >= 0:
            q.unlink(S, s, log, nlog)
        h = keys[i] if keys.shape[0] else -1 - s
        S[s, _KEY] = h
        _sketch.add(table, meta, h)
        q.push(S, cap, _WINDOW, s, log, nlog)
        if S[g, _WINDOW] > w_target and S[g, _PROBATION] + S[g, _PROTECTED] < main_target:
            q.move(S, cap, _PROBATION, S[cap + _WINDOW, q.NEXT], log, nlog)


@numba.njit(cache=True, nogil=True)
def walk_kernel(S, cap, w_target, main_target, table, n, mode, pins, prot, skip, mark, out, origin,
          log, nlog):  # pragma: no cover - compiled
    """Evict for `n` incoming slots (they will join the window).

    While the window (counting the incoming slots) is over its target, its LRU slot leaves
    it: into probation if main has room, else it duels main's victim (probation's LRU, or
    protected's when probation is empty) and the one the sketch counts less is evicted
    (ties evict the candidate). Once the window fits, victims come from main.
    """
    g = S.shape[0] - 1
    tw, tp, tr = cap + _WINDOW, cap + _PROBATION, cap + _PROTECTED
    kw, kp, kr = tw, tp, tr  # last slot each hand left in place
    k = 0
    while k < n:
        if q.log_full(log, nlog):
            return k, False
        c = S[kw, q.NEXT]
        v = S[kp, q.NEXT]
        if v == tp:
            v = S[kr, q.NEXT]
            if v == tr:
                v = -1
        if c != tw and (S[g, _WINDOW] + n - k > w_target or v < 0):
            if S[g, _PROBATION] + S[g, _PROTECTED] < main_target:
                q.move(S, cap, _PROBATION, c, log, nlog)
                continue
            duel = v >= 0 and _sketch.estimate(table, S[c, _KEY]) > _sketch.estimate(table, S[v, _KEY])
            if not duel:  # the candidate loses (or main has nothing evictable)
                if q.allowed(c, mode, pins, prot, skip, mark):
                    out[k] = c
                    origin[k] = _WINDOW
                    k += 1
                    q.unlink(S, c, log, nlog)
                else:
                    kw = c
                continue
        elif v < 0:
            break
        if q.allowed(v, mode, pins, prot, skip, mark):
            out[k] = v
            origin[k] = S[v, q.LIST]
            k += 1
            q.unlink(S, v, log, nlog)
            if c != tw and S[g, _WINDOW] + n - k + 1 > w_target:
                q.move(S, cap, _PROBATION, c, log, nlog)  # the admitted candidate
        elif S[v, q.LIST] == _PROBATION:
            kp = v
        else:
            kr = v
    return k, True


class WTinyLFU(QueuePolicy):
    """W-TinyLFU (Einziger, Friedman & Manes; Caffeine's policy) for batched tiers.

    1% of the slots form an LRU window that every new row enters; the rest is a segmented
    LRU (80% protected, probation the rest). A row leaving the window enters main only if a
    4-bit count-min sketch of recent accesses (halved every 2 x capacity accesses) counts it more often than
    main's eviction candidate. The sketch counts key hashes given by the tier on insert.
    """

    name = "wtinylfu"
    lists = 3
    columns = 1
    wants_keys = True
    window_fraction = 0.01
    protected_fraction = 0.8
    aging_period = 2.0  # halve the sketch every 2 x capacity accesses (measured: docs/policies.md)

    def __init__(self, capacity: int, device: torch.device | str = "cpu") -> None:
        super().__init__(capacity, device)
        self.w_target = max(1, round(self.capacity * self.window_fraction))
        self.main_target = max(0, self.capacity - self.w_target)
        self.prot_target = int(self.main_target * self.protected_fraction)
        self.sketch, self.sketch_meta = _sketch.new_sketch(self.capacity, self.aging_period)

    def on_hit(self, slots: torch.Tensor) -> None:
        """Count accesses; promote probation hits to protected."""
        access_kernel(self.state, self.capacity, self.prot_target, as_numpy(slots), self.sketch,
                self.sketch_meta, q.EMPTY_LOG, np.zeros(1, dtype=np.int64))

    def on_insert(self, slots: torch.Tensor, keys: torch.Tensor | None = None) -> None:
        """New slots enter the window."""
        k = as_numpy(keys) if keys is not None else np.empty(0, dtype=np.int64)
        insert_kernel(self.state, self.capacity, self.w_target, self.main_target, as_numpy(slots), k,
                self.sketch, self.sketch_meta, q.EMPTY_LOG, np.zeros(1, dtype=np.int64))

    def walk(self, n: int, mode: int, ev: Evictable, mark: np.ndarray, out: np.ndarray,
              origin: np.ndarray, log: np.ndarray, nlog: np.ndarray) -> tuple[int, bool]:
        return walk_kernel(self.state, self.capacity, self.w_target, self.main_target, self.sketch, n,
                     mode, ev.pins, ev.protected, ev.skip, mark, out, origin, log, nlog)

    def check(self) -> None:
        """Queues are consistent; protected stays within its share."""
        super().check()
        assert self.g[_PROTECTED] <= max(self.prot_target, 0)
