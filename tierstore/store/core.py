"""Shared parts of the store package: format constants, the table record, the lock decorator."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import lmdb
import torch

from ..backends.lmdb_backend import lmdb_error
from ..backends.lmdb_meta import LAST_OPEN  # noqa: F401 (re-exported)
from ..config import TableSpec
from ..errors import ConfigError

# 2: rows carry a last-update stamp column and a checksum word; 3: the write-behind log lives in
# its own LMDB environment (`wlog/`), and the tables record the sequence number merged through
FORMAT_VERSION = 3
# on-disk versions whose tables hold rows this tierstore reads as they are (format 2 differs only
# in where the write-behind log lives; a writable open converts it in place, docs/persistence.md)
ROW_FORMATS = (2, 3)
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


@dataclass
class _Table:
    spec: TableSpec
    index: int
    key: int  # lazy-init key derived from (seed, name)
    tix: torch.Tensor = dataclasses.field(init=False, repr=False)  # `index` as a 0-d int64 tensor (tier key)
    # bumped by every update of the table's rows (`_stamp`, `_access`), and by whatever may change
    # how a row reads (the clock, expiry): a warm-only forward's copy is current while it holds
    writes: int = dataclasses.field(default=0, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.tix = torch.tensor(self.index, dtype=torch.int64)


def _locked(fn):
    """Serialize a store method with the store's lock (the prefetch thread shares the store)."""

    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        with self._exclusive():
            try:
                return fn(self, *args, **kwargs)
            except lmdb.Error as exc:  # every LMDB error leaves as a TierstoreError with the path
                raise lmdb_error(exc, self.path) from exc

    return wrapper


def _resolve_device(device: torch.device | str | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(f"invalid device {device!r}: {exc}") from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {device!r} requested but CUDA is not available")
    return dev
