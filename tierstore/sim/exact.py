"""Exact, request-by-request, fully associative cache simulators (numba kernels).

Every kernel takes dense keys (0..n_keys-1, see `dense_keys`), the number of distinct keys and
a capacity in objects (every object has size 1), and returns the number of misses. The
semantics are libCacheSim 0.3.5's, so every policy here (LRU, FIFO, CLOCK, LFU, SIEVE,
S3-FIFO, ARC, W-TinyLFU, Belady) gives libCacheSim's miss counts to the request (see
tests/test_sim.py and docs/policies.md). W-TinyLFU (`sim/wtinylfu.py`) hashes the keys
themselves: give it the trace's original keys (`simulate(..., keys=)`).
"""

from __future__ import annotations

from collections.abc import Callable

import numba
import numpy as np

import tierstore.policies.queues as q

from ..errors import ConfigError
from .wtinylfu import lcs_wtinylfu

NIL = -1


def dense_keys(keys: np.ndarray) -> tuple[np.ndarray, int]:
    """Map arbitrary integer keys to dense int64 ids 0..n-1 (first-seen order not kept)."""
    keys = np.asarray(keys)
    if keys.ndim != 1:
        keys = keys.reshape(-1)
    if keys.size == 0:
        return np.zeros(0, dtype=np.int64), 0
    if keys.dtype.kind not in "iu":
        raise ConfigError(f"trace keys must be integers, got dtype {keys.dtype}")
    lo, hi = int(keys.min()), int(keys.max())
    if hi - lo < max(1 << 20, 4 * keys.size):  # small key range: a direct table is faster
        present = np.zeros(hi - lo + 1, dtype=np.bool_)
        shifted = (keys - lo).astype(np.int64)
        present[shifted] = True
        remap = np.cumsum(present, dtype=np.int64) - 1
        return remap[shifted], int(present.sum())
    uniq, inv = np.unique(keys, return_inverse=True)
    return inv.astype(np.int64).reshape(-1), int(uniq.size)


@numba.njit(cache=True, nogil=True)
def next_use(ids: np.ndarray, n_keys: int) -> np.ndarray:  # pragma: no cover - compiled
    """For each request, the index of the next request for the same key (len(ids) if none)."""
    n = ids.size
    out = np.empty(n, dtype=np.int64)
    last = np.full(n_keys, n, dtype=np.int64)
    for i in range(n - 1, -1, -1):
        k = ids[i]
        out[i] = last[k]
        last[k] = i
    return out


# LRU ------------------------------------------------------------------------------------------
@numba.njit(cache=True, nogil=True)
def lru(ids: np.ndarray, n_keys: int, capacity: int) -> int:  # pragma: no cover - compiled
    """LRU: a doubly linked list over dense keys; the head is most recent."""
    if capacity <= 0:
        return ids.size
    prev = np.full(n_keys + 1, NIL, dtype=np.int64)
    nxt = np.full(n_keys + 1, NIL, dtype=np.int64)
    cached = np.zeros(n_keys, dtype=np.bool_)
    s = n_keys  # sentinel: nxt[s] = head (MRU), prev[s] = tail (LRU)
    nxt[s] = s
    prev[s] = s
    size = 0
    misses = 0
    for i in range(ids.size):
        k = ids[i]
        if cached[k]:
            if nxt[s] == k:
                continue
            p, q = prev[k], nxt[k]
            nxt[p] = q
            prev[q] = p
        else:
            misses += 1
            if size >= capacity:
                v = prev[s]
                p = prev[v]
                nxt[p] = s
                prev[s] = p
                cached[v] = False
            else:
                size += 1
            cached[k] = True
        h = nxt[s]
        nxt[k] = h
        prev[k] = s
        prev[h] = k
        nxt[s] = k
    return misses


# FIFO and CLOCK (FIFO with reinsertion, 1-bit) ---------------------------------------------------
@numba.njit(cache=True, nogil=True)
def fifo(ids: np.ndarray, n_keys: int, capacity: int) -> int:  # pragma: no cover - compiled
    """FIFO: a ring buffer of the cached keys in insertion order."""
    if capacity <= 0:
        return ids.size
    ring = np.empty(capacity, dtype=np.int64)
    cached = np.zeros(n_keys, dtype=np.bool_)
    head = 0
    size = 0
    misses = 0
    for i in range(ids.size):
        k = ids[i]
        if cached[k]:
            continue
        misses += 1
        if size >= capacity:
            cached[ring[head]] = False
            ring[head] = k
            head = (head + 1) % capacity
        else:
            ring[size] = k
            size += 1
        cached[k] = True
    return misses


@numba.njit(cache=True, nogil=True)
def clock(ids: np.ndarray, n_keys: int, capacity: int) -> int:  # pragma: no cover - compiled
    """CLOCK: FIFO where a referenced key at the tail is cleared and re-queued."""
    if capacity <= 0:
        return ids.size
    ring = np.empty(capacity, dtype=np.int64)
    cached = np.zeros(n_keys, dtype=np.bool_)
    ref = np.zeros(n_keys, dtype=np.bool_)
    hand = 0
    size = 0
    misses = 0
    for i in range(ids.size):
        k = ids[i]
        if cached[k]:
            ref[k] = True
            continue
        misses += 1
        if size >= capacity:
            while ref[ring[hand]]:
                ref[ring[hand]] = False
                hand = (hand + 1) % capacity
            cached[ring[hand]] = False
            ring[hand] = k
            hand = (hand + 1) % capacity
        else:
            ring[size] = k
            size += 1
        cached[k] = True
        ref[k] = False
    return misses


# SIEVE --------------------------------------------------------------------------------------------
@numba.njit(cache=True, nogil=True)
def sieve(ids: np.ndarray, n_keys: int, capacity: int) -> int:  # pragma: no cover - compiled
    """SIEVE: FIFO order, visited bits, a hand moving from the tail toward the head."""
    if capacity <= 0:
        return ids.size
    prev = np.full(n_keys, NIL, dtype=np.int64)  # toward the head (newer)
    nxt = np.full(n_keys, NIL, dtype=np.int64)  # toward the tail (older)
    cached = np.zeros(n_keys, dtype=np.bool_)
    visited = np.zeros(n_keys, dtype=np.bool_)
    head = NIL
    tail = NIL
    hand = NIL
    size = 0
    misses = 0
    for i in range(ids.size):
        k = ids[i]
        if cached[k]:
            visited[k] = True
            continue
        misses += 1
        if size >= capacity:
            o = hand if hand != NIL else tail
            while visited[o]:
                visited[o] = False
                o = prev[o]
                if o == NIL:
                    o = tail
            hand = prev[o]
            p, q = prev[o], nxt[o]
            if p != NIL:
                nxt[p] = q
            else:
                head = q
            if q != NIL:
                prev[q] = p
            else:
                tail = p
            cached[o] = False
            size -= 1
        prev[k] = NIL
        nxt[k] = head
        if head != NIL:
            prev[head] = k
        head = k
        if tail == NIL:
            tail = k
        cached[k] = True
        visited[k] = False
        size += 1
    return misses


# LFU (in-cache counts, ties by recency) -----------------------------------------------------------
@numba.njit(cache=True, nogil=True)
def lfu(ids: np.ndarray, n_keys: int, capacity: int) -> int:  # pragma: no cover - compiled
    """LFU with O(1) frequency buckets; among the least frequent, evict the least recent."""
    if capacity <= 0:
        return ids.size
    maxf = ids.size + 2
    bhead = np.full(maxf, NIL, dtype=np.int64)  # most recent in bucket
    btail = np.full(maxf, NIL, dtype=np.int64)  # least recent in bucket
    prev = np.full(n_keys, NIL, dtype=np.int64)
    nxt = np.full(n_keys, NIL, dtype=np.int64)
    freq = np.zeros(n_keys, dtype=np.int64)
    size = 0
    minf = 1
    misses = 0
    for i in range(ids.size):
        k = ids[i]
        f = freq[k]
        if f > 0:
            # unlink from bucket f
            p, q = prev[k], nxt[k]
            if p != NIL:
                nxt[p] = q
            else:
                bhead[f] = q
            if q != NIL:
                prev[q] = p
            else:
                btail[f] = p
            if bhead[f] == NIL and minf == f:
                minf = f + 1
            f += 1
        else:
            misses += 1
            if size >= capacity:
                v = btail[minf]
                p = prev[v]
                btail[minf] = p
                if p != NIL:
                    nxt[p] = NIL
                else:
                    bhead[minf] = NIL
                freq[v] = 0
            else:
                size += 1
            f = 1
            minf = 1
        freq[k] = f
        prev[k] = NIL
        h = bhead[f]
        nxt[k] = h
        if h != NIL:
            prev[h] = k
        else:
            btail[f] = k
        bhead[f] = k
    return misses


# Belady (MIN) ------------------------------------------------------------------------------------
@numba.njit(cache=True, nogil=True)
def _belady(ids: np.ndarray, nxt_use: np.ndarray, n_keys: int,
            capacity: int) -> int:  # pragma: no cover - compiled
    n = ids.size
    if capacity <= 0:
        return n
    # max-heap of (next use, key) with lazy deletion: an entry is live if it matches cur[key]
    hk = np.empty(n + 1, dtype=np.int64)
    hv = np.empty(n + 1, dtype=np.int64)
    hn = 0
    cur = np.full(n_keys, -1, dtype=np.int64)  # -1: not cached
    size = 0
    misses = 0
    for i in range(n):
        k = ids[i]
        nu = nxt_use[i]
        if cur[k] < 0:
            misses += 1
            if size >= capacity:
                while True:  # pop the live entry with the farthest next use
                    tk, tv = hk[0], hv[0]
                    hn -= 1
                    lk, lv = hk[hn], hv[hn]
                    j = 0
                    while True:
                        c = 2 * j + 1
                        if c >= hn:
                            break
                        if c + 1 < hn and hk[c + 1] > hk[c]:
                            c += 1
                        if hk[c] <= lk:
                            break
                        hk[j] = hk[c]
                        hv[j] = hv[c]
                        j = c
                    if hn > 0:
                        hk[j] = lk
                        hv[j] = lv
                    if cur[tv] == tk:
                        cur[tv] = -1
                        break
            else:
                size += 1
        cur[k] = nu
        # push (nu, k)
        j = hn
        hn += 1
        while j > 0:
            p = (j - 1) // 2
            if hk[p] >= nu:
                break
            hk[j] = hk[p]
            hv[j] = hv[p]
            j = p
        hk[j] = nu
        hv[j] = k
        if hn >= n:  # compact: keep live entries only (rare)
            m = 0
            for t in range(hn):
                if cur[hv[t]] == hk[t]:
                    hk[m] = hk[t]
                    hv[m] = hv[t]
                    m += 1
            hn = m
            for t in range(hn // 2 - 1, -1, -1):  # heapify
                j = t
                ek, ev = hk[j], hv[j]
                while True:
                    c = 2 * j + 1
                    if c >= hn:
                        break
                    if c + 1 < hn and hk[c + 1] > hk[c]:
                        c += 1
                    if hk[c] <= ek:
                        break
                    hk[j] = hk[c]
                    hv[j] = hv[c]
                    j = c
                hk[j] = ek
                hv[j] = ev
    return misses


def belady(ids: np.ndarray, n_keys: int, capacity: int) -> int:
    """Belady's MIN: on a miss, evict the cached key whose next use is farthest away."""
    return int(_belady(ids, next_use(ids, n_keys), n_keys, capacity))


# S3-FIFO -----------------------------------------------------------------------------------------
@numba.njit(cache=True, nogil=True)
def s3fifo(ids: np.ndarray, n_keys: int, capacity: int) -> int:  # pragma: no cover - compiled
    """S3-FIFO as in libCacheSim: 10% small FIFO, 90% main FIFO (2-bit clock), 90% ghost."""
    n = ids.size
    small_cap = int(capacity * 0.1)
    main_cap = capacity - small_cap
    ghost_cap = int(capacity * 0.9)
    if capacity <= 0 or small_cap <= 1:
        return n  # libCacheSim admits nothing when an object fills the small queue
    ring_n = capacity + 2
    sq = np.empty(ring_n, dtype=np.int64)
    mq = np.empty(ring_n, dtype=np.int64)
    s_head, s_len = 0, 0  # s_head: oldest
    m_head, m_len = 0, 0
    where = np.zeros(n_keys, dtype=np.int8)  # 0 absent, 1 small, 2 main
    freq = np.zeros(n_keys, dtype=np.int64)
    gq = np.empty(n + 1, dtype=np.int64)  # ghost entries (append-only, stale ones skipped)
    gseq = np.full(n_keys, -1, dtype=np.int64)  # position of the key's live ghost entry
    g_head, g_tail, g_live = 0, 0, 0
    has_evicted = False
    misses = 0
    for i in range(n):
        k = ids[i]
        if where[k] != 0:
            freq[k] += 1
            continue
        misses += 1
        hit_ghost = False
        if gseq[k] >= 0:
            gseq[k] = -1
            g_live -= 1
            hit_ghost = True
        # evict until one object fits
        while s_len + m_len >= capacity:
            has_evicted = True
            if m_len > main_cap or s_len == 0:
                while m_len > 0:
                    o = mq[m_head]
                    m_head = (m_head + 1) % ring_n
                    m_len -= 1
                    if freq[o] >= 1:
                        f = freq[o]
                        f = min(f, 3)
                        freq[o] = f - 1
                        mq[(m_head + m_len) % ring_n] = o
                        m_len += 1
                    else:
                        where[o] = 0
                        break
            else:
                while s_len > 0:
                    o = sq[s_head]
                    s_head = (s_head + 1) % ring_n
                    s_len -= 1
                    if freq[o] >= 2:
                        where[o] = 2
                        freq[o] = 0
                        mq[(m_head + m_len) % ring_n] = o
                        m_len += 1
                    else:
                        where[o] = 0
                        if ghost_cap > 0 and gseq[o] < 0:
                            while g_live >= ghost_cap:
                                g = gq[g_head]
                                if gseq[g] == g_head:
                                    gseq[g] = -1
                                    g_live -= 1
                                g_head += 1
                            gq[g_tail] = o
                            gseq[o] = g_tail
                            g_tail += 1
                            g_live += 1
                        break
        if hit_ghost or (not has_evicted and s_len >= small_cap):
            where[k] = 2
            mq[(m_head + m_len) % ring_n] = k
            m_len += 1
        else:
            where[k] = 1
            sq[(s_head + s_len) % ring_n] = k
            s_len += 1
        freq[k] = 0
    return misses


# ARC ---------------------------------------------------------------------------------------------
@numba.njit(cache=True, nogil=True, inline="always")
def _arc_replace(S, n_keys, p, in_b2, log, nlog):  # pragma: no cover - compiled
    g = S.shape[0] - 1
    t1 = S[g, 0]
    if t1 >= 1 and (t1 > p or (in_b2 and t1 == p)):
        q.move(S, n_keys, 2, S[n_keys + 0, q.NEXT], log, nlog)  # T1's LRU -> B1
    else:
        q.move(S, n_keys, 3, S[n_keys + 1, q.NEXT], log, nlog)  # T2's LRU -> B2


@numba.njit(cache=True, nogil=True)
def arc(ids: np.ndarray, n_keys: int, capacity: int) -> int:  # pragma: no cover - compiled
    """ARC as in Megiddo & Modha's pseudocode: lists T1, T2 (cached) and ghosts B1, B2."""
    if capacity <= 0:
        return ids.size
    c = capacity
    S = np.zeros((n_keys + 5, 8), dtype=np.int64)  # lists 0: T1, 1: T2, 2: B1, 3: B2
    S[:n_keys, q.LIST] = -1
    for lst in range(4):
        S[n_keys + lst, q.PREV] = n_keys + lst
        S[n_keys + lst, q.NEXT] = n_keys + lst
    g = S.shape[0] - 1
    log = np.empty((0, 3), dtype=np.int64)
    nlog = np.zeros(1, dtype=np.int64)
    p = 0.0
    misses = 0
    for i in range(ids.size):
        x = ids[i]
        lst = S[x, q.LIST]
        if lst == 0 or lst == 1:
            q.move(S, n_keys, 1, x, log, nlog)
            continue
        misses += 1
        b1, b2 = S[g, 2], S[g, 3]
        if lst == 2:
            p = min(float(c), p + max(b2 / b1, 1.0))
            _arc_replace(S, n_keys, p, False, log, nlog)
            q.move(S, n_keys, 1, x, log, nlog)
            continue
        if lst == 3:
            p = max(0.0, p - max(b1 / b2, 1.0))
            _arc_replace(S, n_keys, p, True, log, nlog)
            q.move(S, n_keys, 1, x, log, nlog)
            continue
        t1, t2 = S[g, 0], S[g, 1]
        if t1 + b1 == c:
            if t1 < c:
                q.unlink(S, S[n_keys + 2, q.NEXT], log, nlog)
                _arc_replace(S, n_keys, p, False, log, nlog)
            else:
                q.unlink(S, S[n_keys + 0, q.NEXT], log, nlog)
        elif t1 + t2 + b1 + b2 >= c:
            if t1 + t2 + b1 + b2 == 2 * c:
                q.unlink(S, S[n_keys + 3, q.NEXT], log, nlog)
            _arc_replace(S, n_keys, p, False, log, nlog)
        q.push(S, n_keys, 0, x, log, nlog)
    return misses


Simulator = Callable[[np.ndarray, int, int], int]

EXACT: dict[str, Simulator] = {
    "lru": lru,
    "fifo": fifo,
    "clock": clock,
    "lfu": lfu,
    "sieve": sieve,
    "s3fifo": s3fifo,
    "belady": belady,
    "wtinylfu": lcs_wtinylfu,
    "arc": arc,
}


KEYED = frozenset({"wtinylfu"})  # simulators whose result depends on the keys themselves (hashes)


def simulate(policy: str, ids: np.ndarray, n_keys: int, capacity: int,
             keys: np.ndarray | None = None) -> int:
    """Misses of the exact `policy` on dense keys `ids` with a cache of `capacity` objects.

    `keys`: each request's original key, for the policies in `KEYED` (libCacheSim's W-TinyLFU
    hashes object ids: pass the trace's keys to match it); default: the dense ids.
    """
    name = policy.lower()
    try:
        fn = EXACT[name]
    except KeyError:
        raise ConfigError(f"no exact simulator for {policy!r}; known: {sorted(EXACT)}") from None
    if capacity < 0:
        raise ConfigError(f"capacity must be >= 0, got {capacity}")
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    if name in KEYED and keys is not None:
        return int(fn(ids, int(n_keys), int(capacity), keys=keys))
    return int(fn(ids, int(n_keys), int(capacity)))
