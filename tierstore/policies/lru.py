"""LRU: evict the slot whose last access is oldest."""

from __future__ import annotations

import torch

import tierstore.policies.queues as q

from .base import QueuePolicy, as_numpy


class LRU(QueuePolicy):
    """Least recently used: one queue, a hit moves the slot to the newest end."""

    name = "lru"

    def on_hit(self, slots: torch.Tensor) -> None:
        """Hit slots become most recent, in access order."""
        q.push_many(self.state, self.capacity, 0, as_numpy(slots))

    def on_insert(self, slots: torch.Tensor, keys: torch.Tensor | None = None) -> None:
        """Inserted slots become most recent."""
        q.push_many(self.state, self.capacity, 0, as_numpy(slots))
