"""FIFO: evict the slot inserted longest ago; hits change nothing."""

from __future__ import annotations

import torch

from .base import Policy


class FIFO(Policy):
    """First in, first out by insertion stamp."""

    name = "fifo"

    def __init__(self, capacity: int, device: torch.device | str = "cpu") -> None:
        super().__init__(capacity, device)
        self.born = torch.zeros(self.capacity, dtype=torch.int64, device=self.device)
        self.clock = 0

    def on_insert(self, slots: torch.Tensor) -> None:
        """Stamp new slots with their insertion order."""
        self.born[slots] = self._stamps(slots.numel())

    def on_evict(self, slots: torch.Tensor) -> None:
        """Clear the stamps of emptied slots."""
        self.born[slots] = 0

    def victims(self, n: int, evictable: torch.Tensor) -> torch.Tensor:
        """The n oldest evictable slots."""
        return self._lowest(self.born, n, evictable)

    def check(self) -> None:
        """Stamps never exceed the clock."""
        assert self.capacity == 0 or int(self.born.max()) <= self.clock
