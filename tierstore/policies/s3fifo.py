"""S3-FIFO: a small probationary FIFO, a main FIFO with reinsertion, 2-bit access counts."""

from __future__ import annotations

import torch

from .base import Policy

_SMALL, _MAIN = 0, 1
_CLASS = 1 << 58


class S3FIFO(Policy):
    """S3-FIFO (Yang et al., SOSP'23) for batched tiers, without the ghost queue.

    New slots enter the small queue (10% of capacity); a small-queue slot hit more than once
    moves to the main queue when the hand reaches it, the others are evicted. Main-queue slots
    are re-queued with their count decremented while it is positive. The tier gives a policy
    slots, not keys, so the ghost queue of evicted keys is left out (the exact simulator in
    `tierstore.sim` has it). A batch peek ranks slots by (class, count, queue stamp).
    """

    name = "s3fifo"
    small_fraction = 0.1
    move_threshold = 1  # a small-queue slot with count above this goes to main

    def __init__(self, capacity: int, device: torch.device | str = "cpu") -> None:
        super().__init__(capacity, device)
        self.queue = torch.zeros(self.capacity, dtype=torch.int8, device=self.device)
        self.freq = torch.zeros(self.capacity, dtype=torch.int64, device=self.device)
        self.queued = torch.zeros(self.capacity, dtype=torch.int64, device=self.device)
        self.live = torch.zeros(self.capacity, dtype=torch.bool, device=self.device)
        self.small_target = max(1, int(self.capacity * self.small_fraction))
        self.clock = 0

    def _key(self) -> torch.Tensor:
        small = self.queue == _SMALL
        n_small = int((small & self.live).sum())
        cold_small = small & (self.freq <= self.move_threshold)
        # small queue first when it is over its share, then main slots by remaining count
        cls = torch.where(small, 2 + self.freq, 1 + self.freq)
        cls = torch.where(cold_small, 0 if n_small > self.small_target else 1, cls)
        return cls * _CLASS + self.queued

    def on_hit(self, slots: torch.Tensor) -> None:
        """Count the access (saturating at 3)."""
        self.freq[slots] = (self.freq[slots] + 1).clamp(max=3)

    def on_insert(self, slots: torch.Tensor) -> None:
        """New slots join the small queue with a zero count."""
        self.queue[slots] = _SMALL
        self.freq[slots] = 0
        self.queued[slots] = self._stamps(slots.numel())
        self.live[slots] = True

    def on_evict(self, slots: torch.Tensor) -> None:
        """Promote hot small-queue slots and age main-queue slots that the hands passed."""
        if slots.numel() == 0:
            return
        small_ev = slots[self.queue[slots] == _SMALL]
        main_ev = slots[self.queue[slots] == _MAIN]
        self.live[slots] = False
        self.freq[slots] = 0
        if small_ev.numel():
            last = int(self.queued[small_ev].max())
            hot = self.live & (self.queue == _SMALL) & (self.freq > self.move_threshold)
            hot &= self.queued < last
            self._requeue(torch.nonzero(hot).flatten(), to_main=True)
        if main_ev.numel():
            last = int(self.queued[main_ev].max())
            aged = self.live & (self.queue == _MAIN) & (self.freq > 0) & (self.queued < last)
            aged_idx = torch.nonzero(aged).flatten()
            self.freq[aged_idx] -= 1
            self._requeue(aged_idx, to_main=True)
        self.queue[slots] = _SMALL
        self.queued[slots] = 0

    def _requeue(self, idx: torch.Tensor, to_main: bool) -> None:
        if idx.numel() == 0:
            return
        idx = idx[torch.sort(self.queued[idx], stable=True).indices]
        if to_main:
            self.queue[idx] = _MAIN
        self.queued[idx] = self._stamps(idx.numel())

    def victims(self, n: int, evictable: torch.Tensor) -> torch.Tensor:
        """Cold small-queue slots (first when the small queue is over its share), then main."""
        return self._lowest(self._key(), n, evictable)

    def check(self) -> None:
        """Counts stay in [0, 3]; dead slots carry no count."""
        assert bool(((self.freq >= 0) & (self.freq <= 3)).all())
        assert not bool(((self.freq > 0) & ~self.live).any())
