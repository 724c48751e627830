"""libCacheSim 0.3.5's W-TinyLFU in plain Python: a transcription of its C simulator's steps.

Written from libCacheSim's `WTinyLFU.c`, `SLRU.c` (main cache, `seg-size=1:4`), `LRU.c`
(window), `cache.c` (`cache_get_base`) and `minimalIncrementCBF.c` (the sketch), with one
change found by running the `libcachesim==0.3.5` wheel: an admitted candidate ends the
eviction step (the C source of 2024 keeps evicting until a candidate is rejected). The XXH64
here is the published algorithm for one 8-byte lane. `OrderedDict`s are the lists (first
entry: the tail, least recent).
"""

from __future__ import annotations

import math
from collections import OrderedDict

MASK64 = (1 << 64) - 1
MASK32 = (1 << 32) - 1
PRIMES64 = (0x9E3779B185EBCA87, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0x85EBCA77C2B2AE63,
            0x27D4EB2F165667C5)


def _rotl(x: int, r: int) -> int:
    return ((x << r) | (x >> (64 - r))) & MASK64


def xxh64_int(key: int, seed: int) -> int:
    """XXH64 of the 8 little-endian bytes of `key` (taken modulo 2**64)."""
    p1, p2, p3, p4, p5 = PRIMES64
    h = (seed + p5 + 8) & MASK64
    h ^= (_rotl((key & MASK64) * p2 & MASK64, 31) * p1) & MASK64
    h = (_rotl(h, 27) * p1 + p4) & MASK64
    h = ((h ^ (h >> 33)) * p2) & MASK64
    h = ((h ^ (h >> 29)) * p3) & MASK64
    return h ^ (h >> 32)


class CountingBloom:
    """minimalIncrementCBF: `hashes` positions by double hashing, every counter incremented."""

    def __init__(self, entries: int, error: float, seeds: tuple[int, int]) -> None:
        bpe = -math.log(error) / 0.480453013918201
        self.hashes = math.ceil(0.693147180559945 * bpe)
        self.n = min(math.ceil(bpe * entries), 2**31 - 1)
        if self.n < self.hashes:
            self.n = 2 * self.hashes
        self.counts = [0] * self.n
        self.seeds = seeds

    def _positions(self, key: int) -> list[int]:
        a = xxh64_int(key, self.seeds[0]) & MASK32
        b = xxh64_int(key, self.seeds[1]) & MASK32
        return [((a + i * b) & MASK32) % self.n for i in range(self.hashes)]

    def estimate(self, key: int) -> int:
        return min(self.counts[x] for x in self._positions(key))

    def add(self, key: int) -> None:
        for x in self._positions(key):
            self.counts[x] += 1

    def halve(self) -> None:
        self.counts = [c >> 1 for c in self.counts]


def py_lcs_wtinylfu(keys: list, cap: int, window: float = 0.01, segments: tuple = (1, 4),
                    error: float = 0.001, decay: int = 32,
                    seeds: tuple = (0x12345678, 0x12344321)) -> int:
    """Misses of libCacheSim's W-TinyLFU (object size 1) on `keys` with `cap` objects."""
    win_size = int(cap * window)
    main = cap - win_size
    total = sum(segments)
    limit = [int(segments[0] / total * main), int(segments[1] / total * main)]
    if min(cap, win_size, main, limit[0]) < 1:
        return len(keys)
    win: OrderedDict = OrderedDict()
    seg: list[OrderedDict] = [OrderedDict(), OrderedDict()]  # probation, protected
    where: dict = {}
    cbf = CountingBloom(main, error, seeds)
    main_hits = 0
    misses = 0

    def main_size() -> int:
        return len(seg[0]) + len(seg[1])

    def main_victim():
        return next(iter(seg[0] or seg[1]))

    def main_evict() -> None:
        v = main_victim()
        del seg[where.pop(v)][v]

    def main_insert(k) -> None:
        for i in (0, 1):
            if len(seg[i]) + 1 <= limit[i]:
                break
        else:
            while main_size() + 1 > main:
                main_evict()
            i = 0
        seg[i][k] = None
        where[k] = i

    def evict() -> None:
        while True:
            if not win:
                main_evict()
                return
            c = next(iter(win))
            del win[c]
            if main_size() + 1 <= main:
                main_insert(c)
                cbf.add(c)
                continue
            if cbf.estimate(c) > cbf.estimate(main_victim()):
                main_evict()
                main_insert(c)
            cbf.add(c)
            return

    for k in keys:
        if k in win:
            win.move_to_end(k)
            continue
        if k in where:
            if where[k] == 0:  # promote; protected's overflow cools, probation's leaves
                del seg[0][k]
                seg[1][k] = None
                where[k] = 1
                while len(seg[1]) > limit[1]:
                    o = next(iter(seg[1]))
                    del seg[1][o]
                    seg[0][o] = None
                    where[o] = 0
                    while len(seg[0]) > limit[0]:
                        o = next(iter(seg[0]))
                        del seg[0][o], where[o]
            else:
                seg[1].move_to_end(k)
            cbf.add(k)
            main_hits += 1
            if main_hits >= decay * main:
                main_hits = 0
                cbf.halve()
            continue
        misses += 1
        while len(win) + main_size() + 1 > cap:
            evict()
        win[k] = None
        cbf.add(k)
    return misses
