"""The device tier over the set-associative cache: `SlabTier`'s interface on an `HbmCache`.

A key is `table << 48 | row` (tables below 2**15, rows below 2**48: `keys_fit`); when the
capacity holds every declared row, it is the row's place in the tables laid end to end and the
cache maps it directly (each key a line of its own: no set overflows, nothing is evicted). The cascade,
staging and the bag paths call this tier as they call a `SlabTier`; the cache's own policy is
LRU or LFU (`set_policy` maps the other names), the host tier keeps the whole registry.
Victim choice is per set, so an insert of rows whose sets are full of locked lines stops at
the first such row: the rows after it go down a tier, as rows that do not fit a slab tier do.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

import tierstore.hostread as hostread

from .._kernels import HAVE_NUMBA
from ..stats import TierStats
from .hbm_cache import POLICIES, HbmCache
from .slab import Rows

TAB_SHIFT = 48
ROW_MASK = (1 << TAB_SHIFT) - 1
MAX_TABLES = 1 << 15
LFU_NAMES = ("lfu", "hlfu", "wtinylfu")  # ranked by counts: the cache's LFU; the rest: LRU


def _direct_keys_np(held: np.ndarray, base: int, rows: int, ids: np.ndarray, out: np.ndarray) -> int:
    """`direct_keys` in numpy (no numba)."""
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= rows):
        return -1
    np.add(ids, base, out=out)
    return int(held[out].all())


if HAVE_NUMBA:
    import numba

    @numba.njit(cache=True, nogil=True)
    def _direct_keys(held, base, rows, ids, out):  # pragma: no cover - compiled
        """Keys of a table's ids in a direct cache: -1 if an id is out of range, 0 if one is
        not held, else 1 (`out` then holds every key)."""
        ok = 1
        for i in range(ids.shape[0]):
            x = ids[i]
            if x < 0 or x >= rows:
                return -1
            k = base + x
            out[i] = k
            if not held[k]:
                ok = 0
        return ok
else:  # pragma: no cover
    _direct_keys = _direct_keys_np


def keys_fit(num_tables: int, max_rows: int) -> bool:
    """Whether every (table, row) key packs into one int64 key of the cache."""
    return num_tables <= MAX_TABLES and max_rows <= ROW_MASK + 1


def set_policy(name: str) -> str:
    """The cache policy a registry policy name maps to on the sets tier ("lru" or "lfu")."""
    return name if name in POLICIES else ("lfu" if name in LFU_NAMES else "lru")


class Keys:
    """(table, row) <-> one int64 key: `table << 48 | row`, or with `offsets` (each table's first
    place, then the total) the row's place in the tables laid end to end."""

    def __init__(self, offsets: torch.Tensor | None = None) -> None:
        self.offsets = offsets
        # a host copy too: keys read back to the host unpack there without a device read (a
        # copy of its own on the CPU as well, so that a test marking `offsets` as on a device
        # sees which one a call reads)
        self.host_offsets = None if offsets is None else offsets.to("cpu", copy=True)

    def _offsets(self, device: torch.device) -> torch.Tensor:
        """The offsets on `device` (the host copy for CPU keys)."""
        return self.host_offsets if device.type == "cpu" else hostread.to_device(self.offsets, device)

    def pack(self, tabs: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """One int64 key per (table, row)."""
        tabs = hostread.to_device(tabs, rows.device).to(torch.int64)
        if self.offsets is None:
            return (tabs << TAB_SHIFT) | rows
        return self._offsets(rows.device)[tabs] + rows

    def unpack(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(tables, rows) of keys."""
        if self.offsets is None:
            return keys >> TAB_SHIFT, keys & ROW_MASK
        offsets = self._offsets(keys.device)
        tabs = torch.searchsorted(offsets[1:], keys, right=True)
        return tabs, keys - offsets.index_select(0, tabs)


class SetPolicy:
    """What the store asks of a device tier's policy, for the cache's built-in LRU/LFU."""

    wants_future = False  # no look-ahead hints: the stamps rank lines
    selective = False  # every arriving row is admitted
    wants_keys = False

    def __init__(self, name: str) -> None:
        self.name = name

    def on_use(self, slots: torch.Tensor) -> None:
        """Staging stamped the lines when it locked them: nothing to add."""

    def on_future(self, slots: torch.Tensor, next_use: torch.Tensor) -> None:
        """Look-ahead hints are not used."""

    def check(self) -> None:
        """No state of its own."""


class SetIndex:
    """The tier's keys seen as a hash index (what the store's checks and expiry read)."""

    def __init__(self, cache: HbmCache, codec: Keys, held: np.ndarray | None = None) -> None:
        self.cache = cache
        self.codec = codec
        self.device = cache.device
        self.held = held  # a direct cache's host mirror: held[k] while key k is cached

    @property
    def table(self) -> torch.Tensor:
        """The key lines (their bytes count in the memory budget)."""
        return self.cache.keys

    def fast(self, rows: torch.Tensor) -> bool:
        """No compiled probe: `absent_from` takes its torch path."""
        return False

    def find(self, tabs: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Slots of the keys, -1 where absent."""
        rows = hostread.to_device(rows, self.cache.device).to(torch.int64)
        return self.cache.lookup(self.codec.pack(tabs, rows))

    def find_host(self, tabs: torch.Tensor, rows: torch.Tensor) -> torch.Tensor | None:
        """`find` answered on the host from a direct cache's mirror (slot k for key k), with no
        device read; None when there is no mirror."""
        if self.held is None:
            return None
        keys = self.codec.pack(tabs.to("cpu", torch.int64), rows.to("cpu", torch.int64)).numpy()
        inside = (keys >= 0) & (keys < len(self.held))
        hit = inside & self.held[np.where(inside, keys, 0)]
        return torch.from_numpy(np.where(hit, keys, -1))

    def keys(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(tables, rows) held at these slots."""
        return self.codec.unpack(self.cache.keys.view(-1).index_select(0, slots.to(self.cache.device)))

    def check(self) -> None:
        """The cache checks itself."""


class SetTier:
    """A device tier on the set-associative cache, called as a `SlabTier` is."""

    staging = 0  # no staging slots, no scratch pad
    scratch_slots = 0
    gather_pins = True
    pins_skip_absent = True  # `pin` ignores -1 slots (they go to the cache's trash line)

    def __init__(self, name: str, capacity: int, width: int, policy: str,
                 device: torch.device | str = "cpu", kernels: str = "torch",
                 table_rows: list[int] | None = None) -> None:
        self.name = name
        self.device = torch.device(device)
        total = sum(table_rows) if table_rows else None
        direct = total is not None and 0 < total <= capacity
        offsets = None
        if direct:  # every row has a line: keys are places in the tables laid end to end
            offsets = torch.tensor([0, *table_rows], dtype=torch.int64).cumsum(0).to(self.device)
            capacity = total
        self.codec = Keys(offsets)
        self.cache = HbmCache(capacity, width, self.device, set_policy(policy), kernels=kernels,
                              direct=direct)
        self.capacity = self.cache.capacity
        self.slots = self.capacity
        self.usable = self.capacity
        self.width = int(width)
        self.policy = SetPolicy(self.cache.policy)
        # direct: which keys are cached, on the host too (kept by insert and remove), so
        # staging finds a batch's slots without reading the device
        self.held = np.zeros(self.capacity, dtype=bool) if direct else None
        # each table's first key (direct), as Python ints: no tensor read a step
        self._bases = [] if offsets is None else self.codec.host_offsets.tolist()
        self.index = SetIndex(self.cache, self.codec, self.held)
        self.stats = TierStats()
        self.generation = 0  # bumped whenever a slot changes owner
        self.pin_epoch = 0  # bumped whenever a pinned row leaves
        self.removals = 0  # bumped whenever rows leave (a direct cache loses rows no other way)
        self.last_slots = torch.empty(0, dtype=torch.int64, device=self.device)

    @property
    def direct(self) -> bool:
        """Whether the cache holds a line for every declared row (key k at slot k: rows never
        move, and leave only by `remove`)."""
        return self.held is not None

    def direct_keys(self, table: int, rows: int, ids: np.ndarray, out: np.ndarray,
                    check: bool = True) -> int:
        """A direct cache's slots of table `table`'s ids (int64, any order, duplicates too) into
        `out`: 1 when every one is held, 0 when one is not, -1 when one is outside
        [0, `rows`) (then `out` is partly written). A host read of the mirror, no device read.
        `check=False`: ids known to be held (`StagingArea.held_whole`): the slots alone, 1."""
        if not check:
            np.add(ids, self._bases[table], out=out)
            return 1
        return int(_direct_keys(self.held, self._bases[table], rows, ids, out))

    @property
    def slab(self) -> torch.Tensor:
        """Payloads by slot (one trash row past the last slot)."""
        return self.cache.slab

    @property
    def dirty(self) -> torch.Tensor:
        """Dirty bits by slot (a view: writes go to the cache)."""
        return self.cache.dirty.view(-1)

    @property
    def occupied(self) -> torch.Tensor:
        """Occupied lines by slot."""
        return self.cache.keys.view(-1) >= 0

    @property
    def size(self) -> int:
        """Occupied lines."""
        return self.cache.size

    @property
    def selective(self) -> bool:
        """Every arriving row is admitted."""
        return False

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
        """Stamp these lines as used now, then advance the clock."""
        if slots.numel():
            self.cache.touch(slots)
            self.cache.tick()

    def ranked(self, slots: torch.Tensor) -> torch.Tensor:
        """Every line is ranked (no staging slots)."""
        return slots

    def read(self, slots: torch.Tensor) -> torch.Tensor:
        """Payloads of resident slots."""
        return self.cache.slab.index_select(0, slots)

    def write(self, slots: torch.Tensor, payload: torch.Tensor) -> None:
        """Overwrite payloads of resident slots and mark them dirty."""
        self.cache.slab.index_copy_(0, slots, payload.to(self.device, non_blocking=True))
        self.cache.mark_dirty(slots)

    def mark_dirty(self, slots: torch.Tensor) -> None:
        """Set the dirty bits of resident slots."""
        self.cache.mark_dirty(hostread.to_device(slots, self.device))

    def pin(self, slots: torch.Tensor, delta: int) -> None:
        """Add `delta` to the locks of resident slots (never below zero; -1 slots ignored)."""
        self.cache.pin(hostread.to_device(slots, self.device), delta)

    def remove(self, slots: torch.Tensor) -> Rows:
        """Take rows out of the tier; returns them with dirty bits and pins."""
        if self.held is not None:  # direct: slot k held key k
            (gone,) = hostread.to_host(slots)
            gone = gone.numpy()
            self.held[gone[gone >= 0]] = False
        slots = slots.to(self.device)
        pins = self.cache.lock.view(-1).index_select(0, slots)
        out = self.cache.remove(slots)
        if bool((pins > 0).any()):
            self.pin_epoch += 1
        self.generation += 1
        self.removals += 1
        return Rows(*self.codec.unpack(out.keys), out.payload, out.dirty, pins)

    def insert(self, rows: Rows, protect: torch.Tensor | None = None,
               keep_clean: bool = True) -> tuple[int, Rows | None]:
        """Insert the longest prefix of `rows` (absent keys) whose sets have room, evicting
        unlocked lines; returns (k, victims on the host: all, or the dirty ones without
        `keep_clean`). Reads back to the host only through `hostread.to_host`."""
        n = len(rows)
        self.last_slots = self.last_slots[:0]
        if n == 0 or self.capacity == 0:
            return 0, None
        if self.held is not None:
            return self._insert_direct(rows)
        rows = rows.to(self.device)
        keys = self.codec.pack(rows.tabs, rows.rows)
        cache = self.cache
        guard = protect is not None and protect.numel() > 0
        if guard:
            protect = hostread.to_device(protect, self.device)
            cache.pin(protect, 1)  # the batch's hits stay
        try:
            choice = cache.choose(keys)
            # read back through an event (the staging thread runs this beside a training step
            # that may be under the sync debug mode: `tierstore.hostread`)
            full = torch.nonzero(hostread.to_host(choice)[0] < 0).flatten()
            k = int(full[0]) if full.numel() else n
            if k == 0:
                return 0, None
            if k < n:
                rows, keys, choice = rows.take(slice(0, k)), keys[:k], choice[:k]
            lock = rows.pins if rows.pins is not None else 0
            v = cache.insert(keys, rows.payload, rows.dirty, lock=lock, slots=choice)
        finally:
            if guard:
                cache.pin(protect, -1)
        self.generation += 1
        self.stats.insertions += k
        self.last_slots = v.slots
        old, old_dirty = hostread.to_host(v.keys, v.dirty)
        gone = torch.nonzero(old >= 0).flatten()
        if not gone.numel():
            return k, None
        dirty = old_dirty.index_select(0, gone)
        self.stats.evictions += gone.numel()
        self.stats.writebacks += int(dirty.sum())
        if not keep_clean:
            gone = gone[dirty]
            dirty = dirty[dirty]
            if not gone.numel():
                return k, None
        # the victims leave on the host (where the tiers below keep them)
        (payload,) = hostread.to_host(v.payload.index_select(0, hostread.to_device(gone, self.device)))
        return k, Rows(*self.codec.unpack(old.index_select(0, gone)), payload, dirty)

    def _insert_direct(self, rows: Rows) -> tuple[int, Rows | None]:
        """`insert` into a direct cache: every absent key takes its own line (slot k), so all
        land and nothing is evicted; no device read."""
        n = len(rows)
        keys_h = self.codec.pack(rows.tabs.to("cpu", torch.int64), rows.rows.to("cpu", torch.int64))
        rows = rows.to(self.device)
        keys = hostread.to_device(keys_h, self.device)
        lock = rows.pins if rows.pins is not None else 0
        v = self.cache.insert(keys, rows.payload, rows.dirty, lock=lock, slots=keys)
        self.held[keys_h.numpy()] = True
        self.generation += 1
        self.stats.insertions += n
        self.last_slots = v.slots
        return n, None

    def admit(self, tabs: torch.Tensor, rows: torch.Tensor) -> torch.Tensor | None:
        """Every arriving row is admitted."""
        return None

    def grow_staging(self, n: int) -> int:
        """No staging slots."""
        return 0

    def reserve_scratch(self, n: int) -> int:
        """No scratch pad."""
        return 0

    def insert_scratch(self, rows: Rows) -> int:
        """No scratch pad: nothing is inserted."""
        self.last_slots = self.last_slots[:0]
        return 0

    def take_expired(self) -> Rows | None:
        """No scratch pad: nothing expires."""
        return None

    def dirty_chunks(self, chunk: int) -> Iterator[tuple[torch.Tensor, Rows]]:
        """Slots and rows of the dirty resident rows, `chunk` rows at a time (for flushing)."""
        dirty = torch.nonzero(self.dirty & self.occupied).flatten()
        for lo in range(0, dirty.numel(), chunk):
            slots = dirty[lo : lo + chunk]
            yield slots, Rows(*self.index.keys(slots), self.cache.slab.index_select(0, slots),
                              self.dirty.index_select(0, slots))

    def resident(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(tabs, rows) of every occupied slot."""
        return self.codec.unpack(self.cache.resident()[0])

    def check(self) -> None:
        """Assert the cache's invariants (and a direct cache's host mirror)."""
        self.cache.check()
        if self.held is not None:
            held = (self.cache.keys.view(-1) >= 0).cpu().numpy()
            assert np.array_equal(held, self.held), "the host mirror differs from the cache"
