"""Tier backends: cache slabs (device and host) and the LMDB SSD tier."""

from .lmdb_backend import LmdbBackend
from .slab import Rows, SlabTier

__all__ = ["LmdbBackend", "Rows", "SlabTier"]
