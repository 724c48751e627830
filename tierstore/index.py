"""A vectorized open-addressing hash map from (table, row id) to cache slot."""

from __future__ import annotations

import torch

from . import _kernels

EMPTY = -1
TOMB = -2
_C1 = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64
_C2 = -4658895280553007687  # 0xBF58476D1CE4E5B9 as int64
_C3 = -7723592293110705685  # 0x94D049BB133111EB as int64


def _next_pow2(n: int) -> int:
    return 1 << max(3, (n - 1).bit_length())


class HashIndex:
    """Linear-probing hash index over a tier's slots; every operation takes a batch.

    Memory is set by the tier capacity (a table of at least twice as many positions),
    never by the number of rows a table declares. Keys are (table index, row id) pairs;
    the index keeps each slot's key so that lookups compare on the real key.
    """

    def __init__(self, capacity: int, device: torch.device | str = "cpu") -> None:
        self.capacity = int(capacity)
        self.device = torch.device(device)
        self.size = _next_pow2(2 * self.capacity + 1)
        self.mask = self.size - 1
        self.table = torch.full((self.size,), EMPTY, dtype=torch.int64, device=self.device)
        self.row_of = torch.full((self.capacity,), -1, dtype=torch.int64, device=self.device)
        self.tab_of = torch.full((self.capacity,), -1, dtype=torch.int64, device=self.device)
        self.pos_of = torch.full((self.capacity,), -1, dtype=torch.int64, device=self.device)
        self.live = 0
        self.tombs = 0
        self.max_probe = 0
        self.use_kernels = _kernels.HAVE_NUMBA

    def _fast(self, rows: torch.Tensor) -> bool:
        """Whether the numba kernels apply (CPU tensors, contiguous int64 keys)."""
        return self.use_kernels and self.device.type == "cpu" and rows.is_contiguous()

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
        if self._fast(rows):
            _kernels.hash_find(self.table.numpy(), self.row_of.numpy(), self.tab_of.numpy(),
                               tabs.reshape(-1).numpy(), rows.numpy(), out.numpy(), self.mask)
            return out
        tabs = tabs.expand(n) if tabs.dim() == 0 else tabs
        pending = torch.arange(n, device=self.device)
        pos = self._home(tabs, rows)
        prow, ptab = rows, tabs
        for _ in range(self.max_probe + 1):
            s = self.table[pos]
            sc = s.clamp(min=0)
            match = (s >= 0) & (self.row_of[sc] == prow) & (self.tab_of[sc] == ptab)
            out[pending[match]] = s[match]
            cont = ~match & (s != EMPTY)
            if not bool(cont.any()):
                break
            pending, pos, prow, ptab = pending[cont], (pos[cont] + 1) & self.mask, prow[cont], ptab[cont]
        return out

    def add(self, tabs: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor) -> None:
        """Insert keys that are absent, mapping them to free `slots` (all distinct)."""
        n = rows.numel()
        if n == 0:
            return
        if (self.live + self.tombs + n) * 10 > self.size * 7:
            self._rebuild()
        if self._fast(rows):
            reused, maxd = _kernels.hash_add(
                self.table.numpy(), self.row_of.numpy(), self.tab_of.numpy(), self.pos_of.numpy(),
                tabs.reshape(-1).numpy(), rows.numpy(), slots.numpy(), self.mask)
            self.live += n
            self.tombs -= int(reused)
            self.max_probe = max(self.max_probe, int(maxd))
            return
        tabs = tabs.expand(n) if tabs.dim() == 0 else tabs
        self.row_of[slots] = rows
        self.tab_of[slots] = tabs
        home = self._home(tabs, rows)
        pending = torch.arange(n, device=self.device)
        pos = home
        landed_on_tomb = 0
        while pending.numel():
            s = self.table[pos]
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
                self.table[wpos] = wslots
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

    def remove(self, slots: torch.Tensor) -> None:
        """Drop the keys held by `slots` (each must be present)."""
        if slots.numel() == 0:
            return
        self.table[self.pos_of[slots]] = TOMB
        self.pos_of[slots] = -1
        self.row_of[slots] = -1
        self.tab_of[slots] = -1
        self.live -= slots.numel()
        self.tombs += slots.numel()

    def _rebuild(self) -> None:
        live = torch.nonzero(self.pos_of >= 0).flatten()
        tabs, rows = self.tab_of[live].clone(), self.row_of[live].clone()
        self.table.fill_(EMPTY)
        self.pos_of.fill_(-1)
        self.live = self.tombs = self.max_probe = 0
        self.add(tabs, rows, live)

    def check(self) -> None:
        """Assert that every live slot is found at its recorded position."""
        live = torch.nonzero(self.pos_of >= 0).flatten()
        assert live.numel() == self.live, (live.numel(), self.live)
        assert bool((self.table[self.pos_of[live]] == live).all())
        found = self.find(self.tab_of[live], self.row_of[live])
        assert bool((found == live).all())
        assert int((self.table >= 0).sum()) == self.live
        assert int((self.table == TOMB).sum()) == self.tombs
