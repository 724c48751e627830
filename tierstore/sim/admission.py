"""Feature admission in the policy benchmark: which requests of a trace reach the caches."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..admission import CountMinSketch, parse_admission


@dataclass
class AdmittedTrace:
    """A trace's admitted requests (what the caches see) and what admission saved."""

    spec: str
    ids: np.ndarray  # the admitted requests, in order
    requests: int  # all requests
    distinct: int  # distinct keys of the whole trace: rows stored without admission
    rows_stored: int  # distinct admitted keys: rows stored with admission

    def fields(self, misses: int) -> dict:
        """Extra record fields for one simulation run over the admitted requests."""
        return {"admission": self.spec, "requests_total": self.requests,
                "rows_stored": self.rows_stored, "rows_stored_without": self.distinct,
                "miss_ratio_all": misses / self.requests if self.requests else 0.0}


def admit_trace(spec: str | None, ids: np.ndarray, batch_size: int) -> AdmittedTrace | None:
    """Run a trace through the store's admission sketch in batches; None without `spec`."""
    if not spec:
        return None
    cfg = parse_admission(spec)
    sketch = CountMinSketch(int(cfg.sketch), cfg.depth, cfg.min_count, salt=0x5EED)
    keep = np.zeros(ids.size, dtype=bool)
    for lo in range(0, ids.size, batch_size):  # one store call per batch
        part = ids[lo: lo + batch_size].astype(np.int64)
        uniq, inv, cnt = np.unique(part, return_inverse=True, return_counts=True)
        final, _ = sketch.add(uniq, cnt)
        keep[lo: lo + part.size] = (final >= cfg.min_count)[inv]
    admitted = ids[keep]
    return AdmittedTrace(spec, admitted, int(ids.size), int(np.unique(ids).size),
                         int(np.unique(admitted).size))
