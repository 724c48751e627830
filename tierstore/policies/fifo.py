"""FIFO: evict the slot inserted longest ago; hits change nothing."""

from __future__ import annotations

import torch

import tierstore.policies.queues as q

from .base import QueuePolicy, as_numpy


class FIFO(QueuePolicy):
    """First in, first out: one queue in insertion order."""

    name = "fifo"

    def on_insert(self, slots: torch.Tensor, keys: torch.Tensor | None = None) -> None:
        """New slots join the newest end of the queue."""
        q.push_many(self.state, self.capacity, 0, as_numpy(slots))
