"""TierStore's introspection: per-tier stats, memory against its budget, the invariant check."""

from __future__ import annotations

from .core import _locked


class StoreMetrics:
    """What a store reports about itself: `stats`, `memory`, and `check` for tests."""

    @_locked
    def stats(self) -> dict[str, dict]:
        """Per-tier counters (device, host, ssd) plus store totals."""
        self.check_live()
        out = {"device": self.device_tier.stats.as_dict(), "host": self.host_tier.stats.as_dict(),
               "ssd": self.ssd_stats.as_dict()}
        out["device"].update(capacity=self.device_tier.capacity, resident=self.device_tier.size,
                             staging=self.device_tier.staging,
                             staging_active=self.device_tier.scratch_slots if self.device_tier.staging else 0)
        out["layout"] = self.layout.as_dict()  # what the store resolved its capacities into, and why
        out["layout"].update(device_cache=self.device_cache, device_policy=self.device_tier.policy.name,
                             device_direct=self.device_tier.direct)
        out["host"].update(capacity=self.host_tier.capacity, resident=self.host_tier.size)
        out["prefetch"] = self.prefetch_stats.as_dict()
        log = self.log
        out["writeback"] = {**self.writeback.stats(), "log_rows": log.size,
                            "log_appended": log.rows_appended, "log_merged": log.rows_merged,
                            "log_chunks": log.chunks_appended,
                            "log_background_merges": log.background_merges}
        if self.gate.states:
            out["admission"] = {n: a.stats() for n, a in self.gate.states.items()}
        out["expiry"] = self.expiry.stats()
        data, log = self.backend.data_bytes(), self.backend.log_bytes()
        out["ssd"].update(rows_stored=sum(self.backend.count(n) for n in self.tables),
                          disk_bytes=data + log, data_bytes=data, log_bytes=log,
                          **self.backend.tree_pages(list(self.tables)))
        # how each table keeps its rows: "chunks" (format 4) or "btree" (format 3, or a table
        # of a chunked store whose rows are too wide for a chunk)
        out["ssd"]["table_formats"] = {n: "chunks" if self.backend.is_chunked(n) else "btree"
                                       for n in self.tables}
        return out

    def memory(self) -> dict[str, int]:
        """The process's anonymous resident bytes next to the store's own memory budget.

        The budget is what the configured capacities allocate: both slabs, the write-behind
        ring, their hash indexes and per-slot bookkeeping, and the write-behind log's index.
        Pages of the LMDB map are the kernel's page cache (file-backed), reported separately.
        """
        budget = 0
        for tier in (self.device_tier, self.host_tier):
            if tier.device.type == "cpu":  # reserved staging slots are unwritten until active
                budget += tier.usable * tier.width * tier.slab.element_size()
            budget += tier.index.table.nbytes + tier.slots * 64  # index + bookkeeping bound
        wb = self.writeback
        budget += wb.payload.nbytes + wb.index.table.nbytes + wb.capacity * 40
        budget += self.log.index_bytes
        status = _proc_status()
        return {"anon_rss_bytes": status.get("RssAnon", 0), "file_rss_bytes": status.get("RssFile", 0),
                "budget_bytes": budget}

    @_locked
    def check(self) -> None:
        """Assert internal invariants (tiers consistent, caches exclusive); for tests."""
        self.check_live()
        self.device_tier.check()
        self.host_tier.check()
        dt, dr = self.device_tier.resident()
        if dr.numel():
            both = self.host_tier.index.find(dt.cpu(), dr.cpu())
            assert bool((both < 0).all()), "a row is cached in both device and host tiers"


def _proc_status() -> dict[str, int]:
    """Byte counts from /proc/self/status (Linux; empty elsewhere)."""
    out = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                parts = line.split()
                if len(parts) == 3 and parts[2] == "kB":
                    out[parts[0].rstrip(":")] = int(parts[1]) * 1024
    except OSError:
        pass
    return out
