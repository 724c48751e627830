"""TierStore's training paths: gather a batch, pool bags, apply a bag gradient with the fused optimizer."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import torch

import tierstore.admission as _adm

from .fused import BatchUpdate, bag_positions
from .fused import pool as fused_pool
from .gathered import Gathered as Gathered  # re-exported
from .index import dedup, sort_unique

if TYPE_CHECKING:
    from .store import _Table


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

    def pool_forward(self, tab: _Table, ids: torch.Tensor, offsets: torch.Tensor,
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
            g = self.gather_rows(tab, ids)
            w = g.weights.to(self.device)
            out = torch.nn.functional.embedding_bag(
                g.inverse.to(w.device), w, offsets.to(w.device), mode=mode,
                per_sample_weights=None if psw is None else psw.to(w.device, w.dtype))
            return out, g
        if ids.numel() == 0:
            return torch.zeros(offsets.numel(), dim), self.gather_rows(tab, ids)
        uniq, inv = dedup(ids)
        psw = None if psw is None else psw.detach().to("cpu", torch.float32)
        dslots = self.cascade.resident_slots(tab, uniq)
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
        promote = self._promoting()
        payload = self.cascade.access(tab, uniq, None, promote=promote)
        weights = codec.decode(payload, dim).contiguous() if codec.packed else payload
        out = fused_pool(weights, torch.arange(uniq.numel()), inv, offsets, dim, psw, mean)
        kept = None if promote else payload  # a warm-only read: no row moved up
        return out, Gathered(uniq, inv, weights[:, :dim], self.cascade.last_dslots, dev.generation,
                             payload=kept, writes=tab.writes)

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
