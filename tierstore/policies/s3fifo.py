"""S3-FIFO: a small probationary FIFO, a main FIFO with reinsertion, a ghost FIFO of keys."""

from __future__ import annotations

import numba
import numpy as np
import torch

import tierstore.policies.ghost as _ghost
import tierstore.policies.queues as q

from .base import Evictable, QueuePolicy, as_numpy

_SMALL, _MAIN = 0, 1
_FREQ, _KEY = q.FIRST_FREE, q.FIRST_FREE + 1
_EVICTED = 2  # globals column: 1 once anything was evicted


@numba.njit(cache=True, nogil=True)
def _walk(S, cap, small_target, n, mode, pins, prot, skip, mark, out, origin,
          log, nlog):  # pragma: no cover - compiled
    """libCacheSim's S3-FIFO eviction, skipping slots that may not be evicted.

    Main is chosen when it is over its share or the small queue is empty; a branch, once
    chosen, runs until it evicts (promoting hot small slots, re-queueing main slots with a
    positive count, decremented) or runs out of candidates.
    """
    g = S.shape[0] - 1
    ts, tm = cap + _SMALL, cap + _MAIN
    main_cap = cap - small_target
    ks, km = ts, tm  # last slot each hand left in place
    branch = -1
    k = 0
    while k < n:
        if q.log_full(log, nlog):
            return k, False
        so = S[ks, q.NEXT]
        mo = S[km, q.NEXT]
        if so == ts and mo == tm:
            break
        if branch < 0 or (branch == _SMALL and so == ts) or (branch == _MAIN and mo == tm):
            if mo != tm and (S[g, _MAIN] > main_cap or S[g, _SMALL] == 0 or so == ts):
                branch = _MAIN
            else:
                branch = _SMALL
        if branch == _MAIN:
            f = S[mo, _FREQ]
            if f >= 1:
                q.put(S, mo, _FREQ, min(f, 3) - 1, log, nlog)
                q.move(S, cap, _MAIN, mo, log, nlog)
            elif q.allowed(mo, mode, pins, prot, skip, mark):
                out[k] = mo
                origin[k] = _MAIN
                k += 1
                q.unlink(S, mo, log, nlog)
                branch = -1
            else:
                km = mo
        else:
            if S[so, _FREQ] >= 2:
                q.put(S, so, _FREQ, 0, log, nlog)
                q.move(S, cap, _MAIN, so, log, nlog)
            elif q.allowed(so, mode, pins, prot, skip, mark):
                out[k] = so
                origin[k] = _SMALL
                k += 1
                q.unlink(S, so, log, nlog)
                branch = -1
            else:
                ks = so
    if k:
        q.put(S, g, _EVICTED, 1, log, nlog)
    return k, True


@numba.njit(cache=True, nogil=True)
def _insert(S, cap, small_target, slots, keys, ring, table, meta):  # pragma: no cover
    """Ghost hits go straight to main (so does everything while main is still filling)."""
    g = S.shape[0] - 1
    nlog = np.zeros(1, dtype=np.int64)
    log = np.empty((0, 3), dtype=np.int64)
    for i in range(slots.shape[0]):
        s = slots[i]
        if S[s, q.LIST] >= 0:
            q.unlink(S, s, log, nlog)
        ghost = keys.shape[0] > 0 and _ghost.take(ring, table, meta, keys[i])
        to_main = ghost or (S[g, _EVICTED] == 0 and S[g, _SMALL] >= small_target)
        q.push(S, cap, _MAIN if to_main else _SMALL, s, log, nlog)
        S[s, _FREQ] = 0
        S[s, _KEY] = keys[i] if keys.shape[0] else 0


class S3FIFO(QueuePolicy):
    """S3-FIFO (Yang et al., SOSP'23) as libCacheSim runs it, with its ghost queue.

    New slots enter the small queue (10% of capacity) unless their key is in the ghost queue
    (then main). The small queue's hand promotes slots hit at least twice to main and evicts
    the others, remembering their keys in the ghost queue (90% of capacity); main's hand
    re-queues slots with a positive 2-bit count, decremented. Keys are the tier's row hashes;
    without them (`on_insert(slots)`) the ghost queue stays empty.
    """

    name = "s3fifo"
    lists = 2
    columns = 2
    wants_keys = True
    small_fraction = 0.1
    ghost_fraction = 0.9

    def __init__(self, capacity: int, device: torch.device | str = "cpu") -> None:
        super().__init__(capacity, device)
        self.small_target = max(1, int(self.capacity * self.small_fraction))
        self.ghost = _ghost.Ghost(int(self.capacity * self.ghost_fraction))

    def on_hit(self, slots: torch.Tensor) -> None:
        """Count the access (saturating at 3)."""
        s = as_numpy(slots)
        np.add.at(self.state[:, _FREQ], s, 1)
        self.state[s, _FREQ] = np.minimum(self.state[s, _FREQ], 3)

    def on_insert(self, slots: torch.Tensor, keys: torch.Tensor | None = None) -> None:
        """New slots join the small queue (main on a ghost hit) with a zero count."""
        s = as_numpy(slots)
        k = as_numpy(keys) if keys is not None else np.empty(0, dtype=np.int64)
        gh = self.ghost
        _insert(self.state, self.capacity, self.small_target, s, k, gh.ring, gh.table, gh.meta)

    def walk(self, n: int, mode: int, ev: Evictable, mark: np.ndarray, out: np.ndarray,
              origin: np.ndarray, log: np.ndarray, nlog: np.ndarray) -> tuple[int, bool]:
        return _walk(self.state, self.capacity, self.small_target, n, mode, ev.pins,
                     ev.protected, ev.skip, mark, out, origin, log, nlog)

    def _evicted(self, slots: np.ndarray, origin: np.ndarray) -> None:
        """Keys evicted from the small queue become ghosts, in eviction order."""
        keys = self.state[slots, _KEY]
        gh = self.ghost
        _ghost.push_many(gh.ring, gh.table, gh.meta, gh.limit, keys[(origin == _SMALL) & (keys != 0)])

    def check(self) -> None:
        """Queues are consistent; counts stay in [0, 3]; the ghost respects its limit."""
        super().check()
        f = self.state[: self.capacity, _FREQ]
        assert bool(((f >= 0) & (f <= 3)).all())
        assert len(self.ghost) <= self.ghost.limit
