"""A vectorized open-addressing hash map from (table, row id) to cache slot."""

from __future__ import annotations

import numpy as np
import torch

import tierstore._kernels as _kernels
import tierstore._memory as _memory
import tierstore.hostread as hostread

from ._parallel import parallel_for
from .errors import ConfigError, ShapeError, StoreCorruptError

EMPTY = -1
TOMB = -2
_C1 = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64
_C2 = -4658895280553007687  # 0xBF58476D1CE4E5B9 as int64
_C3 = -7723592293110705685  # 0x94D049BB133111EB as int64


def _next_pow2(n: int) -> int:
    return 1 << max(3, (n - 1).bit_length())


SLOT_BITS = _kernels.SLOT_BITS
_NO_SLOTS = np.empty(0, dtype=np.int64)  # `assign` without its `moved` output
SLOT_MASK = (1 << SLOT_BITS) - 1


class HashIndex:
    """Linear-probing hash index over a tier's slots; every operation takes a batch.

    Memory is set by the tier capacity (a power-of-two table at most 75% full of live keys),
    never by the number of rows a table declares. Keys are (table index, row id) pairs.
    Each position holds its whole key, `[table << SLOT_BITS | slot, row]` in 16 bytes, so a
    lookup compares keys in the cache line it probes instead of chasing the slot's key
    elsewhere; `pos_of` maps a slot to its position (for `keys` and `remove`). The numba path
    deletes by backward shift (no tombstones); the torch path leaves tombstones, and the table
    is rebuilt when live keys and tombstones pass 85%.
    """

    def __init__(self, capacity: int, device: torch.device | str = "cpu") -> None:
        self.capacity = int(capacity)
        if self.capacity > SLOT_MASK:
            raise ConfigError(f"a cache tier holds at most {SLOT_MASK:,} rows, not {self.capacity:,}")
        self.device = torch.device(device)
        self.size = _next_pow2(-(-self.capacity * 4 // 3))
        self.mask = self.size - 1
        self.table = _memory.full((self.size, 2), EMPTY, torch.int64, self.device)
        self.pos_of = _memory.full((self.capacity,), -1, torch.int64, self.device)
        self.live = 0
        self.tombs = 0
        self.max_probe = 0
        self.use_kernels = _kernels.HAVE_NUMBA

    def fast(self, rows: torch.Tensor) -> bool:
        """Whether the numba kernels apply (CPU tensors; callers pass contiguous copies)."""
        return self.use_kernels and self.device.type == "cpu"

    def _home(self, tabs: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        h = rows * _C1 + tabs * _C2
        h = h ^ (h >> 31)
        h = h * _C3
        h = h ^ (h >> 29)
        return h & self.mask

    def find(self, tabs: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Return the slot of each key, or -1 where absent (`tabs` may be a 0-d tensor)."""
        n = rows.numel()
        out = torch.full((n,), -1, dtype=torch.int64, device=self.device)
        if n == 0 or self.live == 0:
            return out
        if self.fast(rows):
            args = (self.table.numpy(), tabs.reshape(-1).contiguous().numpy(), rows.contiguous().numpy(),
                    out.numpy(), self.mask)
            parallel_for(lambda lo, hi: _kernels.hash_find(*args, lo, hi), n, 8192)
            return out
        tabs = tabs.expand(n) if tabs.dim() == 0 else tabs
        pending = torch.arange(n, device=self.device)
        pos = self._home(tabs, rows)
        prow, ptab = rows, tabs
        for _ in range(self.max_probe + 1):
            e = self.table[pos]
            s = e[:, 0]
            match = (s >= 0) & (e[:, 1] == prow) & ((s >> SLOT_BITS) == ptab)
            out[pending[match]] = s[match] & SLOT_MASK
            cont = ~match & (s != EMPTY)
            if not bool(cont.any()):
                break
            pending, pos, prow, ptab = pending[cont], (pos[cont] + 1) & self.mask, prow[cont], ptab[cont]
        return out

    def probe(self, tabs: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(slots, miss, hits) of keys given as int64 arrays, in one compiled pass (`fast` only):
        each key's slot or -1, the positions of the absent keys, and the found slots in order."""
        n = rows.shape[0]
        slots, miss, hits = np.empty(n, np.int64), np.empty(n, np.int64), np.empty(n, np.int64)
        if n == 0 or self.live == 0:
            slots.fill(-1)
            return slots, np.arange(n, dtype=np.int64), hits[:0]
        nm = _kernels.hash_probe(self.table.numpy(), self.mask, tabs, rows, slots, miss, hits)
        return slots, miss[:nm], hits[: n - nm]

    def gather(self, tab: int, rows: np.ndarray, src: np.ndarray, data: np.ndarray,
               found: np.ndarray, known: np.ndarray) -> int:
        """For each key (tab, rows[i]) the index holds, copy row `src[slot, :w]` into `data[i]`
        (w = data's width) and set found[i] and known[i], in one compiled pass (`fast` only);
        returns how many were held."""
        if self.live == 0:
            return 0
        return int(_kernels.hash_gather(self.table.numpy(), self.mask, int(tab), rows, src, data,
                                        found, known))

    def make_room(self, n: int) -> None:
        """Rebuild now if `n` more keys would fill the table past 85% (before a kernel adds
        keys itself, then reports them with `account`)."""
        if (self.live + self.tombs + n) * 20 > self.size * 17:
            self._rebuild()

    def account(self, added: int, tombs: int, max_probe: int) -> None:
        """Record what a kernel did to the table: live keys added (net), tombstones left (net),
        its largest probe distance."""
        self.live += added
        self.tombs += tombs
        self.max_probe = max(self.max_probe, max_probe)

    def add(self, tabs: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor) -> None:
        """Insert keys that are absent, mapping them to free `slots` (all distinct)."""
        n = rows.numel()
        if slots.numel() != n:  # the kernel trusts its input: a mismatch would write out of bounds
            raise ShapeError(f"{n} keys but {slots.numel()} slots")
        if n == 0:
            return
        if (self.live + self.tombs + n) * 20 > self.size * 17:
            self._rebuild()
        if self.fast(rows):
            reused, maxd = _kernels.hash_add(self.table.numpy(), self.pos_of.numpy(),
                                             tabs.reshape(-1).contiguous().numpy(),
                                             rows.contiguous().numpy(), slots.contiguous().numpy(),
                                             self.mask)
            self.live += n
            self.tombs -= int(reused)
            self.max_probe = max(self.max_probe, int(maxd))
            return
        tabs = tabs.expand(n) if tabs.dim() == 0 else tabs
        home = self._home(tabs, rows)
        pending = torch.arange(n, device=self.device)
        pos = home
        landed_on_tomb = 0
        while pending.numel():
            s = self.table[pos, 0]
            free = s < 0
            cand = torch.nonzero(free).flatten()
            if cand.numel():
                cpos = pos[cand]
                sorted_pos, order = torch.sort(cpos, stable=True)
                first = torch.ones_like(sorted_pos, dtype=torch.bool)
                first[1:] = sorted_pos[1:] != sorted_pos[:-1]
                win = cand[order[first]]
                wpos = pos[win]
                landed_on_tomb += int((s[win] == TOMB).sum())
                wslots = slots[pending[win]]
                self.table[wpos, 0] = (tabs[pending[win]] << SLOT_BITS) | wslots
                self.table[wpos, 1] = rows[pending[win]]
                self.pos_of[wslots] = wpos
                dist = (wpos - home[pending[win]]) & self.mask
                self.max_probe = max(self.max_probe, int(dist.max()))
                keep = torch.ones_like(free)
                keep[win] = False
            else:
                keep = torch.ones_like(free)
            pending, pos = pending[keep], (pos[keep] + 1) & self.mask
        self.live += n
        self.tombs -= landed_on_tomb

    def assign(self, tabs: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor,
               moved: np.ndarray | None = None) -> None:
        """Map distinct keys to distinct `slots`: a slot's previous key is dropped, and a key
        already present moves to its new slot (one probe a key on CPU). With `moved` (int64,
        one entry a key) each key's previous slot is written there, or -1."""
        n = rows.numel()
        if slots.numel() != n or (moved is not None and moved.shape != (n,)):
            # the kernel trusts its input: a mismatch would write out of bounds
            raise ShapeError(f"{n} keys but {slots.numel()} slots")
        if n == 0:
            return
        tabs = tabs.expand(n) if tabs.dim() == 0 or tabs.numel() == 1 else tabs
        if self.fast(rows):
            # every key sits in a slot, so live keys never pass `capacity`: only tombstones fill up
            if (min(self.live + n, self.capacity) + self.tombs) * 20 > self.size * 17:
                self._rebuild()
            added, tombs, maxd = _kernels.hash_assign(
                self.table.numpy(), self.pos_of.numpy(), tabs.reshape(-1).contiguous().numpy(),
                rows.contiguous().numpy(), slots.contiguous().numpy(), self.mask,
                _NO_SLOTS if moved is None else moved)
            self.live += int(added)
            self.tombs += int(tombs)
            self.max_probe = max(self.max_probe, int(maxd))
            return
        old = self.find(tabs, rows)
        if moved is not None:  # as the kernel reports it: a key whose slot an earlier (or its
            # own) assignment reuses was dropped with that slot, so it moved from nowhere
            o, sl = old.cpu().numpy(), slots.cpu().numpy()
            order = np.argsort(sl)
            at = np.minimum(np.searchsorted(sl, o, sorter=order), n - 1)
            j = order[at]
            moved[:] = np.where((sl[j] == o) & (j <= np.arange(n)), -1, o)
        self.remove(old[old >= 0])
        self.remove(slots[self.pos_of[slots] >= 0])
        self.add(tabs, rows, slots)

    def held(self, slots: torch.Tensor) -> torch.Tensor:
        """Mask of the slots that hold a key."""
        return self.pos_of[slots] >= 0

    def keys(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(table index, row id) of each present slot."""
        if self.fast(slots) and slots.dim() == 1 and slots.dtype == torch.int64:
            n = slots.numel()
            tabs, rows = torch.empty(n, dtype=torch.int64), torch.empty(n, dtype=torch.int64)
            if n:
                _kernels.hash_keys(self.table.numpy(), self.pos_of.numpy(),
                                   slots.contiguous().numpy(), tabs.numpy(), rows.numpy())
            return tabs, rows
        entry = self.table[self.pos_of[slots]]
        return entry[:, 0] >> SLOT_BITS, entry[:, 1]

    def remove(self, slots: torch.Tensor) -> None:
        """Drop the keys held by `slots` (each must be present: an absent one raises, since
        removing it would delete whatever key sits in the table's last position)."""
        if slots.numel() == 0:
            return
        if bool((self.pos_of[slots] < 0).any()):
            raise StoreCorruptError("an index removal names a slot that holds no key (internal error)")
        if self.fast(slots):
            self.tombs += int(_kernels.hash_remove(self.table.numpy(), self.pos_of.numpy(),
                                                   slots.contiguous().numpy(), self.mask))
        else:
            self.table[self.pos_of[slots], 0] = TOMB
            self.pos_of[slots] = -1
            self.tombs += slots.numel()
        self.live -= slots.numel()

    def _rebuild(self) -> None:
        live = torch.nonzero(self.pos_of >= 0).flatten()
        tabs, rows = self.keys(live)
        self.table.fill_(EMPTY)
        self.pos_of.fill_(-1)
        self.live = self.tombs = self.max_probe = 0
        self.add(tabs, rows, live)

    def check(self) -> None:
        """Assert that every live slot is found at its recorded position."""
        live = torch.nonzero(self.pos_of >= 0).flatten()
        assert live.numel() == self.live, (live.numel(), self.live)
        entry = self.table[self.pos_of[live]]
        assert bool(((entry[:, 0] & SLOT_MASK) == live).all())
        found = self.find(*self.keys(live))
        assert bool((found == live).all())
        assert int((self.table[:, 0] >= 0).sum()) == self.live
        assert int((self.table[:, 0] == TOMB).sum()) == self.tombs


def dedup(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unique ids and the inverse map (ids == uniq[inverse]); uniq is in no particular order.

    On CPU this is one pass over a small hash set (first-occurrence order), an order of
    magnitude cheaper than `torch.unique`, which sorts; elsewhere it is `torch.unique`.
    """
    if ids.device.type != "cpu" or not _kernels.HAVE_NUMBA or ids.numel() == 0:
        return torch.unique(ids, sorted=True, return_inverse=True)
    bits = max(3, (2 * ids.numel() - 1).bit_length())
    uniq, inverse = _kernels.dedup(ids.contiguous().numpy(), bits)
    return torch.from_numpy(uniq), torch.from_numpy(inverse)


def sorted_dedup(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unique ids ascending and the inverse map (ids == uniq[inverse]): `torch.unique(ids,
    return_inverse=True)`, on CPU by a hash set's pass, then a sort of the distinct ids only."""
    if ids.device.type != "cpu" or not _kernels.HAVE_NUMBA or ids.numel() == 0:
        return torch.unique(ids, sorted=True, return_inverse=True)
    bits = max(3, (2 * ids.numel() - 1).bit_length())
    uniq, first, keys, vals = _kernels.dedup_table(ids.contiguous().numpy(), bits)
    uniq = np.sort(uniq)  # numpy's sort: several times numba's (or an argsort) on a few thousand
    return torch.from_numpy(uniq), torch.from_numpy(_kernels.ranked(uniq, first, keys, vals))


def sort_unique(uniq: torch.Tensor, inverse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same (unique, inverse) pair with `unique` in ascending order."""
    order = torch.argsort(uniq)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel(), device=order.device)
    return uniq.index_select(0, order), rank.index_select(0, inverse)


def sorted_unique(ids: torch.Tensor) -> torch.Tensor:
    """`torch.unique(ids)` (ascending): on CPU a hash pass then a sort of the distinct ids only."""
    if ids.device.type != "cpu" or not _kernels.HAVE_NUMBA or ids.numel() == 0:
        return torch.unique(ids)
    bits = max(3, (2 * ids.numel() - 1).bit_length())
    uniq = _kernels.distinct(ids.contiguous().numpy(), bits)
    uniq.sort()
    return torch.from_numpy(uniq)


def absent_many(indexes: tuple[HashIndex, HashIndex, HashIndex],
                items: list[tuple[int, torch.Tensor]]) -> list[torch.Tensor]:
    """`absent_from` for several (table, rows) at once: an index on a device (the sets cache)
    is probed once for all of them and read back once, not once a table."""
    if len(items) < 2:
        return [absent_from(indexes, tab, rows) for tab, rows in items]
    sizes = [int(rows.numel()) for _, rows in items]
    rows = torch.cat([r.to("cpu", torch.int64) for _, r in items]).contiguous()
    if all(ix.fast(rows) for ix in indexes):  # one compiled pass over every table's keys
        return list(_absent_np(indexes, np.repeat(np.array([int(t) for t, _ in items], dtype=np.int64),
                                                  sizes), rows).split(sizes))
    tabs = torch.repeat_interleave(torch.tensor([int(t) for t, _ in items], dtype=torch.int64),
                                   torch.tensor(sizes, dtype=torch.int64))
    out = torch.ones(rows.numel(), dtype=torch.bool)
    if rows.numel():
        for ix in indexes:
            out &= _found_on_host(ix, tabs, rows) < 0
    return list(out.split(sizes))


def _found_on_host(ix: HashIndex, tabs: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """`ix.find` of host keys, on the host: from the index's host mirror when it has one (a
    direct sets cache: no device read), else a device lookup read back through an event
    (`tierstore.hostread`)."""
    on_host = getattr(ix, "find_host", None)
    found = on_host(tabs, rows) if on_host is not None else None
    if found is None:
        found = hostread.to_host(ix.find(hostread.to_device(tabs, ix.device),
                                         hostread.to_device(rows, ix.device)))[0]
    return found


def _absent_np(indexes: tuple[HashIndex, HashIndex, HashIndex], tabs: np.ndarray,
               rows: torch.Tensor) -> torch.Tensor:
    """`absent_from`'s compiled pass: keys (tabs[i] or tabs[0], rows[i]), rows a contiguous
    CPU int64 tensor."""
    out = torch.empty(rows.numel(), dtype=torch.bool)
    (a, b, c) = indexes
    _kernels.hash_absent(a.table.numpy(), a.mask, b.table.numpy(), b.mask, c.table.numpy(),
                         c.mask, tabs, rows.numpy(), out.numpy())
    return out


def absent_from(indexes: tuple[HashIndex, HashIndex, HashIndex], tab: int,
                rows: torch.Tensor) -> torch.Tensor:
    """Mask of the keys (tab, rows) in none of three indexes (CPU bool tensor).

    On CPU one pass probes the indexes in order and stops at the first that holds a key.
    """
    n = rows.numel()
    rows = rows.to("cpu", torch.int64).contiguous()
    if all(ix.fast(rows) for ix in indexes) and n:
        return _absent_np(indexes, np.array([int(tab)], dtype=np.int64), rows)
    out = torch.ones(n, dtype=torch.bool)
    tabs = torch.full((n,), int(tab), dtype=torch.int64)
    for ix in indexes:
        out &= _found_on_host(ix, tabs, rows) < 0
    return out
