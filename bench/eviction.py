"""Victim-selection time per batch of misses at 1e5-1e7 slots, every policy: `python -m bench.eviction`.

Each policy fills a tier of `slots` slots, then runs batches like a training step does: hits on
random resident slots, `victims(batch)` with those hits protected, `on_evict`, `on_insert` of the
new rows. It reports the median time of the `victims` call (the peek) and of the whole batch
update, and their growth from the smallest to the largest tier (target: flat within 2x). The
"full-scan" row times the old selection (mask + `torch.where` + `topk` over every slot).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from tierstore.policies import Evictable, make_policy
from tierstore.policies.base import key_hash

from .common import OUT_DIR, bar_plot, save, table

POLICIES = "lru,fifo,clock,sieve,s3fifo,lfu,hlfu,wtinylfu,arc,lookahead,full-scan"
_FILL_CHUNK = 1 << 20


def _full_scan(cap: int, batch: int, batches: int, gen: np.random.Generator) -> dict:
    """The pre-queue selection: a per-slot key and mask, `torch.where` + `topk` every batch."""
    key = torch.from_numpy(gen.permutation(cap).astype(np.int64))
    occupied = torch.ones(cap, dtype=torch.bool)
    pins = torch.zeros(cap, dtype=torch.int32)
    times = []
    for _ in range(batches):
        hits = torch.from_numpy(gen.integers(0, cap, batch))
        t0 = time.perf_counter()
        ok = occupied & (pins == 0)
        ok.index_fill_(0, hits, False)
        masked = torch.where(ok, key, torch.iinfo(torch.int64).max)
        cand = torch.topk(masked, batch, largest=False, sorted=False).indices
        cand[torch.sort(masked[cand], stable=True).indices]
        times.append(time.perf_counter() - t0)
    ms = statistics.median(times) * 1e3
    return {"victims_ms": ms, "victims_min_ms": min(times) * 1e3, "batch_ms": ms,
            "batch_min_ms": min(times) * 1e3, "state_bytes_per_slot": 8.0}


def _state_bytes(policy) -> float:
    """Bytes of numpy state the policy keeps per slot (queues, buckets, ghosts, sketch)."""
    seen, total = set(), 0

    def walk(obj) -> None:
        nonlocal total
        for key, val in vars(obj).items():
            if isinstance(val, np.ndarray) and id(val) not in seen and not key.startswith("_scratch"):
                seen.add(id(val))
                total += val.nbytes
            elif hasattr(val, "__dict__") and not isinstance(val, (torch.device, type)):
                walk(val)

    walk(policy)
    return total / max(1, policy.capacity)


def run_one(name: str, cap: int, batch: int, batches: int, seed: int) -> dict:
    """Fill a tier of `cap` slots, warm it, and time `batches` batches of `batch` misses."""
    gen = np.random.default_rng(seed)
    if name == "full-scan":
        return _full_scan(cap, batch, batches, gen)
    p = make_policy(name, cap)
    zero = torch.zeros(1, dtype=torch.int64)
    for lo in range(0, cap, _FILL_CHUNK):
        slots = torch.arange(lo, min(cap, lo + _FILL_CHUNK))
        p.on_insert(slots, key_hash(zero, slots))
    pins = np.zeros(cap, dtype=np.int32)
    protected = np.zeros(cap, dtype=np.bool_)
    next_key = cap
    sel, upd, phases = [], [], []
    for b in range(batches + 3):  # 3 warm-up batches
        # a skewed hit pattern: half the hits on the 1% "hot" slots
        hot = gen.integers(0, max(1, cap // 100), batch // 2)
        hits = torch.from_numpy(np.concatenate([hot, gen.integers(0, cap, batch - hot.size)]))
        t0 = time.perf_counter()
        p.on_hit(hits)
        if p.wants_future:
            p.on_future(hits[:batch // 4], torch.full((batch // 4,), b + 1))
        protected[hits.numpy()] = True
        t1 = time.perf_counter()
        v = p.victims(batch, Evictable(pins=pins, protected=protected))
        t2 = time.perf_counter()
        protected[hits.numpy()] = False
        p.on_evict(v)
        keys = key_hash(zero, torch.arange(next_key, next_key + v.numel()))
        next_key += v.numel()
        p.on_insert(v, keys)
        t3 = time.perf_counter()
        phases.append((t1 - t0, t2 - t1, t3 - t2))
        if v.numel() != batch:
            raise RuntimeError(f"{name}: {v.numel()} victims for {batch}")
        if b >= 3:
            sel.append(t2 - t1)
            upd.append(t3 - t0)
    return {"victims_ms": statistics.median(sel) * 1e3, "victims_min_ms": min(sel) * 1e3,
            "batch_ms": statistics.median(upd) * 1e3,
            "batch_min_ms": sum(min(ph[i] for ph in phases[3:]) for i in range(3)) * 1e3,
            "state_bytes_per_slot": _state_bytes(p)}


def main(argv: list[str] | None = None) -> int:
    """Run the eviction benchmark; prints a table, writes bench/out/eviction.{json,png}."""
    ap = argparse.ArgumentParser(prog="python -m bench.eviction", description=__doc__)
    ap.add_argument("--policies", default=POLICIES)
    ap.add_argument("--slots", default="1e5,1e6,1e7", help="tier sizes, comma-separated")
    ap.add_argument("--batch", type=int, default=4096, help="misses per batch")
    ap.add_argument("--batches", type=int, default=15, help="timed batches per point")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    sizes = [int(float(s)) for s in args.slots.split(",") if s.strip()]
    names = [s.strip() for s in args.policies.split(",") if s.strip()]
    torch.set_num_threads(1)
    run_one("lru", 1 << 12, 64, 1, 0)  # compile the kernels outside the timings
    records = []
    for name in names:
        for cap in sizes:
            r = run_one(name, cap, args.batch, args.batches, args.seed)
            records.append({"policy": name, "slots": cap, "batch": args.batch, **r})
            print(f"{name:>10} {cap:>10,d}: victims {r['victims_ms']:.3f} ms "
                  f"(min {r['victims_min_ms']:.3f}), batch {r['batch_ms']:.3f} ms "
                  f"(min {r['batch_min_ms']:.3f})", flush=True)
    summary = []
    for name in names:
        rs = [r for r in records if r["policy"] == name]
        row = {"policy": name, **{f"v{r['slots']:.0e}": r["victims_ms"] for r in rs},
               **{f"m{r['slots']:.0e}": r["victims_min_ms"] for r in rs}}
        row["growth"] = rs[-1]["victims_ms"] / rs[0]["victims_ms"]
        row["min_growth"] = rs[-1]["victims_min_ms"] / rs[0]["victims_min_ms"]
        row["batch_growth"] = rs[-1]["batch_min_ms"] / rs[0]["batch_min_ms"]
        row["bytes_per_slot"] = rs[-1]["state_bytes_per_slot"]
        summary.append(row)
    cols = [("policy", "policy", "s")]
    cols += [(f"v{c:.0e}", f"victims ms @ {c:.0e}", ".3f") for c in sizes]
    cols += [(f"m{c:.0e}", f"min @ {c:.0e}", ".3f") for c in sizes]
    cols += [("growth", f"median x {sizes[0]:.0e}->{sizes[-1]:.0e}", ".2f"),
             ("min_growth", "min x", ".2f"), ("batch_growth", "batch update min x", ".2f"),
             ("bytes_per_slot", "B/slot", ".1f")]
    print(f"\nvictim selection per batch of {args.batch} misses (median and min of {args.batches}):")
    print(table(summary, cols))
    path = save("eviction", records, {"batch": args.batch, "batches": args.batches,
                                      "summary": summary})
    bar_plot(OUT_DIR / "eviction.png", names,
             {f"{c:.0e} slots": [r["victims_ms"] for r in records if r["slots"] == c]
              for c in sizes},
             "ms per victims() call", f"victim selection, batches of {args.batch} misses")
    print(f"wrote {path} and {OUT_DIR / 'eviction.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
