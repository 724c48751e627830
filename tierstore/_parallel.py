"""Split a nogil numba kernel's index range over threads (torch's intra-op thread count).

The kernels release the GIL and write disjoint outputs per index (a bag's pooled row, a unique
row's payload, a key's slot), so running index ranges on several threads gives the same bits
as one thread. A small shared thread pool avoids numba's own threading layers, which are not
safe to enter from several Python threads at once (the prefetch thread is one).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

MIN_CHUNK = 2048  # indices per thread below which splitting costs more than it saves
PARALLEL_IDS = 1 << 16  # ids in a batch from which its tables (or features) go to several threads
CPUS = os.cpu_count() or 1  # read once: os.cpu_count() costs tens of microseconds a call

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _executor() -> ThreadPoolExecutor:
    """The process-wide worker pool (created on first use)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=max(1, CPUS - 1),
                                       thread_name_prefix="tierstore-kernel")
        return _pool


def parallel_for(fn: Callable[[int, int], object], n: int, min_chunk: int = MIN_CHUNK) -> None:
    """Call fn(lo, hi) over [0, n) in up to torch.get_num_threads() contiguous chunks."""
    if n < 2 * min_chunk:
        fn(0, n)
        return
    threads = min(torch.get_num_threads(), CPUS, n // min_chunk)
    if threads <= 1:
        fn(0, n)
        return
    bounds = [n * k // threads for k in range(threads + 1)]
    futures = [_executor().submit(fn, bounds[k], bounds[k + 1]) for k in range(1, threads)]
    fn(bounds[0], bounds[1])  # this thread takes the first chunk
    for f in futures:
        f.result()
