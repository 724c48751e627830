"""SIEVE: FIFO order, visited bits, and a hand sweeping from old to new that never moves slots."""

from __future__ import annotations

import torch

from .base import Policy

_ROUND = 1 << 60


class Sieve(Policy):
    """SIEVE (Zhang et al., NSDI'24): hits set a bit; the hand clears set bits and evicts the rest.

    The hand is kept as a queue stamp. A slot's eviction round in a batch peek is
    `visited + (stamp < hand)`, so the victims are the smallest (round, stamp) pairs: exact.
    """

    name = "sieve"

    def __init__(self, capacity: int, device: torch.device | str = "cpu") -> None:
        super().__init__(capacity, device)
        self.queued = torch.zeros(self.capacity, dtype=torch.int64, device=self.device)
        self.visited = torch.zeros(self.capacity, dtype=torch.bool, device=self.device)
        self.live = torch.zeros(self.capacity, dtype=torch.bool, device=self.device)
        self.hand = 0
        self.clock = 0

    def _key(self) -> torch.Tensor:
        rounds = self.visited.long() + (self.queued < self.hand).long()
        return self.queued + rounds * _ROUND

    def on_hit(self, slots: torch.Tensor) -> None:
        """Mark the slots visited."""
        self.visited[slots] = True

    def on_insert(self, slots: torch.Tensor) -> None:
        """New slots join the head of the queue, unvisited."""
        self.queued[slots] = self._stamps(slots.numel())
        self.visited[slots] = False
        self.live[slots] = True

    def on_evict(self, slots: torch.Tensor) -> None:
        """Move the hand past the last evicted slot, clearing the visited bits it swept."""
        if slots.numel() == 0:
            return
        key = self._key()
        last = int(key[slots].max())
        self.live[slots] = False
        self.visited[slots] = False
        # a visited slot is cleared one round before it would be evicted
        swept = self.live & self.visited & (key - _ROUND < last)
        self.visited[swept] = False
        self.queued[slots] = 0
        # past the newest slot the hand restarts at the oldest one
        newest = int(self.queued.masked_fill(~self.live, -1).max()) if self.capacity else -1
        self.hand = 0 if last % _ROUND >= newest else last % _ROUND + 1

    def victims(self, n: int, evictable: torch.Tensor) -> torch.Tensor:
        """The next n unvisited slots the hand reaches (wrapping around as needed)."""
        return self._lowest(self._key(), n, evictable)

    def check(self) -> None:
        """Dead slots are unvisited; the hand never passes the clock."""
        assert not bool((self.visited & ~self.live).any())
        assert self.hand <= self.clock + 1
