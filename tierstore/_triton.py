"""Triton launches, one at a time in the process.

Under Triton's interpreter the grid state is global, so two threads launching at once (the
staging thread's cache kernels and the training thread's engine) corrupt each other. On a GPU
Triton's runtime is not documented as thread-safe either (its first launch of a kernel compiles
and loads it into caches shared by every thread; FlagGems serializes its JIT entry for that
reason), and the same two threads launch there. A launch is asynchronous and takes microseconds,
so one lock for every launch costs nothing that counts; a first compile holds it for seconds,
once per kernel variant.
"""

from __future__ import annotations

import contextlib
import threading

_LOCK = threading.RLock()


def launching() -> contextlib.AbstractContextManager:
    """The context a kernel launch runs in: the process's Triton lock."""
    return _LOCK
