"""TierStore's training paths: gather a batch, pool bags, apply a bag gradient with the fused optimizer."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

import torch

import tierstore.admission as _adm

from .fused import BatchUpdate, bag_positions
from .gathered import Gathered as Gathered  # re-exported
from .index import dedup, sort_unique

if TYPE_CHECKING:
    from .store import _Table

R = TypeVar("R")


class BagPaths:
    """How a batch of ids becomes pooled embeddings and how its gradient updates the rows."""

    def _promoting(self) -> bool:
        """Whether this thread's gathers move missed rows up (not during a warm-only batch)."""
        return self.deferring != threading.get_ident()

    def gather_rows(self, tab: _Table, ids: torch.Tensor) -> Gathered:
        if ids.numel() == 0:
            empty = torch.empty(0, dtype=torch.int64)
            return Gathered(empty, empty, torch.empty(0, tab.spec.dim, device=self.device))
        uniq, inv = sort_unique(*dedup(ids))
        payload = self.cascade.access(tab, uniq, None, promote=self._promoting())
        return Gathered(uniq, inv, tab.spec.codec.decode(payload, tab.spec.dim), self.cascade.last_dslots,
                        self.device_tier.generation)

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
        ids = [self.check_ids(tab, i) for tab, (_, i) in zip(tabs, items)]
        if self._pinnable(tabs) and self._begin_unlocked():  # no locked operation moves rows now
            try:
                gs = [self._pinned_rows(tab, i) for tab, i in zip(tabs, ids)]
                if all(g is not None for g in gs):
                    out = pool(gs, [None] * len(gs), self.device_tier.slab)
                    for g in gs:
                        if g.slots.numel():
                            self._pending_hits.append(g.slots)
                    self.prefetch_stats.lock_free_bags += len(gs)
                    return out, gs
            finally:
                self._end_unlocked()
        with self.exclusive():
            self.check_live()
            gs, weights = [], []
            for tab, i in zip(tabs, ids):
                self.record_access(tab.spec.name, i)
                mask = self.admit_mask(tab, i)
                if mask is not None:  # some ids not admitted yet: they read their initial rows
                    g = _adm.gather_masked(self, tab, i, mask)
                    gs.append(g)
                    weights.append(g.weights)
                    continue
                g = self._step_rows(tab, i)
                gs.append(g)
                weights.append(None if g.slots is not None else g.weights)
            return pool(gs, weights, self.device_tier.slab), gs

    def _step_rows(self, tab: _Table, ids: torch.Tensor) -> Gathered:
        """A table's rows for a step's forward (store lock held): device slots when every one
        is resident, else the weights of its sorted unique rows (brought up the tiers)."""
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
        promote = self._promoting()
        payload = self.cascade.access(tab, uniq, None, promote=promote)
        weights = tab.spec.codec.decode(payload, dim).contiguous()
        kept = None if promote else payload  # a warm-only read: no row moved up
        return Gathered(uniq, inv, weights, None, dev.generation, payload=kept, writes=tab.writes)

    def step_backward(self, items: Sequence[tuple[str, Gathered]],
                      update: Callable[[torch.Tensor, list[tuple[torch.Tensor | None, int]]], None],
                      position_grads: Callable[[int], torch.Tensor]) -> None:
        """A training step's update over several tables, after `step_forward`.

        When every table's rows are still in the device slots the forward found, `update(slab,
        salts)` updates them all in place in one call (without the store lock for a pinned
        batch); `salts[t]` are a 16-bit table's row ids and update count (its rounding bits).
        Otherwise each table is updated where its rows now are, from `position_grads(t)`: the
        gradient row of each of its positions, summed per row in position order.
        """
        tabs = [self.table_record(t) for t, _ in items]
        gs = [g for _, g in items]
        if all(g.pinned for g in gs) and self._begin_unlocked():
            try:
                if self._in_place(tabs, gs):
                    self._update_in_place(tabs, gs, update)
                    return
            finally:
                self._end_unlocked()
        with self.exclusive():
            self.check_live()
            tabs = [self.table_record(t) for t, _ in items]
            if self._in_place(tabs, gs):
                self._update_in_place(tabs, gs, update)
                return
            for t, (tab, g) in enumerate(zip(tabs, gs)):
                n = g.inverse.numel()
                if n:  # bags of one position each: gradients summed per row in input order
                    self.apply_bag_grads(tab, g, torch.arange(n), position_grads(t), None, "sum")

    def _in_place(self, tabs: list[_Table], gs: list[Gathered]) -> bool:
        """Whether every table's rows are still in the device slots its forward found (and the
        engine's kernels do the update: without numba every update takes the torch path)."""
        dev = self.device_tier
        if not self.fused:
            return False
        for tab, g in zip(tabs, gs):
            if g.slots is None or tab.spec.name in self._admission:
                return False
            if g.generation != (dev.pin_epoch if g.pinned else dev.generation):
                return False
        return True

    def _update_in_place(self, tabs: list[_Table], gs: list[Gathered],
                         update: Callable[[torch.Tensor, list[tuple[torch.Tensor | None, int]]], None]
                         ) -> None:
        dev = self.device_tier
        salts = [(g.unique, self._count_update(tab)) if tab.spec.codec.packed else (None, 0)
                 for tab, g in zip(tabs, gs)]
        update(dev.slab, salts)
        for tab, g in zip(tabs, gs):
            if g.slots.numel():
                self._stamp(tab, dev.slab, g.slots)
                dev.dirty[g.slots] = True

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
        mask = self._admitted(tab, unique)  # counted by the forward / gather
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
                             bag_of, scale, self.fused, tab.spec.dtype, self._count_update(tab), unique)
        if in_place:
            update.apply(dev.slab, g.slots)  # rows still where gather found them: update in place
            self._stamp(tab, dev.slab, g.slots)
            dev.dirty[g.slots] = True
            return
        self.cascade.access(tab, unique, update, promote=self._promoting(), known=known)
