"""Look-ahead: evict by the next uses known within a window; another policy ranks the rest."""

from __future__ import annotations

import numpy as np
import torch

from .base import INT64_MAX, Evictable, Policy, as_evictable, as_numpy
from .lru import LRU

UNKNOWN = INT64_MAX


class Lookahead(Policy):
    """Belady within a look-ahead window, falling back to another policy outside it.

    Hints come from `on_future(slots, next_use)`: `next_use` is the absolute step (batch
    number) of the slot's next known use. A hit or an insert consumes the slot's hint, so
    the caller (the prefetch pipeline, or the trace benchmark) sends hints *after* a step's
    hits and inserts: for the rows of the step just served whose next use lies inside the
    window, and for resident rows of each batch that enters the window. Victims are first
    the slots with no known next use, in the fallback policy's order (its walk skips hinted
    slots), then the slots used farthest in the future (ties: lowest slot); that second
    stage sorts the hinted slots, so it costs O(capacity) when it runs.
    """

    name = "lookahead"
    wants_future = True

    def __init__(self, capacity: int, device: torch.device | str = "cpu",
                 fallback: Policy | None = None) -> None:
        super().__init__(capacity, device)
        # the registry builds a named fallback (`lookahead:NAME`); by default, LRU ranks the rest
        self.fallback = fallback if fallback is not None else LRU(capacity, device)
        self.fallback_name = self.fallback.name
        self.wants_keys = self.fallback.wants_keys
        self.next_use = np.full(self.capacity, UNKNOWN, dtype=np.int64)
        self.hinted = np.zeros(self.capacity, dtype=np.bool_)

    def _forget(self, s: np.ndarray) -> None:
        self.next_use[s] = UNKNOWN
        self.hinted[s] = False

    def on_hit(self, slots: torch.Tensor) -> None:
        """Consume the hints of used slots and tell the fallback policy."""
        self._forget(as_numpy(slots))
        self.fallback.on_hit(slots)

    def on_use(self, slots: torch.Tensor) -> None:
        """The hinted use happened: drop the hints (the fallback was told at staging)."""
        self._forget(as_numpy(slots))

    def on_insert(self, slots: torch.Tensor, keys: torch.Tensor | None = None) -> None:
        """New slots have no known next use until hinted."""
        self._forget(as_numpy(slots))
        self.fallback.on_insert(slots, keys)

    def on_evict(self, slots: torch.Tensor) -> None:
        """Unhinted victims were the fallback's choice; hinted ones are removals for it."""
        s = as_numpy(slots)
        hinted = self.hinted[s]
        self.fallback.on_evict(torch.from_numpy(s[~hinted]))
        if hinted.any():
            self.fallback.on_remove(torch.from_numpy(s[hinted]))
        self._forget(s)

    def on_remove(self, slots: torch.Tensor) -> None:
        """Forget removed slots."""
        self._forget(as_numpy(slots))
        self.fallback.on_remove(slots)

    def follow(self, upper: Policy) -> None:
        """The fallback follows the upper tier's policy (its fallback, if it looks ahead too)."""
        self.fallback.follow(upper.fallback if isinstance(upper, Lookahead) else upper)

    def on_future(self, slots: torch.Tensor, next_use: torch.Tensor) -> None:
        """Record the next known use (absolute step) of slots; the last hint for a slot wins."""
        s = as_numpy(slots)
        self.next_use[s] = as_numpy(next_use)
        self.hinted[s] = True

    def victims(self, n: int, evictable: Evictable | torch.Tensor) -> torch.Tensor:
        """Slots without a known next use (fallback order), then farthest next use first."""
        if n <= 0 or self.capacity == 0:
            return self._empty()
        ev = as_evictable(evictable)
        skip = self.hinted if not ev.skip.size else (self.hinted | ev.skip)
        first = self.fallback.victims(n, ev.with_skip(skip))
        if first.numel() >= n:
            return first
        idx = np.flatnonzero(self.hinted)
        idx = idx[ev.allows(idx)]
        idx = idx[np.lexsort((idx, -self.next_use[idx]))][: n - first.numel()]
        return torch.cat([first, self._out(idx)])

    def check(self) -> None:
        """The fallback policy's invariants hold; hints are non-negative and flagged."""
        assert bool((self.next_use >= 0).all())
        assert bool(((self.next_use != UNKNOWN) == self.hinted).all())
        self.fallback.check()
