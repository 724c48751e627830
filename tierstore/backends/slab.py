"""A cache tier: a tensor slab of row payloads, a hash index, dirty bits and an eviction policy."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

import tierstore._kernels as _kernels
import tierstore._memory as _memory

from ..index import HashIndex
from ..policies import Evictable, make_policy
from ..policies.base import key_hash, key_hash_np
from ..stats import TierStats
from . import stage_kernels

_NO_MARKS, _NO_SLOTS = np.empty(0, dtype=np.bool_), np.empty(0, dtype=np.int64)  # add_pins: no pad


@dataclass
class Rows:
    """A batch of rows moving between tiers: keys, payloads and dirty bits."""

    tabs: torch.Tensor  # int64 [n] table index
    rows: torch.Tensor  # int64 [n] row id
    payload: torch.Tensor  # float32 [n, width]
    dirty: torch.Tensor  # bool [n]
    pins: torch.Tensor | None = None  # int32 [n] prefetch pins travelling with the rows

    def __len__(self) -> int:
        return int(self.rows.numel())

    def take(self, sel: torch.Tensor | slice) -> Rows:
        """Rows selected by an index or mask tensor (copies), or by a slice (views)."""
        if isinstance(sel, slice):
            return Rows(self.tabs[sel], self.rows[sel], self.payload[sel], self.dirty[sel],
                        None if self.pins is None else self.pins[sel])
        # index_select, not advanced indexing: ~3x faster on [n, width] payloads on the CPU
        idx = torch.nonzero(sel).flatten() if sel.dtype == torch.bool else sel

        def pick(t: torch.Tensor) -> torch.Tensor:
            return t.index_select(0, idx if idx.device == t.device else idx.to(t.device))

        return Rows(pick(self.tabs), pick(self.rows), pick(self.payload), pick(self.dirty),
                    None if self.pins is None else pick(self.pins))

    def to(self, device: torch.device) -> Rows:
        """The same rows on another device."""
        if self.rows.device == device:
            return self
        nb = device.type != "cpu"  # to a device: no blocking copy (a read back blocks, as it must)
        return Rows(self.tabs.to(device, non_blocking=nb), self.rows.to(device, non_blocking=nb),
                    self.payload.to(device, non_blocking=nb), self.dirty.to(device, non_blocking=nb),
                    None if self.pins is None else self.pins.to(device, non_blocking=nb))

    @staticmethod
    def cat(parts: list[Rows]) -> Rows:
        """Concatenate batches (on the first part's device); a single part is returned as is."""
        dev = parts[0].rows.device
        parts = [p.to(dev) for p in parts]
        if len(parts) == 1:
            return parts[0]
        pins = None
        if any(p.pins is not None for p in parts):
            pins = torch.cat([p.pins if p.pins is not None else
                              torch.zeros(len(p), dtype=torch.int32, device=dev) for p in parts])
        return Rows(torch.cat([p.tabs for p in parts]), torch.cat([p.rows for p in parts]),
                    torch.cat([p.payload for p in parts]), torch.cat([p.dirty for p in parts]), pins)


class SlabTier:
    """A fixed-capacity write-back cache of row payloads on one device (GPU HBM or host DDR).

    Slots hold `[embedding | optimizer state]` payloads of width `width` (the widest table's).
    The policy picks victims; the tier evicts them and hands them (with dirty bits) to the
    caller, which moves them down a tier. `pins` protect slots from eviction (prefetch).
    """

    pins_skip_absent = False  # `pin` takes resident slots only (callers drop the -1s)
    direct = False  # slots change owners (`SetTier.direct`: a cache with a line for every row)

    def __init__(self, name: str, capacity: int, width: int, policy: str,
                 device: torch.device | str = "cpu", pin_memory: bool = False,
                 staging: int = 0, staging_active: int | None = None) -> None:
        self.name = name
        self.capacity = int(capacity)
        self.width = int(width)
        self.device = torch.device(device)
        # `staging` extra slots past the cache's `capacity` form its scratch pad (CPU only):
        # the policy never sees them (slots >= capacity), and the cache keeps all its slots.
        # The first `staging_active` of them (all by default) are in use from the start; the
        # rest are a reserve that `grow_staging` activates, whose rows are never written before
        self.staging = int(staging) if self.device.type == "cpu" else 0
        self.slots = self.capacity + self.staging  # every slot: the cache's, then the pad's
        active = self.staging if staging_active is None else min(int(staging_active), self.staging)
        self.slab = _memory.full((self.slots, self.width), 0.0, torch.float32, self.device,
                                 rows=self.capacity + active)
        if pin_memory and self.device.type == "cpu":
            self.slab = self.slab.pin_memory()
        self.index = HashIndex(self.slots, self.device)
        self.policy = make_policy(policy, self.capacity, self.device)
        self.dirty = torch.zeros(self.slots, dtype=torch.bool, device=self.device)
        self.occupied = torch.zeros(self.slots, dtype=torch.bool, device=self.device)
        self.pins = torch.zeros(self.slots, dtype=torch.int32, device=self.device)
        # free slots as a preallocated stack: _free_buf[:_nfree], top at the end
        self._free_buf = torch.arange(self.capacity - 1, -1, -1, dtype=torch.int64, device=self.device)
        self._nfree = self.capacity
        self.stats = TierStats()
        self.generation = 0  # bumped whenever a slot changes owner (insert or release)
        # bumped whenever a pinned row leaves (remove) or pins are dropped wholesale: a batch's
        # staged slots stay valid while this is unchanged (victims are never pinned)
        self.pin_epoch = 0
        self.gather_pins = False  # True: the CUDA way of reading pins (tests force it on CPU)
        self._protect_scratch: np.ndarray | None = None
        self._protected = np.empty(0, dtype=np.int64)
        # slots the last `insert` filled, in row order (its first k rows): callers that need
        # where rows landed read them here instead of looking the keys up again
        self.last_slots = torch.empty(0, dtype=torch.int64, device=self.device)
        # the scratch pad (`reserve_scratch`): slots set aside for staged rows the policy did
        # not admit; such a row is pinned, unknown to the policy, and leaves at its last unpin
        self.transient = np.zeros(self.slots, dtype=np.bool_)
        # free pad slots, a stack: the active staging slots from the start, else none until reserved
        self._scratch = np.arange(self.capacity + active - 1, self.capacity - 1, -1, dtype=np.int64)
        self.scratch_slots = active  # slots set aside so far (free or holding a row)
        self._expired: list[np.ndarray] = []  # pad slots whose pins reached zero
        self._pad_marks: np.ndarray | None = None  # scratch of `_distinct_pad`, per staging slot

    @property
    def size(self) -> int:
        """Number of occupied slots (scratch-pad rows included)."""
        return self.usable - self._nfree - len(self._scratch)

    @property
    def usable(self) -> int:
        """Slots in use or free to use: the cache's and the active staging slots."""
        return self.capacity + self.scratch_slots if self.staging else self.slots

    def grow_staging(self, n: int) -> int:
        """Activate staging slots from the reserve until `n` are active (at most `staging`);
        returns how many are active. The new slots go to the bottom of the pad's stack."""
        n = min(int(n), self.staging)
        if n > self.scratch_slots:
            new = np.arange(self.capacity + n - 1, self.capacity + self.scratch_slots - 1, -1,
                            dtype=np.int64)
            self._scratch = np.concatenate([new, self._scratch])
            self.scratch_slots = n
        return self.scratch_slots

    def lookup(self, tabs: torch.Tensor, rows: torch.Tensor, count: bool = True) -> torch.Tensor:
        """Slots holding the keys (-1 where absent); counts lookups, hits and misses."""
        slots = self.index.find(tabs, rows)
        if count:
            self.count_lookups(rows.numel(), int((slots >= 0).sum()))
        return slots

    def count_lookups(self, n: int, hits: int) -> None:
        """Add `n` lookups, `hits` of which hit, to the tier's counters."""
        self.stats.count_lookups(n, hits)

    def touch(self, slots: torch.Tensor) -> None:
        """Tell the policy these resident slots were used (scratch-pad rows by key: `on_pass`)."""
        if not slots.numel():
            return
        pad = None
        if self.scratch_slots and self.device.type == "cpu" and _kernels.HAVE_NUMBA:
            s = np.ascontiguousarray(slots.numpy(), dtype=np.int64)  # one pass splits them
            ranked, pad = np.empty_like(s), np.empty_like(s)
            nr, npad = stage_kernels.split_touched(s, bool(self.staging), self.capacity, self.transient,
                                                   ranked, pad)
            self.policy.on_hit(torch.from_numpy(ranked[:nr]))
            pad = pad[:npad]
        else:
            self.policy.on_hit(self.ranked(slots))
            if self.scratch_slots:
                s = slots.cpu().numpy()
                pad = s[self.transient[s]]
        if pad is not None and pad.size:
            self.policy.on_pass(key_hash(*self.index.keys(torch.from_numpy(pad))))

    def ranked(self, slots: torch.Tensor) -> torch.Tensor:
        """The slots among `slots` that the policy ranks: all but the staging slots."""
        if not self.staging or not slots.numel():
            return slots
        return slots[slots < self.capacity]

    def read(self, slots: torch.Tensor) -> torch.Tensor:
        """Payloads of resident slots."""
        return self.slab.index_select(0, slots)

    def write(self, slots: torch.Tensor, payload: torch.Tensor) -> None:
        """Overwrite payloads of resident slots and mark them dirty."""
        self.slab.index_copy_(0, slots, payload.to(self.slab.device, non_blocking=True))
        self.mark_dirty(slots)

    def mark_dirty(self, slots: torch.Tensor) -> None:
        """Set the dirty bits of resident slots (their rows now differ from LMDB)."""
        if self.device.type == "cpu":
            self.dirty.numpy()[slots.numpy()] = True  # numpy: less per-call overhead
        else:
            self.dirty.index_fill_(0, slots, True)

    def remove(self, slots: torch.Tensor) -> Rows:
        """Take rows out of the tier (to move them elsewhere); returns them with dirty bits."""
        out = self._take(slots, self.dirty.index_select(0, slots))
        if out.pins is not None and bool((out.pins > 0).any()):
            self.pin_epoch += 1
        self._release(slots)
        return out

    def _take(self, slots: torch.Tensor, dirty: torch.Tensor, pins: bool = True) -> Rows:
        # advanced indexing and index_select return copies: the rows outlive their slots
        if self.device.type == "cpu" and _kernels.HAVE_NUMBA and slots.dtype == torch.int64:
            payload = torch.from_numpy(_kernels.gather_rows(self.slab.numpy(), slots.contiguous().numpy()))
        else:
            payload = self.slab.index_select(0, slots)
        return Rows(*self.index.keys(slots), payload, dirty,
                    self.pins.index_select(0, slots) if pins else None)

    def _release(self, slots: torch.Tensor, reuse: bool = False) -> None:
        """Empty slots; with `reuse` the caller refills them at once (no reset, no free list).
        Scratch-pad slots (never in the policy) go back to the pad."""
        self.generation += 1
        self.index.remove(slots)
        if reuse:  # the policy's own victims (see _evict)
            self.policy.on_evict(slots)
            return
        self.dirty.index_fill_(0, slots, False)
        self.occupied.index_fill_(0, slots, False)
        self.pins.index_fill_(0, slots, 0)
        if self.scratch_slots:
            s = slots.cpu().numpy()
            pad = self.transient[s]
            if pad.any():
                self.transient[s[pad]] = False
                self._scratch = np.concatenate([self._scratch, s[pad][::-1]])
                slots = slots[torch.from_numpy(~pad).to(slots.device)]
        self.policy.on_remove(slots)
        m = slots.numel()
        self._free_buf[self._nfree : self._nfree + m] = slots.flip(0)
        self._nfree += m

    def _fill(self, slots: torch.Tensor, rows: Rows) -> None:
        """Write rows into empty or just-evicted slots: index, payload, dirty bits, pins."""
        self.index.add(rows.tabs, rows.rows, slots)
        if self.device.type == "cpu" and _kernels.HAVE_NUMBA:  # prefetching row copies
            _kernels.scatter_rows(self.slab.numpy(), slots.contiguous().numpy(),
                                  rows.payload.contiguous().numpy())
        else:
            self.slab.index_copy_(0, slots, rows.payload)
        self.dirty.index_copy_(0, slots, rows.dirty)
        if rows.pins is not None:
            self.pins.index_copy_(0, slots, rows.pins)
        self.stats.insertions += len(rows)

    def evictable(self, protect: torch.Tensor | None = None) -> Evictable:
        """Per-slot checks a policy applies to each candidate: unpinned, not in `protect`.

        O(len(protect)) on the CPU (the pins are read in place); a CUDA tier gathers its
        pinned slots on the device first. Valid until `_unprotect` (the scratch is shared).
        """
        scratch = self._protect_scratch
        if scratch is None:
            scratch = self._protect_scratch = np.zeros(self.slots, dtype=np.bool_)
        marked = []
        if protect is not None and protect.numel():
            marked.append(protect.detach().to("cpu", torch.int64).numpy())
        if self.device.type == "cpu" and not self.gather_pins:
            pins = self.pins.numpy()
        else:
            marked.append(torch.nonzero(self.pins).flatten().cpu().numpy())
            pins = np.empty(0, dtype=np.int32)
        self._protected = np.concatenate(marked) if marked else np.empty(0, dtype=np.int64)
        scratch[self._protected] = True
        return Evictable(pins=pins, protected=scratch)

    def _unprotect(self) -> None:
        """Clear the scratch marks `evictable` set."""
        self._protect_scratch[self._protected] = False

    def _evict(self, need: int, protect: torch.Tensor | None,
               keep_clean: bool) -> tuple[Rows | None, torch.Tensor | None]:
        """Evict up to `need` victims for `insert`, which refills their slots.

        Returns (rows, slots): the victims' rows (all, or only the dirty ones; None when none
        is kept) and their slots (None when nothing could be evicted).
        """
        try:
            victims = self.policy.victims(need, self.evictable(protect)).to(self.device)
        finally:
            self._unprotect()
        need = victims.numel()
        if need <= 0:
            return None, None
        dirty = self.dirty.index_select(0, victims)
        ndirty = int(dirty.sum())
        self.stats.evictions += need
        self.stats.writebacks += ndirty
        out = None
        if keep_clean:  # victims are unpinned: no pins travel with them
            out = self._take(victims, dirty, pins=False)
        elif ndirty:
            keep = victims[dirty]
            out = self._take(keep, dirty[dirty], pins=False)
        self._release(victims, reuse=True)
        return out, victims

    @property
    def selective(self) -> bool:
        """Whether the policy may refuse rows arriving by a miss (`Policy.admit`)."""
        return self.policy.selective

    def admit(self, tabs: torch.Tensor, rows: torch.Tensor) -> torch.Tensor | None:
        """Mask of arriving rows the policy lets displace cached ones (`Policy.admit`); None:
        all, also when free slots hold them all."""
        if not self.selective or rows.numel() <= self._nfree:
            return None
        return self.policy.admit(key_hash(tabs, rows))

    def reserve_scratch(self, n: int) -> int:
        """Set aside up to `n` more free slots (never evicting) as the scratch pad; returns how
        many the pad has now. CPU tiers only (the pad's pins are read in place)."""
        if self.staging:  # a pad of its own: the cache keeps every slot
            return self.scratch_slots
        k = min(int(n) - self.scratch_slots, self._nfree) if self.device.type == "cpu" else 0
        if k > 0:
            taken = self._free_buf[self._nfree - k : self._nfree].numpy().copy()
            self._nfree -= k
            self._scratch = np.concatenate([self._scratch, taken])
            self.scratch_slots += k
        return self.scratch_slots

    def insert_scratch(self, rows: Rows) -> int:
        """Put the first k of `rows` (absent keys, pinned) in free pad slots; returns k, their
        slots in `last_slots`. The policy is not told: a pad row is never a victim."""
        k = min(len(rows), len(self._scratch))
        self.last_slots = self.last_slots[:0]
        if k == 0:
            return 0
        s = self._scratch[len(self._scratch) - k :][::-1].copy()
        self._scratch = self._scratch[: len(self._scratch) - k]
        slots = torch.from_numpy(s)
        self.generation += 1
        self._fill(slots, rows.take(slice(0, k)) if k < len(rows) else rows)
        self.occupied.index_fill_(0, slots, True)
        self.transient[s] = True
        self.stats.scratch_rows += k
        self.last_slots = slots
        return k

    @property
    def fused_placement(self) -> bool:
        """Whether `place_misses` applies: a CPU tier with staging slots, numba, and a policy
        whose victims are a plain queue walk (`QueuePolicy.plain_victims`)."""
        return (self.staging > 0 and self.index.fast(self.slab)  # fast: numba, a CPU tier
                and getattr(self.policy, "plain_victims", False))

    def place_misses(self, tabs: np.ndarray, rows: np.ndarray, payload: torch.Tensor,
                     refused: np.ndarray | None) -> tuple[np.ndarray, Rows | None]:
        """Staged misses (absent keys, clean, each with its batch's pin) placed in one compiled
        pass (`stage_kernels.place_misses`, only where `fused_placement`): the rows the policy
        refused (`refused`, a mask, or None) to the scratch pad, the rest into the cache after
        the policy's victims, what the cache cannot take to the pad. Returns each row's slot
        (-1: placed nowhere) and the dirty victims, for the write-behind ring."""
        m = len(rows)
        staged = np.empty(m, dtype=np.int64)
        if m == 0:
            return staged, None
        self.index.make_room(m)
        pol = self.policy
        ev_tabs, ev_rows = np.empty(m, dtype=np.int64), np.empty(m, dtype=np.int64)
        ev_payload = np.empty((m, self.width), dtype=np.float32)
        ins_slots, ins_pos = np.empty(m, dtype=np.int64), np.empty(m, dtype=np.int64)
        nfree, npad, nev, nv, fit, npadded, tombs, maxd = stage_kernels.place_misses(
            self.index.table.numpy(), self.index.pos_of.numpy(), self.index.mask,
            self.slab.numpy(), self.dirty.numpy(), self.occupied.numpy(), self.pins.numpy(),
            self.transient, self._free_buf.numpy(), self._nfree, self._scratch, len(self._scratch),
            pol.state, self.capacity, pol.victim_order, tabs, rows, payload.numpy(),
            refused if refused is not None else np.empty(0, dtype=np.bool_),
            staged, ev_tabs, ev_rows, ev_payload, ins_slots, ins_pos)
        self._nfree = int(nfree)
        self._scratch = self._scratch[: int(npad)]
        self.index.account(int(fit + npadded - nv), int(tombs), int(maxd))
        self.generation += 1
        self.stats.insertions += int(fit + npadded)
        self.stats.scratch_rows += int(npadded)
        self.stats.evictions += int(nv)
        self.stats.writebacks += int(nev)
        self.last_slots = torch.from_numpy(ins_slots[:fit])
        if fit:
            at = ins_pos[:fit]
            pol.on_insert(self.last_slots, torch.from_numpy(key_hash_np(tabs[at], rows[at]))
                          if pol.wants_keys else None)
        evicted = None
        if nev:
            evicted = Rows(torch.from_numpy(ev_tabs[:nev]), torch.from_numpy(ev_rows[:nev]),
                           torch.from_numpy(ev_payload[:nev]), torch.ones(int(nev), dtype=torch.bool))
        return staged, evicted

    def take_expired(self) -> Rows | None:
        """Take out the pad rows whose last pin dropped (their slots return to the pad)."""
        if not self._expired:
            return None
        s = np.concatenate(self._expired) if len(self._expired) > 1 else self._expired[0]
        self._expired.clear()
        if self.staging and self.index.fast(self.slab):  # staging slots: one compiled pass
            return self._take_pad(s)
        s = s[self.transient[s] & (self.pins.numpy()[s] == 0)]
        if s.size == 0:
            return None
        s = self._distinct_pad(s)  # a slot may have expired twice since the last take
        slots = torch.from_numpy(s)
        out = self._take(slots, self.dirty.index_select(0, slots), pins=False)
        self._release(slots)
        return out

    def _take_pad(self, s: np.ndarray) -> Rows | None:
        """`take_expired` of staging slots in one compiled pass (`stage_kernels.take_pad`)."""
        n = len(s)
        tabs, rows = np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64)
        payload, dirty = np.empty((n, self.width), dtype=np.float32), np.empty(n, dtype=np.bool_)
        slots = np.empty(n, dtype=np.int64)
        k, tombs = stage_kernels.take_pad(
            np.ascontiguousarray(s, dtype=np.int64), self.pins.numpy(), self.transient,
            self._marks(), self.capacity, self.index.table.numpy(), self.index.pos_of.numpy(),
            self.index.mask, self.slab.numpy(), self.dirty.numpy(), self.occupied.numpy(),
            tabs, rows, payload, dirty, slots)
        if k == 0:
            return None
        self.generation += 1
        self.index.account(-int(k), int(tombs), 0)
        self._scratch = np.concatenate([self._scratch, slots[:k][::-1]])
        return Rows(torch.from_numpy(tabs[:k]), torch.from_numpy(rows[:k]), torch.from_numpy(payload[:k]),
                    torch.from_numpy(dirty[:k]))

    def _distinct_pad(self, s: np.ndarray) -> np.ndarray:
        """Pad slots `s` without repeats. Staging slots (all >= capacity) are marked in an array
        the size of the staging slots, one pass instead of `np.unique`'s sort (4.5 against
        0.14 ms for 38k slots); a pad carved from the cache falls back to `np.unique`."""
        if not self.staging:
            return np.unique(s)
        marks = self._marks()
        pos = np.arange(s.size, dtype=np.int32)
        at = s - self.capacity
        marks[at] = pos  # each slot keeps one position: the last that wrote it
        return s[marks[at] == pos]

    def _marks(self) -> np.ndarray:
        """Scratch marks, one per staging slot (made on first use)."""
        if self._pad_marks is None:
            self._pad_marks = np.empty(self.staging, dtype=np.int32)
        return self._pad_marks

    def insert(self, rows: Rows, protect: torch.Tensor | None = None,
               keep_clean: bool = True) -> tuple[int, Rows | None]:
        """Insert as many of `rows` (absent keys) as fit, in order, evicting victims.

        Returns (k, evicted): the first k rows were inserted; `evicted` holds the victims
        (their payloads and dirty bits) for the caller to move down a tier. With
        `keep_clean=False` it holds only the dirty victims (the bottom cache tier drops clean
        rows, which LMDB or the lazy init already hold).
        """
        n = len(rows)
        self.last_slots = self.last_slots[:0]
        if n == 0 or self.capacity == 0:
            return 0, None
        evicted, reused = None, None
        if n > self._nfree:
            evicted, reused = self._evict(n - self._nfree, protect, keep_clean)
        m = 0 if reused is None else reused.numel()
        k = min(n, self._nfree + m)  # the victims' slots first, then free ones
        if k == 0:
            return 0, evicted
        self.generation += 1
        fresh = k - m
        slots = self._free_buf[self._nfree - fresh : self._nfree].flip(0)
        self._nfree -= fresh
        if fresh:
            self.occupied.index_fill_(0, slots, True)
        if m:  # a victim's slot is still occupied and unpinned, its dirty bit overwritten below
            slots = reused if not fresh else torch.cat([reused, slots])
        if k < n:
            rows = rows.take(slice(0, k))
        rows = rows.to(self.device)
        self._fill(slots, rows)
        self.policy.on_insert(slots, key_hash(rows.tabs, rows.rows) if self.policy.wants_keys
                              else None)
        self.last_slots = slots
        return k, evicted

    def pin(self, slots: torch.Tensor, delta: int) -> None:
        """Add `delta` to the prefetch pins of resident slots (never below zero)."""
        if (delta == -1 and self.scratch_slots and slots.numel() and self.device.type == "cpu"
                and _kernels.HAVE_NUMBA):  # an unpin: the pad rows at their last unpin, in the pass
            s = slots.contiguous().numpy()
            out = np.empty(s.shape[0], dtype=np.int64)
            k = _kernels.add_pins(self.pins.numpy(), s, -1, self.transient, out)
            if k:
                self._expired.append(out[:k])
            return
        if slots.numel() and self.device.type == "cpu" and _kernels.HAVE_NUMBA:
            _kernels.add_pins(self.pins.numpy(), slots.contiguous().numpy(), int(delta), _NO_MARKS, _NO_SLOTS)
        elif slots.numel():  # only the named slots: the cost never grows with the capacity
            pins = self.pins
            pins.index_add_(0, slots, torch.full_like(slots, delta, dtype=torch.int32))
            if delta < 0:
                pins.index_copy_(0, slots, pins.index_select(0, slots).clamp_(min=0))
        if delta < 0 and self.scratch_slots and slots.numel():  # pad rows at their last unpin
            s = slots.cpu().numpy()
            s = s[self.transient[s]]
            if s.size:
                self._expired.append(s[self.pins.numpy()[s] == 0])

    def stacks(self) -> tuple[np.ndarray, np.ndarray]:
        """(free cache slots, free pad slots), copies, each a stack with its top at the end:
        for checks and tests."""
        return self._free_buf[: self._nfree].cpu().numpy().copy(), self._scratch.copy()

    def dirty_chunks(self, chunk: int) -> Iterator[tuple[torch.Tensor, Rows]]:
        """Slots and rows of the dirty resident rows, `chunk` rows at a time (for flushing)."""
        dirty = torch.nonzero(self.dirty & self.occupied).flatten()
        for lo in range(0, dirty.numel(), chunk):
            slots = dirty[lo : lo + chunk]
            yield slots, Rows(*self.index.keys(slots),
                              self.slab.index_select(0, slots), self.dirty[slots])

    def resident(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(tabs, rows) of every occupied slot."""
        slots = torch.nonzero(self.occupied).flatten()
        return self.index.keys(slots)

    def check(self) -> None:
        """Assert the tier's invariants: index, occupancy, free list and policy agree."""
        self.index.check()
        assert self.index.live == int(self.occupied.sum())
        free = self._free_buf[: self._nfree]
        assert self._nfree + len(self._scratch) + self.index.live == self.usable
        if free.numel():
            assert not bool(self.occupied[free].any())
            assert free.unique().numel() == free.numel()
        if len(self._scratch):
            assert not bool(self.occupied[torch.from_numpy(self._scratch)].any())
            assert np.unique(self._scratch).size == len(self._scratch)
            assert not bool(self.transient[self._scratch].any())
        assert not bool((torch.from_numpy(self.transient) & ~self.occupied.cpu()).any())
        assert not bool((self.dirty & ~self.occupied).any())
        self.policy.check()
