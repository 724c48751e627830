"""TierStore's tier cascade: find rows in the device and host tiers, move them, write victims back."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from .backends.slab import Rows
from .fused import BatchUpdate
from .index import absent_from, absent_many

if TYPE_CHECKING:
    from .backends.slab import SlabTier
    from .backends.writeback import WriteBehind
    from .stats import SsdStats
    from .store import _Table
    from .stored_rows import RowLoader


@dataclass(eq=False)
class Assign:
    """An update that sets whole payload rows: `rows[u]` [u, width] becomes unique row u's payload.

    The step engine updates a gathered payload once for every table of a step; the store then
    writes it back through `Cascade.access` with this update (no second optimizer pass).
    """

    rows: torch.Tensor  # float32 [u, width], CPU

    def apply(self, table: torch.Tensor, slots: torch.Tensor) -> None:
        """Write the rows to `table[slots]`."""
        table.index_copy_(0, slots, self.rows.to(table.device))


class Cascade:
    """Rows move up to the device tier on use; victims cascade to the host tier and the write-behind ring.

    Built by the store from its parts: the two cache tiers, the loader of rows cached nowhere,
    the write-behind ring, and the clock's `stamp` / `clock_value` (an update records the clock
    in its rows). `last_sources` is (device hits, host hits, loads) of the latest access.
    """

    def __init__(self, device_tier: SlabTier, host_tier: SlabTier, loader: RowLoader,
                 writeback: WriteBehind, ssd_stats: SsdStats, width: int, device: torch.device,
                 stamp: Callable[[_Table, torch.Tensor, torch.Tensor], None],
                 clock_value: Callable[[], torch.Tensor]) -> None:
        self.device_tier = device_tier
        self.host_tier = host_tier
        self.loader = loader
        self.writeback = writeback
        self.ssd_stats = ssd_stats
        self.width = width
        self.device = device
        self.stamp = stamp
        self.clock_value = clock_value
        self.last_sources = (0, 0, 0)
        self.last_dslots: torch.Tensor | None = None  # device slots of the latest all-resident access
        self.marks: np.ndarray | None = None  # scratch for `distinct_resident`, one per device slot

    def resident_slots(self, tab: _Table, ids: torch.Tensor) -> torch.Tensor | None:
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

    def access(self, tab: _Table, uniq: torch.Tensor, update: BatchUpdate | Assign | None,
                count: bool = True, dslots: torch.Tensor | None = None,
                promote: bool = True, known: torch.Tensor | None = None) -> torch.Tensor | None:
        """Locate sorted unique rows, optionally update them, and promote them to the device tier.

        `dslots` are the rows' device slots when the caller has just looked them up. Returns
        the payloads [u, width] when reading (`update` is None), else None. With
        `promote=False` (a warm-only step) a read moves no row (`_read_in_place`), and an update
        brings up from below only the rows the device policy admits (`Policy.admit`), handing
        the others to the write-behind ring. (Prefetch staging, which pins rows instead, is
        `StagingArea.stage_many`.) `known` are the rows' payloads [u, width] as a read that
        moved nothing found them, with no update since: an update takes the rows cached nowhere
        from there instead of loading them again.
        """
        dev = self.device_tier
        n = uniq.numel()
        if dslots is None:
            dslots = dev.lookup(tab.tix.to(dev.device), uniq.to(dev.device), count=False)
        dhit = dslots >= 0
        nd = int(dhit.sum())
        if nd < n and update is None and not promote:
            return self._read_in_place(tab, uniq, dslots, dhit, nd, count)
        if nd < n:  # rows will move: room in the write-behind ring for the victims, or fail now
            self.writeback.reserve(n - nd)
        if count:
            dev.count_lookups(n, nd)
        if nd == n:
            self.last_sources = (n, 0, 0)
            self.last_dslots = dslots
            dev.touch(dslots)
            if update is None:
                return dev.read(dslots)
            update.apply(dev.slab, dslots)  # in place in the device slab
            self.stamp(tab, dev.slab, dslots)
            dev.mark_dirty(dslots)
            return None
        self.last_dslots = None
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
        if known is not None:  # a private CPU copy of the misses' rows: the update changes them
            part = (known if miss is None else known.index_select(0, miss.to(known.device))).cpu()
            known = part.clone() if part is known else part  # copied once, not again in `_cold`
        mpay, mdirty, mpins, hhit = self._fetch_misses(tab, miss_rows, count, known=known)
        nh = int(hhit.sum())
        self.last_sources = (nd, nh, m - nh)
        if nd:  # assemble the whole batch: device hits and the rows fetched from below
            payload = torch.empty((n, self.width), dtype=torch.float32)
            payload.index_copy_(0, hit_idx, dev.read(hit_slots).cpu())
            payload.index_copy_(0, miss, mpay)
            dev.touch(hit_slots)
        else:
            payload = mpay
        if update is not None:
            update.apply(payload, torch.arange(n))
            payload[:, tab.spec.stamp_col] = self.clock_value()
            tab.writes += 1  # as `_stamp` counts an update in place
            if nd:
                dev.write(hit_slots, payload.index_select(0, hit_idx))
                mpay = payload.index_select(0, miss)
            mdirty = torch.ones(m, dtype=torch.bool)
        moving = Rows(tab.tix.expand(m), miss_rows, mpay, mdirty, mpins)
        if update is not None and not promote and nh < m:  # rows from below: admitted ones only
            below = torch.nonzero(~hhit).flatten()  # rows the host tier held stay cached
            admit = self.device_tier.admit(moving.tabs.index_select(0, below),
                                           miss_rows.index_select(0, below))
            if admit is not None:
                keep = hhit.clone()
                keep[below] = admit
                self.write_down(moving.take(~keep))
                moving = moving.take(keep)
        self.place(moving, protect=hit_slots)
        return None if update is not None else payload.to(self.device, non_blocking=True)

    def _read_in_place(self, tab: _Table, uniq: torch.Tensor, dslots: torch.Tensor,
                       dhit: torch.Tensor, nd: int, count: bool) -> torch.Tensor:
        """Payloads [u, width] of sorted unique rows read wherever they are, moving none.

        A warm-only batch's forward reads this way: the caches cannot hold its rows until the
        backward, so rows it promoted would only be evicted by later tables' forwards and
        fetched again. The backward's `access` moves each row up once, after its update, and
        tells the policies of the access then (so it is reported once, not here).
        """
        dev = self.device_tier
        n = uniq.numel()
        if count:
            dev.count_lookups(n, nd)
        if not nd:
            payload, _, _, hhit = self._fetch_misses(tab, uniq, count, take=False)
            miss_n = n
        else:
            hit_idx = torch.nonzero(dhit).flatten()
            miss = torch.nonzero(~dhit).flatten().cpu()
            mpay, _, _, hhit = self._fetch_misses(tab, uniq.index_select(0, miss), count, take=False)
            payload = torch.empty((n, self.width), dtype=torch.float32)
            payload.index_copy_(0, hit_idx.cpu(), dev.read(dslots.index_select(0, hit_idx)).cpu())
            payload.index_copy_(0, miss, mpay)
            miss_n = miss.numel()
        nh = int(hhit.sum())
        self.last_sources = (nd, nh, miss_n - nh)
        self.last_dslots = None
        return payload.to(self.device, non_blocking=True)

    def _fetch_misses(self, tab: _Table, rows: torch.Tensor, count: bool, take: bool = True,
                      known: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Take device-missed rows out of the host tier or load them from LMDB.

        Returns (payload [m, width], dirty [m], pins [m] or None, host hit mask [m]); host
        hits leave the host tier (the caches are exclusive), or with `take=False` stay there,
        read (their dirty bits and pins are then not returned: all False / None). `known`
        (the rows' current payloads) replaces the loads.
        """
        host = self.host_tier
        m = rows.numel()
        hslots = host.lookup(tab.tix, rows, count=False)
        hhit = hslots >= 0
        nh = int(hhit.sum())
        if count:
            host.count_lookups(m, nh)
        if nh == 0:
            return self._cold(tab, rows, None, known), torch.zeros(m, dtype=torch.bool), None, hhit
        if not take:
            payload = torch.empty((m, self.width), dtype=torch.float32)
            hidx = torch.nonzero(hhit).flatten()
            payload.index_copy_(0, hidx, host.read(hslots.index_select(0, hidx)))
            if nh < m:
                cidx = torch.nonzero(~hhit).flatten()
                payload.index_copy_(0, cidx, self.loader.load(tab, rows.index_select(0, cidx)))
            return payload, torch.zeros(m, dtype=torch.bool), None, hhit
        if nh == m:
            moved = host.remove(hslots)
            return moved.payload, moved.dirty, moved.pins, hhit
        hidx = torch.nonzero(hhit).flatten()
        cidx = torch.nonzero(~hhit).flatten()
        moved = host.remove(hslots.index_select(0, hidx))
        payload = torch.empty((m, self.width), dtype=torch.float32)
        payload.index_copy_(0, hidx, moved.payload)
        payload.index_copy_(0, cidx, self._cold(tab, rows, cidx, known))
        dirty = torch.zeros(m, dtype=torch.bool).index_copy_(0, hidx, moved.dirty)
        pins = torch.zeros(m, dtype=torch.int32).index_copy_(0, hidx, moved.pins)
        return payload, dirty, pins, hhit

    def _cold(self, tab: _Table, rows: torch.Tensor, idx: torch.Tensor | None,
              known: torch.Tensor | None) -> torch.Tensor:
        """Payloads of `rows[idx]` (all when None), cached nowhere: from `known` (the caller's own
        copy, updated in place), else `_load`."""
        if known is not None:
            return known if idx is None else known.index_select(0, idx)
        return self.loader.load(tab, rows if idx is None else rows.index_select(0, idx))

    def uncached(self, tab: _Table, rows: torch.Tensor) -> torch.Tensor:
        """Mask of rows in no cache tier and not in the write-behind ring (store lock held)."""
        indexes = (self.device_tier.index, self.host_tier.index, self.writeback.index)
        with self.writeback.cv:
            return absent_from(indexes, tab.index, rows)

    def uncached_many(self, items: list[tuple[_Table, torch.Tensor]]) -> list[torch.Tensor]:
        """`uncached` for several tables: a device tier's index probed once for all."""
        indexes = (self.device_tier.index, self.host_tier.index, self.writeback.index)
        with self.writeback.cv:
            return absent_many(indexes, [(tab.index, rows) for tab, rows in items])

    def distinct_resident(self, slots: torch.Tensor) -> torch.Tensor | None:
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
        if self.marks is None:
            self.marks = np.empty(self.device_tier.slots, dtype=np.int32)
        pos = np.arange(n)
        self.marks[s] = pos
        return torch.from_numpy(pos) if np.array_equal(self.marks[s], pos) else None

    def place(self, moving: Rows, protect: torch.Tensor, overflow_first: bool = False) -> int:
        """Insert rows into the device tier; victims and overflow cascade to host, then LMDB.

        Returns k: the first k rows landed in the device tier (at `device_tier.last_slots`).
        The device's victims take host slots first (`tests/test_store.py` counts on it), or,
        with `overflow_first` (staging), the rows that did not fit the device tier: those are
        pinned for the coming steps, the victims are not. Only dirty rows leave the host tier
        for LMDB: a clean row is already there (or is its lazy init), so the bottom tier drops
        clean victims without copying them.
        """
        if len(moving) == 0:
            return 0
        host = self.host_tier
        k, evicted = self.device_tier.insert(moving, protect=protect, keep_clean=host.capacity > 0)
        down = [evicted, moving.take(slice(k, None)) if k < len(moving) else None]
        down = [p for p in (down[::-1] if overflow_first else down) if p is not None and len(p)]
        if not down:
            return k
        spill_in = Rows.cat([p.to(torch.device("cpu")) for p in down])
        k2, spill = host.insert(spill_in, keep_clean=False)
        parts = [] if spill is None else [spill]
        if k2 < len(spill_in):
            rest = spill_in.take(slice(k2, None))
            if bool(rest.dirty.any()):
                parts.append(rest.take(rest.dirty))
        if parts:
            self.write_down(Rows.cat(parts))
        return k

    def write_down(self, rows: Rows) -> None:
        """Hand dirty rows (any tables) to the write-behind ring; its writer thread writes them to LMDB."""
        if len(rows) == 0:
            return
        self.writeback.put(rows)
        self.ssd_stats.writebacks += len(rows)
