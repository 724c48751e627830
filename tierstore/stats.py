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


@dataclass
class PrefetchStats:
    """Counters of the prefetch pipeline: stalls, staged rows per source tier, hit rate."""

    batches: int = 0
    warm_only: int = 0  # batches whose window could not stay cached: LMDB pages warmed, no pins
    stall_seconds: float = 0.0
    rows_staged: int = 0
    staged_from_host: int = 0
    staged_from_ssd: int = 0
    rows_used: int = 0
    rows_resident_at_use: int = 0
    rows_read_ahead_from_ssd: int = 0  # rows the pipeline's threads read from LMDB ahead of use
    rows_read_ahead: int = 0  # rows served to the store from the pipeline's read-ahead buffers
    read_seconds: float = 0.0  # pipeline threads reading LMDB (off the training thread)
    stage_seconds: float = 0.0  # staging time spent holding the store lock

    def as_dict(self) -> dict:
        """The counters plus the prefetch hit rate (rows resident when their batch ran)."""
        rate = self.rows_resident_at_use / self.rows_used if self.rows_used else 0.0
        return {**self.__dict__, "hit_rate": rate}
