"""TierStore's row API (read, gather, apply, apply_unique, apply_bags) and its argument checks."""

from __future__ import annotations

from typing import Any

import torch

import tierstore.admission as _adm
import tierstore.validate as validate

from ..bagpaths import Gathered
from ..errors import InvalidIdsError, ShapeError, StoreClosedError, UnknownTableError
from ..fused import BatchUpdate
from .core import _locked, _Table


class RowApi:
    """The public row operations, each over a batch of ids of one table, under the store lock."""

    # validation -----------------------------------------------------------------------------
    def check_live(self) -> None:
        if self.closed:
            raise StoreClosedError(f"store {self.path} is closed")

    def table_record(self, table: str) -> _Table:
        self.check_live()
        try:
            return self.tables[table]
        except (KeyError, TypeError):
            raise UnknownTableError(
                f"unknown table {table!r}; this store has {sorted(self.tables)}") from None

    def check_ids(self, tab: _Table, ids: Any) -> torch.Tensor:
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
        tab = self.table_record(table)
        ids = self.check_ids(tab, ids)
        self.gate.record(table, ids)
        mask = self.gate.count(tab, ids)
        if mask is not None:
            return _adm.read_masked(self, tab, ids, mask)
        return self.read_rows(tab, ids)

    def read_rows(self, tab: _Table, ids: torch.Tensor) -> torch.Tensor:
        dev = self.device_tier
        # probe one id first: a batch that misses the device tier skips the full lookup
        probe = ids[:1].to(dev.device)
        if ids.numel() and dev.size and int(dev.lookup(tab.tix.to(dev.device), probe, count=False)) >= 0:
            slots = self.cascade.resident_slots(tab, ids)
            if slots is not None:  # fast path: one lookup and one gather
                return tab.spec.codec.gather(dev.slab, slots, tab.spec.dim)
        g = self.paths.gather_rows(tab, ids)
        return g.weights.index_select(0, g.inverse.to(g.weights.device))

    @_locked
    def gather(self, table: str, ids: Any) -> Gathered:
        """Make a batch's rows resident (device tier first) and return them deduplicated."""
        tab = self.table_record(table)
        ids = self.check_ids(tab, ids)
        self.gate.record(table, ids)
        mask = self.gate.count(tab, ids)
        if mask is not None:
            return _adm.gather_masked(self.paths, tab, ids, mask)
        return self.paths.gather_rows(tab, ids)

    @_locked
    def apply(self, table: str, ids: Any, grads: torch.Tensor) -> None:
        """One optimizer step on the rows of `ids`; duplicate ids' gradients are summed first."""
        tab = self.table_record(table)
        ids = self.check_ids(tab, ids)
        grads = self._grads(tab, grads, ids.numel())
        if ids.numel() == 0:
            return
        self.gate.record(table, ids)
        mask = self.gate.count(tab, ids)
        if mask is not None:  # updates of ids not admitted yet are discarded
            keep = torch.from_numpy(mask)
            ids, grads = ids[keep], grads[keep]
            if ids.numel() == 0:
                return
        grads = grads.cpu()
        dev = self.device_tier
        n = ids.numel()
        slots = dev.lookup(tab.tix.to(dev.device), ids.to(dev.device), count=False)
        iota = self.cascade.distinct_resident(slots)
        if iota is not None:
            # fast path: every row device-resident, none repeated: update in place, input order
            dev.count_lookups(n, n)
            self.cascade.last_sources = (n, 0, 0)
            dev.touch(slots)
            BatchUpdate(tab.spec.optimizer, tab.spec.dim, n, iota, grads, use_kernel=self.fused,
                        dtype=tab.spec.dtype, update_count=self.count_update(tab),
                        keys=ids).apply(dev.slab, slots)
            self.stamp(tab, dev.slab, slots)
            dev.mark_dirty(slots)
            return
        uniq, inv = torch.unique(ids, sorted=True, return_inverse=True)
        # the device slots of the unique rows, from the lookup above (repeats carry equal slots)
        uslots = torch.empty_like(slots[: uniq.numel()]).index_copy_(0, inv.to(slots.device), slots)
        self.cascade.access(tab, uniq, BatchUpdate(tab.spec.optimizer, tab.spec.dim, uniq.numel(), inv,
                                            grads, use_kernel=self.fused, dtype=tab.spec.dtype,
                                            update_count=self.count_update(tab), keys=uniq),
                     dslots=uslots)

    @_locked
    def apply_unique(self, table: str, unique: torch.Tensor, grads: torch.Tensor) -> None:
        """One optimizer step on sorted unique ids (as from `gather`) with one gradient per id."""
        tab = self.table_record(table)
        unique = self.check_ids(tab, unique)
        grads = self._grads(tab, grads, unique.numel())
        if unique.numel() > 1 and not bool((unique[1:] > unique[:-1]).all()):
            raise InvalidIdsError("apply_unique needs sorted unique ids; use apply() otherwise")
        mask = self.gate.admitted(tab, unique)  # gather's second half: counted by the gather
        if mask is not None:
            keep = torch.from_numpy(mask)
            unique, grads = unique[keep], grads[keep]
        if unique.numel():
            n = unique.numel()
            self.cascade.access(tab, unique, BatchUpdate(tab.spec.optimizer, tab.spec.dim, n, torch.arange(n),
                                                  grads.cpu(), use_kernel=self.fused,
                                                  dtype=tab.spec.dtype, update_count=self.count_update(tab),
                                                  keys=unique))

    @_locked
    def apply_bags(self, table: str, unique: torch.Tensor, inverse: torch.Tensor,
                   offsets: torch.Tensor, grad_out: torch.Tensor,
                   per_sample_weights: torch.Tensor | None = None, mode: str = "sum") -> None:
        """One optimizer step from the output gradient of an embedding bag over gathered rows.

        `unique`/`inverse` come from `gather` (ids == unique[inverse]); `offsets` start each bag;
        `grad_out` is [bags, dim]. Gradients are summed per row in input order and the update is
        fused (one pass over the rows, in place where they live).
        """
        tab = self.table_record(table)
        unique = self.check_ids(tab, unique)
        inverse, offsets, grad_out, psw = validate.bags(tab.spec, unique, inverse, offsets,
                                                        grad_out, per_sample_weights, mode)
        self.paths.apply_bag_grads(tab, Gathered(unique, inverse, grad_out[:0]), offsets, grad_out, psw, mode)
