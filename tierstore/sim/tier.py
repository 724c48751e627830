"""Tier mode: replay a trace through a real `SlabTier` (the store's host or device cache)."""

from __future__ import annotations

import numba
import numpy as np
import torch

from ..backends.slab import Rows, SlabTier
from ..policies import Lookahead, make_policy
from .exact import next_use

NO_USE = np.iinfo(np.int64).max


@numba.njit(cache=True, nogil=True)
def prev_use(nxt: np.ndarray) -> np.ndarray:  # pragma: no cover - compiled
    """For each request, the index of the previous request for the same key (-1 if none)."""
    n = nxt.size
    out = np.full(n, -1, dtype=np.int64)
    for i in range(n):
        j = nxt[i]
        if j < n:
            out[j] = i
    return out


def simulate_tier(ids: np.ndarray, n_keys: int, policy: str, capacity: int, batch_size: int,
                  window: int | None = None, device: str = "cpu", progress=None) -> int:
    """Misses of a `SlabTier` with `policy` replaying dense `ids` in batches of `batch_size`.

    Per batch: its distinct keys are looked up, hits are touched, misses inserted (the batch's
    hits protected from eviction); a miss is a distinct key of a batch that was not resident
    (one row fetch), so `batch_size=1` counts like the exact simulators. Look-ahead policies
    get next-use hints (batch numbers) for uses within `window` batches (Belady: all of them).
    """
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    n = ids.size
    bs = max(1, int(batch_size))
    tier = SlabTier("sim", capacity, 1, policy, device)
    wants_future = isinstance(tier.policy, Lookahead)
    if wants_future and window is None and make_policy(policy, 1).name == "lookahead":
        window = 1
    win = None if tier.policy.name == "belady" else window
    nxt = next_use(ids, n_keys)
    prv = prev_use(nxt) if wants_future and win is not None else None
    dev = torch.device(device)
    ids_t = torch.from_numpy(ids)
    nxt_t = torch.from_numpy(nxt)
    zero = torch.zeros((), dtype=torch.int64, device=dev)
    misses = 0
    n_batches = (n + bs - 1) // bs
    for b in range(n_batches):
        lo, hi = b * bs, min(n, (b + 1) * bs)
        if prv is not None and win is not None and b + win < n_batches:
            # the batch entering the window: hint resident keys not hinted yet
            elo, ehi = (b + win) * bs, min(n, (b + win + 1) * bs)
            p = prv[elo:ehi]
            first = (p < elo) & ((p < 0) | (p // bs < b))
            keys = ids_t[elo:ehi][torch.from_numpy(first)].to(dev)
            if keys.numel():
                slots = tier.index.find(zero, keys)
                ok = slots >= 0
                if bool(ok.any()):
                    tier.policy.on_future(slots[ok], torch.full_like(slots[ok], b + win))
        last = nxt_t[lo:hi] >= hi  # the last request of each distinct key in this batch
        keys = ids_t[lo:hi][last].to(dev)
        slots = tier.lookup(zero.expand(keys.numel()), keys)
        hit = slots >= 0
        hit_slots = slots[hit]
        tier.touch(hit_slots)
        miss = keys[~hit]
        misses += int(miss.numel())
        if miss.numel():
            tier.insert(Rows(zero.expand(miss.numel()), miss,
                             torch.zeros((miss.numel(), 1), device=dev),
                             torch.zeros(miss.numel(), dtype=torch.bool, device=dev)),
                        protect=hit_slots)
        if wants_future:
            nb = nxt_t[lo:hi][last]
            known = nb < n
            nb = torch.where(known, nb // bs, torch.full_like(nb, NO_USE))
            if win is not None:
                known &= nb - b <= win
            if bool(known.any()):
                kk = keys[known.to(dev)]
                s = tier.index.find(zero, kk)
                ok = s >= 0
                tier.policy.on_future(s[ok], nb.to(dev)[known.to(dev)][ok])
        if progress is not None:
            progress.update(hi - lo)
    return misses
