"""A set-associative row cache whose whole state is tensors on one device (HBM on a GPU).

Every line is one way of one set: `keys` [sets, ways] int64 (-1 empty), `stamp` [sets, ways]
int64 (LRU: the clock of the last use; LFU: a use count), `lock` [sets, ways] int32 (pins of
staged batches), `dirty` [sets, ways] bool and the slab [sets * ways, width] float32; a slot is
`set * ways + way`. A key lives only in the set its hash names, so a lookup compares one set's
ways and nothing else.

No call here reads a tensor back to the host: sizes are the caller's (a batch of n keys gives n
slots, -1 where absent), writes for "no slot" go to one trash line past the last slot, and
victim choice is a stable sort (or one Triton kernel) per key. So on CUDA the hit path (lookup,
touch, lock, dirty) and the insert of a staged batch run without a device-to-host sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._kernels import HAVE_NUMBA
from ..errors import ConfigError

WAYS = 32
POLICIES = ("lru", "lfu")
KERNELS = ("torch", "triton", "numba")  # numba: CPU tensors only (`hbm_numba.py`)
HASH_MUL = -7046029254386353131  # 0x9E3779B97F4A7C15 as a signed int64 (Fibonacci hashing)
LOCKED = 2**62  # the victim-order key of a locked line: after every unlocked one


def set_of(keys: torch.Tensor, sets: int, direct_ways: int = 0) -> torch.Tensor:
    """The set each key hashes to: bits 32..62 of `key * HASH_MUL` (wrapping), modulo `sets`;
    with `direct_ways`, the key's own block of that many (keys are dense ids below the capacity)."""
    if direct_ways:
        return keys.clamp(0, sets * direct_ways - 1) // direct_ways
    return ((keys * HASH_MUL) >> 32).bitwise_and_(0x7FFFFFFF).remainder_(sets)


def order_key(keys: torch.Tensor, stamp: torch.Tensor, lock: torch.Tensor) -> torch.Tensor:
    """Per line, its place in victim order: empty lines (0) first, then unlocked lines by stamp
    (stamp + 1), locked lines last; ties go to the lower way."""
    occ = stamp.clamp(min=0) + 1
    return torch.where(lock > 0, LOCKED, torch.where(keys >= 0, occ, 0))


def rank_in_set(sets: torch.Tensor) -> torch.Tensor:
    """Each key's rank among the keys of its set, in input order (sizes known: no sync)."""
    srt, order = torch.sort(sets, stable=True)
    start = torch.searchsorted(srt, srt)
    rank = torch.empty_like(order)
    rank.index_copy_(0, order, torch.arange(sets.numel(), device=sets.device) - start)
    return rank


@dataclass
class Victims:
    """What an insert displaced, one entry per inserted key: the old key (-1 none), its payload
    and dirty bit (meaningless where the key is -1), and the slot the new key took (-1: no room)."""

    keys: torch.Tensor  # int64 [m]
    payload: torch.Tensor  # float32 [m, width]
    dirty: torch.Tensor  # bool [m]
    slots: torch.Tensor  # int64 [m]


class HbmCache:
    """A set-associative write-back cache of row payloads, all state on `device`.

    `capacity` rows round up to whole sets of `ways` lines. `policy` is "lru" (stamp = the clock
    at the last use) or "lfu" (stamp = uses since the line was filled). `kernels="triton"` runs
    lookup and victim choice as Triton kernels (CUDA, or the interpreter on CPU tensors); "torch"
    runs the same rules as torch ops; "numba" as compiled loops on CPU tensors (`hbm_numba`);
    all give the same slots. `direct=True`: keys are dense ids
    below the capacity and key k lives at slot k (in set k // ways), so every key has a line of
    its own, no set ever overflows, and a lookup is one gather (a cache that holds every row).
    """

    def __init__(self, capacity: int, width: int, device: torch.device | str = "cpu",
                 policy: str = "lru", ways: int = WAYS, kernels: str = "torch",
                 direct: bool = False) -> None:
        if policy not in POLICIES:
            raise ConfigError(f"the set-associative cache offers {POLICIES}, got {policy!r}")
        if ways < 1 or ways & (ways - 1):
            raise ConfigError(f"ways must be a power of two, got {ways}")
        if kernels not in KERNELS:
            raise ConfigError(f"kernels must be one of {KERNELS}, got {kernels!r}")
        if kernels == "numba" and (torch.device(device).type != "cpu" or not HAVE_NUMBA):
            raise ConfigError("kernels='numba' runs on CPU tensors with numba installed")
        self.ways = int(ways)
        self.sets = max(1, -(-int(capacity) // self.ways)) if capacity > 0 else 0
        self.capacity = self.sets * self.ways
        self.width = int(width)
        self.device = torch.device(device)
        self.policy = policy
        self.kernels = kernels
        self.direct = bool(direct)
        n = self.capacity + 1  # one trash line past the last slot absorbs writes for "no slot"
        dev = self.device
        self._keys = torch.full((n,), -1, dtype=torch.int64, device=dev)
        self._stamp = torch.zeros(n, dtype=torch.int64, device=dev)
        self._lock = torch.zeros(n, dtype=torch.int32, device=dev)
        self._dirty = torch.zeros(n, dtype=torch.bool, device=dev)
        self.slab = torch.zeros((n, self.width), dtype=torch.float32, device=dev)
        self.clock = 1  # LRU stamps: advanced by the caller once a step (`tick`)
        self.trash = self.capacity

    # the lines, [sets, ways] views of the flat state (the trash line excluded)
    @property
    def keys(self) -> torch.Tensor:
        """Keys [sets, ways], -1 where a line is empty."""
        return self._keys[: self.capacity].view(self.sets, self.ways)

    @property
    def stamp(self) -> torch.Tensor:
        """Stamps [sets, ways]: LRU the clock of the last use, LFU the use count."""
        return self._stamp[: self.capacity].view(self.sets, self.ways)

    @property
    def lock(self) -> torch.Tensor:
        """Pins [sets, ways] of staged batches: a locked line is never a victim."""
        return self._lock[: self.capacity].view(self.sets, self.ways)

    @property
    def dirty(self) -> torch.Tensor:
        """Dirty bits [sets, ways]: the line differs from the tiers below."""
        return self._dirty[: self.capacity].view(self.sets, self.ways)

    def set_of(self, keys: torch.Tensor) -> torch.Tensor:
        """The set of each key (hashed, or its block when `direct`)."""
        return set_of(keys, self.sets, self.ways if self.direct else 0)

    def tick(self) -> int:
        """Advance the LRU clock (once a step); returns the new value."""
        self.clock += 1
        return self.clock

    def _to_trash(self, slots: torch.Tensor) -> torch.Tensor:
        """Slots with -1 sent to the trash line (writes there are discarded)."""
        return torch.where(slots >= 0, slots, self.trash)

    # the hit path -------------------------------------------------------------------------
    def lookup(self, keys: torch.Tensor) -> torch.Tensor:
        """Slots holding `keys` (int64 [n], any order, repeats allowed), -1 where absent."""
        if self.capacity == 0 or keys.numel() == 0:
            return torch.full_like(keys, -1)
        if self.direct:  # key k lives at slot k: one gather, whatever the kernels
            inside = (keys >= 0) & (keys < self.capacity)
            held = self._keys.index_select(0, torch.where(inside, keys, self.trash))
            return torch.where(inside & (held == keys), keys, -1)
        if self.kernels == "triton":
            return _triton_lookup(self, keys)
        if self.kernels == "numba":
            return _numba_lookup(self, keys)
        return self.lookup_torch(keys)

    def lookup_torch(self, keys: torch.Tensor) -> torch.Tensor:
        """`lookup` as torch ops (the reference the Triton kernel equals)."""
        s = self.set_of(keys)
        ways = self.keys.index_select(0, s)  # [n, ways]
        eq = (ways == keys.unsqueeze(1)) & (keys >= 0).unsqueeze(1)
        way = eq.to(torch.int8).argmax(dim=1)
        return torch.where(eq.any(dim=1), s * self.ways + way, -1)

    def touch(self, slots: torch.Tensor) -> None:
        """Record a use of these lines (-1 ignored): LRU stamps the clock, LFU counts one."""
        if slots.numel() == 0:
            return
        at = self._to_trash(slots)
        if self.policy == "lru":
            self._stamp.index_fill_(0, at, self.clock)
        else:
            self._stamp.index_add_(0, at, torch.ones_like(at))

    def pin(self, slots: torch.Tensor, delta: int) -> None:
        """Add `delta` to the locks of these lines (-1 ignored; repeats count), never below 0."""
        if slots.numel() == 0:
            return
        at = self._to_trash(slots)
        self._lock.index_add_(0, at, torch.full_like(at, delta, dtype=torch.int32))
        if delta < 0:
            self._lock.index_copy_(0, at, self._lock.index_select(0, at).clamp_(min=0))

    def mark_dirty(self, slots: torch.Tensor) -> None:
        """Set the dirty bits of these lines (-1 ignored)."""
        if slots.numel():
            self._dirty.index_fill_(0, self._to_trash(slots), True)

    # victim choice and insert -------------------------------------------------------------
    def choose(self, keys: torch.Tensor) -> torch.Tensor:
        """The slot each absent key (unique) would take: its set's free or unlocked lines in
        victim order, the k-th key of a set (in input order) taking the k-th line; -1 where
        the set has no line left for it. Changes nothing."""
        if self.capacity == 0 or keys.numel() == 0:
            return torch.full_like(keys, -1)
        if self.direct:  # an absent key's own line is free: it takes it
            return torch.where((keys >= 0) & (keys < self.capacity), keys, -1)
        if self.kernels == "triton":
            return _triton_choose(self, keys)
        if self.kernels == "numba":
            return _numba_choose(self, keys)
        return self.choose_torch(keys)

    def choose_torch(self, keys: torch.Tensor) -> torch.Tensor:
        """`choose` as torch ops (the reference the Triton kernel equals)."""
        s = self.set_of(keys)
        rank = rank_in_set(s)
        ok = order_key(self.keys, self.stamp, self.lock).index_select(0, s)  # [m, ways]
        srt, way = torch.sort(ok, dim=1, stable=True)
        r = rank.clamp(max=self.ways - 1).unsqueeze(1)
        pick = way.gather(1, r).squeeze(1)
        free = srt.gather(1, r).squeeze(1) < LOCKED
        return torch.where((rank < self.ways) & free, s * self.ways + pick, -1)

    def insert(self, keys: torch.Tensor, payload: torch.Tensor, dirty: torch.Tensor | None = None,
               lock: int | torch.Tensor = 0, slots: torch.Tensor | None = None) -> Victims:
        """Insert absent, unique `keys` with their payloads [m, width], evicting per set.

        Each key takes the line `choose` names (`slots`: the caller's own `choose` of the same
        keys, or of a longer list they begin); a key whose set has no unlocked line left is
        not inserted (its slot is -1: the caller sends it down a tier). Returns the victims, one
        entry per key, for the caller to write down (their dirty rows). New lines start with
        `lock` pins (one count, or one per key), a fresh stamp (LRU: the clock; LFU: 1) and the
        given dirty bits.
        """
        m = keys.numel()
        if slots is None:
            slots = self.choose(keys)
        at = self._to_trash(slots)
        old = self._keys.index_select(0, at)
        old = torch.where(slots >= 0, old, -1)
        victims = Victims(old, self.slab.index_select(0, at), self._dirty.index_select(0, at)
                          & (old >= 0), slots)
        if m == 0:
            return victims
        self._keys.index_copy_(0, at, keys)
        fresh = self.clock if self.policy == "lru" else 1
        self._stamp.index_fill_(0, at, fresh)
        if isinstance(lock, torch.Tensor):
            self._lock.index_copy_(0, at, lock.to(self.device, torch.int32))
        else:
            self._lock.index_fill_(0, at, int(lock))
        d = torch.zeros(m, dtype=torch.bool, device=self.device) if dirty is None else dirty
        self._dirty.index_copy_(0, at, d.to(self.device))
        self.slab.index_copy_(0, at, payload.to(self.device, torch.float32))
        self._clear_trash()
        return victims

    def remove(self, slots: torch.Tensor) -> Victims:
        """Empty these lines (-1 ignored); returns their keys, payloads and dirty bits."""
        at = self._to_trash(slots)
        out = Victims(self._keys.index_select(0, at), self.slab.index_select(0, at),
                      self._dirty.index_select(0, at), slots)
        self._keys.index_fill_(0, at, -1)
        self._stamp.index_fill_(0, at, 0)
        self._lock.index_fill_(0, at, 0)
        self._dirty.index_fill_(0, at, False)
        self._clear_trash()
        return out

    def _clear_trash(self) -> None:
        """Reset the trash line (a write for "no slot" may have landed there)."""
        t = self.trash  # fills with a scalar: `x[t] = -1` copies a host tensor over (a sync on CUDA)
        self._keys[t].fill_(-1)
        self._stamp[t].fill_(0)
        self._lock[t].fill_(0)
        self._dirty[t].fill_(False)

    # off the hot path: these read back to the host ------------------------------------------
    def resident(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, slots) of every occupied line (syncs: flushes and checks only)."""
        slots = torch.nonzero(self._keys[: self.capacity] >= 0).flatten()
        return self._keys.index_select(0, slots), slots

    @property
    def size(self) -> int:
        """Occupied lines (syncs)."""
        return int((self._keys[: self.capacity] >= 0).sum())

    def check(self) -> None:
        """Assert the invariants: keys unique, each in its hashed set, state only on occupied
        lines, locks never negative, the trash line clean."""
        keys, slots = self.resident()
        assert keys.unique().numel() == keys.numel(), "a key is cached twice"
        if keys.numel():
            assert torch.equal(self.set_of(keys), slots // self.ways), "a key outside its set"
            assert not self.direct or torch.equal(keys, slots), "a direct key off its own line"
        empty = self._keys[: self.capacity] < 0
        assert not bool((self._dirty[: self.capacity] & empty).any()), "a dirty empty line"
        assert not bool((self._lock[: self.capacity] != 0)[empty].any()), "a locked empty line"
        assert not bool((self._lock < 0).any()), "a negative lock"
        assert int(self._keys[self.trash]) == -1 and int(self._lock[self.trash]) == 0


def _triton_lookup(cache: HbmCache, keys: torch.Tensor) -> torch.Tensor:
    """`HbmCache.lookup` by the Triton kernel (imported only when chosen: optional package)."""
    from . import hbm_kernels

    return hbm_kernels.lookup(cache.keys, keys, cache.sets, cache.ways, cache.direct)


def _triton_choose(cache: HbmCache, keys: torch.Tensor) -> torch.Tensor:
    """`HbmCache.choose` by the Triton kernel."""
    from . import hbm_kernels

    rank = rank_in_set(cache.set_of(keys))
    return hbm_kernels.choose(cache.keys, cache.stamp, cache.lock, keys, rank, cache.sets,
                              cache.ways, cache.direct)


def _numba_lookup(cache: HbmCache, keys: torch.Tensor) -> torch.Tensor:
    """`HbmCache.lookup` by numba's loops on CPU tensors (`hbm_numba`: numba is optional)."""
    from . import hbm_numba

    return hbm_numba.lookup(cache.keys, keys)


def _numba_choose(cache: HbmCache, keys: torch.Tensor) -> torch.Tensor:
    """`HbmCache.choose` by numba's loops on CPU tensors."""
    from . import hbm_numba

    return hbm_numba.choose(cache.keys, cache.stamp, cache.lock, keys)
