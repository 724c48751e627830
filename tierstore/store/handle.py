"""The TierStore class: its constructor, which builds the parts it owns, and the mixins by concept
that hold its methods."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

import tierstore._switch as _switch
import tierstore.admission as _adm
import tierstore.expiry as _exp
import tierstore.store as _st  # the package: HAVE_NUMBA is read there, where tests patch it

from ..backends.lmdb_backend import LmdbBackend
from ..backends.set_tier import SetTier, keys_fit, set_policy
from ..backends.slab import SlabTier
from ..backends.upgrade import replay_and_convert
from ..backends.wal import HEADER, WriteLog
from ..backends.writeback import WriteBehind
from ..bagpaths import BagPaths
from ..cascade import Cascade
from ..config import StoreConfig, TableSpec, parse_capacity, parse_map_limit, resolve_device
from ..engine import check_kernels
from ..errors import ConfigError, LogCorruptError
from ..initializers import name_key
from ..pinned import StagingArea
from ..resolve import resolve_layout
from ..stats import PrefetchStats, SsdStats
from ..stored_rows import RowLoader
from .clock import StoreClock
from .core import LOG_MAX_CHUNK_ROWS, LOG_MAX_ROWS, LOG_RINGS, LOG_WIDE_ENTRY, WB_SLOT_OVERHEAD, _Table
from .lifecycle import _OPEN_STORES, StoreLifecycle, _weak_context
from .metrics import StoreMetrics
from .opening import StoreOpening
from .rows import RowApi


class TierStore(RowApi, StoreOpening, StoreLifecycle, StoreClock, StoreMetrics):
    """Embedding rows over three tiers (device cache, host cache, LMDB) with fused optimizers.

    Upper tiers are exclusive write-back caches: a row lives in at most one cache tier, with a
    dirty bit when it differs from LMDB. Rows never written are initialized lazily from
    (seed, table, row, column). Every operation takes a batch of ids. It is a
    `tierstore.reader.RowReader`, as a `ReadOnlyStore` is.
    """

    readonly = False  # a writable store (ReadOnlyStore says True)

    def __init__(self, path: str | os.PathLike, tables: Sequence[TableSpec] | TableSpec, *,
                 config: StoreConfig | None = None, **options: Any) -> None:
        """Create or open the store at `path`; `config` and `options` are `StoreConfig` fields."""
        cfg = StoreConfig.build(config, **options)
        device_capacity, host_capacity = cfg.device_capacity, cfg.host_capacity
        policy, seed, map_limit, record = cfg.policy, cfg.seed, cfg.map_limit, cfg.record
        write_buffer, write_log, staging_capacity = cfg.write_buffer, cfg.write_log, cfg.staging_capacity
        tables = [tables] if isinstance(tables, TableSpec) else list(tables)
        if not tables or not all(isinstance(t, TableSpec) for t in tables):
            raise ConfigError("tables must be a non-empty sequence of TableSpec")
        names = [t.name for t in tables]
        if len(set(names)) != len(names):
            raise ConfigError(f"duplicate table names in {names}")
        self.path = Path(path)
        self.config = cfg
        self.seed = seed
        self.device = resolve_device(cfg.device)
        self.kernels = check_kernels(cfg.kernels, self.device)  # the step engine's backend
        width = max(t.row_dim for t in tables)
        # the layout: the fastest measured one for the device, unless the user named a choice
        self.layout = resolve_layout(
            self.device.type, parse_capacity(device_capacity, width * 4),
            parse_capacity(host_capacity, width * 4), policy,
            None if staging_capacity is None else parse_capacity(staging_capacity, width * 4),
            width * 4, sum(t.num_rows for t in tables),
            defaults=(device_capacity == StoreConfig.device_capacity,  # the field defaults
                      host_capacity == StoreConfig.host_capacity))
        dcap, hcap, policy = self.layout.device_rows, self.layout.host_rows, self.layout.policy
        scap = self.layout.staging_rows
        if write_buffer is None:  # 64 MiB with its indexes
            wcap = (64 << 20) // (width * 4 + WB_SLOT_OVERHEAD)
        else:
            wcap = max(1, parse_capacity(write_buffer, width * 4 + WB_SLOT_OVERHEAD))
        if write_log is not None:  # rows, or a size of log entries (payload + 20 bytes each)
            log_rows = parse_capacity(write_log, width * 4 + HEADER + 4)
            if log_rows < 1:
                raise ConfigError(f"write_log must hold at least one row, got {write_log!r}")
        else:  # a configured ring sets the log; the default one may grow it (below)
            log_rows = LOG_RINGS * wcap
        limit = parse_map_limit(map_limit)
        switch = _switch.configured()  # a bad TIERSTORE_SWITCH_INTERVAL fails before any file opens
        self.closed = True
        self.lock = threading.RLock()
        self.prefetch_stats = PrefetchStats()
        # feature name -> table, registered by TieredEmbeddingBagCollection (None: ambiguous);
        # lets a Prefetcher over the store read jagged batches keyed by feature
        self.feature_tables: dict[str, str | None] = {}
        self.prefetchers: weakref.WeakSet = weakref.WeakSet()  # stopped when the store closes
        from ..policies import make_policy

        probe = make_policy(policy, 0)  # an unknown policy is refused before the store is touched
        self.device_cache = _device_cache(cfg.device_cache, self.device, tables)
        if self.device_cache == "sets":
            if staging_capacity is not None:
                raise ConfigError("staging_capacity extends a slab device tier: it needs "
                                  "device_cache='slab' (the sets cache has no staging slots)")
            scap = 0
            why = f"device_cache='sets': the device tier ranks by {set_policy(policy)}, no staging slots"
            self.layout = dataclasses.replace(self.layout, staging_rows=0, staging_auto=False,
                                              reasons=(*self.layout.reasons, why))
        if scap and not self.layout.staging_auto and (
                self.device.type != "cpu" or hcap or not probe.selective):
            raise ConfigError(
                f"staging_capacity holds the staged rows a selective device policy refuses: it "
                f"needs a CPU device tier, host_capacity=0 and policy='hlfu' (got device="
                f"{self.device}, host_capacity={hcap} rows, policy={policy!r})")
        self.backend = LmdbBackend(self.path, map_limit=limit)
        try:
            self._check_config(tables, cfg.add_tables)
            self.backend.open_tables(names)
            if self.backend.chunked:  # a range rewrite cut short by a kill left its fresh copy
                self.backend.drop_unnamed_ranges(names)
            if self.device_cache == "sets":
                self.device_tier = SetTier("device", dcap, width, policy, self.device,
                                           kernels=_set_kernels(self.kernels, self.device),
                                           table_rows=[t.num_rows for t in tables])
            else:
                self.device_tier = SlabTier("device", dcap, width, policy, self.device, staging=scap,
                                            staging_active=0 if self.layout.staging_auto else None)
            self.host_tier = SlabTier("host", hcap, width, policy, "cpu",
                                      pin_memory=self.device.type == "cuda")
            self.host_tier.policy.follow(self.device_tier.policy)  # device victims move down
        except BaseException:
            self.backend.close()
            raise
        self.policy = policy
        self.width = width
        self.tables = {t.name: _Table(t, i, name_key(seed, t.name)) for i, t in enumerate(tables)}
        self.by_index = [self.tables[n] for n in names]
        try:  # table name -> admission state, for tables with an admission config
            admission = _adm.open_admission(self)
            self.expiry = _exp.Expiry(self)  # cutoffs per table, ttl expiry points, its deleter
        except BaseException:
            self.backend.close()
            raise
        self.ssd_stats = SsdStats()
        try:  # a write-behind log left by a crash: fold it into the tables before anything reads
            replay_and_convert(self.backend)  # them (and a format-2 store becomes format 3)
        except LogCorruptError:
            try:
                if cfg.damaged_log != "last_flush":
                    raise
                self.backend.drop_log_env()  # asked for: open without the log's rows
                replay_and_convert(self.backend)
            except BaseException:
                self.backend.close()
                raise
        except BaseException:
            self.backend.close()
            raise
        self.writeback = WriteBehind(wcap, width, self._write_rows, name=f"tierstore-writer:{self.path.name}")
        self.log = None
        if write_log is None and write_buffer is None:  # up to half the declared rows, at most
            wide = self.backend.chunked and width * 4 + HEADER + 4 >= LOG_WIDE_ENTRY  # (core.py)
            most = LOG_MAX_CHUNK_ROWS if wide else LOG_MAX_ROWS
            log_rows = max(log_rows, min(sum(t.num_rows for t in tables) // 2, most))
        try:  # a failure from here on stops the threads started so far and frees the lock
            self.log = WriteLog(self.backend, names, [t.row_dim for t in tables], log_rows,
                                self.writeback.cv)
            # the store's parts: rows cached nowhere come from the loader; the cascade moves rows
            # between the tiers and hands victims to the write-behind ring
            self.loader = RowLoader(self.backend, self.writeback, self.log, self.expiry, width,
                                    self.ssd_stats, self.prefetch_stats)
            self.io_seconds = self.loader.io_seconds  # LMDB read seconds: training thread, others
            self.cascade = Cascade(self.device_tier, self.host_tier, self.loader, self.writeback,
                                   self.ssd_stats, width, self.device, self.stamp, self.clock_value)
            # the staging and pin area: the prefetch pipeline's batches, staged and pinned, and
            # their steps' lock-free path
            self.staging = StagingArea(self.device_tier, self.host_tier, self.cascade, self.loader,
                                       self.writeback, self.lock, self.tables, self.layout, width,
                                       lambda: self.closed)
            self.backend.quiesce = _weak_context(self.quiesce_writer)  # the merger holds the backend
            self.log.start_merger(self._add_written)
            # the logical clock (store.advance, stamped on updates) and the tables' update counts
            self._load_clock(self.backend.get_meta("clock") or {})
            recorder = None
            if record is not None:
                from ..traces import TraceRecorder

                try:
                    recorder = TraceRecorder(record)
                except OSError as exc:
                    raise ConfigError(f"cannot record the access trace to {record!r}: {exc}") from exc
            self.gate = _adm.AccessGate(admission, recorder)  # admission and the access trace
            # the training paths: a step's rows for the engine, its update, `gather`'s rows
            self.paths = BagPaths(self.device_tier, self.cascade, self.staging, self.gate,
                                  self.prefetch_stats, self.device, self.device_cache, _st.HAVE_NUMBA,
                                  table_record=self.table_record, check_live=self.check_live,
                                  stamp_many=self.stamp_many, count_update=self.count_update)
        except BaseException:
            if self.log is not None:
                self.log.stop_merger()
            self.writeback.close()
            self.backend.close()
            raise
        self.closed = False
        _OPEN_STORES.add(self)
        _switch.STORES.acquire(self, switch)  # a shorter GIL switch interval while its threads run

    def exclusive(self) -> contextlib.AbstractContextManager[None]:
        """The store lock, with no lock-free step over pinned rows running (`StagingArea.exclusive`)."""
        return self.staging.exclusive()

    @property
    def fused(self) -> bool:
        """Whether updates run the numba kernels on the CPU (False: the torch path); settable."""
        return self.paths.fused

    @fused.setter
    def fused(self, value: bool) -> None:
        self.paths.fused = value

    @property
    def map_limit(self) -> int | None:
        """The cap on the LMDB map (bytes), or None; raising it lets a stalled writer go on."""
        return self.backend.map_limit

    @map_limit.setter
    def map_limit(self, value: int | str | None) -> None:
        self.backend.map_limit = parse_map_limit(value)

    @property
    def table_specs(self) -> dict[str, TableSpec]:
        """The specs of the tables this handle serves."""
        return {n: t.spec for n, t in self.tables.items()}

    @property
    def store_id(self) -> str:
        """This store's identity (32 hex digits; its checkpoints and restores keep it)."""
        return self.log.owner


def _set_kernels(kernels: str, device: torch.device) -> str:
    """The sets cache's lookup and victim choice: Triton with the Triton engine, numba's loops on
    CPU tensors otherwise (`hbm_numba`: the CPU stand-in of the CUDA path), else torch ops."""
    if kernels == "triton":
        return "triton"
    return "numba" if device.type == "cpu" and _st.HAVE_NUMBA else "torch"


def _device_cache(name: str, device: torch.device, tables: Sequence[TableSpec]) -> str:
    """The device tier's structure `name` resolves to: "auto" is "sets" on CUDA (when every key
    packs into the cache's int64 keys), else "slab"; "sets" with keys that do not fit is refused."""
    fits = keys_fit(len(tables), max(t.num_rows for t in tables))
    if name == "sets" and not fits:
        raise ConfigError("device_cache='sets' packs (table, row) into one int64 key: it takes "
                          "at most 2**15 tables of at most 2**48 rows; use device_cache='slab'")
    if name == "auto":
        return "sets" if device.type == "cuda" and fits else "slab"
    return name
