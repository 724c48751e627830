"""Steps on a direct device cache: a sets cache with a line for every declared row.

Key k lives at slot k, rows never move, and they leave only by a removal (expiry). So a step
whose ids the cache holds reads its rows where they are: each id is its slot, with no dedup,
lookup, staging or pin (`DirectSteps.forward`), and its update goes straight to the slab
(`DirectSteps.update`). The prefetch pipeline may make a batch's step ahead on its own thread
(`DirectSteps.prepare`: the ids checked, their slots on the device, the keyed batch built),
which the step takes when its input is that batch's and nothing left the cache since.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import torch

import tierstore.hostread as hostread
import tierstore.validate as validate

from .errors import InvalidGradientError

if TYPE_CHECKING:
    from .admission import AccessGate
    from .backends.set_tier import SetTier
    from .backends.slab import SlabTier
    from .pinned import StagingArea
    from .stats import PrefetchStats
    from .store import _Table

R = TypeVar("R")


@dataclass(frozen=True, eq=False)
class DirectRows:
    """A step's rows as `DirectSteps.forward` found them: the items' tables, their slots (on
    the device, by item and all together; a row's slot may come more than once), the cache's
    removal count then, and whether a pipeline delivered the batch (its gradient check is then
    left to the device)."""

    tabs: list[_Table]
    keys: list[torch.Tensor]
    slots: torch.Tensor
    removals: int
    deferred: bool


@dataclass(frozen=True, eq=False)
class AheadStep:
    """A direct step made ahead by the pipeline (`DirectSteps.prepare`) for one module's batch:
    whose (`owner`, the module's engine), of which input (each item's host ids, the lengths),
    its tables, its slots on the device and their sizes, what `make` built from them, and the
    cache's removal count before the check."""

    owner: Any
    ids: list[torch.Tensor]
    lengths: torch.Tensor
    tabs: list[_Table]
    slots: torch.Tensor
    sizes: list[int]
    made: Any
    removals: int

    def fits(self, owner: Any, items: Sequence[tuple[str, torch.Tensor]], lengths: torch.Tensor) -> bool:
        """Whether a step of `owner` over this input is the one made ahead (memcmps on the host,
        or none for ids that are views of the very memory the pipeline read)."""
        return (owner is self.owner and len(items) == len(self.ids)
                and all(_same(i, a) for (_, i), a in zip(items, self.ids))
                and lengths.device.type == "cpu" and torch.equal(lengths, self.lengths))


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two host tensors hold the same values now: the same memory seen the same way, or
    equal by a compare."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.data_ptr() == b.data_ptr() and a.stride() == b.stride():
        return True
    return torch.equal(a, b)


class DirectSteps:
    """The direct way of a step (a part `BagPaths` owns): built from the device tier, the
    staging area (the lock-free barrier, the pipeline's checks and steps made ahead), the
    access gate, the prefetch stats, and the store's `table_record` and `stamp_many` and the
    bag paths' `defer_check`."""

    def __init__(self, device_tier: SlabTier | SetTier, staging: StagingArea, gate: AccessGate,
                 stats: PrefetchStats, *, table_record: Callable[[str], _Table],
                 stamp_many: Callable[..., None],
                 defer_check: Callable[[torch.Tensor | None], None]) -> None:
        self.device_tier, self.staging, self.gate, self.prefetch_stats = device_tier, staging, gate, stats
        self.table_record, self.stamp_many, self.defer_check = table_record, stamp_many, defer_check

    def _tables(self, items: Sequence[tuple[str, torch.Tensor]]) -> list[_Table] | None:
        """The items' tables, or None when a step over them cannot go the direct way."""
        if not self.device_tier.direct:
            return None
        tabs = [self.table_record(t) for t, _ in items]
        if self.gate.counts(tabs) or any(i.device.type != "cpu" or i.dim() != 1
                                         or i.dtype not in validate.INT_DTYPES for _, i in items):
            return None
        return tabs

    def _slots(self, tabs: list[_Table], items: Sequence[tuple[str, torch.Tensor]], sizes: list[int],
               trust: bool, known: bool = False) -> torch.Tensor | None:
        """Every item's ids' slots one item after another, on the device; None if one is not
        held or out of range. `trust`: ids the pipeline found held need no second look;
        `known`: every id is known held (the pipeline's check of this very batch)."""
        dev = self.device_tier
        flat = torch.empty(sum(sizes), dtype=torch.int64, pin_memory=dev.device.type == "cuda")
        at = 0
        # one thread: on the H100 (16 cores), the features' checks on the kernels' pool took 2 ms
        # a step of waiting (their Python parts hold the GIL), one thread ~1 ms
        for tab, (_, ids), n in zip(tabs, items, sizes):
            ids = ids.to(torch.int64)
            if dev.direct_keys(tab.index, tab.spec.num_rows, ids.numpy(), flat[at : at + n].numpy(),
                               check=not (known or trust and self.staging.held_whole(tab, ids))) != 1:
                return None
            at += n
        return hostread.to_device(flat, dev.device)

    def prepare(self, owner: Any, items: Sequence[tuple[str, torch.Tensor]], lengths: torch.Tensor,
                make: Callable[[torch.Tensor, list[int]], Any], held_at: int | None = None
                ) -> AheadStep | None:
        """A step made ahead on the pipeline's thread: the items' ids checked and turned into
        slots on the device, and `make(slots, sizes)` (the keyed batch) run on them; None
        when the step could not go the direct way (it then finds that out itself). `held_at`:
        the cache's removal count at which the pipeline found every one of these ids held
        (`StagingArea.holds` over this batch): they are not checked again."""
        tabs = self._tables(items)
        if tabs is None:
            return None
        # read before the check (or the pipeline's): a removal after it shows at the step
        removals = self.device_tier.removals if held_at is None else held_at
        sizes = [int(i.numel()) for _, i in items]
        slots = self._slots(tabs, items, sizes, trust=False, known=held_at is not None)
        if slots is None:
            return None
        return AheadStep(owner, [i for _, i in items], lengths, tabs, slots, sizes,
                         make(slots, sizes), removals)

    def forward(self, items: Sequence[tuple[str, torch.Tensor]],
                pool: Callable[[torch.Tensor, list[int], torch.Tensor, Any], R],
                owner: Any = None, lengths: torch.Tensor | None = None
                ) -> tuple[R, DirectRows] | None:
        """A step's forward the direct way, when the cache holds every id.

        `items`: (table, ids) pairs (a table may come more than once). `pool(slots, sizes,
        slab, made)` runs lock-free: `slots` every item's ids' slots one item after another
        (`sizes[i]` of item i), on the device, and `made` what the pipeline made ahead for
        exactly this input of `owner` (with `lengths`), else None. Returns None, with nothing
        done, when the step must go `BagPaths.step_forward`'s way: another device tier,
        admission or a trace counting, ids not 1-D integers on the host, not all held or out of
        range (that way raises the error), or a locked operation running.
        """
        tabs = self._tables(items)
        if tabs is None or not self.staging.begin_unlocked():
            return None
        try:
            dev = self.device_tier
            ahead = self.staging.step_ahead()
            if (ahead is not None and lengths is not None and ahead.removals == dev.removals
                    and ahead.fits(owner, items, lengths)):
                slots, sizes, made, removals = ahead.slots, ahead.sizes, ahead.made, ahead.removals
                self.prefetch_stats.steps_made_ahead += 1
            else:
                removals = dev.removals
                sizes = [int(i.numel()) for _, i in items]
                slots, made = self._slots(tabs, items, sizes, trust=True), None
                if slots is None:
                    return None
            out = pool(slots, sizes, dev.slab, made)
            self.staging.count_hits(slots)  # each position a device hit (no dedup to count rows)
            self.prefetch_stats.lock_free_bags += len({id(t) for t in tabs})  # tables, as staged
            return out, DirectRows(tabs, list(torch.split(slots, sizes)), slots, removals,
                                   self.staging.delivers())
        finally:
            self.staging.end_unlocked()

    def update(self, rows: DirectRows, update: Callable[[torch.Tensor, torch.Tensor | None], None],
               finite: torch.Tensor | None) -> bool:
        """The update of a `forward` step, in the device slab and lock-free: `update(slab,
        finite)` (the engine's), then the rows' stamps and dirty marks. `finite` (a device bool:
        whether the gradient is) is kept for `raise_deferred` when a prefetch pipeline
        delivered the batch, else read here (a sync) and raised on. False, with nothing done,
        when rows left the cache since the forward or a locked operation runs: the caller then
        updates through `BagPaths.step_backward`."""
        dev = self.device_tier
        if finite is not None and not rows.deferred:
            if not bool(finite):
                raise InvalidGradientError("the output gradient holds NaN/Inf values; nothing was updated")
            finite = None
        if not self.staging.begin_unlocked():
            return False
        try:
            if dev.removals != rows.removals:
                return False
            update(dev.slab, finite)
            tabs = list({id(t): t for t in rows.tabs}.values())
            if len({t.spec.stamp_col for t in tabs}) == 1:  # one stamp column: all rows at once
                self.stamp_many(tabs, dev.slab, [rows.slots] * len(tabs), finite)
            else:
                self.stamp_many(rows.tabs, dev.slab, rows.keys, finite)
            dev.dirty.index_fill_(0, rows.slots, True)
            self.defer_check(finite)
            return True
        finally:
            self.staging.end_unlocked()
