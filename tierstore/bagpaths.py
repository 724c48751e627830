"""The store's training paths: gather a batch, a step's forward and backward over the engine, a
bag gradient applied with the fused optimizer."""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

import torch

import tierstore.admission as _adm
import tierstore.cascade as _cas
import tierstore.validate as validate

from .direct import DirectSteps
from .errors import InvalidGradientError
from .fused import BatchUpdate, bag_positions
from .gathered import Gathered as Gathered  # re-exported
from .index import dedup, sort_unique, sorted_dedup

if TYPE_CHECKING:
    from .backends.set_tier import SetTier
    from .backends.slab import SlabTier
    from .pinned import StagingArea
    from .stats import PrefetchStats
    from .store import _Table

R = TypeVar("R")


class BagPaths:
    """How a batch of ids becomes pooled embeddings and how its gradient updates the rows.

    A part the store owns (`store.paths`), built from the device tier, the cascade (rows that
    are not resident), the staging area (a prefetched batch's pinned rows, the lock-free path
    and `exclusive()`), the access gate (admission and the trace), the prefetch stats, the
    store's device and device cache, and four of the store's calls: `table_record` and
    `check_live` (its tables and state), `stamp_many` and `count_update` (its clock). It owns
    `fused` (numba kernels for a bag update on the CPU; False: the torch path) and the device
    flags of staged steps' gradient checks not read yet (`deferred_checks`).
    """

    def __init__(self, device_tier: SlabTier | SetTier, cascade: _cas.Cascade, staging: StagingArea,
                 gate: _adm.AccessGate, stats: PrefetchStats, device: torch.device,
                 device_cache: str, fused: bool, *, table_record: Callable[[str], _Table],
                 check_live: Callable[[], None],
                 stamp_many: Callable[..., None],
                 count_update: Callable[[_Table], int]) -> None:
        self.device_tier, self.cascade, self.staging, self.gate = device_tier, cascade, staging, gate
        self.prefetch_stats, self.device, self.device_cache, self.fused = stats, device, device_cache, fused
        self.table_record, self.check_live = table_record, check_live
        self.stamp_many, self.count_update = stamp_many, count_update
        # device flags of staged steps' gradient checks not read yet, each with the CUDA event
        # recorded after its step (None on the CPU): `raise_deferred`
        self.deferred_checks: collections.deque = collections.deque()
        # the direct way of a step, on a device cache with a line for every row
        self.direct = DirectSteps(device_tier, staging, gate, stats, table_record=table_record,
                                  stamp_many=stamp_many, defer_check=self.defer_check)

    def gather_rows(self, tab: _Table, ids: torch.Tensor) -> Gathered:
        """A table's rows of `ids` (validated), made resident and deduplicated (store lock held)."""
        if ids.numel() == 0:
            empty = torch.empty(0, dtype=torch.int64)
            return Gathered(empty, empty, torch.empty(0, tab.spec.dim, device=self.device))
        uniq, inv = sorted_dedup(ids)
        payload = self.cascade.access(tab, uniq, None, promote=self.staging.promotes())
        return Gathered(uniq, inv, tab.spec.codec.decode(payload, tab.spec.dim), self.cascade.last_dslots,
                        self.device_tier.generation)

    def _pinnable(self, tabs: list[_Table]) -> bool:
        """Whether a step over these tables may read the pipeline's pinned rows lock-free (not
        while recording a trace or with admission: both count under the lock). A CUDA device
        tier reads them so only as the sets cache (its pins and slots need no host reads)."""
        return ((self.device_tier.device.type == "cpu" or self.device_cache == "sets")
                and not self.gate.counts(tabs))

    def step_forward(self, items: Sequence[tuple[str, torch.Tensor]],
                     pool: Callable[[list[Gathered], list[torch.Tensor | None], torch.Tensor], R]
                     ) -> tuple[R, list[Gathered]]:
        """A training step's forward over several tables: make each table's rows readable and
        run `pool(gathered, weights, slab)` while they stay where they are.

        `items`: (table, ids) pairs. Per table, `gathered[t].slots` index the device slab when
        every row is resident (or pinned by the prefetch pipeline), and `weights[t]` is None;
        otherwise `weights[t]` holds its unique rows' float32 weights [u, dim]. A batch the
        pipeline pinned is read without the store lock; any other takes it once for all tables.
        """
        tabs = [self.table_record(t) for t, _ in items]
        ids = [validate.row_ids(tab.spec, i) for tab, (_, i) in zip(tabs, items)]
        staged: list[Gathered | None] = [None] * len(tabs)
        if self._pinnable(tabs) and self.staging.begin_unlocked():  # no locked operation moves rows now
            try:
                gs = [self.staging.pinned_rows(tab, i) for tab, i in zip(tabs, ids)]
                if all(g is not None for g in gs):
                    out = pool(gs, [None] * len(gs), self.device_tier.slab)
                    for g in gs:
                        if g.slots.numel():
                            self.staging.count_hits(g.slots)
                    self.prefetch_stats.lock_free_bags += len(gs)
                    return out, gs
                staged = gs  # a table staging could not place whole: the others keep their rows
            finally:
                self.staging.end_unlocked()
        with self.staging.exclusive():
            self.check_live()
            gs, weights, held, resident = [], [], [], []
            dev = self.device_tier

            def hold() -> None:
                """Pin the slots of the tables gathered so far before rows move: the pool reads
                every table's slots at the end, so a later table's misses must not evict them."""
                while resident:
                    slots = resident.pop()
                    dev.pin(slots, 1)
                    held.append(slots)

            try:
                for tab, i, pinned in zip(tabs, ids, staged):
                    self.gate.record(tab.spec.name, i)
                    mask = self.gate.count(tab, i)
                    if mask is not None:  # some ids not admitted yet: they read their initial rows
                        hold()
                        g = _adm.gather_masked(self, tab, i, mask)
                        gs.append(g)
                        weights.append(g.weights)
                        continue
                    if pinned is not None and pinned.generation == dev.pin_epoch:
                        # staged whole and still pinned: read where staging put it, as on the
                        # lock-free path (only the tables it could not place go the long way)
                        g = pinned
                        self.prefetch_stats.staged_bags_locked += 1
                        if g.slots.numel():
                            self.staging.count_hits(g.slots)
                    else:
                        g = self.step_rows(tab, i, hold)
                        if g.slots is not None and g.slots.numel():
                            resident.append(g.slots)
                    gs.append(g)
                    weights.append(None if g.slots is not None else g.weights)
                return pool(gs, weights, dev.slab), gs
            finally:
                for slots in held:
                    dev.pin(slots, -1)

    def step_rows(self, tab: _Table, ids: torch.Tensor,
                   hold: Callable[[], None] | None = None) -> Gathered:
        """A table's rows for a step's forward (store lock held): device slots when every one
        is resident, else the weights of its sorted unique rows (brought up the tiers, after
        `hold()` pinned the earlier tables' slots)."""
        dim = tab.spec.dim
        dev = self.device_tier
        if ids.numel() == 0:
            empty = torch.empty(0, dtype=torch.int64)
            return Gathered(empty, empty, torch.empty(0, dim, device=self.device),
                            empty.to(dev.device), dev.generation)
        uniq, inv = dedup(ids)
        dslots = self.cascade.resident_slots(tab, uniq)
        if dslots is not None:  # `uniq` may stay unsorted: only these slots are touched
            return Gathered(uniq, inv, torch.empty(0, dim), dslots, dev.generation)
        uniq, inv = sort_unique(uniq, inv)  # the tier cascade and LMDB work in key order
        promote = self.staging.promotes()
        if hold is not None:
            hold()
        payload = self.cascade.access(tab, uniq, None, promote=promote)
        weights = tab.spec.codec.decode(payload, dim).contiguous()
        # the rows as read: the backward updates a copy of them while the table has no write
        return Gathered(uniq, inv, weights, None, dev.generation, payload=payload, writes=tab.writes)

    def defers_checks(self, gs: Sequence[Gathered]) -> bool:
        """Whether a step's gradient check is left to the device: a batch staged on the sets
        cache (every table pinned), whose lock-free update reads nothing back to the host."""
        return self.device_cache == "sets" and all(g.pinned for g in gs)

    def raise_deferred(self, wait: bool = False) -> None:
        """Raise `InvalidGradientError` if a staged step's deferred gradient check failed (its
        update was discarded, its rows left as they were). Reads back only the flags whose step
        the device has finished (a CUDA event says so), so the host does not wait for the
        device, unless `wait` (then every flag: a sync)."""
        flags = []
        pending = self.deferred_checks
        while pending and (wait or pending[0][1] is None or pending[0][1].query()):
            flag, done = pending.popleft()
            if done is not None:
                done.synchronize()  # (done already, unless `wait`)
            flags.append(flag)
        # host values (a CUDA flag was copied to pinned memory before its event): no device read
        if flags and not bool(torch.stack(flags).all()):
            raise InvalidGradientError("a staged step's output gradient held NaN/Inf values; "
                                       "its update was discarded (nothing changed)")

    def step_backward(self, items: Sequence[tuple[str, Gathered]],
                      update: Callable[..., None],
                      finite: torch.Tensor | None = None, thread: int | None = None) -> None:
        """A training step's update over several tables, after `step_forward`: one engine call.

        `update(table, slots, salts, finite=None)` runs the engine's backward+update in place
        on `table[slots[u]]` (`slots=None`: the forward's slots); `salts[t]` are a 16-bit
        table's row ids and update count (its rounding bits); `finite` as the engine's. When
        every table's rows are still in the device slots the forward found, it updates the
        device slab (without the store lock for a pinned batch). Otherwise it updates a payload
        gathered by unique row (reused from the forward when the table had no write since),
        which the cascade then writes back where the rows are (`Assign`); rows not admitted are
        left as they were. `finite` (a device bool, `defers_checks`): whether the gradient is
        finite, checked without a sync on the lock-free path (an update it refuses leaves
        every row as it was, `raise_deferred` reports it), at once on the locked one.
        `thread`: the id of the thread that ran the forward (None: this one); autograd runs a
        CUDA step's backward on a device thread of its own, and whether rows move up (a
        warm-only batch's `deferring`) belongs to the consumer's thread.
        """
        tabs = [self.table_record(t) for t, _ in items]
        gs = [g for _, g in items]
        if all(g.pinned for g in gs) and self.staging.begin_unlocked():
            try:
                if self._in_place(tabs, gs):
                    self._update_in_place(tabs, gs, update, finite)
                    return
            finally:
                self.staging.end_unlocked()
        if finite is not None and not bool(finite):
            raise InvalidGradientError("the output gradient holds NaN/Inf values; nothing was updated")
        with self.staging.exclusive():
            self.check_live()
            tabs = [self.table_record(t) for t, _ in items]
            if self._in_place(tabs, gs):
                self._update_in_place(tabs, gs, update)
            else:
                self._update_gathered(tabs, gs, update, thread)

    def _in_place(self, tabs: list[_Table], gs: list[Gathered]) -> bool:
        """Whether every table's rows are still in the device slots its forward found."""
        return all(self._slots_valid(tab, g) for tab, g in zip(tabs, gs))

    def _slots_valid(self, tab: _Table, g: Gathered) -> bool:
        """Whether a table's rows are still in the device slots its forward found (and all admitted)."""
        dev = self.device_tier
        return (g.slots is not None and not self.gate.gated(tab)
                and g.generation == (dev.pin_epoch if g.pinned else dev.generation))

    def _salts(self, tabs: list[_Table], gs: list[Gathered]) -> list[tuple[torch.Tensor | None, int]]:
        """Each 16-bit table's rounding salt (its unique ids and update count, counted here)."""
        return [(g.unique, self.count_update(tab)) if tab.spec.codec.packed else (None, 0)
                for tab, g in zip(tabs, gs)]

    def _update_in_place(self, tabs: list[_Table], gs: list[Gathered],
                         update: Callable[..., None], finite: torch.Tensor | None = None) -> None:
        """The engine's update in the device slab; with `finite`, undone (sync-free) unless it holds."""
        dev = self.device_tier
        slots = torch.cat([g.slots for g in gs]) if len(gs) != 1 else gs[0].slots
        # with `finite`, the engine leaves every row as it was unless it holds (no host sync)
        update(dev.slab, None, self._salts(tabs, gs), finite)
        used = [(tab, g.slots) for tab, g in zip(tabs, gs) if g.slots.numel()]
        if used:  # every table's stamps and dirty marks in a few calls, not a few a table
            self.stamp_many([t for t, _ in used], dev.slab, [s for _, s in used], finite)
            dev.dirty.index_fill_(0, slots, True)  # a scalar fill: `[...] = True` syncs on CUDA
        self.defer_check(finite)

    def defer_check(self, finite: torch.Tensor | None) -> None:
        """Keep a staged step's device flag `finite` for `raise_deferred` (None: nothing to keep)."""
        if finite is not None:
            done = None
            if finite.device.type == "cuda":  # the flag lands in pinned host memory in stream
                # order, and the event says when: `raise_deferred` then reads it on the host
                # without enqueuing anything (a read enqueued later would wait for later steps)
                flag = torch.empty((), dtype=torch.bool, pin_memory=True)
                flag.copy_(finite, non_blocking=True)
                finite = flag
                done = torch.cuda.Event()
                done.record()
            self.deferred_checks.append((finite, done))

    def _update_gathered(self, tabs: list[_Table], gs: list[Gathered],
                         update: Callable[..., None], thread: int | None = None) -> None:
        """The engine's update over the step's payloads gathered by unique row, then each
        table's rows written back through the cascade (store lock held)."""
        parts, keeps = [], []
        for tab, g in zip(tabs, gs):
            mask = self.gate.admitted(tab, g.unique) if g.unique.numel() else None
            keep = None if mask is None else torch.from_numpy(mask)
            parts.append(self._payload_now(tab, g, keep))
            keeps.append(keep)
        payload = torch.cat(parts) if len(parts) > 1 else parts[0].clone()
        dev = self.device_tier.device
        work = payload.to(dev)
        update(work, torch.arange(work.shape[0], device=dev), self._salts(tabs, gs))
        payload = work.cpu() if work.device.type != "cpu" else work
        at = 0
        promote = self.staging.promotes(thread)
        for tab, g, keep in zip(tabs, gs, keeps):
            u = g.unique.numel()
            rows, uniq = payload[at : at + u], g.unique
            at += u
            if keep is not None:
                rows, uniq = rows[keep], uniq[keep]
            if not uniq.numel():
                continue
            uniq, order = self._key_order(uniq)
            if order is not None:
                rows = rows.index_select(0, order)
            self.cascade.access(tab, uniq, _cas.Assign(rows), promote=promote, known=rows)

    @staticmethod
    def _key_order(uniq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Unique ids in increasing order (the cascade works in key order) and the permutation
        that sorts them, or None when they already are."""
        if uniq.numel() < 2 or bool((uniq[1:] > uniq[:-1]).all()):
            return uniq, None
        order = torch.argsort(uniq)
        return uniq.index_select(0, order), order

    def _payload_now(self, tab: _Table, g: Gathered, keep: torch.Tensor | None) -> torch.Tensor:
        """The current payloads [u, width] of a table's unique rows, in the forward's order (CPU):
        the device slots the forward found, else the rows the forward read when the table had
        no write since, else read again where they are (moving none); rows outside `keep` (not
        admitted) are zeros, updated by the engine and then dropped."""
        width = self.cascade.width
        if not g.unique.numel():
            return torch.empty((0, width), dtype=torch.float32)
        if self._slots_valid(tab, g):
            return self.device_tier.read(g.slots).cpu()
        if g.payload is not None and g.writes == tab.writes and keep is None:
            return g.payload.cpu()
        uniq = g.unique if keep is None else g.unique[keep]
        out = torch.zeros((g.unique.numel(), width), dtype=torch.float32)
        if uniq.numel():
            srt, order = self._key_order(uniq)
            rows = self.cascade.access(tab, srt, None, count=False, promote=False).cpu()
            if order is not None:
                rows = torch.empty_like(rows).index_copy_(0, order, rows)
            if keep is None:
                return rows
            out[keep] = rows
        return out

    def apply_bag_grads(self, tab: _Table, g: Gathered, offsets: torch.Tensor, grad_out: torch.Tensor,
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
        known = g.payload if g.writes == tab.writes else None  # no update of the table since
        if not in_place and unique.numel() > 1 and not bool((unique[1:] > unique[:-1]).all()):
            unique, inverse = sort_unique(unique, inverse)  # the cascade works in key order
            known = None
        bag_of, lengths = bag_positions(offsets, n)
        scale = None
        if mode == "mean":
            scale = (1.0 / lengths.clamp(min=1).to(torch.float32)).index_select(0, bag_of)
        if per_sample_weights is not None:
            psw = per_sample_weights.detach().to("cpu", torch.float32).reshape(-1)
            scale = psw if scale is None else scale * psw
        mask = self.gate.admitted(tab, unique)  # counted by the forward / gather
        if mask is not None:  # drop the positions of rows not admitted (updates discarded)
            unique, inverse, (bag_of, scale) = _adm.filter_positions(mask, unique, inverse,
                                                                     bag_of, scale)
            known = None if known is None else known[torch.from_numpy(mask)]
            if unique.numel() == 0:
                return
            if in_place:  # (unreachable: counts only grow) the cascade works in key order
                unique, inverse = sort_unique(unique, inverse)
                in_place, known = False, None
        update = BatchUpdate(tab.spec.optimizer, tab.spec.dim, unique.numel(), inverse, grad_out,
                             bag_of, scale, self.fused, tab.spec.dtype, self.count_update(tab), unique)
        if in_place:
            update.apply(dev.slab, g.slots)  # rows still where gather found them: update in place
            self.stamp_many([tab], dev.slab, [g.slots])
            dev.dirty.index_fill_(0, g.slots, True)
            return
        self.cascade.access(tab, unique, update, promote=self.staging.promotes(), known=known)
