"""LFU: evict the slot with the fewest accesses while cached; ties go to the least recent."""

from __future__ import annotations

import torch

from .base import Policy

_TS_BITS = 40


class LFU(Policy):
    """Least frequently used (in-cache counts), ties broken by recency as libCacheSim does."""

    name = "lfu"

    def __init__(self, capacity: int, device: torch.device | str = "cpu") -> None:
        super().__init__(capacity, device)
        self.count = torch.zeros(self.capacity, dtype=torch.int64, device=self.device)
        self.last = torch.zeros(self.capacity, dtype=torch.int64, device=self.device)
        self.clock = 0

    def _touch(self, slots: torch.Tensor) -> None:
        self._stamp(self.last, slots)

    def on_hit(self, slots: torch.Tensor) -> None:
        """Count the accesses (duplicates count each time) and refresh recency."""
        self.count.index_add_(0, slots, torch.ones_like(slots))
        self._touch(slots)

    def on_insert(self, slots: torch.Tensor) -> None:
        """A new slot starts with one access."""
        self.count[slots] = 1
        self._touch(slots)

    def on_evict(self, slots: torch.Tensor) -> None:
        """Forget counts of emptied slots."""
        self.count[slots] = 0
        self.last[slots] = 0

    def victims(self, n: int, evictable: torch.Tensor) -> torch.Tensor:
        """The n evictable slots with the lowest (count, last access)."""
        if n <= 0:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        if self.clock < (1 << _TS_BITS) and int(self.count.max()) < (1 << (62 - _TS_BITS)):
            return self._lowest((self.count << _TS_BITS) | self.last, n, evictable)
        # fallback for very long runs: order by recency, then stably by count
        idx = torch.nonzero(evictable).flatten()
        idx = idx[torch.sort(self.last[idx], stable=True).indices]
        idx = idx[torch.sort(self.count[idx], stable=True).indices]
        return idx[:n]

    def check(self) -> None:
        """Counts are non-negative."""
        assert bool((self.count >= 0).all())
