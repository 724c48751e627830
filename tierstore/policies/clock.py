"""CLOCK (FIFO with reinsertion): a referenced slot at the queue head gets a second chance."""

from __future__ import annotations

import torch

from .base import Policy


class Clock(Policy):
    """Second-chance FIFO: referenced slots are cleared and re-queued instead of evicted.

    A batch peek is exact: the hand evicts unreferenced slots in queue order, and referenced
    ones it passes go behind every slot now queued, so the victim order is (referenced, queue
    stamp). `on_evict` then re-queues, in order, the referenced slots the hand passed.
    """

    name = "clock"

    def __init__(self, capacity: int, device: torch.device | str = "cpu") -> None:
        super().__init__(capacity, device)
        self.queued = torch.zeros(self.capacity, dtype=torch.int64, device=self.device)
        self.ref = torch.zeros(self.capacity, dtype=torch.bool, device=self.device)
        self.live = torch.zeros(self.capacity, dtype=torch.bool, device=self.device)
        self.clock = 0

    def _key(self) -> torch.Tensor:
        return self.queued + self.ref.long() * (1 << 62)

    def on_hit(self, slots: torch.Tensor) -> None:
        """Set the reference bit."""
        self.ref[slots] = True

    def on_insert(self, slots: torch.Tensor) -> None:
        """Queue new slots at the tail, unreferenced."""
        self.queued[slots] = self._stamps(slots.numel())
        self.ref[slots] = False
        self.live[slots] = True

    def on_evict(self, slots: torch.Tensor) -> None:
        """Advance the hand past the evicted slots, re-queueing the referenced ones it passed."""
        if slots.numel() == 0:
            return
        last = int(self._key()[slots].max())
        self.live[slots] = False
        self.ref[slots] = False
        self.queued[slots] = 0
        passed = torch.nonzero(self.live & self.ref & (self.queued < last)).flatten()
        if passed.numel():
            passed = passed[torch.sort(self.queued[passed], stable=True).indices]
            self.ref[passed] = False
            self.queued[passed] = self._stamps(passed.numel())

    def victims(self, n: int, evictable: torch.Tensor) -> torch.Tensor:
        """Unreferenced slots in queue order, then referenced ones in queue order."""
        return self._lowest(self._key(), n, evictable)

    def check(self) -> None:
        """Dead slots carry no state; stamps never exceed the clock."""
        assert not bool((self.ref & ~self.live).any())
        assert self.capacity == 0 or int(self.queued.max()) <= self.clock
