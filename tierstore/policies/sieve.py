"""SIEVE: FIFO order, visited bits, and a hand sweeping from old to new that never moves slots."""

from __future__ import annotations

import numba
import numpy as np
import torch

import tierstore.policies.queues as q

from .base import Evictable, QueuePolicy, as_numpy

_VISITED = q.FIRST_FREE
_HAND = 1  # globals column: the slot the hand points at (-1: the oldest)


@numba.njit(cache=True, nogil=True)
def _walk(S, cap, n, mode, pins, prot, skip, mark, out, log, nlog):  # pragma: no cover
    """The hand moves toward newer slots, clearing visited bits and evicting unvisited ones."""
    t = cap
    g = S.shape[0] - 1
    o = S[g, _HAND]
    if o < 0:
        o = S[t, q.NEXT]
    wraps = 0
    k = 0
    while k < n:
        if q.log_full(log, nlog):
            return k, False
        if o == t:  # past the newest: restart at the oldest
            wraps += 1
            if wraps > 2:
                break
            o = S[t, q.NEXT]
            continue
        nx = S[o, q.NEXT]
        if S[o, _VISITED]:
            q.put(S, o, _VISITED, 0, log, nlog)
        elif q.allowed(o, mode, pins, prot, skip, mark):
            out[k] = o
            k += 1
            q.unlink(S, o, log, nlog)
        o = nx
    q.put(S, g, _HAND, -1 if o == t else o, log, nlog)
    return k, True


@numba.njit(cache=True, nogil=True)
def _remove(S, cap, slots):  # pragma: no cover - compiled
    """Unlink slots; a hand on a removed slot moves on to the next newer one."""
    g = S.shape[0] - 1
    nlog = np.zeros(1, dtype=np.int64)
    log = np.empty((0, 3), dtype=np.int64)
    for i in range(slots.shape[0]):
        s = slots[i]
        if S[s, q.LIST] < 0:
            continue
        if S[g, _HAND] == s:
            nx = S[s, q.NEXT]
            S[g, _HAND] = -1 if nx == cap else nx
        q.unlink(S, s, log, nlog)
        S[s, _VISITED] = 0


class Sieve(QueuePolicy):
    """SIEVE (Zhang et al., NSDI'24): hits set a bit; the hand clears set bits, evicts the rest."""

    name = "sieve"
    columns = 1

    def __init__(self, capacity: int, device: torch.device | str = "cpu") -> None:
        super().__init__(capacity, device)
        self.g[_HAND] = -1

    def on_hit(self, slots: torch.Tensor) -> None:
        """Mark the slots visited."""
        self.state[as_numpy(slots), _VISITED] = 1

    def on_insert(self, slots: torch.Tensor, keys: torch.Tensor | None = None) -> None:
        """New slots join the newest end of the queue, unvisited."""
        s = as_numpy(slots)
        _remove(self.state, self.capacity, s)
        q.push_many(self.state, self.capacity, 0, s)
        self.state[s, _VISITED] = 0

    def on_remove(self, slots: torch.Tensor) -> None:
        """Unlink slots without sweeping; the hand steps off a removed slot."""
        _remove(self.state, self.capacity, as_numpy(slots))

    def walk(self, n: int, mode: int, ev: Evictable, mark: np.ndarray, out: np.ndarray,
              origin: np.ndarray, log: np.ndarray, nlog: np.ndarray) -> tuple[int, bool]:
        origin[:] = 0
        return _walk(self.state, self.capacity, n, mode, ev.pins, ev.protected, ev.skip, mark,
                     out, log, nlog)

    def check(self) -> None:
        """Queues are consistent; the hand is a queued slot or -1; dead slots are unvisited."""
        super().check()
        st = self.state[: self.capacity]
        assert not bool(((st[:, _VISITED] != 0) & (st[:, q.LIST] < 0)).any())
        hand = int(self.g[_HAND])
        assert hand == -1 or st[hand, q.LIST] == 0
