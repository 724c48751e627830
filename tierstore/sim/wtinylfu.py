"""libCacheSim's W-TinyLFU, request by request (numba), and the tier policy's W-TinyLFU for comparison.

`lcs_wtinylfu` reproduces the miss counts of libCacheSim 0.3.5's `WTinyLFU` (object size 1,
default parameters) to the request. Its mechanism, as the C simulator runs it:

- **Sizes.** The window LRU holds `int(capacity * window)` objects (truncated, as C's
  `int64 *= double`); the main cache, the rest, is an SLRU of two segments sized
  `int(main * 1/5)` (probation) and `int(main * 4/5)` (protected), truncated, so they may sum to
  one less than `main`. An object can be cached only if the window, the main cache and
  probation each hold at least one: below 100 objects (window 0) every request misses.
- **Hits.** A window hit moves the object to the window's head; nothing is counted. A main hit
  is counted in the sketch; a probation hit moves to protected's head and, while protected is
  over its size, protected's tail goes to probation's head, and while probation is over its
  size probation's tail is evicted (a hit can evict: only when the truncated segment sizes
  let probation overfill). Every `decay` x main main-cache hits, all counters are halved.
- **Misses.** While the cache is full, one eviction step runs: the window's tail (the
  candidate) moves to main if main has room (insert: the first segment with room, else
  probation) and the step goes on; otherwise the candidate duels main's victim (probation's
  tail, or protected's when probation is empty): if the sketch counts it strictly more, the
  victim is evicted and the candidate enters main, else the candidate is evicted. Each
  candidate is counted once more in the sketch, whatever the outcome. With the window empty,
  main's victim is evicted. The new object then enters the window's head and is counted.
- **Sketch** (libCacheSim's minimalIncrementCBF): one array of 32-bit counters,
  `ceil(bpe * main)` of them with `bpe = -ln(error) / ln(2)^2`, and `ceil(ln(2) * bpe)`
  positions per object (10 at `error=0.001`): `(a + i * b) mod counters` in 32-bit arithmetic,
  `a` and `b` the low 32 bits of XXH64 of the object id's 8 bytes under two seeds. An add
  increments every position; the estimate is the minimum.

The object id libCacheSim hashes is the trace's key, so the result depends on the keys, not
only on their pattern: pass the original keys (`keys`), not the dense ids.
"""

from __future__ import annotations

import math

import numba
import numpy as np

import tierstore.policies.queues as q
import tierstore.policies.sketch as _sketch

from ..errors import ConfigError
from ..policies import wtinylfu as _wtlfu
from ..policies.base import key_hash_np

SEEDS = (0x12345678, 0x12344321)  # libCacheSim's HASH_SEED0 and HASH_SEED1
_P1 = np.uint64(0x9E3779B185EBCA87)
_P2 = np.uint64(0xC2B2AE3D27D4EB4F)
_P3 = np.uint64(0x165667B19E3779F9)
_P4 = np.uint64(0x85EBCA77C2B2AE63)
_P5 = np.uint64(0x27D4EB2F165667C5)
_LN2 = 0.693147180559945  # the constants libCacheSim's sketch sizing uses
_LN2_SQ = 0.480453013918201
_INT_MAX = 2**31 - 1
NIL = -1
WINDOW, PROBATION, PROTECTED = 0, 1, 2


def _rotl(x: np.ndarray, r: int) -> np.ndarray:
    return (x << np.uint64(r)) | (x >> np.uint64(64 - r))


def xxh64_u64(keys: np.ndarray, seed: int) -> np.ndarray:
    """XXH64 of each key's 8 little-endian bytes under `seed` (uint64; vectorized)."""
    v = np.ascontiguousarray(keys).astype(np.int64).view(np.uint64)
    with np.errstate(over="ignore"):
        h = np.full(v.shape, np.uint64((seed + int(_P5) + 8) % 2**64), dtype=np.uint64)
        k = _rotl(v * _P2, 31) * _P1
        h ^= k
        h = _rotl(h, 27) * _P1 + _P4
        h ^= h >> np.uint64(33)
        h *= _P2
        h ^= h >> np.uint64(29)
        h *= _P3
        h ^= h >> np.uint64(32)
    return h


def sketch_shape(entries: int, error: float = 0.001) -> tuple[int, int]:
    """(counters, positions per object) of libCacheSim's minimalIncrementCBF for `entries`."""
    bpe = -math.log(error) / _LN2_SQ
    hashes = math.ceil(_LN2 * bpe)
    counters = int(min(math.ceil(bpe * entries), _INT_MAX))
    return (2 * hashes if counters < hashes else counters), hashes


@numba.njit(cache=True, nogil=True, inline="always")
def _unlink(prev, nxt, x):  # pragma: no cover - compiled
    p, q = prev[x], nxt[x]
    nxt[p] = q
    prev[q] = p


@numba.njit(cache=True, nogil=True, inline="always")
def _push(prev, nxt, s, x):  # pragma: no cover - compiled
    """Put `x` at the head (most recent end) of the list whose sentinel is `s`."""
    h = nxt[s]
    nxt[x] = h
    prev[x] = s
    prev[h] = x
    nxt[s] = x


@numba.njit(cache=True, nogil=True)
def _estimate(bf, ha, hb, k, nhash):  # pragma: no cover - compiled
    n = bf.size
    best = np.uint32(0xFFFFFFFF)
    for i in range(nhash):
        c = bf[((ha[k] + i * hb[k]) & 0xFFFFFFFF) % n]
        if c < best:
            best = c
    return best


@numba.njit(cache=True, nogil=True)
def _add(bf, ha, hb, k, nhash):  # pragma: no cover - compiled
    n = bf.size
    for i in range(nhash):
        x = ((ha[k] + i * hb[k]) & 0xFFFFFFFF) % n
        bf[x] += np.uint32(1)


@numba.njit(cache=True, nogil=True)
def _lcs_kernel(ids, ha, hb, n_keys, capacity, window, main, max_prob, max_prot, counters,
                nhash, decay_every):  # pragma: no cover - compiled
    s_win, s_prob, s_prot = n_keys + WINDOW, n_keys + PROBATION, n_keys + PROTECTED
    prev = np.empty(n_keys + 3, dtype=np.int64)
    nxt = np.empty(n_keys + 3, dtype=np.int64)
    for s in range(n_keys, n_keys + 3):
        prev[s] = s  # prev[sentinel]: the tail (least recent)
        nxt[s] = s  # nxt[sentinel]: the head (most recent)
    where = np.full(n_keys, NIL, dtype=np.int8)
    length = np.zeros(3, dtype=np.int64)
    bf = np.zeros(counters, dtype=np.uint32)
    main_hits = 0
    misses = 0
    for r in range(ids.size):
        k = ids[r]
        lst = where[k]
        if lst == WINDOW:
            _unlink(prev, nxt, k)
            _push(prev, nxt, s_win, k)
            continue
        if lst == PROTECTED:
            _unlink(prev, nxt, k)
            _push(prev, nxt, s_prot, k)
        elif lst == PROBATION:
            _unlink(prev, nxt, k)
            _push(prev, nxt, s_prot, k)
            where[k] = PROTECTED
            length[PROBATION] -= 1
            length[PROTECTED] += 1
            while length[PROTECTED] > max_prot:  # protected's tail cools to probation
                o = prev[s_prot]
                _unlink(prev, nxt, o)
                _push(prev, nxt, s_prob, o)
                where[o] = PROBATION
                length[PROTECTED] -= 1
                length[PROBATION] += 1
                while length[PROBATION] > max_prob:  # and probation's tail leaves the cache
                    o = prev[s_prob]
                    _unlink(prev, nxt, o)
                    where[o] = NIL
                    length[PROBATION] -= 1
        if lst != NIL:
            _add(bf, ha, hb, k, nhash)
            main_hits += 1
            if main_hits >= decay_every:
                main_hits = 0
                for i in range(counters):
                    bf[i] >>= np.uint32(1)
            continue
        misses += 1
        while length[WINDOW] + length[PROBATION] + length[PROTECTED] + 1 > capacity:
            while True:  # one eviction step
                if length[WINDOW] == 0:
                    seg = PROBATION if length[PROBATION] > 0 else PROTECTED
                    v = prev[n_keys + seg]
                    _unlink(prev, nxt, v)
                    where[v] = NIL
                    length[seg] -= 1
                    break
                c = prev[s_win]
                done = False
                admit = length[PROBATION] + length[PROTECTED] + 1 <= main
                if not admit:
                    seg = PROBATION if length[PROBATION] > 0 else PROTECTED
                    v = prev[n_keys + seg]
                    admit = _estimate(bf, ha, hb, c, nhash) > _estimate(bf, ha, hb, v, nhash)
                    done = True
                    if admit:  # main's victim goes, the candidate takes its place
                        _unlink(prev, nxt, v)
                        where[v] = NIL
                        length[seg] -= 1
                _unlink(prev, nxt, c)
                length[WINDOW] -= 1
                if admit:  # into the first segment with room, else probation
                    if length[PROBATION] + 1 <= max_prob:
                        seg = PROBATION
                    elif length[PROTECTED] + 1 <= max_prot:
                        seg = PROTECTED
                    else:
                        seg = PROBATION
                        while length[PROBATION] + length[PROTECTED] + 1 > main:
                            s2 = PROBATION if length[PROBATION] > 0 else PROTECTED
                            o = prev[n_keys + s2]
                            _unlink(prev, nxt, o)
                            where[o] = NIL
                            length[s2] -= 1
                    _push(prev, nxt, n_keys + seg, c)
                    where[c] = seg
                    length[seg] += 1
                else:
                    where[c] = NIL
                _add(bf, ha, hb, c, nhash)
                if done:
                    break
        _push(prev, nxt, s_win, k)
        where[k] = WINDOW
        length[WINDOW] += 1
        _add(bf, ha, hb, k, nhash)
    return misses


def lcs_wtinylfu(ids: np.ndarray, n_keys: int, capacity: int, keys: np.ndarray | None = None,
                 window: float = 0.01, segments: tuple[int, int] = (1, 4), error: float = 0.001,
                 decay: int = 32, seeds: tuple[int, int] = SEEDS) -> int:
    """Misses of libCacheSim's W-TinyLFU (window LRU + SLRU main + count-min admission).

    `keys`: the object id of each request (what libCacheSim hashes; default: the dense ids).
    `window`: the window's share of the capacity; `segments`: probation:protected shares of
    main; `error`: the sketch's target error (sizes it); `decay`: counters are halved every
    `decay` x main main-cache hits; `seeds`: the two XXH64 seeds. Defaults are libCacheSim's.
    """
    if not 0 <= window < 1:
        raise ConfigError(f"window must be in [0, 1), got {window}")
    if len(segments) != 2 or min(segments) < 0 or sum(segments) <= 0:
        raise ConfigError(f"segments must be two non-negative shares, got {segments}")
    if not 0 < error < 1 or decay < 1:
        raise ConfigError(f"error must be in (0, 1) and decay >= 1, got {error}, {decay}")
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    win = int(capacity * window)
    main = capacity - win
    total = segments[0] + segments[1]
    max_prob = int(segments[0] / total * main)
    max_prot = int(segments[1] / total * main)
    if capacity < 1 or win < 1 or main < 1 or max_prob < 1:
        return int(ids.size)  # libCacheSim cannot insert anything: every request misses
    obj = ids if keys is None else np.ascontiguousarray(keys, dtype=np.int64)
    if obj.shape != ids.shape:
        raise ConfigError(f"keys must have one entry per request, got {obj.shape} vs {ids.shape}")
    per_id = np.zeros(n_keys, dtype=np.int64)
    per_id[ids] = obj
    low = np.uint64(0xFFFFFFFF)
    ha = (xxh64_u64(per_id, seeds[0]) & low).astype(np.int64)
    hb = (xxh64_u64(per_id, seeds[1]) & low).astype(np.int64)
    counters, nhash = sketch_shape(main, error)
    return int(_lcs_kernel(ids, ha, hb, int(n_keys), int(capacity), win, main, max_prob,
                           max_prot, counters, nhash, decay * main))


# the tier policy's W-TinyLFU (policies/wtinylfu.py), its kernels one request at a time ---------
@numba.njit(cache=True, nogil=True)
def _tier_kernels(ids, hashes, n_keys, capacity, w_target, main_target, prot_target, table,
                  meta):  # pragma: no cover - compiled
    S = np.zeros((n_keys + 4, 8), dtype=np.int64)
    S[:n_keys, q.LIST] = -1
    for lst in range(3):
        S[n_keys + lst, q.PREV] = n_keys + lst
        S[n_keys + lst, q.NEXT] = n_keys + lst
    one = np.empty(1, dtype=np.int64)
    key = np.empty(1, dtype=np.int64)
    out = np.empty(1, dtype=np.int64)
    origin = np.empty(1, dtype=np.int64)
    no_i32 = np.empty(0, dtype=np.int32)
    no_bool = np.empty(0, dtype=np.bool_)
    log = np.empty((0, 3), dtype=np.int64)
    nlog = np.zeros(1, dtype=np.int64)
    size = 0
    misses = 0
    for i in range(ids.size):
        one[0] = ids[i]
        if S[one[0], q.LIST] >= 0:
            _wtlfu.access_kernel(S, n_keys, prot_target, one, table, meta, log, nlog)
            continue
        misses += 1
        if size >= capacity:
            _wtlfu.walk_kernel(S, n_keys, w_target, main_target, table, 1, 0, no_i32, no_bool,
                         no_bool, no_bool, out, origin, log, nlog)
        else:
            size += 1
        key[0] = hashes[i]
        _wtlfu.insert_kernel(S, n_keys, w_target, main_target, one, key, table, meta, log, nlog)
    return misses


def tier_wtinylfu(ids: np.ndarray, n_keys: int, capacity: int) -> int:
    """The tier policy's W-TinyLFU request by request (what tier mode at batch 1 must give)."""
    if capacity <= 0:
        return int(ids.size)
    pol = _wtlfu.WTinyLFU  # the tier policy's sizing rules
    w_target = max(1, round(capacity * pol.window_fraction))
    main_target = max(0, capacity - w_target)
    table, meta = _sketch.new_sketch(capacity, pol.aging_period)
    hashes = key_hash_np(np.zeros(1, dtype=np.int64), ids)  # as the tier hashes row ids
    return int(_tier_kernels(np.ascontiguousarray(ids, dtype=np.int64), hashes, n_keys, capacity,
                             w_target, main_target, int(main_target * pol.protected_fraction),
                             table, meta))
