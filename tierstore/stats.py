"""Counters reported by `TierStore.stats()`, and the one way to print them.

Definitions (the same in `stats()`, the demo's progress bar and its final table):
- a cache tier's `lookups` are the distinct rows of a batch asked of it (the host tier is asked
  for the device tier's misses), `hit_rate` = hits / lookups since the store was opened (one
  exception: `read`'s all-resident fast path counts every id, duplicates included);
- the SSD tier (LMDB) never misses: a row it has not stored is initialized lazily. It reports
  `rows_read` (stored rows read), `rows_initialized` (never-written rows created from the seed)
  and `rows_written` (rows written back), not a hit rate.
"""


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
    scratch_rows: int = 0  # rows staged in the scratch pad (refused by the policy; device tier)

    def count_lookups(self, n: int, hits: int) -> None:
        """Add `n` lookups, `hits` of which hit."""
        self.lookups += n
        self.hits += hits
        self.misses += n - hits

    @property
    def hit_rate(self) -> float:
        """Hits over lookups (0 when nothing was looked up)."""
        return self.hits / self.lookups if self.lookups else 0.0

    def as_dict(self) -> dict:
        """The counters and the hit rate as a plain dict."""
        return {**asdict(self), "hit_rate": self.hit_rate}


@dataclass
class SsdStats(TierStats):
    """The LMDB tier's counters: rows read, rows initialized lazily, rows written (no hit rate)."""

    def as_dict(self) -> dict:
        """The counters plus `rows_read`, `rows_initialized` and `rows_written`."""
        return {**asdict(self), "rows_read": self.hits, "rows_initialized": self.misses,
                "rows_written": self.writebacks}


def progress_line(stats: dict) -> str:
    """The tier part of a progress bar: cache hit rates and the SSD tier's rows read / written."""
    d, h, s = stats["device"], stats["host"], stats["ssd"]
    return (f"hit dev {d['hit_rate']:.3f} host {h['hit_rate']:.3f}, "
            f"ssd read {_si(s['rows_read'])} written {_si(s['rows_written'])}")


def tier_table(stats: dict) -> list[str]:
    """The final per-tier table: caches with hit rates, then the SSD tier's row counts."""
    lines = [f"{'tier':<8} {'capacity':>10} {'resident':>10} {'lookups':>12} {'hits':>12} "
             f"{'hit rate':>9} {'evictions':>10} {'writebacks':>11}"]
    for name in ("device", "host"):
        t = stats[name]
        lines.append(f"{name:<8} {t['capacity']:>10,} {t['resident']:>10,} {t['lookups']:>12,} "
                     f"{t['hits']:>12,} {t['hit_rate']:>9.3f} {t['evictions']:>10,} "
                     f"{t['writebacks']:>11,}")
    s = stats["ssd"]
    lines.append(f"{'ssd':<8} rows read {s['rows_read']:,}, initialized lazily (never written) "
                 f"{s['rows_initialized']:,}, written {s['rows_written']:,}")
    return lines


def _si(n: int) -> str:
    """A count in k/M/G for a progress bar."""
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(n)


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
    # batches read with many reads in flight (the reads before them waited on the disk)
    cold_read_batches: int = 0
    stage_seconds: float = 0.0  # staging time spent holding the store lock
    lock_free_bags: int = 0  # bag lookups (and their updates) served from pinned slots, lock-free
    # direct steps (a device cache with a line for every row) whose slots and keyed batch the
    # pipeline made ahead (`Prefetcher` over a collection: `prepare_step`)
    steps_made_ahead: int = 0
    # tables of a locked step (another table's rows could not all be staged) still read from
    # the slots staging pinned them in
    staged_bags_locked: int = 0
    # the most rows a window held with the batch being read (unique rows, summed per batch): a
    # window stays pinned while this fits the caches (twice over), or the cache plus its
    # staging slots (once, with `staging_capacity`); what to size `staging_capacity` by
    window_rows: int = 0
    # batches read ahead beyond the one being staged (while reads are cold the pipeline reads
    # further ahead, within `Prefetcher(read_ahead_bytes=...)`): the most at once, and the most
    # bytes (ids plus rows read) all batches read ahead held
    reads_ahead_peak: int = 0
    read_ahead_bytes_peak: int = 0

    def as_dict(self) -> dict:
        """The counters plus the prefetch hit rate (rows resident when their batch ran)."""
        rate = self.rows_resident_at_use / self.rows_used if self.rows_used else 0.0
        return {**self.__dict__, "hit_rate": rate}
