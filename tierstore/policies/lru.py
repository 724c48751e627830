"""LRU: evict the slot whose last access is oldest."""

from __future__ import annotations

import torch

from .base import Policy


class LRU(Policy):
    """Least recently used, with one access clock tick per slot access."""

    name = "lru"

    def __init__(self, capacity: int, device: torch.device | str = "cpu") -> None:
        super().__init__(capacity, device)
        self.last = torch.zeros(self.capacity, dtype=torch.int64, device=self.device)
        self.clock = 0

    def _touch(self, slots: torch.Tensor) -> None:
        self._stamp(self.last, slots)

    def on_hit(self, slots: torch.Tensor) -> None:
        """Refresh the recency of hit slots."""
        self._touch(slots)

    def on_insert(self, slots: torch.Tensor) -> None:
        """Inserted slots become most recent."""
        self._touch(slots)

    def on_evict(self, slots: torch.Tensor) -> None:
        """Clear the recency of emptied slots."""
        self.last.index_fill_(0, slots, 0)

    def victims(self, n: int, evictable: torch.Tensor) -> torch.Tensor:
        """The n least recently used evictable slots."""
        return self._lowest(self.last, n, evictable)

    def check(self) -> None:
        """Timestamps never exceed the clock."""
        assert int(self.last.max()) <= self.clock if self.capacity else True
