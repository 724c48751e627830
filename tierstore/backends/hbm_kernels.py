"""Triton kernels of the set-associative cache (`hbm_cache.HbmCache`): lookup and victim choice.

Each equals its torch reference in `hbm_cache` exactly (the same hash, the same victim order);
`tests/test_hbm_triton.py` checks them under Triton's interpreter on CPU tensors. Offsets are
int64, block sizes `tl.constexpr`, and nothing is read back to the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._triton import launching

BLOCK = 64  # keys a lookup program compares at once


@triton.jit
def _set_of(k, sets, WAYS: tl.constexpr, DIRECT: tl.constexpr):
    # as `hbm_cache.set_of`: bits 32..62 of k * 0x9E3779B97F4A7C15 (wrapping) modulo the sets,
    # or, direct, the key's own block of WAYS (keys clamped into the capacity)
    if DIRECT:
        return tl.minimum(tl.maximum(k, 0), sets * WAYS - 1) // WAYS
    else:
        return (((k * -7046029254386353131) >> 32) & 0x7FFFFFFF) % sets


@triton.jit
def _lookup_kernel(table, keys, out, n, sets, WAYS: tl.constexpr, BLOCK_N: tl.constexpr,
                   DIRECT: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    im = i < n
    k = tl.load(keys + i, mask=im, other=-1)
    s = _set_of(k, sets, WAYS, DIRECT)
    w = tl.arange(0, WAYS)
    line = tl.load(table + s[:, None] * WAYS + w[None, :], mask=im[:, None], other=-1)
    eq = (line == k[:, None]) & (k[:, None] >= 0)
    way = tl.min(tl.where(eq, w[None, :], WAYS), axis=1)
    tl.store(out + i, tl.where(way < WAYS, s * WAYS + way, -1), mask=im)


@triton.jit
def _choose_kernel(table, stamp, lock, keys, rank, out, sets, WAYS: tl.constexpr,
                   DIRECT: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    k = tl.load(keys + i)
    r = tl.load(rank + i)
    base = _set_of(k, sets, WAYS, DIRECT) * WAYS
    w = tl.arange(0, WAYS)
    kk = tl.load(table + base + w)
    st = tl.load(stamp + base + w)
    lk = tl.load(lock + base + w)
    # victim order as `hbm_cache.order_key`: empty lines, then unlocked by stamp, locked last
    ok = tl.where(lk > 0, 4611686018427387904, tl.where(kk >= 0, tl.maximum(st, 0) + 1, 0))
    a = ok[:, None]
    b = ok[None, :]
    before = (a < b) | ((a == b) & (w[:, None] < w[None, :]))
    pos = tl.sum(before.to(tl.int32), axis=0)  # each way's place in the order
    hit = (pos == r) & (ok < 4611686018427387904)
    way = tl.min(tl.where(hit, w, WAYS), axis=0)
    tl.store(out + i, tl.where(way < WAYS, base + way, -1))


def lookup(table: torch.Tensor, keys: torch.Tensor, sets: int, ways: int,
           direct: bool = False) -> torch.Tensor:
    """Slots of `keys` in the cache's keys [sets, ways], -1 where absent."""
    keys = keys.contiguous()
    out = torch.empty_like(keys)
    n = keys.numel()
    if n:
        with launching():
            _lookup_kernel[(triton.cdiv(n, BLOCK),)](table, keys, out, n, sets, WAYS=ways,
                                                     BLOCK_N=BLOCK, DIRECT=direct)
    return out


def choose(table: torch.Tensor, stamp: torch.Tensor, lock: torch.Tensor, keys: torch.Tensor,
           rank: torch.Tensor, sets: int, ways: int, direct: bool = False) -> torch.Tensor:
    """The slot each absent key takes (its `rank`-th line in its set's victim order), or -1."""
    keys = keys.contiguous()
    out = torch.empty_like(keys)
    n = keys.numel()
    if n:
        with launching():
            _choose_kernel[(n,)](table, stamp, lock, keys, rank.contiguous(), out, sets, WAYS=ways,
                                 DIRECT=direct)
    return out
