"""CPU time per (thread, method) of the store's miss path and its background I/O, by `time.thread_time`.

A sampling profiler (py-spy, cProfile across threads) counts a thread that waits for a core as
busy, so on a loaded 2-core machine its percentages overstate whichever thread the scheduler
starves. `CallTimer` wraps a fixed list of methods instead and adds each call's own thread CPU
time to a (thread, method) total: inclusive times (a caller's total holds its callees'), exact
per thread, ~1 us of overhead a call. `bench.steady --calls` uses it.
"""

from __future__ import annotations

import functools
import os
import re
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from tierstore.backends.lmdb_log import LogIO
from tierstore.backends.lmdb_tables import TableRows
from tierstore.backends.slab import SlabTier
from tierstore.backends.wal.writelog import WriteLog
from tierstore.bagpaths import BagPaths
from tierstore.cascade import Cascade
from tierstore.index import HashIndex
from tierstore.pinned import StagingArea
from tierstore.policies.base import Policy, QueuePolicy
from tierstore.prefetch.pipeline import Prefetcher
from tierstore.stored_rows import RowLoader

# (class, method) pairs: the pipeline's two phases, staging, the cascade's miss path, the
# tiers' operations and the policy calls they make; the writer's log appends, the merges (the
# merger's, and the writer's own when the log is full), LMDB table reads, puts and commits
TARGETS: tuple[tuple[type, str], ...] = (
    (Prefetcher, "prepare_batch"), (Prefetcher, "finish_batch"),
    (StagingArea, "stage_many"), (BagPaths, "step_forward"), (BagPaths, "step_backward"),
    (StagingArea, "drain_hits"), (StagingArea, "drain_unpins"), (StagingArea, "pin"),
    (StagingArea, "_expire_scratch"),
    (Cascade, "access"), (Cascade, "_read_in_place"), (Cascade, "_fetch_misses"),
    (Cascade, "place"), (Cascade, "uncached"), (Cascade, "write_down"),
    (RowLoader, "load"), (RowLoader, "load_many"), (RowLoader, "read_stored"),
    (SlabTier, "lookup"), (SlabTier, "touch"), (SlabTier, "pin"), (SlabTier, "insert"),
    (SlabTier, "remove"), (SlabTier, "_evict"), (SlabTier, "_fill"), (SlabTier, "_take"),
    (SlabTier, "_release"), (SlabTier, "admit"),
    (SlabTier, "insert_scratch"), (SlabTier, "take_expired"),
    (QueuePolicy, "victims"), (Policy, "on_hit"), (Policy, "on_insert"),
    (HashIndex, "find"), (HashIndex, "add"), (HashIndex, "remove"),
    (WriteLog, "append"), (WriteLog, "_merge"), (WriteLog, "read_entries"), (LogIO, "append_log"),
    (TableRows, "get"), (TableRows, "put"), (TableRows, "_commit"),
)


class CallTimer:
    """Wraps TARGETS while active; `totals()` gives CPU seconds and calls per (thread, method)."""

    def __init__(self, targets: tuple[tuple[type, str], ...] = TARGETS) -> None:
        self.targets = targets
        self._saved: list[tuple[type, str, Any]] = []
        self._lock = threading.Lock()
        self._seconds: dict[tuple[str, str], float] = defaultdict(float)
        self._calls: dict[tuple[str, str], int] = defaultdict(int)

    def __enter__(self) -> CallTimer:
        for cls, name in self.targets:
            self._saved.append((cls, name, cls.__dict__[name]))
            setattr(cls, name, self._wrap(cls, name, cls.__dict__[name]))
        self._wrap_overrides()
        return self

    def __exit__(self, *exc: object) -> None:
        for cls, name, fn in reversed(self._saved):
            setattr(cls, name, fn)
        self._saved.clear()

    def _wrap_overrides(self) -> None:
        """Policy hooks are overridden per policy: wrap every subclass's own on_hit / on_insert."""
        for base, name in ((Policy, "on_hit"), (Policy, "on_insert")):
            stack = list(base.__subclasses__())
            while stack:
                cls = stack.pop()
                stack.extend(cls.__subclasses__())
                if name in cls.__dict__:
                    self._saved.append((cls, name, cls.__dict__[name]))
                    setattr(cls, name, self._wrap(cls, name, cls.__dict__[name]))

    def _wrap(self, cls: type, name: str, fn: Callable) -> Callable:
        label = f"{cls.__name__}.{name}"
        tier = cls is SlabTier

        @functools.wraps(fn)
        def timed(obj, *args, **kwargs):
            t0 = time.thread_time()
            try:
                return fn(obj, *args, **kwargs)
            finally:
                spent = time.thread_time() - t0
                key = (pool_name(threading.current_thread().name), f"{label}[{obj.name}]" if tier else label)
                with self._lock:
                    self._seconds[key] += spent
                    self._calls[key] += 1

        return timed

    def reset(self) -> None:
        """Forget what was counted so far (after a warm-up)."""
        with self._lock:
            self._seconds.clear()
            self._calls.clear()

    def totals(self) -> list[dict]:
        """One record per (thread, method): CPU seconds and calls, largest first."""
        with self._lock:
            rows = [{"thread": t, "method": m, "cpu_s": s, "calls": self._calls[(t, m)]}
                    for (t, m), s in self._seconds.items()]
        return sorted(rows, key=lambda r: -r["cpu_s"])


def pool_name(name: str) -> str:
    """A thread's name with its pool number dropped (the reader pool reports as one thread)."""
    return re.sub(r"[-_ ]?\d+$", "", name)


def thread_cpu() -> dict[tuple[int, str], float]:
    """CPU seconds of each live thread of this process, keyed by (native id, thread name); empty
    where /proc/self/task is missing (not Linux)."""
    if not os.path.isdir("/proc/self/task"):
        return {}
    names = {t.native_id: t.name for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        name = pool_name(names.get(int(tid), "other"))
        out[(int(tid), name)] = (int(fields[11]) + int(fields[12])) / tick
    return out
