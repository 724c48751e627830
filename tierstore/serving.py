"""Read-only handles on a live store: the writer's last flushed state, with a host cache of hot rows.

A `ReadOnlyStore` works in any process while one writer (a `TierStore`) has the store open. It
reads LMDB only through `backends.snapshot.SnapshotReader`: one MVCC snapshot, which holds the
state of the writer's last `flush()` / `checkpoint()` (see docs/serving.md), until `refresh()`
moves it to the newest flushed state. It never takes the writer lock and never blocks the
writer. Opened on a quantized export (`tierstore export --dtype int8|int4`), it dequantizes rows
to float32 on read.
"""

from __future__ import annotations

import fcntl
import os
import threading
import time
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import torch

import tierstore.validate as validate

from .backends.lmdb_backend import DATA_NAME, LOCK_NAME
from .backends.publish import READERS_LOCK
from .backends.slab import Rows, SlabTier
from .backends.snapshot import Snapshot, SnapshotLostError, SnapshotReader
from .backends.wal.marks import MERGED_KEY
from .config import TableSpec, parse_capacity, resolve_device
from .errors import (
    ReadOnlyError,
    SnapshotUnavailableError,
    StoreClosedError,
    StoreCorruptError,
    UnknownTableError,
)
from .index import dedup
from .initializers import name_key
from .qcodec import dequantize

_POLL_S = 0.002
_LOST_RETRIES = 5


def writer_alive(path: Path) -> bool:
    """Whether a process holds the store's writer lock (read from /proc/locks; never locks it)."""
    lock = path / LOCK_NAME
    try:
        st = lock.stat()
    except OSError:
        return False
    dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks") as f:
            return any(line.split()[1] == "FLOCK" and dev in line.split() for line in f)
    except OSError:  # no /proc: the pid the writer wrote, if that process lives
        try:
            pid = int(lock.read_text() or 0)
            if pid <= 0:
                return False
            os.kill(pid, 0)
            return True
        except (OSError, ValueError):
            return False


class _Table:
    """A served table: its spec, index (cache key), lazy-init key and how rows are decoded."""

    def __init__(self, spec: TableSpec, index: int, seed: int, quant: dict | None) -> None:
        self.spec = spec
        self.tix = torch.tensor(index, dtype=torch.int64)
        self.key = name_key(seed, spec.name)
        self.quant = quant  # {"dtype": "int8"|"int4", "width": stored float32 columns}
        # a store's row is [payload | stamp] (format v2); an export's is the quantized row
        self.stored_width = quant["width"] if quant else spec.row_dim

    def decode(self, payload: np.ndarray) -> torch.Tensor:
        """Float32 weights [n, dim] from stored rows."""
        spec = self.spec
        if self.quant is not None:
            return torch.from_numpy(dequantize(payload, spec.dim, self.quant["dtype"]))
        cols = torch.from_numpy(np.ascontiguousarray(payload[:, : spec.weight_cols]))
        return spec.codec.decode(cols, spec.dim).contiguous()

    def lazy(self, rows: np.ndarray) -> torch.Tensor:
        """Weights of never-written rows (their deterministic init, as the writer would read it)."""
        spec = self.spec
        init = torch.from_numpy(spec.init(self.key, rows, spec.dim))
        if spec.codec.packed and self.quant is None:
            init = spec.codec.decode(spec.codec.encode(init), spec.dim)
        return init


class ReadOnlyStore:
    """A read-only handle on a store (live or closed) or on a quantized export.

    `read(table, ids)` returns float32 rows [n, dim] as of the current snapshot; `refresh()`
    moves to the writer's newest flushed state. Writes raise `ReadOnlyError`. `timeout`: how
    long opening or refreshing waits for a flushed state the reader can see (a writer that
    wrote rows since its last flush before this reader registered must flush once more).
    """

    readonly = True

    def __init__(self, path: str | os.PathLike, *, host_capacity: int | str = "64MiB",
                 device: torch.device | str | None = None, policy: str = "lru",
                 timeout: float = 60.0) -> None:
        self.path = Path(path)
        self.device = resolve_device(device)
        self.timeout = float(timeout)
        self.closed = True
        self._lock = threading.RLock()
        self._reg_fd: int | None = None
        if not (self.path / DATA_NAME).is_file():
            raise StoreCorruptError(f"{self.path} holds no tierstore store or export (no {DATA_NAME})")
        self._register()
        try:
            self._reader = SnapshotReader(self.path)
        except BaseException:
            self._unregister()
            raise
        try:
            self._snap = self._snapshot()
            self._tables = self._load_tables(self._snap)
            width = max(t.spec.dim for t in self._tables.values())
            cap = parse_capacity(host_capacity, width * 4)
            self.host_tier = SlabTier("host", cap, width, policy, "cpu")
        except BaseException:
            self._reader.close()
            self._unregister()
            raise
        self.width = width
        self.feature_tables: dict[str, str | None] = {}  # as TierStore's (sequence collections)
        self.refreshes = 0
        self._generation = 0  # bumped when the cache is dropped for a new state
        self._reopens_seen = self._reader.reopens
        self.closed = False

    # registration: the writer keeps flushed values while this shared lock is held --------
    def _register(self) -> None:
        try:
            fd = os.open(self.path / READERS_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:
            return  # a read-only directory (an export): no writer to tell
        fcntl.flock(fd, fcntl.LOCK_SH)  # waits at most for a writer's instant test
        self._reg_fd = fd

    def _unregister(self) -> None:
        if self._reg_fd is not None:
            os.close(self._reg_fd)
            self._reg_fd = None

    # snapshots ------------------------------------------------------------------------------
    def _snapshot(self) -> Snapshot:
        """Begin a snapshot showing a whole flushed state, waiting up to `timeout` for one."""
        deadline = time.monotonic() + self.timeout
        while True:
            snap = self._reader.begin()
            if snap.covered or not writer_alive(self.path):
                return snap
            if time.monotonic() > deadline:
                raise SnapshotUnavailableError(
                    f"store {self.path}: the writer has not flushed since it last wrote rows "
                    f"unseen by readers; waited {self.timeout:.1f} s for its next flush()")
            time.sleep(_POLL_S)

    def _load_tables(self, snap: Snapshot) -> dict[str, _Table]:
        meta = snap.meta
        seed = int((meta.get("store") or {}).get("seed", 0))
        quant = meta.get("quantized")
        specs = [TableSpec.from_config(v) for k, v in sorted(meta.items()) if k.startswith("table:")]
        if not specs:
            raise UnknownTableError(f"store {self.path} holds no tables")
        return {s.name: _Table(s, i, seed, None if quant is None else
                               {"dtype": quant["dtype"], "width": quant["widths"][s.name]})
                for i, s in enumerate(specs)}

    def _renew(self) -> bool:
        """Move to a new snapshot; clear the cache when the published state changed."""
        old = self._snap
        snap = self._snapshot()
        changed = (snap.epoch != old.epoch or self._reader.reopens != self._reopens_seen
                   or (snap.epoch is None and snap.txn_id != old.txn_id))
        self._reopens_seen = self._reader.reopens
        self._snap = snap
        if changed:
            self._generation += 1
            cache = self.host_tier  # emptied in place: reallocating a large cache costs seconds
            held = torch.nonzero(cache.occupied).flatten()
            if held.numel():
                cache.remove(held)
        return changed

    # public API -----------------------------------------------------------------------------
    def refresh(self) -> bool:
        """Move to the writer's newest flushed state; whether the state changed."""
        with self._lock:
            self.check_live()
            self.refreshes += 1
            return self._renew()

    def read(self, table: str, ids: Any) -> torch.Tensor:
        """Embedding rows [n, dim] (float32, on `device`) as of the current snapshot."""
        with self._lock:
            tab = self.table_record(table)
            ids = self.check_ids(tab, ids)
            dim = tab.spec.dim
            if ids.numel() == 0:
                return torch.empty(0, dim, device=self.device)
            uniq, inv = dedup(ids)
            gen = self._generation
            cache = self.host_tier
            slots = cache.lookup(tab.tix, uniq) if cache.capacity else torch.full_like(uniq, -1)
            hit = slots >= 0
            nhit = int(hit.sum())
            if nhit == uniq.numel():
                cache.touch(slots)
                weights = cache.slab[:, :dim].index_select(0, slots)
            else:
                weights = torch.empty(uniq.numel(), dim)
                miss = torch.nonzero(~hit).flatten()
                rows = uniq.index_select(0, miss)
                fetched = self._fetch(tab, rows.numpy())
                if self._generation != gen:
                    # the snapshot was lost and renewed (in-process remap / compaction): the
                    # cached hits belong to the old state; read everything from the new one
                    return self.read(table, ids)
                weights.index_copy_(0, miss, fetched)
                hit_slots = slots[hit]
                if nhit:
                    cache.touch(hit_slots)
                    weights.index_copy_(0, torch.nonzero(hit).flatten(),
                                        cache.slab[:, :dim].index_select(0, hit_slots))
                if cache.capacity:
                    pay = torch.nn.functional.pad(fetched, (0, self.width - dim)) \
                        if dim < self.width else fetched
                    m = rows.numel()
                    cache.insert(Rows(tab.tix.expand(m), rows, pay,
                                      torch.zeros(m, dtype=torch.bool)),
                                 protect=hit_slots, keep_clean=False)
            return weights.index_select(0, inv).to(self.device)

    def _fetch(self, tab: _Table, rows: np.ndarray) -> torch.Tensor:
        """Weights [m, dim] of rows from the snapshot (lazy init where not stored)."""
        for attempt in range(_LOST_RETRIES):
            try:
                payload, found = self._reader.get(tab.spec.name, rows, tab.stored_width)
                break
            except SnapshotLostError:
                # the writer in this process remapped, compacted or closed (or another reader
                # of this process reopened the shared environment): a new snapshot
                if attempt == _LOST_RETRIES - 1:
                    raise
                self._renew()
        out = tab.decode(payload)
        if not found.all():
            lazy = ~found
            out[torch.from_numpy(lazy)] = tab.lazy(rows[lazy])
        return out

    def stats(self) -> dict[str, Any]:
        """Snapshot (epoch, LMDB txn id), host-cache counters, refreshes and reopens."""
        with self._lock:
            self.check_live()
            host = self.host_tier.stats.as_dict()
            host.update(capacity=self.host_tier.capacity, resident=self.host_tier.size)
            return {"epoch": self._snap.epoch, "txn_id": self._snap.txn_id, "host": host,
                    "refreshes": self.refreshes, "reopens": self._reader.reopens,
                    "borrowed_env": self._reader.borrowed}

    @property
    def table_specs(self) -> dict[str, TableSpec]:
        """The specs of the tables this handle serves."""
        return {n: t.spec for n, t in self._tables.items()}

    @property
    def store_id(self) -> str | None:
        """The writer's store id at the current snapshot (None for stores made before ids)."""
        return (self._snap.meta.get(MERGED_KEY) or {}).get("store")

    @property
    def clock(self) -> int:
        """The writer's store clock at its flushed state this handle reads."""
        return int((self._snap.meta.get("clock") or {}).get("value", 0))

    @property
    def epoch(self) -> int | None:
        """The writer's flush count at the current snapshot (None for an export)."""
        return self._snap.epoch

    def close(self) -> None:
        """Release the snapshot, the environment and the reader registration (idempotent)."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            self._reader.close()
            self._unregister()

    def __enter__(self) -> ReadOnlyStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    # writes: refused ---------------------------------------------------------------------------
    def _refuse(self, what: str) -> NoReturn:
        raise ReadOnlyError(f"store {self.path} is open read-only: {what} is not allowed")

    def apply(self, *args: Any, **kwargs: Any) -> NoReturn:
        """Refused: a read-only handle does not update rows."""
        self._refuse("apply()")

    def apply_unique(self, *args: Any, **kwargs: Any) -> NoReturn:
        """Refused: a read-only handle does not update rows."""
        self._refuse("apply_unique()")

    def apply_bags(self, *args: Any, **kwargs: Any) -> NoReturn:
        """Refused: a read-only handle does not update rows."""
        self._refuse("apply_bags()")

    def gather(self, *args: Any, **kwargs: Any) -> NoReturn:
        """Refused: gather() prepares rows for training; use read()."""
        self._refuse("gather() (training)")

    def flush(self) -> NoReturn:
        """Refused: a read-only handle has nothing to write."""
        self._refuse("flush()")

    def advance(self, *args: Any, **kwargs: Any) -> NoReturn:
        """Refused: the store clock is the writer's."""
        self._refuse("advance()")

    def checkpoint(self, *args: Any, **kwargs: Any) -> NoReturn:
        """Refused: checkpoint the writer's store instead."""
        self._refuse("checkpoint()")

    def compact(self, *args: Any, **kwargs: Any) -> NoReturn:
        """Refused: compaction rewrites the file."""
        self._refuse("compact()")

    def expire(self, *args: Any, **kwargs: Any) -> NoReturn:
        """Refused: expiry deletes rows; expire through the writer."""
        self._refuse("expire()")

    @property
    def map_limit(self) -> None:
        """A read-only handle has no map limit (it never grows the file)."""
        return None

    @map_limit.setter
    def map_limit(self, value: Any) -> NoReturn:
        self._refuse("setting map_limit")

    # validation ----------------------------------------------------------------------------------
    def check_live(self) -> None:
        if self.closed:
            raise StoreClosedError(f"read-only store {self.path} is closed")

    def table_record(self, table: str) -> _Table:
        self.check_live()
        try:
            return self._tables[table]
        except (KeyError, TypeError):
            raise UnknownTableError(
                f"unknown table {table!r}; this store has {sorted(self._tables)}") from None

    @staticmethod
    def check_ids(tab: _Table, ids: Any) -> torch.Tensor:
        """Validated row ids of a table (the signature `TierStore._ids` has)."""
        return validate.row_ids(tab.spec, ids)
