"""The policy protocol: a policy ranks eviction victims among a tier's slots; the tier evicts."""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import torch

INT64_MAX = torch.iinfo(torch.int64).max


class Policy:
    """Base class of the tier eviction policies; state is per slot and owned by the policy.

    The tier calls `on_hit` / `on_insert` with batches of slot indices (int64, in access
    order), `victims(n, evictable)` to peek at the `n` slots it should evict next (a pure
    query: state does not change), then `on_evict` for the slots it really evicted.
    `on_future` hands look-ahead hints (the step of each slot's next known use) to policies
    that want them; others ignore it.
    """

    name: ClassVar[str] = ""
    wants_future: ClassVar[bool] = False  # True for policies that use `on_future` hints

    def __init__(self, capacity: int, device: torch.device | str = "cpu") -> None:
        self.capacity = int(capacity)
        self.device = torch.device(device)

    def on_hit(self, slots: torch.Tensor) -> None:
        """Record accesses to resident slots, in order."""

    def on_insert(self, slots: torch.Tensor) -> None:
        """Record newly filled slots, in order."""

    def on_evict(self, slots: torch.Tensor) -> None:
        """Forget the state of slots that were just emptied."""

    def on_future(self, slots: torch.Tensor, next_use: torch.Tensor) -> None:
        """Receive the next known use (a step number) of slots; default: ignore."""

    def victims(self, n: int, evictable: torch.Tensor) -> torch.Tensor:
        """Return `n` distinct slots to evict among those where `evictable` is True."""
        raise NotImplementedError

    def check(self) -> None:
        """Raise AssertionError if the policy's internal invariants do not hold."""

    # helpers shared by policies -------------------------------------------------------
    def _lowest(self, key: torch.Tensor, n: int, evictable: torch.Tensor) -> torch.Tensor:
        """Return the `n` evictable slots with the smallest `key` (ties: lowest slot)."""
        if n <= 0:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        masked = torch.where(evictable, key, INT64_MAX)
        if n * 8 >= masked.numel():
            order = torch.sort(masked, stable=True).indices[:n]
        else:
            # topk does not promise a tie order: re-sort the winners by (key, slot)
            cand = torch.topk(masked, n, largest=False, sorted=False).indices
            cand = cand.sort().values
            order = cand[torch.sort(masked[cand], stable=True).indices]
        return order

    def _lowest_lex(self, keys: list[torch.Tensor], n: int,
                    evictable: torch.Tensor) -> torch.Tensor:
        """Return the `n` evictable slots smallest by the key tuple (most significant first).

        Ties after the last key go to the lowest slot. Used when keys do not pack into one int64.
        """
        if n <= 0:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        idx = torch.nonzero(evictable).flatten()
        for key in reversed(keys):
            idx = idx[torch.sort(key[idx], stable=True).indices]
        return idx[:n]

    def _stamp(self, key: torch.Tensor, slots: torch.Tensor) -> None:
        """Write the next `len(slots)` clock stamps into `key[slots]`, in order."""
        n = slots.numel()
        if key.device.type != "cpu" or slots.device.type != "cpu":
            key[slots] = self._stamps(n)
            return
        clock = getattr(self, "clock", 0)
        key.numpy()[slots.numpy()] = np.arange(clock + 1, clock + 1 + n)  # less overhead than torch
        self.clock = clock + n

    def _stamps(self, n: int) -> torch.Tensor:
        """Advance the policy's access clock by `n` and return the `n` new stamps."""
        clock = getattr(self, "clock", 0)
        out = torch.arange(clock + 1, clock + 1 + n, dtype=torch.int64, device=self.device)
        self.clock = clock + n
        return out
