"""`python -m bench.staging_floor`: the CPU floor of staging a step in set-associative cache tiers.

A model, not the store: it measures what the next tier design would cost, to compare with what
`bench.steady --calls` reports for today's (`Prefetcher._finish` on the staging thread). Each tier
is `slots / ways` buckets of `ways` slots; a bucket keeps its keys, last-use stamps, pins and
dirty bits side by side, so finding a row, recording its use and choosing a victim touch one
bucket's cache lines. Today's tier keeps a hash index, a linked policy queue, a pin array and a
dirty array, each spread over the whole tier, and a staged row costs ~20 cache misses among them.

One compiled pass stages a step's unique keys (the `bench.training` workload, cycled like its
`--pool`): a device hit is pinned; a host hit swaps with the device victim (exclusive tiers); a
row from below (the read-ahead buffer, modelled by a random source block) displaces the device
victim into the host tier, whose dirty victim goes to a write-behind ring. The batch used
`depth + 1` steps earlier is unpinned and marked dirty (its update). Reported per timed step:
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

from .common import OUT_DIR, save, table
from .training import Workload

EMPTY = np.int64(-1)
_MUL = np.int64(-7046029254386353131)


@numba.njit(cache=True, inline="always")
def _bucket(key, nbuckets):  # pragma: no cover - compiled
    """The bucket of a key: a multiplicative hash, folded."""
    x = key * _MUL
    x ^= x >> 31
    return (x & np.int64(0x7FFFFFFFFFFFFFFF)) % nbuckets


@numba.njit(cache=True, nogil=True, inline="always")
def _victim(keys, stamps, pins, b):  # pragma: no cover - compiled
    """An empty way of bucket b, else its least recently used unpinned way; -1: all pinned."""
    v = -1
    best = np.int64(1 << 62)
    for j in range(keys.shape[1]):
        if keys[b, j] == EMPTY:
            return j
        if pins[b, j] == 0 and stamps[b, j] < best:
            best = stamps[b, j]
            v = j
    return v


@numba.njit(cache=True, nogil=True)
def _host_put(key, stamp, dirty, payload, hk, hs, hp, hd, hpay, ring, rpos, copy, stats):  # pragma: no cover
    """Put a row coming down from the device tier into the host tier; a dirty victim goes to the ring."""
    ways = hk.shape[1]
    b = _bucket(key, hk.shape[0])
    v = _victim(hk, hs, hp, b)  # host rows are never pinned: -1 only for a zero-way tier
    slot = b * ways + v
    if v >= 0 and hk[b, v] != EMPTY and hd[b, v]:
        if copy:
            ring[rpos[0] % ring.shape[0]] = hpay[slot]
        rpos[0] += 1
        stats[4] += 1
    if v < 0:  # no room: write the row down instead
        if dirty:
            if copy:
                ring[rpos[0] % ring.shape[0]] = payload
            rpos[0] += 1
            stats[4] += 1
        return
    hk[b, v] = key
    hs[b, v] = stamp
    hd[b, v] = dirty
    if copy:
        hpay[slot] = payload


@numba.njit(cache=True, nogil=True)
def stage(keys, clock, two, copy, dk, ds, dp, dd, dpay, hk, hs, hp, hd, hpay, src, ring, rpos,
          out, stats):  # pragma: no cover - compiled
    """Stage one step's unique keys into the device tier, pinned; `out` gets each key's slot (-1:
    every way of its bucket pinned). stats: device hits, host hits, rows from below, pinned-out,
    ring rows."""
    ways = dk.shape[1]
    tmp = np.empty(dpay.shape[1], dtype=dpay.dtype)
    for i in range(keys.shape[0]):
        key = keys[i]
        b = _bucket(key, dk.shape[0])
        w = -1
        for j in range(ways):
            if dk[b, j] == key:
                w = j
                break
        if w >= 0:
            ds[b, w] = clock
            dp[b, w] += 1
            out[i] = b * ways + w
            stats[0] += 1
            continue
        v = _victim(dk, ds, dp, b)
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
                _host_put(vkey, ds[b, v], dd[b, v], tmp, hk, hs, hp, hd, hpay, ring, rpos, copy, stats)
            dd[b, v] = dirty_in
            stats[1] += 1
        else:  # from below: the device victim moves down (two tiers) or is written down
            if vkey != EMPTY:
                if two:
                    _host_put(vkey, ds[b, v], dd[b, v], dpay[dslot], hk, hs, hp, hd, hpay, ring,
                              rpos, copy, stats)
                elif dd[b, v]:
                    if copy:
                        ring[rpos[0] % ring.shape[0]] = dpay[dslot]
                    rpos[0] += 1
                    stats[4] += 1
            if copy:
                dpay[dslot] = src[key & (src.shape[0] - 1)]
            dd[b, v] = False
            stats[2] += 1
        dk[b, v] = key
        ds[b, v] = clock
        dp[b, v] = 1
        out[i] = dslot


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


class Tier:
    """One set-associative tier's arrays."""

    def __init__(self, slots: int, ways: int, width: int) -> None:
        nb = max(1, slots // ways)
        self.keys = np.full((nb, ways), EMPTY)
        self.stamps = np.zeros((nb, ways), np.int64)
        self.pins = np.zeros((nb, ways), np.int32)
        self.dirty = np.zeros((nb, ways), np.bool_)
        self.payload = np.zeros((nb * ways, width), np.float32)

    def arrays(self) -> tuple[np.ndarray, ...]:
        """keys, stamps, pins, dirty, payload."""
        return self.keys, self.stamps, self.pins, self.dirty, self.payload


def step_keys(wl: Workload) -> list[np.ndarray]:
    """Each pooled batch's unique (table << 40 | row) keys, sorted."""
    out = []
    for values, lengths in wl.steps:
        per = lengths.view(wl.tables, wl.batch).sum(1).tolist()
        parts = torch.split(values, per)
        out.append(np.concatenate([np.unique(p.numpy()) + (t << 40) for t, p in enumerate(parts)]))
    return out


def run_case(batches: list[np.ndarray], slots: int, two: bool, copy: bool, ways: int, width: int,
             depth: int, warmup: int, steps: int) -> dict:
    """Stage warmup + steps batches; per timed step: staging CPU and the counts."""
    per_tier = slots // 2 if two else slots
    dev, host = Tier(per_tier, ways, width), Tier(per_tier if two else ways, ways, width)
    src = np.random.default_rng(0).standard_normal((1 << 14, width)).astype(np.float32)
    ring, rpos = np.zeros((1 << 16, width), np.float32), np.zeros(1, np.int64)
    stats = np.zeros(5, np.int64)
    window: list[np.ndarray] = []
    cpu = 0.0
    for step in range(warmup + steps):
        if step == warmup:
            stats[:] = 0
            cpu = 0.0
        keys = batches[step % len(batches)]
        out = np.empty(keys.shape[0], np.int64)
        t0 = time.thread_time()
        stage(keys, step, two, copy, *dev.arrays(), *host.arrays(), src, ring, rpos, out, stats)
        window.append(out)
        if len(window) > depth + 1:
            release(window.pop(0), dev.pins, dev.dirty)
        cpu += time.thread_time() - t0
    names = ("device_hits", "host_hits", "from_below", "pinned_out", "ring_rows")
    return {"tiers": 2 if two else 1, "copies": copy, "slots": slots, "ways": ways,
            "staging_cpu_ms": 1e3 * cpu / steps,
            **{n: float(stats[i]) / steps for i, n in enumerate(names)}}


def baseline(batches: list[np.ndarray], slots: int, width: int, warmup: int, steps: int) -> float:
    """CPU ms per step of copying the staged rows' payloads alone (same keys, same row width)."""
    src = np.random.default_rng(0).standard_normal((1 << 14, width)).astype(np.float32)
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
    p.add_argument("--tables", type=int, default=8)
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=2048)
    p.add_argument("--max-len", type=int, default=20)
    p.add_argument("--alpha", type=float, default=1.05)
    p.add_argument("--pool", type=int, default=64, help="distinct batches, cycled")
    p.add_argument("--ways", type=int, default=16, help="slots per bucket")
    p.add_argument("--depth", type=int, default=2, help="prefetch depth: batches staged ahead")
    p.add_argument("--warmup", type=int, default=150)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--out", default=str(OUT_DIR))
    args = p.parse_args(argv)
    wl = Workload(args.tables, args.rows, args.dim, args.batch, args.max_len, args.alpha, args.pool)
    batches = step_keys(wl)
    width = args.dim + 2  # the store's row with RowWiseAdagrad: [embedding | state | update stamp]
    slots = max(2 * args.ways, int(args.tables * args.rows * args.fraction))
    base = baseline(batches, slots, width, min(args.warmup, 20), args.steps)
    records = []
    for two in (True, False):
        for copy in (True, False):
            r = run_case(batches, slots, two, copy, args.ways, width, args.depth, args.warmup, args.steps)
            r["vs_copy_only"] = r["staging_cpu_ms"] / base if base > 0 else float("nan")
            records.append(r)
    unique = sum(len(b) for b in batches) / len(batches)
    print(f"{unique:,.0f} unique keys a step, {slots:,} cached slots, {args.ways}-way buckets; "
          f"copying the rows alone: {base:.2f} ms/step")
    print(table(records, [("tiers", "tiers", "d"), ("copies", "copies", ""),
                          ("staging_cpu_ms", "staging CPU ms/step", ".2f"),
                          ("vs_copy_only", "vs copy only", ".2f"),
                          ("device_hits", "device hits", ",.0f"), ("host_hits", "host hits", ",.0f"),
                          ("from_below", "from below", ",.0f"), ("pinned_out", "all ways pinned", ",.1f"),
                          ("ring_rows", "to the ring", ",.0f")]))
    path = save("staging_floor", records, {**vars(args), "copy_only_ms": base, "unique_keys": unique},
                args.out)
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
