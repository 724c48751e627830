"""Look-ahead: evict by the next uses known within a window; another policy ranks the rest."""

from __future__ import annotations

import torch

from .base import INT64_MAX, Policy

UNKNOWN = INT64_MAX


class Lookahead(Policy):
    """Belady within a look-ahead window, falling back to another policy outside it.

    Hints come from `on_future(slots, next_use)`: `next_use` is the absolute step (batch
    number) of the slot's next known use. A hit or an insert consumes the slot's hint, so
    the caller (the prefetch pipeline, or the trace benchmark) sends hints *after* a step's
    hits and inserts: for the rows of the step just served whose next use lies inside the
    window, and for resident rows of each batch that enters the window. Victims are first
    the slots with no known next use, in the fallback policy's order, then the slots used
    farthest in the future (ties: lowest slot).
    """

    name = "lookahead"
    wants_future = True
    default_fallback = "lru"

    def __init__(self, capacity: int, device: torch.device | str = "cpu",
                 fallback: str | None = None) -> None:
        super().__init__(capacity, device)
        from . import make_policy  # the registry imports this module

        self.fallback_name = fallback or self.default_fallback
        self.fallback = make_policy(self.fallback_name, capacity, device)
        self.next_use = torch.full((self.capacity,), UNKNOWN, dtype=torch.int64,
                                   device=self.device)

    def on_hit(self, slots: torch.Tensor) -> None:
        """Consume the hints of used slots and tell the fallback policy."""
        self.next_use[slots] = UNKNOWN
        self.fallback.on_hit(slots)

    def on_insert(self, slots: torch.Tensor) -> None:
        """New slots have no known next use until hinted."""
        self.next_use[slots] = UNKNOWN
        self.fallback.on_insert(slots)

    def on_evict(self, slots: torch.Tensor) -> None:
        """Forget hints of emptied slots."""
        self.next_use[slots] = UNKNOWN
        self.fallback.on_evict(slots)

    def on_future(self, slots: torch.Tensor, next_use: torch.Tensor) -> None:
        """Record the next known use (absolute step) of slots; the last hint for a slot wins."""
        self.next_use[slots] = next_use.to(device=self.device, dtype=torch.int64)

    def victims(self, n: int, evictable: torch.Tensor) -> torch.Tensor:
        """Slots without a known next use (fallback order), then farthest next use first."""
        if n <= 0:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        unknown = evictable & (self.next_use == UNKNOWN)
        n_unknown = int(unknown.sum())
        first = self.fallback.victims(min(n, n_unknown), unknown)
        if n_unknown >= n:
            return first
        rest = self._lowest(-self.next_use, n - n_unknown, evictable & ~unknown)
        return torch.cat([first, rest])

    def check(self) -> None:
        """The fallback policy's invariants hold; hints are non-negative."""
        assert bool((self.next_use >= 0).all())
        self.fallback.check()
