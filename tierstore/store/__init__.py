"""The tiered store: device cache -> host cache -> LMDB, lazy rows, fused optimizer updates."""

# TierStore (handle.py) is assembled from mixins by concept: rows.py (the row API), opening.py
# (config checks, open), lifecycle.py (flush, checkpoint, close), clock.py (clock, expiry),
# metrics.py (stats, memory, check); core.py holds the constants and helpers they share. The store
# owns its parts (loader, cascade, staging area, access gate, bag paths) and reaches them by public names.
# handle.py reads HAVE_NUMBA from this module, so that patching tierstore.store.HAVE_NUMBA works.

from .._kernels import HAVE_NUMBA
from ..bagpaths import Gathered
from .core import (
    CLOCK_MAX,
    FLUSH_CHUNK,
    FORMAT_VERSION,
    LAST_LAYOUT,
    LAST_OPEN,
    LOG_MAX_CHUNK_ROWS,
    LOG_MAX_ROWS,
    LOG_RINGS,
    LOG_WIDE_ENTRY,
    ROW_FORMATS,
    WB_SLOT_OVERHEAD,
    _locked,
    _Table,
)
from .handle import TierStore
from .lifecycle import _OPEN_STORES, _close_open_stores, _weak_context
from .metrics import _proc_status
from .opening import _mismatch, _open_readonly, old_format_message, open_tables, stored_config

__all__ = [
    "TierStore", "Gathered", "HAVE_NUMBA", "FORMAT_VERSION", "ROW_FORMATS", "CLOCK_MAX", "WB_SLOT_OVERHEAD",
    "FLUSH_CHUNK", "LOG_RINGS", "LOG_MAX_ROWS", "LOG_MAX_CHUNK_ROWS", "LOG_WIDE_ENTRY",
    "LAST_OPEN", "LAST_LAYOUT",
    "_OPEN_STORES", "_Table",
    "_locked", "_mismatch", "_open_readonly", "_weak_context", "_proc_status",
    "_close_open_stores", "old_format_message", "stored_config", "open_tables",
]
