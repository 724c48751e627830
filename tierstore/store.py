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
import time
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lmdb
import numpy as np
import torch

from . import admission as _adm
from . import expiry as _exp
from . import validate
from ._kernels import HAVE_NUMBA, SLOT_BITS
from .backends.lmdb_backend import DATA_NAME, LmdbBackend, lmdb_error
from .backends.slab import Rows, SlabTier
from .backends.wal import WriteLog, replay
from .backends.writeback import WriteBehind
from .config import TableSpec, parse_capacity, parse_size
from .errors import (
    ConfigError,
    ConfigMismatchError,
    InvalidIdsError,
    ShapeError,
    StoreClosedError,
    StoreNotFoundError,
    UnknownTableError,
)
from .fused import BatchUpdate, bag_positions
from .fused import pool as fused_pool
from .index import dedup, sort_unique
from .initializers import name_key
from .stats import PrefetchStats, SsdStats

if TYPE_CHECKING:
    from .serving import ReadOnlyStore

FORMAT_VERSION = 2  # 2: rows carry a last-update stamp column and a checksum word
CLOCK_MAX = 2**31 - 1  # stamps are int32 bits in a float32 payload column
# bytes per write-behind ring row besides its payload: the ring's index and bookkeeping, and the
# log index (4 log entries per ring row)
WB_SLOT_OVERHEAD = 160
FLUSH_CHUNK = 65536  # rows per LMDB transaction when flushing
LOG_RINGS = 8  # the write-behind log holds up to this many rings of rows; its older half is merged at 3/4
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
_INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


@dataclass(frozen=True)
class Gathered:
    """A batch's rows for training: sorted unique ids, inverse map, and their embeddings."""

    unique: torch.Tensor  # int64 [u], sorted (unsorted only inside the module's resident fast path)
    inverse: torch.Tensor  # int64 [n], ids == unique[inverse]
    weights: torch.Tensor  # float32 [u, dim] on the store's device
    slots: torch.Tensor | None = None  # device-tier slots of `unique` when all were resident
    generation: int = -1  # the device tier's generation when `slots` was taken
    pinned: bool = False  # `slots` hold rows the prefetch pipeline pinned for this batch


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


class TierStore:
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
                 write_buffer: int | str | None = None) -> None:
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
        self._staged: tuple[int, dict[str, tuple[np.ndarray, np.ndarray]]] = (0, {})
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
        from .policies import make_policy

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
        self._readahead: dict[str, list[tuple[int, np.ndarray, np.ndarray, np.ndarray]]] = {}
        # seconds spent reading LMDB inside the store, on the main (training) thread and on others
        self.io_seconds = {"training": 0.0, "background": 0.0}
        stored = [TableSpec.from_config(self.backend.get_meta(k)) for k in self.backend.meta_keys()
                  if k.startswith("table:")]
        # a write-behind log left by a crash: fold it into the tables before anything reads them
        replay(self.backend, [t.name for t in stored], [t.row_dim for t in stored])
        self.writeback = WriteBehind(wcap, width, self._write_rows, name=f"tierstore-writer:{self.path.name}")
        self.log = WriteLog(self.backend, names, [t.row_dim for t in tables], LOG_RINGS * wcap,
                            self.writeback._cv)
        self.backend.quiesce = self._quiesce_writer
        clock = self.backend.get_meta("clock") or {}
        self.clock = int(clock.get("value", 0))  # logical clock (store.advance), stamped on updates
        self._clock_saved = self.clock
        self._recorder = None
        if record is not None:
            from .traces import TraceRecorder

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
             readonly: bool = False, write_buffer: int | str | None = None
             ) -> TierStore | ReadOnlyStore:
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
                   write_buffer=write_buffer)

    # validation -----------------------------------------------------------------------------
    @contextlib.contextmanager
    def _exclusive(self):
        """The store lock, with no lock-free update of pinned rows running (they wait outside)."""
        with self._lock:
            with self._compute:
                self._barrier += 1
                while self._inflight:
                    self._compute.wait()
            try:
                self._drain_hits()
                yield
            finally:
                with self._compute:
                    self._barrier -= 1

    def _begin_unlocked(self) -> bool:
        """Start a lock-free update of pinned rows; False while a locked operation holds them."""
        with self._compute:
            if self._barrier or self._closed:
                return False
            self._inflight += 1
            return True

    def _end_unlocked(self) -> None:
        with self._compute:
            self._inflight -= 1
            if not self._inflight:
                self._compute.notify_all()

    def _drain_hits(self) -> None:
        """Count and tell the device policy the hits of lock-free gathers (store lock held).

        Their rows are pinned, so no victim choice could have used the hits in between.
        """
        hits, dev = self._pending_hits, self.device_tier
        while hits:
            slots = hits.popleft()
            dev.count_lookups(slots.numel(), slots.numel())
            dev.touch(slots)

    def _pinned_slots(self, tab: _Table, uniq: torch.Tensor) -> torch.Tensor | None:
        """Device slots of `uniq` from the batch the pipeline staged for this thread, or None.

        Lock-free: the rows were looked up under the lock when staged and are pinned until the
        pipeline releases the batch (from this same thread), so they cannot move; each slot's
        pin and index entry are still checked, and any doubt returns None (the locked path).
        """
        owner, staged = self._staged
        got = staged.get(tab.spec.name)
        if got is None or owner != threading.get_ident():
            return None
        rows, slots = got
        u = uniq.numpy()
        pos = np.minimum(np.searchsorted(rows, u), len(rows) - 1)
        if not np.array_equal(rows[pos], u):
            return None
        s = slots[pos]
        return torch.from_numpy(s) if self._still_pinned(tab, u, s) else None

    def _still_pinned(self, tab: _Table, rows: np.ndarray, slots: np.ndarray) -> bool:
        """Whether every device slot is pinned and still holds its row (read without the lock)."""
        dev = self.device_tier
        if len(slots) == 0 or slots.min() < 0 or not (dev.pins.numpy()[slots] > 0).all():
            return False
        entry = dev.index.table.numpy()[dev.index.pos_of.numpy()[slots]]
        return bool(np.array_equal(entry[:, 1], rows) and
                    np.array_equal(entry[:, 0], (tab.index << SLOT_BITS) | slots))

    def _pool_pinned(self, tab: _Table, ids: torch.Tensor, offsets: torch.Tensor,
                     psw: torch.Tensor | None, mode: str, need_weights: bool
                     ) -> tuple[torch.Tensor, Gathered] | None:
        """`_pool_forward` without the store lock for a batch the pipeline pinned, else None."""
        dev = self.device_tier
        if (not self.fused or dev.device.type != "cpu" or ids.numel() == 0
                or self._recorder is not None or tab.spec.codec.packed):
            return None
        uniq, inv = dedup(ids)
        if not self._begin_unlocked():  # first: no locked operation may move rows from here on
            return None
        try:
            dslots = self._pinned_slots(tab, uniq)
            if dslots is None:
                return None
            psw = None if psw is None else psw.detach().to("cpu", torch.float32)
            out = fused_pool(dev.slab, dslots, inv, offsets, tab.spec.dim, psw, mode == "mean")
            weights = tab.spec.codec.gather(dev.slab, dslots, tab.spec.dim) if need_weights \
                else torch.empty(0, tab.spec.dim)
        finally:
            self._end_unlocked()
        self._pending_hits.append(dslots)
        self.prefetch_stats.lock_free_bags += 1
        return out, Gathered(uniq, inv, weights, dslots, dev.generation, pinned=True)

    def _apply_pinned(self, tab: _Table, g: Gathered, offsets: torch.Tensor,
                      grad_out: torch.Tensor, psw: torch.Tensor | None, mode: str) -> bool:
        """`_apply_bags` without the store lock when `g`'s rows are still pinned; False otherwise."""
        if not g.pinned or g.slots is None:
            return False
        if not self._begin_unlocked():  # first: no locked operation may move rows from here on
            return False
        try:
            if not self._still_pinned(tab, g.unique.numpy(), g.slots.numpy()):
                return False
            self._apply_bags(tab, g, offsets, grad_out, psw, mode)
        finally:
            self._end_unlocked()
        return True

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
        if not isinstance(ids, torch.Tensor):
            try:
                ids = torch.as_tensor(np.asarray(ids))
            except (TypeError, ValueError, RuntimeError) as exc:
                raise InvalidIdsError(f"ids must be an integer tensor: {exc}") from exc
        validate.not_meta(ids, "ids", InvalidIdsError)
        if ids.dtype not in _INT_DTYPES:
            raise InvalidIdsError(f"ids must be an integer tensor, got dtype {ids.dtype}")
        if ids.dim() != 1:
            raise ShapeError(f"ids must be 1-D, got shape {tuple(ids.shape)}")
        if ids.dtype != torch.int64 or ids.device.type != "cpu":
            ids = ids.to(device="cpu", dtype=torch.int64)
        if ids.numel():
            arr = ids.numpy()  # numpy reductions cost less per call than torch ops
            lo, hi = int(arr.min()), int(arr.max())
            if lo < 0 or hi >= tab.spec.num_rows:
                bad = lo if lo < 0 else hi
                raise InvalidIdsError(
                    f"row id {bad} out of range for table {tab.spec.name!r} "
                    f"(num_rows={tab.spec.num_rows})")
        return ids

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

    def _pool_forward(self, tab: _Table, ids: torch.Tensor, offsets: torch.Tensor,
                      psw: torch.Tensor | None, mode: str, need_weights: bool
                      ) -> tuple[torch.Tensor, Gathered]:
        """Pooled embeddings of bags over validated ids, and what the backward needs.

        With the numba kernels on a CPU store, bags are pooled straight from the device slab
        when every row is resident (no copy), otherwise from the gathered payloads: the same
        kernel, the same bits. Elsewhere, `F.embedding_bag` over the gathered rows.
        """
        dim = tab.spec.dim
        dev = self.device_tier
        mean = mode == "mean"
        if not (self.fused and dev.device.type == "cpu"):
            g = self._gather(tab, ids)
            w = g.weights.to(self.device)
            out = torch.nn.functional.embedding_bag(
                g.inverse.to(w.device), w, offsets.to(w.device), mode=mode,
                per_sample_weights=None if psw is None else psw.to(w.device, w.dtype))
            return out, g
        if ids.numel() == 0:
            return torch.zeros(offsets.numel(), dim), self._gather(tab, ids)
        uniq, inv = dedup(ids)
        psw = None if psw is None else psw.detach().to("cpu", torch.float32)
        dslots = self._resident_slots(tab, uniq)
        codec = tab.spec.codec
        if dslots is not None:  # `uniq` may stay unsorted: only these slots are touched
            if codec.packed:  # 16-bit weights: pool their float32 values
                weights = codec.gather(dev.slab, dslots, dim)
                out = fused_pool(weights, torch.arange(uniq.numel()), inv, offsets, dim, psw, mean)
            else:  # straight from the slab, no copy
                out = fused_pool(dev.slab, dslots, inv, offsets, dim, psw, mean)
                weights = codec.gather(dev.slab, dslots, dim) if need_weights else torch.empty(0, dim)
            return out, Gathered(uniq, inv, weights, dslots, dev.generation)
        uniq, inv = sort_unique(uniq, inv)  # the tier cascade and LMDB work in key order
        payload = self._access(tab, uniq, None)
        weights = codec.decode(payload, dim).contiguous() if codec.packed else payload
        out = fused_pool(weights, torch.arange(uniq.numel()), inv, offsets, dim, psw, mean)
        return out, Gathered(uniq, inv, weights[:, :dim], self._last_dslots, dev.generation)

    def _apply_bags(self, tab: _Table, g: Gathered, offsets: torch.Tensor, grad_out: torch.Tensor,
                    per_sample_weights: torch.Tensor | None, mode: str) -> None:
        """`apply_bags` on trusted input from `gather`; reuses its device slots when still valid."""
        unique, inverse = g.unique, g.inverse
        n = inverse.numel()
        grad_out = grad_out.detach().to("cpu", torch.float32)
        if unique.numel() == 0 or n == 0:
            return
        offsets = offsets.to("cpu", torch.int64)
        inverse = inverse.to("cpu", torch.int64)
        dev = self.device_tier
        in_place = g.slots is not None and (g.pinned or g.generation == dev.generation)
        if not in_place and unique.numel() > 1 and not bool((unique[1:] > unique[:-1]).all()):
            unique, inverse = sort_unique(unique, inverse)  # the cascade works in key order
        bag_of, lengths = bag_positions(offsets, n)
        scale = None
        if mode == "mean":
            scale = (1.0 / lengths.clamp(min=1).to(torch.float32)).index_select(0, bag_of)
        if per_sample_weights is not None:
            psw = per_sample_weights.detach().to("cpu", torch.float32).reshape(-1)
            scale = psw if scale is None else scale * psw
        mask = self._admitted(tab, unique)  # counted by the forward / gather
        if mask is not None:  # drop the positions of rows not admitted (updates discarded)
            unique, inverse, (bag_of, scale) = _adm.filter_positions(mask, unique, inverse,
                                                                     bag_of, scale)
            if unique.numel() == 0:
                return
            if in_place:  # (unreachable: counts only grow) the cascade works in key order
                unique, inverse = sort_unique(unique, inverse)
                in_place = False
        update = BatchUpdate(tab.spec.optimizer, tab.spec.dim, unique.numel(), inverse, grad_out,
                             bag_of, scale, self.fused, tab.spec.dtype)
        if in_place:
            update.apply(dev.slab, g.slots)  # rows still where gather found them: update in place
            self._stamp(tab, dev.slab, g.slots)
            dev.dirty[g.slots] = True
            return
        self._access(tab, unique, update)

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
                            "log_chunks": log.chunks_appended}
        if self._admission:
            out["admission"] = {n: a.stats() for n, a in self._admission.items()}
        out["expiry"] = self._expiry.stats()
        out["ssd"].update(rows_stored=sum(self.backend.count(n) for n in self.tables),
                          disk_bytes=self.backend.disk_bytes())
        return out

    def memory(self) -> dict[str, int]:
        """The process's anonymous resident bytes next to the store's own memory budget.

        The budget is what the configured capacities allocate: both slabs, the write-behind
        ring, their hash indexes and per-slot bookkeeping. Pages of the LMDB map are the
        kernel's page cache (file-backed) and are reported separately.
        """
        budget = 0
        for tier in (self.device_tier, self.host_tier):
            if tier.device.type == "cpu":
                budget += tier.slab.nbytes
            budget += tier.index.table.nbytes + tier.capacity * 64  # index + bookkeeping bound
        wb = self.writeback
        budget += wb.payload.nbytes + wb.index.table.nbytes + wb.capacity * 40
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
        from .persistence import checkpoint

        return checkpoint(self, dest, step=step, extra=extra, overwrite=overwrite)

    @classmethod
    def restore(cls, dest: str | os.PathLike, path: str | os.PathLike,
                **open_kwargs: Any) -> TierStore:
        """Replace the store at `path` with the checkpoint `dest` and open it (kwargs as __init__)."""
        from .persistence import restore

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

    def _gather(self, tab: _Table, ids: torch.Tensor) -> Gathered:
        if ids.numel() == 0:
            empty = torch.empty(0, dtype=torch.int64)
            return Gathered(empty, empty, torch.empty(0, tab.spec.dim, device=self.device))
        uniq, inv = sort_unique(*dedup(ids))
        payload = self._access(tab, uniq, None)
        return Gathered(uniq, inv, tab.spec.codec.decode(payload, tab.spec.dim), self._last_dslots,
                        self.device_tier.generation)

    def _resident_slots(self, tab: _Table, ids: torch.Tensor) -> torch.Tensor | None:
        """Device slots of `ids` if every one is device-resident (counted as hits), else None."""
        dev = self.device_tier
        if ids.numel() == 0 or dev.capacity == 0:
            return None
        slots = dev.lookup(tab.tix.to(dev.device), ids.to(dev.device),
                           count=False)
        if not bool((slots >= 0).all()):
            return None
        dev.count_lookups(ids.numel(), ids.numel())
        dev.touch(slots)
        return slots

    def _access(self, tab: _Table, uniq: torch.Tensor, update: BatchUpdate | None,
                count: bool = True, dslots: torch.Tensor | None = None,
                pin: bool = False) -> torch.Tensor | None:
        """Locate sorted unique rows, optionally update them, and promote them to the device tier.

        `dslots` are the rows' device slots when the caller has just looked them up. Returns
        the payloads [u, width] when reading (`update` is None), else None. With `pin` (prefetch
        staging) the rows are pinned where they land and nothing is read or returned.
        """
        dev = self.device_tier
        n = uniq.numel()
        if dslots is None:
            dslots = dev.lookup(tab.tix.to(dev.device), uniq.to(dev.device), count=False)
        dhit = dslots >= 0
        nd = int(dhit.sum())
        if nd < n:  # rows will move: room in the write-behind ring for the victims, or fail now
            self.writeback.reserve(n - nd)
        if count:
            dev.count_lookups(n, nd)
        if nd == n:
            self._last_sources = (n, 0, 0)
            self._last_dslots = dslots
            dev.touch(dslots)
            if pin:
                dev.pin(dslots, 1)
                return None
            if update is None:
                return dev.read(dslots)
            update.apply(dev.slab, dslots)  # in place in the device slab
            self._stamp(tab, dev.slab, dslots)
            dev.mark_dirty(dslots)
            return None
        self._last_dslots = None
        if nd:
            hit_idx = torch.nonzero(dhit).flatten()
            hit_slots = dslots.index_select(0, hit_idx)
            miss = torch.nonzero(~dhit).flatten().cpu()
            miss_rows = uniq.index_select(0, miss)
            hit_idx = hit_idx.cpu()
        else:  # nothing device-resident: the misses are the whole batch, in order
            hit_slots = dslots[:0]
            miss, miss_rows = None, uniq
        m = n - nd
        mpay, mdirty, mpins, nh = self._fetch_misses(tab, miss_rows, count)
        self._last_sources = (nd, nh, m - nh)
        if pin:  # the pins travel with the rows into whichever tier takes them
            dev.touch(hit_slots)
            dev.pin(hit_slots, 1)
            mpins = torch.ones(m, dtype=torch.int32) if mpins is None else mpins + 1
            self._place(Rows(tab.tix.expand(m), miss_rows, mpay, mdirty, mpins), protect=hit_slots)
            return None
        if nd:  # assemble the whole batch: device hits and the rows fetched from below
            payload = torch.empty((n, self.width), dtype=torch.float32)
            payload.index_copy_(0, hit_idx, dev.read(hit_slots).cpu())
            payload.index_copy_(0, miss, mpay)
            dev.touch(hit_slots)
        else:
            payload = mpay
        if update is not None:
            update.apply(payload, torch.arange(n))
            payload[:, tab.spec.stamp_col] = self._clock_value()
            if nd:
                dev.write(hit_slots, payload.index_select(0, hit_idx))
                mpay = payload.index_select(0, miss)
            mdirty = torch.ones(m, dtype=torch.bool)
        self._place(Rows(tab.tix.expand(m), miss_rows, mpay, mdirty, mpins), protect=hit_slots)
        return None if update is not None else payload.to(self.device, non_blocking=True)

    def _fetch_misses(self, tab: _Table, rows: torch.Tensor, count: bool
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int]:
        """Take device-missed rows out of the host tier or load them from LMDB.

        Returns (payload [m, width], dirty [m], pins [m] or None, host hits); host hits leave
        the host tier (the caches are exclusive).
        """
        host = self.host_tier
        m = rows.numel()
        hslots = host.lookup(tab.tix, rows, count=False)
        hhit = hslots >= 0
        nh = int(hhit.sum())
        if count:
            host.count_lookups(m, nh)
        if nh == 0:
            return self._load(tab, rows), torch.zeros(m, dtype=torch.bool), None, 0
        if nh == m:
            moved = host.remove(hslots)
            return moved.payload, moved.dirty, moved.pins, nh
        hidx = torch.nonzero(hhit).flatten()
        cidx = torch.nonzero(~hhit).flatten()
        moved = host.remove(hslots.index_select(0, hidx))
        payload = torch.empty((m, self.width), dtype=torch.float32)
        payload.index_copy_(0, hidx, moved.payload)
        payload.index_copy_(0, cidx, self._load(tab, rows.index_select(0, cidx)))
        dirty = torch.zeros(m, dtype=torch.bool).index_copy_(0, hidx, moved.dirty)
        pins = torch.zeros(m, dtype=torch.int32).index_copy_(0, hidx, moved.pins)
        return payload, dirty, pins, nh

    def _distinct_resident(self, slots: torch.Tensor) -> torch.Tensor | None:
        """`arange(n)` when every device lookup hit and no slot repeats (no id repeated), else None."""
        n = slots.numel()
        if slots.device.type != "cpu":
            srt = torch.sort(slots).values
            ok = bool(srt[0] >= 0) and not bool((srt[1:] == srt[:-1]).any())
            return torch.arange(n) if ok else None
        s = slots.numpy()
        if s.min() < 0:
            return None
        # a mark per device slot: each position writes its number; a repeated slot keeps one
        if self._marks is None:
            self._marks = np.empty(self.device_tier.capacity, dtype=np.int32)
        pos = np.arange(n)
        self._marks[s] = pos
        return torch.from_numpy(pos) if np.array_equal(self._marks[s], pos) else None

    # prefetch support (called by tierstore.prefetch with the store lock held) ------------
    def _stage(self, tab: _Table, uniq: torch.Tensor) -> tuple[int, int, int]:
        """Bring sorted unique rows up the hierarchy and pin them; returns (device, host, ssd)."""
        self._access(tab, uniq, None, count=False, pin=True)
        return self._last_sources

    def _pin(self, tab: _Table, uniq: torch.Tensor, delta: int) -> None:
        """Add `delta` to the prefetch pins of those rows wherever they are cached."""
        tabs = tab.tix
        for tier in (self.device_tier, self.host_tier):
            slots = tier.lookup(tabs.to(tier.device), uniq.to(tier.device), count=False)
            tier.pin(slots[slots >= 0], delta)

    def _hint(self, tab: _Table, rows: torch.Tensor, next_use: torch.Tensor) -> None:
        """Tell look-ahead policies the next known use (batch number) of cached rows."""
        tabs = tab.tix
        for tier in (self.device_tier, self.host_tier):
            if not tier.policy.wants_future:
                continue
            slots = tier.lookup(tabs.to(tier.device), rows.to(tier.device), count=False)
            found = slots >= 0
            tier.policy.on_future(slots[found], next_use.to(tier.device)[found])

    def _load(self, tab: _Table, rows: torch.Tensor) -> torch.Tensor:
        """Rows cached nowhere: from the write-behind ring, a read-ahead buffer, or LMDB; [n, width].

        Rows never written are lazily initialized. The ring holds the newest version of every
        row written back recently; a read-ahead buffer holds rows the prefetch pipeline read from
        LMDB when they were in no cache and not in the ring, valid while every row written
        since is still in the ring (so any newer version would have been found there).
        """
        spec = tab.spec
        rows_np = rows.numpy()
        n = len(rows_np)
        data = np.zeros((n, spec.row_dim), dtype=np.float32)
        found = np.zeros(n, dtype=bool)
        known = np.zeros(n, dtype=bool)
        if n and self.writeback.tail:
            hit, wdata = self.writeback.lookup(tab.index, rows)
            if wdata.shape[0]:
                h = hit.numpy()
                data[h] = wdata[:, : spec.row_dim].numpy()
                found |= h
                known |= h
        ahead = self._readahead.get(spec.name)
        if ahead and not known.all():
            self._read_ahead(ahead, rows_np, data, found, known)
        need = ~known
        nneed = int(np.count_nonzero(need))
        if nneed:
            t0 = time.perf_counter()
            part = rows_np if nneed == n else rows_np[need]
            got, gfound = self._read_stored(tab, part)
            side = "training" if threading.current_thread() is threading.main_thread() else "background"
            self.io_seconds[side] += time.perf_counter() - t0
            if nneed == n:
                data, found = (got if got.flags.writeable else got.copy()), gfound
            else:
                data[need] = got
                found[need] = gfound
            nfound = int(np.count_nonzero(gfound))
            st = self.ssd_stats
            st.lookups += nneed
            st.hits += nfound
            st.misses += nneed - nfound
            st.bytes_read += nfound * (spec.row_dim + 1) * 4
        if self._expiry.cutoffs:  # rows stamped below their table's expiry cutoff read as missing
            data, found = self._expiry.stale_mask(tab.index, data, found, spec.stamp_col)
        nfound = int(np.count_nonzero(found))
        if nfound < n:
            lazy = ~found
            init = spec.init(tab.key, rows_np[lazy], spec.dim)
            data[lazy, : spec.weight_cols] = spec.codec.encode(torch.from_numpy(init)).numpy() \
                if spec.codec.packed else init
        out = torch.from_numpy(data)
        if spec.row_dim < self.width:  # narrower table: zero tail columns
            out = torch.nn.functional.pad(out, (0, self.width - spec.row_dim))
        return out

    def _read_ahead(self, buffers: list, rows_np: np.ndarray, data: np.ndarray, found: np.ndarray,
                    known: np.ndarray) -> None:
        """Fill rows not yet known from the prefetch pipeline's still-current read-ahead buffers."""
        wb = self.writeback
        for since, brows, bdata, bfound in buffers:
            if not wb.still_current(since):
                continue
            pos = np.searchsorted(brows, rows_np)
            pos[pos >= len(brows)] = 0
            match = (brows[pos] == rows_np) & ~known if len(brows) else np.zeros_like(known)
            if match.any():
                src = pos[match]
                data[match] = bdata[src]
                found[match] = bfound[src]
                known |= match
                k, f = int(np.count_nonzero(match)), int(np.count_nonzero(bfound[src]))
                st = self.ssd_stats  # read from LMDB by the pipeline's threads, counted at use
                st.lookups += k
                st.hits += f
                st.misses += k - f
                self.prefetch_stats.rows_read_ahead += int(np.count_nonzero(match))
            if known.all():
                return

    def _add_read_ahead(self, table: str, since: int, rows: np.ndarray, data: np.ndarray,
                        found: np.ndarray, keep: int) -> None:
        """Register rows the prefetch pipeline read from LMDB (sorted); keeps the newest `keep` buffers."""
        bufs = self._readahead.setdefault(table, [])
        bufs.append((since, rows, data, found))
        del bufs[:-keep]

    def _place(self, moving: Rows, protect: torch.Tensor) -> None:
        """Insert rows into the device tier; victims and overflow cascade to host, then LMDB.

        Only dirty rows leave the host tier for LMDB: a clean row is already there (or is its
        lazy init), so the bottom tier drops clean victims without copying them.
        """
        if len(moving) == 0:
            return
        host = self.host_tier
        k, evicted = self.device_tier.insert(moving, protect=protect, keep_clean=host.capacity > 0)
        down = [p for p in (evicted, moving.take(slice(k, None)) if k < len(moving) else None)
                if p is not None and len(p)]
        if not down:
            return
        spill_in = Rows.cat([p.to(torch.device("cpu")) for p in down])
        k2, spill = host.insert(spill_in, keep_clean=False)
        parts = [] if spill is None else [spill]
        if k2 < len(spill_in):
            rest = spill_in.take(slice(k2, None))
            if bool(rest.dirty.any()):
                parts.append(rest.take(rest.dirty))
        if parts:
            self._write_down(Rows.cat(parts))

    def _write_down(self, rows: Rows) -> None:
        """Hand dirty rows (any tables) to the write-behind ring; its writer thread writes them to LMDB."""
        if len(rows) == 0:
            return
        self.writeback.put(rows)
        self.ssd_stats.writebacks += len(rows)

    def _write_rows(self, tabs: np.ndarray, rows: np.ndarray, payload: np.ndarray) -> int:
        """The writer thread's sink: append rows to the write-behind log, merge it when it is large."""
        log = self.log
        written = log.append(tabs, rows, payload)
        if log.size >= log.capacity * 3 // 4:  # fold the older half into the tables, sorted
            written += log.merge(log.capacity // 2)
        self.ssd_stats.bytes_written += written
        return written

    @contextlib.contextmanager
    def _quiesce_writer(self):
        """Drain the write-behind ring, merge the log, and keep the writer idle inside the block."""
        self.writeback.drain()
        with self.writeback._cv:
            self.ssd_stats.bytes_written += self.log.merge()
            yield

    def _read_stored(self, tab: _Table, rows_np: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Stored rows (log first, then the table): (rows [n, row_dim], found [n]); any thread."""
        spec = tab.spec
        seqs = self.log.lookup(tab.index, torch.from_numpy(rows_np))
        inlog = seqs >= 0
        if not inlog.any():
            return self.backend.get(spec.name, rows_np, spec.row_dim)
        data = np.zeros((len(rows_np), spec.row_dim), dtype=np.float32)
        found = np.zeros(len(rows_np), dtype=bool)
        ldata, lfound = self.log.read(tab.index, rows_np[inlog], seqs[inlog])
        idx = np.flatnonzero(inlog)
        data[idx[lfound]] = ldata[lfound]
        found[idx[lfound]] = True
        rest = np.flatnonzero(~inlog)
        rest = np.concatenate([rest, idx[~lfound]]) if (~lfound).any() else rest
        if len(rest):  # merged meanwhile entries are in the table by now
            mdata, mfound = self.backend.get(spec.name, rows_np[rest], spec.row_dim)
            data[rest] = mdata
            found[rest] = mfound
        return data, found


def _open_readonly(path: str | os.PathLike, host_capacity: int | str, policy: str,
                   device: torch.device | str | None) -> ReadOnlyStore:
    """`TierStore.open(path, readonly=True)`: a ReadOnlyStore on the store or quantized export."""
    from .serving import ReadOnlyStore

    if not (Path(path) / DATA_NAME).is_file():
        raise StoreNotFoundError(f"no tierstore store at {path} (no {DATA_NAME})")
    return ReadOnlyStore(path, host_capacity=host_capacity, policy=policy, device=device)


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
