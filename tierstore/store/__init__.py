"""The tiered store: device cache -> host cache -> LMDB, lazy rows, fused optimizer updates."""

from __future__ import annotations

import atexit
import collections
import contextlib
import dataclasses
import functools
import os
import sys
import threading
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lmdb
import numpy as np
import torch

from .. import admission as _adm
from .. import expiry as _exp
from .. import validate
from .._kernels import HAVE_NUMBA
from ..backends.lmdb_backend import DATA_NAME, LmdbBackend, lmdb_error
from ..backends.slab import SlabTier
from ..backends.wal import HEADER, WriteLog, replay
from ..backends.writeback import WriteBehind
from ..bagpaths import BagPaths, Gathered
from ..cascade import TierCascade
from ..config import TableSpec, parse_capacity, parse_size
from ..errors import (
    ConfigError,
    ConfigMismatchError,
    InvalidIdsError,
    ShapeError,
    StoreClosedError,
    StoreNotFoundError,
    UnknownTableError,
)
from ..fused import BatchUpdate
from ..initializers import name_key
from ..pinned import PinnedSteps
from ..stats import PrefetchStats, SsdStats
from ..stored_rows import StoredRows

if TYPE_CHECKING:
    from ..serving import ReadOnlyStore

FORMAT_VERSION = 2  # 2: rows carry a last-update stamp column and a checksum word
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
LAST_OPEN = "last_open"  # metadata record: the table specs of the latest open, per table
_OPEN_STORES: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _close_open_stores() -> None:
    """Flush and close stores still open at exit, before the interpreter tears torch down."""
    for store in list(_OPEN_STORES):
        try:
            store.close()
        except Exception:
            pass


@dataclass
class _Table:
    spec: TableSpec
    index: int
    key: int  # lazy-init key derived from (seed, name)
    tix: torch.Tensor = dataclasses.field(init=False, repr=False)  # `index` as a 0-d int64 tensor (tier key)

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


def _mismatch(stored: TableSpec, given: TableSpec) -> list[str]:
    """Fields that make a stored table incompatible with the given spec."""
    out = []
    for field in ("num_rows", "dim", "dtype"):
        if getattr(stored, field) != getattr(given, field):
            out.append(f"{field}: stored {getattr(stored, field)!r}, given {getattr(given, field)!r}")
    if stored.optimizer.kind != given.optimizer.kind:
        out.append(f"optimizer: stored {stored.optimizer.kind!r}, given {given.optimizer.kind!r}")
    if stored.init != given.init:
        out.append(f"init: stored {stored.init!r}, given {given.init!r}")
    if stored.admission != given.admission:
        out.append(f"admission: stored {stored.admission!r}, given {given.admission!r}")
    return out


class TierStore(PinnedSteps, BagPaths, TierCascade, StoredRows):
    """Embedding rows over three tiers (device cache, host cache, LMDB) with fused optimizers.

    Upper tiers are exclusive write-back caches: a row lives in at most one cache tier, with a
    dirty bit when it differs from LMDB. Rows never written are initialized lazily from
    (seed, table, row, column). Every operation takes a batch of ids.
    """

    def __init__(self, path: str | os.PathLike, tables: Sequence[TableSpec] | TableSpec, *,
                 device_capacity: int | str = "64MiB", host_capacity: int | str = "512MiB",
                 policy: str = "lru",
                 seed: int = 0, device: torch.device | str | None = None,
                 map_limit: int | str | None = None,
                 record: str | os.PathLike | None = None, add_tables: bool = False,
                 write_buffer: int | str | None = None,
                 write_log: int | str | None = None) -> None:
        tables = [tables] if isinstance(tables, TableSpec) else list(tables)
        if not tables or not all(isinstance(t, TableSpec) for t in tables):
            raise ConfigError("tables must be a non-empty sequence of TableSpec")
        names = [t.name for t in tables]
        if len(set(names)) != len(names):
            raise ConfigError(f"duplicate table names in {names}")
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ConfigError(f"seed must be a non-negative int, got {seed!r}")
        self.path = Path(path)
        self.seed = seed
        self.device = _resolve_device(device)
        width = max(t.row_dim for t in tables)
        dcap = parse_capacity(device_capacity, width * 4)
        hcap = parse_capacity(host_capacity, width * 4)
        if write_buffer is None:  # 64 MiB with its indexes
            wcap = (64 << 20) // (width * 4 + WB_SLOT_OVERHEAD)
        else:
            wcap = max(1, parse_capacity(write_buffer, width * 4 + WB_SLOT_OVERHEAD))
        if write_log is not None:  # rows, or a size of log entries (payload + 20 bytes each)
            log_rows = parse_capacity(write_log, width * 4 + HEADER + 4)
            if log_rows < 1:
                raise ConfigError(f"write_log must hold at least one row, got {write_log!r}")
        else:  # a configured ring sets the log; the default one may grow it
            log_rows = LOG_RINGS * wcap
            if write_buffer is None:
                log_rows = max(log_rows, min(sum(t.num_rows for t in tables) // 2, LOG_MAX_ROWS))
        limit = None if map_limit is None else parse_size(map_limit)
        self._closed = True
        self._lock = threading.RLock()
        # lock-free updates of pinned rows (see _pinned_slots): a count of those running, and a
        # barrier that holds new ones off while a locked operation needs every row at rest
        self._compute = threading.Condition()
        self._inflight = 0
        self._barrier = 0
        # the batch in use, as the prefetch pipeline staged it: (consumer thread id,
        # {table: (sorted rows, device slots)}); its rows stay pinned until the pipeline's release
        self._staged: tuple[int, dict[str, tuple[np.ndarray, np.ndarray]], int] = (0, {}, -1)
        # batches released by the pipeline without the lock: their pins drop at the next locked
        # section (staging or any store call), after their hits are told
        self._pending_unpins: collections.deque = collections.deque()
        # device hits of lock-free gathers, not yet told (a deque: append and popleft are atomic)
        self._pending_hits: collections.deque[torch.Tensor] = collections.deque()
        self.prefetch_stats = PrefetchStats()
        self._last_sources = (0, 0, 0)
        self._marks: np.ndarray | None = None  # scratch for `_distinct_resident`, one per device slot
        # feature name -> table, registered by TieredEmbeddingBagCollection (None: ambiguous);
        # lets a Prefetcher over the store read jagged batches keyed by feature
        self.feature_tables: dict[str, str | None] = {}
        self._prefetchers: weakref.WeakSet = weakref.WeakSet()  # stopped when the store closes
        self.fused = HAVE_NUMBA  # numba kernels for the update on CPU; False: the torch path
        from ..policies import make_policy

        make_policy(policy, 0)  # an unknown policy is refused before the store is touched
        self.backend = LmdbBackend(self.path, map_limit=limit)
        try:
            self._check_config(tables, add_tables)
            self.backend.open_tables(names)
            self.device_tier = SlabTier("device", dcap, width, policy, self.device)
            self.host_tier = SlabTier("host", hcap, width, policy, "cpu",
                                      pin_memory=self.device.type == "cuda")
        except BaseException:
            self.backend.close()
            raise
        self.policy = policy
        self.width = width
        self.tables = {t.name: _Table(t, i, name_key(seed, t.name)) for i, t in enumerate(tables)}
        self._by_index = [self.tables[n] for n in names]
        try:  # table name -> admission state, for tables with an admission config
            self._admission = _adm.open_admission(self)
            self._expiry = _exp.Expiry(self)  # cutoffs per table, ttl expiry points, its deleter
        except BaseException:
            self.backend.close()
            raise
        self.ssd_stats = SsdStats()
        # read-ahead buffers of the prefetch pipeline: table -> [(tail at read, rows, payload, found)]
        self._readahead: dict[str, list[tuple[Any, np.ndarray, np.ndarray, np.ndarray]]] = {}
        # seconds spent reading LMDB inside the store, on the main (training) thread and on others
        self.io_seconds = {"training": 0.0, "background": 0.0}
        stored = [TableSpec.from_config(self.backend.get_meta(k)) for k in self.backend.meta_keys()
                  if k.startswith("table:")]
        # a write-behind log left by a crash: fold it into the tables before anything reads them
        replay(self.backend, [t.name for t in stored], [t.row_dim for t in stored])
        self.writeback = WriteBehind(wcap, width, self._write_rows, name=f"tierstore-writer:{self.path.name}")
        self.log = WriteLog(self.backend, names, [t.row_dim for t in tables], log_rows,
                            self.writeback._cv)
        self.backend.quiesce = _weak_context(self._quiesce_writer)  # the merger holds the backend
        self.log.start_merger(self._add_written)
        clock = self.backend.get_meta("clock") or {}
        self.clock = int(clock.get("value", 0))  # logical clock (store.advance), stamped on updates
        self._clock_saved = self.clock
        self._recorder = None
        if record is not None:
            from ..traces import TraceRecorder

            try:
                self._recorder = TraceRecorder(record)
            except OSError as exc:
                self.backend.close()
                raise ConfigError(f"cannot record the access trace to {record!r}: {exc}") from exc
        self._closed = False
        _OPEN_STORES.add(self)

    # configuration ------------------------------------------------------------------------
    def _check_config(self, tables: list[TableSpec], add_tables: bool = False) -> None:
        store = self.backend.get_meta("store")
        if store is not None:
            if store.get("format_version") != FORMAT_VERSION:
                raise ConfigMismatchError(old_format_message(self.path, store.get("format_version")))
            if store.get("seed") != self.seed:
                raise ConfigMismatchError(
                    f"store {self.path} was created with seed {store.get('seed')}, given {self.seed}")
        new: dict[str, dict] = {}
        for spec in tables:
            cfg = self.backend.get_meta(f"table:{spec.name}")
            if cfg is None:
                if store is not None and not add_tables:  # a typo must not create a table for good
                    stored = sorted(k[len("table:"):] for k in self.backend.meta_keys()
                                    if k.startswith("table:"))
                    raise UnknownTableError(
                        f"store {self.path} has no table {spec.name!r}; it holds {stored} "
                        "(pass add_tables=True to add a new table)")
                new[f"table:{spec.name}"] = spec.to_config()
                continue
            problems = _mismatch(TableSpec.from_config(cfg), spec)
            if problems:
                raise ConfigMismatchError(
                    f"table {spec.name!r} in {self.path} was stored with another config: "
                    + "; ".join(problems))
        if store is None:
            new["store"] = {"format_version": FORMAT_VERSION, "seed": self.seed}
        old = self.backend.get_meta(LAST_OPEN) or {}  # each table's specs at its latest open
        last = {**old, **{t.name: t.to_config() for t in tables}}
        if last != old:
            new[LAST_OPEN] = last
        if new:
            self.backend.put_meta(new)
            self.backend.sync()

    @classmethod
    def open(cls, path: str | os.PathLike, *, device_capacity: int | str = "64MiB",
             host_capacity: int | str | None = None, policy: str = "lru",
             device: torch.device | str | None = None, map_limit: int | str | None = None,
             readonly: bool = False, write_buffer: int | str | None = None,
             write_log: int | str | None = None) -> TierStore | ReadOnlyStore:
        """Open an existing store with its recorded table specs and seed (`StoreNotFoundError` if none).

        `readonly=True` returns a `tierstore.serving.ReadOnlyStore` (any process, while a writer
        has the store open; only `host_capacity`, `policy` and `device` apply). `host_capacity`
        defaults to 512MiB for a writer and 64MiB (weights only) for a read-only handle.
        """
        if readonly:  # a serving handle on the writer's last flush: docs/serving.md
            return _open_readonly(path, "64MiB" if host_capacity is None else host_capacity,
                                  policy, device)
        host_capacity = "512MiB" if host_capacity is None else host_capacity
        specs, seed = stored_config(path)
        return cls(path, specs, device_capacity=device_capacity, host_capacity=host_capacity,
                   policy=policy, seed=seed, device=device, map_limit=map_limit,
                   write_buffer=write_buffer, write_log=write_log)

    # validation -----------------------------------------------------------------------------
    def _live(self) -> None:
        if self._closed:
            raise StoreClosedError(f"store {self.path} is closed")

    def _table(self, table: str) -> _Table:
        self._live()
        try:
            return self.tables[table]
        except (KeyError, TypeError):
            raise UnknownTableError(
                f"unknown table {table!r}; this store has {sorted(self.tables)}") from None

    def _ids(self, tab: _Table, ids: Any) -> torch.Tensor:
        return validate.row_ids(tab.spec, ids)

    def _grads(self, tab: _Table, grads: Any, n: int) -> torch.Tensor:
        if not isinstance(grads, torch.Tensor) or not grads.is_floating_point():
            raise ShapeError("grads must be a floating-point tensor")
        if tuple(grads.shape) != (n, tab.spec.dim):
            raise ShapeError(f"grads must have shape ({n}, {tab.spec.dim}) for table "
                             f"{tab.spec.name!r}, got {tuple(grads.shape)}")
        return validate.gradients(tab.spec, grads.detach().to(dtype=torch.float32))

    # public API ---------------------------------------------------------------------------
    @_locked
    def read(self, table: str, ids: Any) -> torch.Tensor:
        """Current embedding rows [n, dim] (float32, store device); never-written rows are lazy."""
        tab = self._table(table)
        ids = self._ids(tab, ids)
        self._record(table, ids)
        mask = self._admit(tab, ids)
        if mask is not None:
            return _adm.read_masked(self, tab, ids, mask)
        return self._read(tab, ids)

    def _read(self, tab: _Table, ids: torch.Tensor) -> torch.Tensor:
        dev = self.device_tier
        # probe one id first: a batch that misses the device tier skips the full lookup
        probe = ids[:1].to(dev.device)
        if ids.numel() and dev.size and int(dev.lookup(tab.tix.to(dev.device), probe, count=False)) >= 0:
            slots = self._resident_slots(tab, ids)
            if slots is not None:  # fast path: one lookup and one gather
                return tab.spec.codec.gather(dev.slab, slots, tab.spec.dim)
        g = self._gather(tab, ids)
        return g.weights.index_select(0, g.inverse.to(g.weights.device))

    @_locked
    def gather(self, table: str, ids: Any) -> Gathered:
        """Make a batch's rows resident (device tier first) and return them deduplicated."""
        tab = self._table(table)
        ids = self._ids(tab, ids)
        self._record(table, ids)
        mask = self._admit(tab, ids)
        if mask is not None:
            return _adm.gather_masked(self, tab, ids, mask)
        return self._gather(tab, ids)

    @_locked
    def apply(self, table: str, ids: Any, grads: torch.Tensor) -> None:
        """One optimizer step on the rows of `ids`; duplicate ids' gradients are summed first."""
        tab = self._table(table)
        ids = self._ids(tab, ids)
        grads = self._grads(tab, grads, ids.numel())
        if ids.numel() == 0:
            return
        self._record(table, ids)
        mask = self._admit(tab, ids)
        if mask is not None:  # updates of ids not admitted yet are discarded
            keep = torch.from_numpy(mask)
            ids, grads = ids[keep], grads[keep]
            if ids.numel() == 0:
                return
        grads = grads.cpu()
        dev = self.device_tier
        n = ids.numel()
        slots = dev.lookup(tab.tix.to(dev.device), ids.to(dev.device), count=False)
        iota = self._distinct_resident(slots)
        if iota is not None:
            # fast path: every row device-resident, none repeated: update in place, input order
            dev.count_lookups(n, n)
            self._last_sources = (n, 0, 0)
            dev.touch(slots)
            BatchUpdate(tab.spec.optimizer, tab.spec.dim, n, iota, grads,
                        use_kernel=self.fused, dtype=tab.spec.dtype).apply(dev.slab, slots)
            self._stamp(tab, dev.slab, slots)
            dev.mark_dirty(slots)
            return
        uniq, inv = torch.unique(ids, sorted=True, return_inverse=True)
        # the device slots of the unique rows, from the lookup above (repeats carry equal slots)
        uslots = torch.empty_like(slots[: uniq.numel()]).index_copy_(0, inv.to(slots.device), slots)
        self._access(tab, uniq, BatchUpdate(tab.spec.optimizer, tab.spec.dim, uniq.numel(), inv,
                                            grads, use_kernel=self.fused, dtype=tab.spec.dtype),
                     dslots=uslots)

    @_locked
    def apply_unique(self, table: str, unique: torch.Tensor, grads: torch.Tensor) -> None:
        """One optimizer step on sorted unique ids (as from `gather`) with one gradient per id."""
        tab = self._table(table)
        unique = self._ids(tab, unique)
        grads = self._grads(tab, grads, unique.numel())
        if unique.numel() > 1 and not bool((unique[1:] > unique[:-1]).all()):
            raise InvalidIdsError("apply_unique needs sorted unique ids; use apply() otherwise")
        mask = self._admitted(tab, unique)  # gather's second half: counted by the gather
        if mask is not None:
            keep = torch.from_numpy(mask)
            unique, grads = unique[keep], grads[keep]
        if unique.numel():
            n = unique.numel()
            self._access(tab, unique, BatchUpdate(tab.spec.optimizer, tab.spec.dim, n, torch.arange(n),
                                                  grads.cpu(), use_kernel=self.fused,
                                                  dtype=tab.spec.dtype))

    @_locked
    def apply_bags(self, table: str, unique: torch.Tensor, inverse: torch.Tensor,
                   offsets: torch.Tensor, grad_out: torch.Tensor,
                   per_sample_weights: torch.Tensor | None = None, mode: str = "sum") -> None:
        """One optimizer step from the output gradient of an embedding bag over gathered rows.

        `unique`/`inverse` come from `gather` (ids == unique[inverse]); `offsets` start each bag;
        `grad_out` is [bags, dim]. Gradients are summed per row in input order and the update is
        fused (one pass over the rows, in place where they live).
        """
        tab = self._table(table)
        unique = self._ids(tab, unique)
        inverse, offsets, grad_out, psw = validate.bags(tab.spec, unique, inverse, offsets,
                                                        grad_out, per_sample_weights, mode)
        self._apply_bags(tab, Gathered(unique, inverse, grad_out[:0]), offsets, grad_out, psw, mode)

    @_locked
    def flush(self) -> None:
        """Write every dirty cached row to LMDB and sync it to disk.

        Rows go down in transactions of at most `FLUSH_CHUNK` rows, so flushing a large cache
        needs bounded extra memory; the flush is acknowledged (durable) when it returns.
        """
        self._live()
        for tier in (self.device_tier, self.host_tier):
            for slots, rows in tier.dirty_chunks(FLUSH_CHUNK):
                self._write_down(rows.to(torch.device("cpu")))
                tier.dirty[slots] = False
        with self._quiesce_writer():  # drain the ring, fold the whole log into the tables
            self.backend.publish()  # readers (tierstore.serving) now see this flush
        for adm in self._admission.values():  # the sketches go down with the rows they gate
            adm.save(self.backend)
        self._expiry.save(self.backend)  # and the expiry cutoffs
        self._save_clock()
        self.backend.sync()
        self._expiry.flushed()  # rows below durable ttl cutoffs may now leave LMDB

    @_locked
    def advance(self, steps: int = 1) -> int:
        """Move the store's logical clock forward (the trainer calls this once per step); returns it.

        Every row update records the clock as the row's last-update stamp (kept with the row in
        every tier and on disk); the clock is saved by `flush()`, `checkpoint()` and `close()`.
        """
        self._live()
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ConfigError(f"steps must be an int >= 0, got {steps!r}")
        if self.clock + steps > CLOCK_MAX:
            raise ConfigError(f"the store clock cannot pass {CLOCK_MAX} (at {self.clock})")
        self.clock += steps
        self._expiry.on_advance()  # tables with a ttl: expire at fixed clock points
        return self.clock

    @_locked
    def expire(self, table: str | None = None, older_than: int = 0) -> dict[str, int]:
        """Delete rows (of `table`, or all) last updated more than `older_than` clock steps ago.

        They leave the caches and LMDB and read as freshly initialized; durable on return.
        Returns rows deleted from LMDB per table. `tierstore compact` reclaims the disk.
        """
        self._live()
        return _exp.expire(self, table, older_than)

    def _clock_value(self) -> torch.Tensor:
        """The clock as a 0-d float32 tensor holding its int32 bits (the stamp column's value)."""
        return torch.tensor(self.clock, dtype=torch.int32).view(torch.float32)

    def _stamp(self, tab: _Table, target: torch.Tensor, slots: torch.Tensor) -> None:
        """Record the clock as the last-update stamp of updated rows `target[slots]`."""
        target[:, tab.spec.stamp_col].index_fill_(0, slots, self._clock_value().to(target.device))

    def _save_clock(self) -> None:
        """Persist the logical clock (with the next sync) when it moved since the last save."""
        if self.clock != self._clock_saved:
            self.backend.put_meta({"clock": {"value": self.clock}})
            self._clock_saved = self.clock

    @_locked
    def stats(self) -> dict[str, dict]:
        """Per-tier counters (device, host, ssd) plus store totals."""
        self._live()
        out = {"device": self.device_tier.stats.as_dict(), "host": self.host_tier.stats.as_dict(),
               "ssd": self.ssd_stats.as_dict()}
        out["device"].update(capacity=self.device_tier.capacity, resident=self.device_tier.size)
        out["host"].update(capacity=self.host_tier.capacity, resident=self.host_tier.size)
        out["prefetch"] = self.prefetch_stats.as_dict()
        log = self.log
        out["writeback"] = {**self.writeback.stats(), "log_rows": log.size,
                            "log_appended": log.rows_appended, "log_merged": log.rows_merged,
                            "log_chunks": log.chunks_appended,
                            "log_background_merges": log.background_merges}
        if self._admission:
            out["admission"] = {n: a.stats() for n, a in self._admission.items()}
        out["expiry"] = self._expiry.stats()
        out["ssd"].update(rows_stored=sum(self.backend.count(n) for n in self.tables),
                          disk_bytes=self.backend.disk_bytes())
        return out

    def memory(self) -> dict[str, int]:
        """The process's anonymous resident bytes next to the store's own memory budget.

        The budget is what the configured capacities allocate: both slabs, the write-behind
        ring, their hash indexes and per-slot bookkeeping, and the write-behind log's index.
        Pages of the LMDB map are the kernel's page cache (file-backed), reported separately.
        """
        budget = 0
        for tier in (self.device_tier, self.host_tier):
            if tier.device.type == "cpu":
                budget += tier.slab.nbytes
            budget += tier.index.table.nbytes + tier.capacity * 64  # index + bookkeeping bound
        wb = self.writeback
        budget += wb.payload.nbytes + wb.index.table.nbytes + wb.capacity * 40
        budget += self.log.index_bytes
        status = _proc_status()
        return {"anon_rss_bytes": status.get("RssAnon", 0), "file_rss_bytes": status.get("RssFile", 0),
                "budget_bytes": budget}

    @_locked
    def check(self) -> None:
        """Assert internal invariants (tiers consistent, caches exclusive); for tests."""
        self._live()
        self.device_tier.check()
        self.host_tier.check()
        dt, dr = self.device_tier.resident()
        if dr.numel():
            both = self.host_tier.index.find(dt.cpu(), dr.cpu())
            assert bool((both < 0).all()), "a row is cached in both device and host tiers"

    @_locked
    def close(self) -> None:
        """Flush dirty rows and release the store (idempotent)."""
        if self._closed:
            return
        for pf in list(self._prefetchers):  # abandoned or still running pipelines: stop them
            pf._stop_for_store()
        self._expiry.close()
        try:
            self.flush()
            self._expiry.finish()  # rows below durable ttl cutoffs the deleter did not reach
        finally:
            self._closed = True
            self.log.stop_merger()
            self.writeback.close()
            self._readahead.clear()
            self.backend.close()
            if self._recorder is not None:
                self._recorder.close()

    def __enter__(self) -> TierStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # best effort: never lose acknowledged writes to GC order
        try:
            if not getattr(self, "_closed", True) and not sys.is_finalizing():
                self.close()
        except Exception:
            pass

    @property
    def map_limit(self) -> int | None:
        """The cap on the LMDB map (bytes), or None; raising it lets a stalled writer go on."""
        return self.backend.map_limit

    @map_limit.setter
    def map_limit(self, value: int | str | None) -> None:
        self.backend.map_limit = None if value is None else parse_size(value)

    @property
    def table_specs(self) -> dict[str, TableSpec]:
        """The specs of the tables this handle serves."""
        return {n: t.spec for n, t in self.tables.items()}

    def checkpoint(self, dest: str | os.PathLike, *, step: int | None = None,
                   extra: dict | None = None, overwrite: bool = False) -> dict:
        """Flush, then write a consistent snapshot of every table to `dest`; returns the manifest."""
        from ..persistence import checkpoint

        return checkpoint(self, dest, step=step, extra=extra, overwrite=overwrite)

    @classmethod
    def restore(cls, dest: str | os.PathLike, path: str | os.PathLike,
                **open_kwargs: Any) -> TierStore:
        """Replace the store at `path` with the checkpoint `dest` and open it (kwargs as __init__)."""
        from ..persistence import restore

        return restore(dest, path, **open_kwargs)

    # internals --------------------------------------------------------------------------
    def _admit(self, tab: _Table, ids: torch.Tensor) -> np.ndarray | None:
        """Count `ids` for admission; the admitted mask over them, or None when all are."""
        adm = self._admission.get(tab.spec.name)
        return None if adm is None else adm.count(ids)

    def _admitted(self, tab: _Table, ids: torch.Tensor) -> np.ndarray | None:
        """The admitted mask over `ids` without counting them, or None when all are."""
        adm = self._admission.get(tab.spec.name)
        return None if adm is None else adm.admitted_mask(ids)

    def _record(self, table: str, ids: torch.Tensor) -> None:
        """Append the requested ids to the access trace, when recording."""
        if self._recorder is not None:
            self._recorder.record(table, ids)


















def _open_readonly(path: str | os.PathLike, host_capacity: int | str, policy: str,
                   device: torch.device | str | None) -> ReadOnlyStore:
    """`TierStore.open(path, readonly=True)`: a ReadOnlyStore on the store or quantized export."""
    from ..serving import ReadOnlyStore

    if not (Path(path) / DATA_NAME).is_file():
        raise StoreNotFoundError(f"no tierstore store at {path} (no {DATA_NAME})")
    return ReadOnlyStore(path, host_capacity=host_capacity, policy=policy, device=device)


def _weak_context(method):
    """A context factory calling a bound method held weakly (a no-op context once it is gone)."""
    ref = weakref.WeakMethod(method)

    def context():
        m = ref()
        return m() if m is not None else contextlib.nullcontext()

    return context


def _proc_status() -> dict[str, int]:
    """Byte counts from /proc/self/status (Linux; empty elsewhere)."""
    out = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                parts = line.split()
                if len(parts) == 3 and parts[2] == "kB":
                    out[parts[0].rstrip(":")] = int(parts[1]) * 1024
    except OSError:
        pass
    return out


def old_format_message(path: str | os.PathLike, version: object) -> str:
    """The error text for a store written in another on-disk format version."""
    if version == 1:
        return (f"store {path} has on-disk format version 1 (rows without checksums and stamps); "
                f"this tierstore reads version {FORMAT_VERSION}. Convert it in place with "
                f"`tierstore upgrade {path}` (the store must be closed)")
    return (f"store {path} has on-disk format version {version!r}; this tierstore reads version "
            f"{FORMAT_VERSION}")


def stored_config(path: str | os.PathLike) -> tuple[list[TableSpec], int]:
    """The table specs (creation order of names aside) and seed recorded in a store directory."""
    p = Path(path)
    if not (p / DATA_NAME).is_file():
        raise StoreNotFoundError(f"no tierstore store at {p} (no {DATA_NAME}); "
                                 "create one with TierStore(path, tables)")
    backend = LmdbBackend(p, readonly=True)
    try:
        store = backend.get_meta("store")
        specs = [TableSpec.from_config(backend.get_meta(k)) for k in backend.meta_keys()
                 if k.startswith("table:")]
    finally:
        backend.close()
    if store is None or not specs:
        raise StoreNotFoundError(f"{p} holds LMDB data but no tierstore tables")
    return specs, int(store["seed"])


def open_tables(path: str | os.PathLike) -> Iterable[TableSpec]:
    """The table specs stored in a store directory (read-only; no lock taken)."""
    backend = LmdbBackend(path, readonly=True)
    try:
        return [TableSpec.from_config(backend.get_meta(k)) for k in backend.meta_keys()
                if k.startswith("table:")]
    finally:
        backend.close()
