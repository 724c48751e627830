"""The set-associative cache's lookup and victim choice as numba kernels, for CPU tensors.

`HbmCache(kernels="numba")` on the CPU: the same slots as its torch ops (`lookup_torch`,
`choose_torch`), which on the CPU cost a [keys, ways] gather, compare and stable sort per call.
Each kernel walks the keys once: a lookup compares one set's ways; a choice counts each key's
rank in its set as it goes (the input order, as `rank_in_set`) and selects that rank's line in
victim order (empty lines, then unlocked lines by stamp, locked lines never; ties to the lower
way) by repeated minimum, without sorting the set. A machine without a GPU runs the CUDA
backend's staging through these, so its host-side cost can be measured on the CPU.
"""

from __future__ import annotations

import numpy as np
import torch

from .._kernels import HAVE_NUMBA
from .hbm_cache import HASH_MUL, LOCKED  # the cache's hash and victim order: the same slots

AHEAD = 8  # keys ahead whose set's lines a kernel asks for (the sets are at random)

if HAVE_NUMBA:
    import numba

    from .._kernels import prefetch

    @numba.njit(nogil=True, cache=True, inline="always")
    def _set(key, sets):  # pragma: no cover - compiled
        """`hbm_cache.set_of` of one key: bits 32..62 of key * HASH_MUL (wrapping), mod sets."""
        h = ((key * np.int64(HASH_MUL)) >> np.int64(32)) & np.int64(0x7FFFFFFF)
        return h % sets

    @numba.njit(nogil=True, cache=True)
    def _lookup(lines, keys, out):  # pragma: no cover - compiled
        """out[i]: the slot holding keys[i] in `lines` [sets, ways], -1 where absent."""
        sets, ways = lines.shape
        n = keys.shape[0]
        for i in range(n):
            if i + AHEAD < n and keys[i + AHEAD] >= 0:  # a later key's set, asked for now
                sa = _set(keys[i + AHEAD], sets)
                for w in range(0, ways, 8):
                    prefetch(lines, sa, w)
            k = keys[i]
            out[i] = -1
            if k < 0:
                continue
            s = _set(k, sets)
            for w in range(ways):
                if lines[s, w] == k:
                    out[i] = s * ways + w
                    break

    @numba.njit(nogil=True, cache=True, inline="always")
    def _order(lines, stamp, lock, s, w):  # pragma: no cover - compiled
        """A line's place in victim order (`hbm_cache.order_key`)."""
        if lock[s, w] > 0:
            return np.int64(LOCKED)
        if lines[s, w] < 0:
            return np.int64(0)
        st = stamp[s, w]
        return (st if st > 0 else np.int64(0)) + 1

    @numba.njit(nogil=True, cache=True)
    def _choose(lines, stamp, lock, keys, out):  # pragma: no cover - compiled
        """out[i]: the line keys[i] would take (the r-th in its set's victim order, r its rank
        among the keys of its set in input order), -1 where none is left unlocked."""
        sets, ways = lines.shape
        seen = np.zeros(sets, dtype=np.int64)
        n = keys.shape[0]
        for i in range(n):
            if i + AHEAD < n:  # a later key's set: its lines, stamps and locks asked for now
                sa = _set(keys[i + AHEAD], sets)
                for w in range(0, ways, 8):
                    prefetch(lines, sa, w)
                    prefetch(stamp, sa, w)
                for w in range(0, ways, 16):
                    prefetch(lock, sa, w)
            s = _set(keys[i], sets)
            r = seen[s]
            seen[s] = r + 1
            out[i] = -1
            if r >= ways:
                continue
            # the r-th smallest (order, way): r + 1 passes, each past the last one taken
            last_o, last_w = np.int64(-1), -1
            for _ in range(r + 1):
                best_o, best_w = np.int64(0), -1
                for w in range(ways):
                    o = _order(lines, stamp, lock, s, w)
                    if o < last_o or (o == last_o and w <= last_w):
                        continue
                    if best_w < 0 or o < best_o:
                        best_o, best_w = o, w
                last_o, last_w = best_o, best_w
            if last_o < LOCKED:
                out[i] = s * ways + last_w


def lookup(lines: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """`HbmCache.lookup` of a hashed (not direct) cache's lines [sets, ways], on CPU tensors."""
    out = torch.empty_like(keys)
    _lookup(lines.numpy(), keys.contiguous().numpy(), out.numpy())
    return out


def choose(lines: torch.Tensor, stamp: torch.Tensor, lock: torch.Tensor,
           keys: torch.Tensor) -> torch.Tensor:
    """`HbmCache.choose` of a hashed cache (its lines, stamps and locks [sets, ways]) for unique
    absent `keys`, on CPU tensors."""
    out = torch.empty_like(keys)
    _choose(lines.numpy(), stamp.numpy(), lock.numpy(), keys.contiguous().numpy(), out.numpy())
    return out
