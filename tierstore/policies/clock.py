"""CLOCK (FIFO with reinsertion): a referenced slot at the queue head gets a second chance."""

from __future__ import annotations

import numba
import numpy as np
import torch

import tierstore.policies.queues as q

from .base import Evictable, QueuePolicy, as_numpy

_REF = q.FIRST_FREE


@numba.njit(cache=True, nogil=True)
def _walk(S, cap, n, mode, pins, prot, skip, mark, out, log, nlog):  # pragma: no cover
    """The hand: clear and re-queue referenced slots, evict unreferenced allowed ones."""
    t = cap
    keep = t  # the last slot the hand left in place (pinned or protected)
    k = 0
    while k < n:
        if q.log_full(log, nlog):
            return k, False
        s = S[keep, q.NEXT]
        if s == t:
            break
        if S[s, _REF]:
            q.put(S, s, _REF, 0, log, nlog)
            q.move(S, cap, 0, s, log, nlog)
        elif q.allowed(s, mode, pins, prot, skip, mark):
            out[k] = s
            k += 1
            q.unlink(S, s, log, nlog)
        else:
            keep = s
    return k, True


class Clock(QueuePolicy):
    """Second-chance FIFO: the hand clears referenced slots and re-queues them at the tail."""

    name = "clock"
    columns = 1

    def on_hit(self, slots: torch.Tensor) -> None:
        """Set the reference bit."""
        self.state[as_numpy(slots), _REF] = 1

    def on_insert(self, slots: torch.Tensor, keys: torch.Tensor | None = None) -> None:
        """Queue new slots at the tail, unreferenced."""
        s = as_numpy(slots)
        q.push_many(self.state, self.capacity, 0, s)
        self.state[s, _REF] = 0

    def walk(self, n: int, mode: int, ev: Evictable, mark: np.ndarray, out: np.ndarray,
              origin: np.ndarray, log: np.ndarray, nlog: np.ndarray) -> tuple[int, bool]:
        origin[:] = 0
        return _walk(self.state, self.capacity, n, mode, ev.pins, ev.protected, ev.skip, mark,
                     out, log, nlog)

    def referenced(self, slots: torch.Tensor) -> torch.Tensor:
        """The reference bits of slots (for tests)."""
        return torch.from_numpy(self.state[as_numpy(slots), _REF] != 0)

    def check(self) -> None:
        """Queues are consistent; slots outside the queue carry no reference bit."""
        super().check()
        st = self.state[: self.capacity]
        assert not bool(((st[:, _REF] != 0) & (st[:, q.LIST] < 0)).any())
