"""Shared parts of the store package: format constants, the table record, the lock decorator."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import lmdb
import torch

from ..backends.format import FORMAT_VERSION as FORMAT_VERSION  # re-exported
from ..backends.format import ROW_FORMATS as ROW_FORMATS  # re-exported
from ..backends.lmdb_backend import lmdb_error
from ..backends.lmdb_meta import LAST_LAYOUT, LAST_OPEN  # noqa: F401 (re-exported)
from ..config import TableSpec

CLOCK_MAX = 2**31 - 1  # stamps are int32 bits in a float32 payload column
# bytes per write-behind ring row besides its payload: the ring's index and bookkeeping, and the
# log index (LOG_RINGS = 8 log entries per ring row, ~30 B each)
WB_SLOT_OVERHEAD = 280
FLUSH_CHUNK = 65536  # rows per LMDB transaction when flushing
LOG_RINGS = 8  # the write-behind log holds at least this many rings of rows; its older half is merged at 3/4
# with the default write buffer, up to half the declared rows, at most LOG_MAX_ROWS: a larger log
# merges more rows into each table leaf page, and more of its rows are superseded before a merge
# (docs/design.md, "Merge density"). 3 * 2**20 rows fill the same power-of-two hash table as 2**21.
LOG_MAX_ROWS = 3 << 20
# chunked tables (format 4) of wide rows (log entries of LOG_WIDE_ENTRY bytes or more): up to
# twice that. Their log is bounded by the disk budget (wal/budget.py), which lets a log near half
# of an 8 M-row table of dense chunks: merges copy fewer rows a row fed. The index costs ~37
# bytes a row of capacity (224 MiB here against 112): under a seventh of the entries it indexes
# when they are wide; narrow rows' tables (1.4x at dim 16) leave the budget a shorter log anyway.
LOG_MAX_CHUNK_ROWS = 3 << 21
LOG_WIDE_ENTRY = 256


@dataclass
class _Table:
    spec: TableSpec
    index: int
    key: int  # lazy-init key derived from (seed, name)
    tix: torch.Tensor = dataclasses.field(init=False, repr=False)  # `index` as a 0-d int64 tensor (tier key)
    # bumped by every update of the table's rows (`_stamp`, `Cascade.access`), and by whatever may change
    # how a row reads (the clock, expiry): a warm-only forward's copy is current while it holds
    writes: int = dataclasses.field(default=0, init=False, repr=False, compare=False)
    # 16-bit tables: update calls so far, the stochastic-rounding salt (saved with the clock)
    updates: int = dataclasses.field(default=0, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.tix = torch.tensor(self.index, dtype=torch.int64)


def _locked(fn):
    """Serialize a store method with the store's lock (the prefetch thread shares the store)."""

    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        with self.exclusive():
            try:
                return fn(self, *args, **kwargs)
            except lmdb.Error as exc:  # every LMDB error leaves as a TierstoreError with the path
                raise lmdb_error(exc, self.path) from exc

    return wrapper
