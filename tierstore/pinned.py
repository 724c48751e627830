"""The staging and pin area: a prefetched batch's rows staged up the tiers and pinned, and its
step's lock-free path over them."""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

import tierstore.hostread as hostread

from .backends.slab import Rows
from .gathered import Gathered, Staged
from .index import dedup

if TYPE_CHECKING:
    from .backends.set_tier import SetTier
    from .backends.slab import SlabTier
    from .backends.writeback import WriteBehind
    from .cascade import Cascade
    from .resolve import Layout
    from .store import _Table
    from .stored_rows import RowLoader


SCRATCH_SHARE = 16  # a selective device policy's scratch pad: 1/16 of the tier's slots


class StagingArea:
    """Staging (tierstore.prefetch, store lock held) and the lock-free path of a staged batch.

    The store builds it from its parts: the two cache tiers, the cascade (placement and
    write-down), the loader (rows cached nowhere), the write-behind ring (room for victims), the
    store lock, the table registry, the layout (staging slots), the payload width, and
    `closed()`, the store's state. It owns what staging shares with the steps: the batch handed
    to the consumer thread (`staged`, `deferring`), the hits and unpins of lock-free steps not
    told yet, and the barrier that keeps lock-free updates off while a locked section runs.
    """

    def __init__(self, device_tier: SlabTier | SetTier, host_tier: SlabTier, cascade: Cascade,
                 loader: RowLoader, writeback: WriteBehind, lock: threading.RLock,
                 tables: dict[str, _Table], layout: Layout, width: int,
                 closed: Callable[[], bool]) -> None:
        self.device_tier, self.host_tier = device_tier, host_tier
        self.cascade, self.loader, self.writeback = cascade, loader, writeback
        self.lock, self.tables, self.layout, self.width = lock, tables, layout, width
        self.closed = closed
        # lock-free updates of pinned rows (see _pinned_slots): a count of those running, and a
        # barrier that holds new ones off while a locked operation needs every row at rest
        self._compute = threading.Condition()
        self._inflight = 0
        self._barrier = 0
        # the batch in use, as the prefetch pipeline staged it: (consumer thread id,
        # {table: (sorted rows, device slots)}, pin epoch); its rows stay pinned until the
        # pipeline's release
        self.staged: tuple[int, dict[str, Staged], int] = (0, {}, -1)
        # the step the pipeline made ahead for that batch (`BagPaths.prepare_direct`), by thread
        self.ahead: tuple[int, Any] = (0, None)
        # the consumer thread whose batch is warm-only (0: none): its forward reads missed rows
        # where they are, and its backward moves them up once (`Cascade.access`'s `promote`)
        self.deferring = 0
        # batches released by the pipeline without the lock: their pins drop at the next locked
        # section (staging or any store call), after their hits are told
        self._pending_unpins: collections.deque = collections.deque()
        # device hits of lock-free gathers, not yet told (a deque: append and popleft are atomic)
        self._pending_hits: collections.deque[torch.Tensor] = collections.deque()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """The store lock, with no lock-free update of pinned rows running (they wait outside)."""
        with self.lock:
            with self._compute:
                self._barrier += 1
                while self._inflight:
                    self._compute.wait()
            try:
                self.drain_hits()
                self.drain_unpins()
                yield
            finally:
                with self._compute:
                    self._barrier -= 1

    def begin_unlocked(self) -> bool:
        """Start a lock-free update of pinned rows; False while a locked operation holds them."""
        with self._compute:
            if self._barrier or self.closed():
                return False
            self._inflight += 1
            return True

    def end_unlocked(self) -> None:
        """End a lock-free update `begin_unlocked` started (a waiting locked section may go on)."""
        with self._compute:
            self._inflight -= 1
            if not self._inflight:
                self._compute.notify_all()

    # the batch handed to the consumer thread -----------------------------------------------
    def use_batch(self, staged: tuple[dict[str, Staged], int, Any] | None, warm: bool) -> None:
        """Hand this (consumer) thread its batch: the slots the pipeline staged, their pin
        epoch and the step it made ahead (None: none), and whether it is warm-only (its misses
        stay where they are)."""
        ident = threading.get_ident()
        self.staged = (ident, staged[0], staged[1]) if staged else (0, {}, -1)
        self.ahead = (ident, staged[2]) if staged and staged[2] is not None else (0, None)
        self.deferring = ident if warm else 0

    def step_ahead(self) -> Any:
        """The step the pipeline made ahead for this thread's batch (`prepare_step`), or None."""
        owner, ahead = self.ahead
        return ahead if owner == threading.get_ident() else None

    def drop_batch(self) -> None:
        """Forget the consumer's batch (its rows are about to lose their pins)."""
        self.staged = (0, {}, -1)
        self.deferring = 0

    def promotes(self, thread: int | None = None) -> bool:
        """Whether gathers of `thread` (None: this one) move missed rows up (not in a warm-only batch)."""
        return self.deferring != (threading.get_ident() if thread is None else thread)

    def holds(self, ids: dict[str, torch.Tensor]) -> bool:
        """Whether a direct device tier (`SetTier.direct`) holds every row of a batch's ids
        (table -> host int64 ids; a read of the host mirror, no lock): such a batch needs no
        staging, its step reads every row where it is (`DirectSteps.forward`)."""
        dev = self.device_tier
        if not dev.direct:
            return False
        for name, i in ids.items():
            tab = self.tables.get(name)
            if tab is None or i.device.type != "cpu" or i.dtype != torch.int64:
                return False
            out = np.empty(i.numel(), dtype=np.int64)
            if dev.direct_keys(tab.index, tab.spec.num_rows, i.numpy(), out) != 1:
                return False
        return True

    def held_whole(self, tab: _Table, ids: torch.Tensor) -> bool:
        """Whether the pipeline found every one of exactly these ids held by the direct device
        tier (`Staged.held`, for this thread's batch) and no row has left it since: the step
        then needs no check of its own."""
        owner, staged, _ = self.staged
        got = staged.get(tab.spec.name)
        return (got is not None and got.held_at >= 0 and owner == threading.get_ident()
                and got.held_at == self.device_tier.removals and got.ids is not None
                and ids.dtype == torch.int64 and torch.equal(ids, got.ids))

    def delivers(self) -> bool:
        """Whether a prefetch pipeline hands this thread its batches (`use_batch`)."""
        return self.staged[0] == threading.get_ident()

    def count_hits(self, slots: torch.Tensor) -> None:
        """Queue the device hits of a step that read pinned rows; told at the next locked section."""
        self._pending_hits.append(slots)

    def unpin_later(self, entries: Iterable[tuple]) -> None:
        """Queue pins to drop at the next locked section: (table, rows) or (table, rows, device
        slots, pin epoch) entries, as `drain_unpins` takes them (lock-free)."""
        self._pending_unpins.extend(entries)

    def drain_unpins(self) -> None:
        """Drop the pins of batches the pipeline released lock-free (store lock held).

        An entry is (table, rows) or (table, rows, device slots, pin epoch): the slots where
        staging put every one of the rows, still theirs while the device tier's `pin_epoch` is
        unchanged (a pinned row never leaves otherwise, and the caches are exclusive, so no
        other tier holds one of them); then the pins are dropped by slot, without lookups.
        """
        pending, dev = self._pending_unpins, self.device_tier
        by_slot = []  # dropped together: one call for every table (repeats count)
        while pending:
            item = pending.popleft()
            tab = self.tables.get(item[0])
            if tab is None:
                continue
            if len(item) == 4 and item[3] == dev.pin_epoch:
                by_slot.append(item[2])
            else:
                self.pin(tab, item[1], -1)
        if by_slot:
            dev.pin(by_slot[0] if len(by_slot) == 1 else torch.cat(by_slot), -1)
        self._expire_scratch()

    def _expire_scratch(self) -> None:
        """Hand the scratch pad's rows whose last pin dropped to the write-behind ring (dirty
        ones; a clean one's newest version is below the caches already). Store lock held."""
        rows = self.device_tier.take_expired()
        if rows is not None and bool(rows.dirty.any()):  # all dirty, as a rule (their step
            # updated them): then no second copy of the rows
            self.cascade.write_down(rows if bool(rows.dirty.all()) else rows.take(rows.dirty))

    def drain_hits(self) -> None:
        """Count the hits of lock-free gathers and report the use to the policy (store lock held).

        Staging told the policy of this access of every one of these rows (a hit or an insert)
        when it pinned them, and they stayed pinned since, so no victim choice came between:
        the policy gets `on_use` (look-ahead drops the hint of this use), not a second `on_hit`,
        which would count one use twice and cost a queue move per row (~10% of staging with
        `hlfu`, BENCHMARKS.md session 11).
        """
        hits, dev = self._pending_hits, self.device_tier
        hinted = dev.policy.wants_future  # only a policy holding hints acts on a use
        while hits:
            slots = hits.popleft()
            dev.count_lookups(slots.numel(), slots.numel())
            if hinted:
                dev.policy.on_use(dev.ranked(slots))

    def _pinned_slots(self, tab: _Table, uniq: torch.Tensor) -> torch.Tensor | None:
        """Device slots of `uniq` from the batch the pipeline staged for this thread, or None.

        Lock-free: the rows were looked up under the lock when staged and are pinned until the
        pipeline releases the batch (from this same thread), so they cannot move: eviction never
        takes a pinned row, and anything else that removes one, or drops pins wholesale, bumps
        the device tier's `pin_epoch`, which must still be the one seen at staging.
        """
        owner, staged, epoch = self.staged
        got = staged.get(tab.spec.name)
        if got is None or got.held_at >= 0 or owner != threading.get_ident() \
                or epoch != self.device_tier.pin_epoch:
            return None  # (a batch a direct cache held whole pinned nothing)
        rows, slots = got.rows, got.slots
        u = uniq.numpy()
        order = np.argsort(u)  # searching in key order: ~3.7x faster than random probes here
        pos = np.empty_like(order)
        pos[order] = np.minimum(np.searchsorted(rows, u[order]), len(rows) - 1)
        if not np.array_equal(rows[pos], u):
            return None
        s = slots[pos]
        return None if len(s) == 0 or s.min() < 0 else torch.from_numpy(s)

    def staged_indexes(self, tab: _Table, ids: torch.Tensor) -> Gathered | None:
        """The step's indexes staging made on the device for exactly these ids, or None."""
        owner, staged, epoch = self.staged
        got = staged.get(tab.spec.name)
        if (got is None or got.inverse is None or owner != threading.get_ident()
                or epoch != self.device_tier.pin_epoch or ids.device.type != "cpu"
                or not torch.equal(ids, got.ids)):
            return None
        return Gathered(got.unique, got.inverse, torch.empty(0, tab.spec.dim), got.dslots,
                        epoch, pinned=True)

    def pinned_rows(self, tab: _Table, ids: torch.Tensor) -> Gathered | None:
        """A table's rows of the batch the pipeline pinned for this thread, or None (lock-free,
        inside `begin_unlocked`)."""
        dev = self.device_tier
        if ids.numel() == 0:
            empty = torch.empty(0, dtype=torch.int64)
            return Gathered(empty, empty, torch.empty(0, tab.spec.dim), hostread.to_device(empty, dev.device),
                            dev.pin_epoch, pinned=True)
        got = self.staged_indexes(tab, ids)
        if got is not None:
            return got
        uniq, inv = dedup(ids)  # the ids are host-side (validated there): no device sync
        dslots = self._pinned_slots(tab, uniq)
        if dslots is None:
            return None
        dslots = dslots.to(dev.device, non_blocking=True)  # a copy to the device, not from it
        return Gathered(uniq, inv, torch.empty(0, tab.spec.dim), dslots, dev.pin_epoch, pinned=True)

    # staging (called by tierstore.prefetch with the store lock held) ---------------------
    def window_fits(self, rows: int) -> bool:
        """Whether a prefetch window of `rows` staged rows (counted per batch) can stay pinned.

        Without staging slots, only when the caches could hold it twice over: pinned rows
        cannot be evicted, and staging must leave the running step room. With staging slots
        (`staging_capacity`), rows the device policy refuses wait there instead of displacing
        cached ones, so the window fits when the cache and the staging slots hold it once (the
        store has them only with a selective policy and no host tier). Automatic staging slots
        (`Layout.staging_auto`) are activated here as windows grow: one a window row, up to the
        reserve (a window's rows the cache refuses or cannot hold wait there).
        """
        dev = self.device_tier
        if 0 < self.layout.table_rows <= dev.capacity:  # the device tier holds every declared
            return True  # row: nothing is ever evicted, so pins never stand in the way
        if dev.staging:  # automatic slots: as many as the window has rows (the most of them the
            # policy may refuse), up to the reserve; a slot costs a row's memory once used
            if self.layout.staging_auto and dev.scratch_slots < min(rows, dev.staging):
                dev.grow_staging(min(rows, dev.staging))
            return rows <= dev.capacity + dev.scratch_slots
        return 2 * rows <= dev.capacity + self.host_tier.capacity

    def stage_many(self, items: list[tuple[_Table, torch.Tensor]],
                   host_copies: list[torch.Tensor] | None = None
                   ) -> list[tuple[tuple[int, int, int], torch.Tensor]]:
        """Bring each table's sorted unique rows up the hierarchy and pin them, all tables at
        once: ((device, host, ssd) counts, device slots or -1 where a row overflowed to the
        host) per table.

        The keys of all tables go through each step together: one device lookup, one pin of the
        hits, one host lookup and removal of the misses it holds, the rest loaded together
        (`loader.load_many`: ring and read-ahead buffers table by table, then one log read for
        every table, then LMDB), and one `cascade.place` of every miss. So the per-call work
        of each step (index probes, victim choice, policy and index updates, the hand-off to
        the write-behind ring) is done once a batch instead of once a table. Which rows land where may differ
        from staging table by table (victims are chosen once, with every hit protected); no value does.

        `host_copies`: a list to receive each table's slots on the host too (a batch whose rows
        were all on the device reuses the lookup's copy: one device wait fewer on CUDA).
        """
        dev, host = self.device_tier, self.host_tier
        sizes = [int(uniq.numel()) for _, uniq in items]
        total = sum(sizes)
        if total == 0:
            if host_copies is not None:
                host_copies.extend(torch.empty(0, dtype=torch.int64) for _ in items)
            return [((0, 0, 0), torch.empty(0, dtype=torch.int64, device=dev.device)) for _ in items]
        if (dev.device.type == "cpu" and not host.capacity and getattr(dev.index, "probe", None)
                and dev.index.fast(items[0][1])):
            return self._stage_one_tier(items, sizes, host_copies)
        seg = torch.repeat_interleave(torch.arange(len(items)), torch.tensor(sizes))
        tabs = torch.cat([tab.tix.expand(n) for (tab, _), n in zip(items, sizes)])
        rows = torch.cat([uniq.to("cpu", torch.int64) for _, uniq in items])
        to_dev = hostread.to_device
        find_host = getattr(dev.index, "find_host", None)  # a direct sets cache: its host mirror
        dslots_h = find_host(tabs, rows) if find_host is not None else None
        if dslots_h is not None:
            dslots = to_dev(dslots_h, dev.device)
        else:
            dslots = dev.lookup(to_dev(tabs, dev.device), to_dev(rows, dev.device), count=False)
            # read back through an event: a sync-debug-mode step may run on the training thread
            (dslots_h,) = hostread.to_host(dslots)
        dhit = dslots_h >= 0
        miss = torch.nonzero(~dhit).flatten()
        m = miss.numel()
        if m:  # room in the write-behind ring for the victims, or fail before any row moves
            self.writeback.reserve(m)
        hit_slots = to_dev(dslots_h[dhit], dev.device) if m else dslots
        dev.touch(hit_slots)
        dev.pin(hit_slots, 1)
        staged = dslots.clone()
        nh_of = torch.zeros(len(items), dtype=torch.int64)
        if m:
            mtabs, mrows, mseg = tabs[miss], rows[miss], seg[miss]
            payload = torch.empty((m, self.width), dtype=torch.float32)
            dirty = torch.zeros(m, dtype=torch.bool)
            pins = torch.ones(m, dtype=torch.int32)
            hslots = host.lookup(mtabs, mrows, count=False)
            hhit = hslots >= 0
            if bool(hhit.any()):  # host hits leave the host tier (the caches are exclusive)
                hidx = torch.nonzero(hhit).flatten()
                moved = host.remove(hslots.index_select(0, hidx))
                payload.index_copy_(0, hidx, moved.payload)
                dirty.index_copy_(0, hidx, moved.dirty)
                if moved.pins is not None:
                    pins.index_copy_(0, hidx, moved.pins + 1)
                nh_of = torch.bincount(mseg[hidx], minlength=len(items))
            cold = torch.nonzero(~hhit).flatten()
            cseg = mseg[cold]
            which = torch.unique(cseg).tolist()  # each table's rows in key order, all loaded at once
            ats = [cold[cseg == i] for i in which]
            loaded = self.loader.load_many([(items[i][0], mrows[at]) for i, at in zip(which, ats)])
            for at, got in zip(ats, loaded):
                payload.index_copy_(0, at, got)
            self._place_misses(Rows(mtabs, mrows, payload, dirty, pins), miss, staged, hit_slots, cold)
        nd_of = torch.bincount(seg[dhit], minlength=len(items))
        if host_copies is not None:  # all hits: the staged slots are the lookup's
            full = dslots_h if not m else hostread.to_host(staged)[0]
            host_copies.extend(full.split(sizes))
        out, lo = [], 0
        for i, n in enumerate(sizes):
            nd, nh = int(nd_of[i]), int(nh_of[i])
            out.append(((nd, nh, n - nd - nh), staged[lo : lo + n]))
            lo += n
        return out

    def _stage_one_tier(self, items: list[tuple[_Table, torch.Tensor]], sizes: list[int],
                        host_copies: list[torch.Tensor] | None
                        ) -> list[tuple[tuple[int, int, int], torch.Tensor]]:
        """`stage_many` on a CPU device tier with no host tier below it (the resolved default
        on a CPU): one compiled probe of every key (slots, misses and hits at once), then the
        misses loaded and placed with numpy bookkeeping, no torch op a phase. Same moves, same
        slots, same counts as the general path."""
        dev = self.device_tier
        rows = np.concatenate([u.numpy() for _, u in items]) if len(items) > 1 else items[0][1].numpy()
        rows = np.ascontiguousarray(rows, dtype=np.int64)
        tabs = np.repeat(np.array([int(tab.index) for tab, _ in items], dtype=np.int64), sizes)
        slots, miss, hits = dev.index.probe(tabs, rows)
        m = len(miss)
        if m:  # room in the write-behind ring for the victims, or fail before any row moves
            self.writeback.reserve(m)
        hit_slots = torch.from_numpy(hits)
        dev.touch(hit_slots)
        dev.pin(hit_slots, 1)
        staged = torch.from_numpy(slots)  # the lookup's own array: filled in below
        bounds = np.searchsorted(miss, np.cumsum([0] + sizes)) if m else np.zeros(len(sizes) + 1, np.int64)
        if m:
            mtabs, mrows = torch.from_numpy(tabs[miss]), torch.from_numpy(rows[miss])
            which = [i for i in range(len(items)) if bounds[i + 1] > bounds[i]]
            loaded = self.loader.load_many([(items[i][0], mrows[bounds[i] : bounds[i + 1]]) for i in which])
            payload = loaded[0] if len(loaded) == 1 else torch.cat(loaded)
            if dev.fused_placement:  # `_place_misses` in one compiled pass, same outcome
                refused = self._refused_mask(None, mtabs, mrows)
                got, evicted = dev.place_misses(tabs[miss], rows[miss], payload.contiguous(), refused)
                slots[miss] = got
                if evicted is not None:
                    self.cascade.write_down(evicted)
            else:
                self._place_misses(Rows(mtabs, mrows, payload, torch.zeros(m, dtype=torch.bool),
                                        torch.ones(m, dtype=torch.int32)),
                                   torch.from_numpy(miss), staged, hit_slots, torch.arange(m))
        if host_copies is not None:
            host_copies.extend(staged.split(sizes))
        out, lo = [], 0
        for i, n in enumerate(sizes):
            nd = n - int(bounds[i + 1] - bounds[i])
            out.append(((nd, 0, n - nd), staged[lo : lo + n]))
            lo += n
        return out

    def _place_misses(self, moving: Rows, placed: torch.Tensor, staged: torch.Tensor,
                      hit_slots: torch.Tensor, cold: torch.Tensor) -> None:
        """Place a batch's staged misses (`moving`, at positions `placed` of the batch; `cold`:
        which of them came from below the caches) op by op: rows the device policy refuses to
        the scratch pad, the rest into the device tier (its staging slots, or the cascade),
        recording each row that landed on the device in `staged`."""
        dev, m, to_dev = self.device_tier, len(moving), hostread.to_device
        pad = self._refused(cold, moving.tabs, moving.rows)
        if pad is not None:  # refused by the policy: to the scratch pad while it has room
            kp = dev.insert_scratch(moving.take(pad))
            if kp:
                staged.index_copy_(0, to_dev(placed[pad[:kp]], staged.device), dev.last_slots[:kp])
                rest = torch.ones(m, dtype=torch.bool)
                rest[pad[:kp]] = False
                moving, placed = moving.take(rest), placed[rest]
        if dev.staging:  # one cache tier, whose staging slots take what it cannot
            self._place_staged(moving, placed, staged, hit_slots)
        else:
            k = self.cascade.place(moving, protect=hit_slots, overflow_first=True)
            if k:  # the first k misses, in order, landed on the device
                staged.index_copy_(0, to_dev(placed[:k], staged.device), dev.last_slots[:k])

    def _place_staged(self, moving: Rows, placed: torch.Tensor, staged: torch.Tensor,
                      protect: torch.Tensor) -> None:
        """Stage misses in a device tier with staging slots and no host tier: into the cache,
        evicting unpinned victims (dirty ones to the write-behind ring), and the rows it has no
        room for into staging slots, so a staged row keeps its pin. Only rows neither holds
        (both full) go to the ring, unpinned: their batch then takes the locked path."""
        dev = self.device_tier
        k, evicted = dev.insert(moving, protect=protect, keep_clean=False)
        if k:  # the first k misses, in order, landed in the cache
            staged.index_copy_(0, placed[:k], dev.last_slots[:k])
        if evicted is not None and len(evicted):  # only dirty victims are kept
            self.cascade.write_down(evicted)
        if k == len(moving):
            return
        rest = moving.take(slice(k, None))
        kp = dev.insert_scratch(rest)
        if kp:
            staged.index_copy_(0, placed[k : k + kp], dev.last_slots[:kp])
        if kp < len(rest):
            left = rest.take(slice(kp, None))
            if bool(left.dirty.any()):
                self.cascade.write_down(left.take(left.dirty))

    def _refused(self, cold: torch.Tensor, tabs: torch.Tensor, rows: torch.Tensor
                 ) -> torch.Tensor | None:
        """Positions among a staged batch's misses of the rows from below the caches that the
        device policy does not admit (`Policy.admit`), or None: all admitted.

        With a selective policy (hlfu) a CPU device tier with no host tier below it sets aside a
        scratch pad of 1/`SCRATCH_SHARE` of its slots, taken from free slots only, for these
        rows: staged there they are pinned for their steps like any staged row, but evict nothing
        and are not ranked, and they leave for the write-behind ring at their last unpin. With a
        host tier the pad lost (more rows read: BENCHMARKS.md, session 12), so rows go up as
        before.
        """
        refused = self._refused_mask(cold, tabs, rows)
        return None if refused is None else cold[torch.from_numpy(refused)]

    def _refused_mask(self, cold: torch.Tensor | None, tabs: torch.Tensor, rows: torch.Tensor
                      ) -> np.ndarray | None:
        """`_refused` as a mask over `cold` (over every row when `cold` is None), or None."""
        dev = self.device_tier
        n = rows.numel() if cold is None else cold.numel()
        if not n or not dev.selective or self.host_tier.capacity:
            return None
        if not dev.reserve_scratch(dev.capacity // SCRATCH_SHARE):  # none on a CUDA tier
            return None
        admit = dev.admit(tabs, rows) if cold is None else \
            dev.admit(tabs.index_select(0, cold), rows.index_select(0, cold))
        if admit is None:
            return None
        refused = ~admit.numpy()
        return refused if refused.any() else None

    def pin(self, tab: _Table, uniq: torch.Tensor, delta: int) -> None:
        """Add `delta` to the prefetch pins of those rows wherever they are cached."""
        tabs, to_dev = tab.tix, hostread.to_device
        for tier in (self.device_tier, self.host_tier):
            slots = tier.lookup(to_dev(tabs, tier.device), to_dev(uniq, tier.device), count=False)
            # a tier that skips absent (-1) slots takes them as they are: no mask, no sync
            tier.pin(slots if tier.pins_skip_absent else slots[slots >= 0], delta)
        if delta < 0:
            self._expire_scratch()

    def hint(self, tab: _Table, rows: torch.Tensor, next_use: torch.Tensor) -> None:
        """Tell look-ahead policies the next known use (batch number) of cached rows."""
        tabs = tab.tix
        for tier in (self.device_tier, self.host_tier):
            if not tier.policy.wants_future:
                continue
            slots = tier.lookup(tabs.to(tier.device), rows.to(tier.device), count=False)
            found = (slots >= 0) & (slots < tier.capacity)  # not the staging slots
            tier.policy.on_future(slots[found], next_use.to(tier.device)[found])
