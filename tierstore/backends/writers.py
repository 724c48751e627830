"""The LMDB environments this process has open for writing, so a reader of the same file can find them."""

from __future__ import annotations

import os
import weakref
from pathlib import Path
from typing import Any

_WRITERS: weakref.WeakSet = weakref.WeakSet()


def register(backend: Any) -> None:
    """Record a backend opened for writing (until `unregister` or its collection)."""
    _WRITERS.add(backend)


def unregister(backend: Any) -> None:
    """Forget a backend that closed."""
    _WRITERS.discard(backend)


def live_writer(path: Path) -> Any:
    """The open writing backend on the store directory `path` in this process, else None."""
    for backend in list(_WRITERS):
        if getattr(backend, "env", None) is None:
            continue
        try:
            if os.path.samefile(backend.path, path):
                return backend
        except OSError:
            continue
    return None
