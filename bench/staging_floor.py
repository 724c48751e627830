"""`python -m bench.staging_floor`: the CPU floor of staging a step in set-associative cache tiers.

A model, not the store: it measures what the next tier design would cost, to compare with what
`bench.steady --calls` reports for today's (`Prefetcher.finish_batch` on the staging thread). Each tier
is `slots / ways` buckets of `ways` slots; a bucket keeps its keys, last-use stamps, pins and
dirty bits side by side, so finding a row, recording its use and choosing a victim touch one
bucket's cache lines. Today's tier keeps a hash index, a linked policy queue, a pin array and a
dirty array, each spread over the whole tier, and a staged row costs ~20 cache misses among them.
The model covers the tiers' work only: the staging thread's other work (`_prepare`, `_load`
from the read-ahead buffers, the ring hand-off: ~20-24 ms a step at cache10) is not in it.

One compiled pass stages a step's unique keys (the `bench.training` workload, cycled like its
`--pool`): a device hit is pinned; a host hit swaps with the device victim (exclusive tiers); a
row from below (the read-ahead buffer, modelled by a random source block) displaces the device
victim into the host tier, whose dirty victim goes to a write-behind ring. The batch used
`depth + 1` steps earlier is unpinned and marked dirty (its update). Two bucket policies: LRU
(a way's rank is its last use) and hlfu's (the rank is the count hlfu's sketch gives the row,
then its last use; the sketch and the aging are hlfu's own; with one tier, TinyLFU's admission
test against the way a row would displace, a refused row staged in the scratch pad and written
down after its use, as the store does). Reported per timed step:
staging CPU with and without payload copies, and in the same run the bare copy of the same rows'
payload bytes (the baseline: what moving the bytes alone costs).
"""

from __future__ import annotations

import argparse
import sys
import time

import numba
import numpy as np
import torch

from tierstore.policies import hlfu
from tierstore.policies.base import _H1, _H2

from .common import OUT_DIR, save, table
from .training import Workload, add_workload_options, workload_from

EMPTY = np.int64(-1)
_MUL = _H1  # the bucket hash multiplies by the key hash's first constant
_ROW_MASK = np.int64((1 << 40) - 1)
MAX_COUNT = hlfu.MAX_COUNT
STAMP_BITS = 40  # a way's rank: count << STAMP_BITS | last-use stamp (counts are 0 under LRU)


@numba.njit(cache=True, inline="always")
def _bucket(key, nbuckets):  # pragma: no cover - compiled
    """The bucket of a key: a multiplicative hash, folded."""
    x = key * _MUL
    x ^= x >> 31
    return (x & np.int64(0x7FFFFFFFFFFFFFFF)) % nbuckets


@numba.njit(cache=True, inline="always")
def _key_hash(key):  # pragma: no cover - compiled
    """The store's key hash (`key_hash_np`) of a (table << 40 | row) key, as hlfu's sketch takes it."""
    h = (key & _ROW_MASK) * _H1 + (key >> 40) * _H2
    h ^= h >> 31
    return h | 1


@numba.njit(cache=True, nogil=True, inline="always")
def _victim(keys, rank, pins, b):  # pragma: no cover - compiled
    """An empty way of bucket b, else its lowest-ranked unpinned way; -1: all pinned."""
    v = -1
    best = np.int64(1 << 62)
    for j in range(keys.shape[1]):
        if keys[b, j] == EMPTY:
            return j
        if pins[b, j] == 0 and rank[b, j] < best:
            best = rank[b, j]
            v = j
    return v


@numba.njit(cache=True, nogil=True, inline="always")
def _rank(sketch, key, clock, freq):  # pragma: no cover - compiled
    """A used row's rank: its sketch count, this use counted, above its stamp (LRU: the stamp)."""
    if not freq:
        return clock
    return (np.int64(hlfu._count(sketch, _key_hash(key))) << STAMP_BITS) | clock


@numba.njit(cache=True, nogil=True)
def _host_put(key, rank, dirty, payload, hk, hr, hp, hd, hpay, ring, rpos, copy, stats):  # pragma: no cover
    """Put a row coming down from the device tier into the host tier (a move down is not a use:
    it keeps its rank); a dirty victim goes to the write-behind ring."""
    ways = hk.shape[1]
    b = _bucket(key, hk.shape[0])
    v = _victim(hk, hr, hp, b)  # host rows are never pinned: always a way
    slot = b * ways + v
    if hk[b, v] != EMPTY and hd[b, v]:
        if copy:
            ring[rpos[0] % ring.shape[0]] = hpay[slot]
        rpos[0] += 1
        stats[5] += 1
    hk[b, v] = key
    hr[b, v] = rank
    hd[b, v] = dirty
    if copy:
        hpay[slot] = payload


@numba.njit(cache=True, nogil=True)
def stage(keys, clock, two, copy, freq, admit, sketch, dk, dr, dp, dd, dpay, hk, hr, hp, hd, hpay,
          src, ring, rpos, pad, out, stats):  # pragma: no cover - compiled
    """Stage one step's unique keys into the device tier, pinned; `out` gets each key's slot (-1:
    not in the tier). `freq`: rank ways by hlfu's sketch count, then last use (else last use);
    `admit` (one tier): TinyLFU's test against the way a row would displace, a refused row
    staged in the scratch pad (`pad`, a ring standing for it). stats: device hits, host hits,
    rows from below, all ways pinned, refused, ring rows; returns the clock after the step."""
    ways = dk.shape[1]
    tmp = np.empty(dpay.shape[1], dtype=dpay.dtype)
    for i in range(keys.shape[0]):
        key = keys[i]
        clock += 1
        b = _bucket(key, dk.shape[0])
        w = -1
        for j in range(ways):
            if dk[b, j] == key:
                w = j
                break
        if w >= 0:
            dr[b, w] = _rank(sketch, key, clock, freq)
            dp[b, w] += 1
            out[i] = b * ways + w
            stats[0] += 1
            continue
        v = _victim(dk, dr, dp, b)
        if v < 0:
            out[i] = -1
            stats[3] += 1
            continue
        dslot = b * ways + v
        vkey = dk[b, v]
        hb, hw = -1, -1
        if two:
            hb = _bucket(key, hk.shape[0])
            for j in range(ways):
                if hk[hb, j] == key:
                    hw = j
                    break
        if hw >= 0:  # a host hit: the row moves up, the device victim takes its place below
            hslot = hb * ways + hw
            dirty_in = hd[hb, hw]
            if copy:
                tmp[:] = dpay[dslot]
                dpay[dslot] = hpay[hslot]
            hk[hb, hw] = EMPTY
            if vkey != EMPTY:
                _host_put(vkey, dr[b, v], dd[b, v], tmp, hk, hr, hp, hd, hpay, ring, rpos, copy, stats)
            dd[b, v] = dirty_in
            stats[1] += 1
        else:  # from below
            h = _key_hash(key) if admit and vkey != EMPTY else np.int64(0)
            if h and min(hlfu._estimate(sketch, h) + 1, MAX_COUNT) <= (dr[b, v] >> STAMP_BITS):
                hlfu._count(sketch, h)  # a refused row's use counts all the same
                if copy:  # into the pad now, and to the ring after its use (dirty by then)
                    pad[rpos[0] % pad.shape[0]] = src[key & (src.shape[0] - 1)]
                    ring[rpos[0] % ring.shape[0]] = pad[rpos[0] % pad.shape[0]]
                rpos[0] += 1
                out[i] = -1
                stats[4] += 1
                stats[5] += 1
                continue
            if vkey != EMPTY:  # the device victim moves down (two tiers) or is written down
                if two:
                    _host_put(vkey, dr[b, v], dd[b, v], dpay[dslot], hk, hr, hp, hd, hpay, ring,
                              rpos, copy, stats)
                elif dd[b, v]:
                    if copy:
                        ring[rpos[0] % ring.shape[0]] = dpay[dslot]
                    rpos[0] += 1
                    stats[5] += 1
            if copy:
                dpay[dslot] = src[key & (src.shape[0] - 1)]
            dd[b, v] = False
            stats[2] += 1
        dk[b, v] = key
        dr[b, v] = _rank(sketch, key, clock, freq)
        dp[b, v] = 1
        out[i] = dslot
    return clock


@numba.njit(cache=True, nogil=True)
def release(slots, dp, dd):  # pragma: no cover - compiled
    """A used batch: unpin its slots and mark them dirty (the step updated them)."""
    ways = dp.shape[1]
    for i in range(slots.shape[0]):
        s = slots[i]
        if s >= 0:
            dp[s // ways, s % ways] -= 1
            dd[s // ways, s % ways] = True


@numba.njit(cache=True, nogil=True)
def copy_rows(keys, src, dst):  # pragma: no cover - compiled
    """The baseline: copy each staged row's payload from a source block into a random slot."""
    for i in range(keys.shape[0]):
        k = keys[i]
        dst[((k * _MUL) & np.int64(0x7FFFFFFFFFFFFFFF)) % dst.shape[0]] = src[k & (src.shape[0] - 1)]


@numba.njit(cache=True, nogil=True)
def halve_ranks(rank):  # pragma: no cover - compiled
    """hlfu's aging of the cached rows: count c -> max(c // 2, 1), stamps kept."""
    mask = (np.int64(1) << STAMP_BITS) - 1
    for b in range(rank.shape[0]):
        for j in range(rank.shape[1]):
            c = rank[b, j] >> STAMP_BITS
            rank[b, j] = (np.int64(max(c >> 1, 1)) << STAMP_BITS) | (rank[b, j] & mask)


class Tier:
    """One set-associative tier's arrays."""

    def __init__(self, slots: int, ways: int, width: int) -> None:
        nb = max(1, slots // ways)
        self.keys = np.full((nb, ways), EMPTY)
        self.rank = np.zeros((nb, ways), np.int64)
        self.pins = np.zeros((nb, ways), np.int32)
        self.dirty = np.zeros((nb, ways), np.bool_)
        self.payload = np.zeros((nb * ways, width), np.float32)

    def arrays(self) -> tuple[np.ndarray, ...]:
        """keys, ranks, pins, dirty, payload."""
        return self.keys, self.rank, self.pins, self.dirty, self.payload


def step_keys(wl: Workload) -> list[np.ndarray]:
    """Each pooled batch's unique (table << 40 | row) keys, sorted."""
    out = []
    for values, lengths in wl.steps:
        per = lengths.view(wl.tables, wl.batch).sum(1).tolist()
        parts = torch.split(values, per)
        out.append(np.concatenate([np.unique(p.numpy()) + (t << 40) for t, p in enumerate(parts)]))
    return out


def _source(width: int) -> np.ndarray:
    """The rows 'from below': a fixed block a key indexes by its low bits."""
    return np.random.default_rng(0).standard_normal((1 << 14, width)).astype(np.float32)


def run_case(batches: list[np.ndarray], slots: int, two: bool, copy: bool, policy: str, ways: int,
             width: int, depth: int, warmup: int, steps: int) -> dict:
    """Stage warmup + steps batches; per timed step: staging CPU and the counts."""
    freq = policy == "hlfu"
    admit = freq and not two  # as in the store: refused rows wait in the pad with one tier only
    per_tier = slots // 2 if two else slots
    dev, host = Tier(per_tier, ways, width), Tier(per_tier if two else ways, ways, width)
    sketch = hlfu.HistoryLFU.new_sketch(per_tier)  # hlfu's sizing and aging
    period, since = hlfu.HistoryLFU.aging_period * per_tier, 0
    src = _source(width)
    ring, rpos = np.zeros((1 << 16, width), np.float32), np.zeros(1, np.int64)
    pad = np.zeros((1 << 14, width), np.float32)
    stats = np.zeros(6, np.int64)
    window: list[np.ndarray] = []
    cpu, clock = 0.0, 0
    for step in range(warmup + steps):
        if step == warmup:
            stats[:] = 0
            cpu = 0.0
        keys = batches[step % len(batches)]
        out = np.empty(keys.shape[0], np.int64)
        t0 = time.thread_time()
        clock = stage(keys, clock, two, copy, freq, admit, sketch, *dev.arrays(), *host.arrays(), src,
                      ring, rpos, pad, out, stats)
        window.append(out)
        if len(window) > depth + 1:
            release(window.pop(0), dev.pins, dev.dirty)
        since += keys.shape[0]
        if freq and since >= period:
            since = 0
            sketch >>= 1
            halve_ranks(dev.rank)
            halve_ranks(host.rank)
        cpu += time.thread_time() - t0
    names = ("device_hits", "host_hits", "from_below", "pinned_out", "refused", "ring_rows")
    return {"policy": policy, "tiers": 2 if two else 1, "copies": copy, "slots": slots, "ways": ways,
            "staging_cpu_ms": 1e3 * cpu / steps,
            **{n: float(stats[i]) / steps for i, n in enumerate(names)}}


def baseline(batches: list[np.ndarray], slots: int, width: int, warmup: int, steps: int) -> float:
    """CPU ms per step of copying the staged rows' payloads alone (same keys, same row width)."""
    src = _source(width)
    dst = np.zeros((max(1, slots), width), np.float32)
    cpu = 0.0
    for step in range(warmup + steps):
        t0 = time.thread_time()
        copy_rows(batches[step % len(batches)], src, dst)
        if step >= warmup:
            cpu += time.thread_time() - t0
    return 1e3 * cpu / steps


def main(argv: list[str] | None = None) -> int:
    """Model the issue's cache10 workload; print and save staging CPU per step."""
    p = argparse.ArgumentParser(prog="python -m bench.staging_floor", description=__doc__.splitlines()[0])
    p.add_argument("--fraction", type=float, default=0.10, help="cached rows / rows (cache10: 0.10)")
    add_workload_options(p)
    p.add_argument("--pool", type=int, default=64, help="distinct batches, cycled")
    p.add_argument("--ways", type=int, default=16, help="slots per bucket")
    p.add_argument("--depth", type=int, default=2, help="prefetch depth: batches staged ahead")
    p.add_argument("--warmup", type=int, default=150)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--out", default=str(OUT_DIR))
    args = p.parse_args(argv)
    wl = workload_from(args, args.pool)
    batches = step_keys(wl)
    width = args.dim + 2  # the store's row with RowWiseAdagrad: [embedding | state | update stamp]
    slots = max(2 * args.ways, int(args.tables * args.rows * args.fraction))
    base = baseline(batches, slots, width, min(args.warmup, 20), args.steps)
    records = []
    for policy in ("lru", "hlfu"):
        for two in (True, False):
            for copy in (True, False):
                r = run_case(batches, slots, two, copy, policy, args.ways, width, args.depth,
                             args.warmup, args.steps)
                r["vs_copy_only"] = r["staging_cpu_ms"] / base if base > 0 else float("nan")
                records.append(r)
    unique = sum(len(b) for b in batches) / len(batches)
    print(f"{unique:,.0f} unique keys a step, {slots:,} cached slots, {args.ways}-way buckets; "
          f"copying the rows alone: {base:.2f} ms/step")
    print(table(records, [("policy", "policy", "s"), ("tiers", "tiers", "d"), ("copies", "copies", ""),
                          ("staging_cpu_ms", "staging CPU ms/step", ".2f"),
                          ("vs_copy_only", "vs copy only", ".2f"),
                          ("device_hits", "device hits", ",.0f"), ("host_hits", "host hits", ",.0f"),
                          ("from_below", "from below", ",.0f"), ("pinned_out", "all ways pinned", ",.1f"),
                          ("refused", "refused (to the pad)", ",.0f"), ("ring_rows", "to the ring", ",.0f")]))
    path = save("staging_floor", records, {**vars(args), "copy_only_ms": base, "unique_keys": unique},
                args.out)
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
