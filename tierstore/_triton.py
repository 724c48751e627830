"""Triton launches while Triton runs its interpreter: one at a time (its grid state is global, so
two threads launching at once, the staging thread's cache kernels and the training thread's
engine, corrupt each other). On a GPU launches take no lock."""

from __future__ import annotations

import contextlib
import os
import threading

_LOCK = threading.RLock()


def launching() -> contextlib.AbstractContextManager:
    """The context a kernel launch runs in: the interpreter's lock, or nothing on a GPU."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return _LOCK
    return contextlib.nullcontext()
