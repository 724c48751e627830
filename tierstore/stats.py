"""Counters reported by `TierStore.stats()`."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class TierStats:
    """Per-tier counters: lookups, hits, misses, insertions, evictions, write-backs, bytes."""

    lookups: int = 0
    hits: int = 0
    misses: int = 0
    insertions: int = 0
    evictions: int = 0
    writebacks: int = 0
    bytes_read: int = 0
    bytes_written: int = 0

    @property
    def hit_rate(self) -> float:
        """Hits over lookups (0 when nothing was looked up)."""
        return self.hits / self.lookups if self.lookups else 0.0

    def as_dict(self) -> dict:
        """The counters and the hit rate as a plain dict."""
        return {**asdict(self), "hit_rate": self.hit_rate}
