"""Tier backends: cache slabs (device and host) and the LMDB SSD tier.

The classes are imported on first use, so a torch-free submodule (`lmdb_meta`) stays torch-free.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_LAZY = {"LmdbBackend": "lmdb_backend", "Rows": "slab", "SlabTier": "slab"}

__all__ = ["LmdbBackend", "Rows", "SlabTier"]

if TYPE_CHECKING:
    from .lmdb_backend import LmdbBackend
    from .slab import Rows, SlabTier


def __getattr__(name: str) -> Any:
    """A backend class, imported on first access."""
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    globals()[name] = value
    return value
