"""Feature admission: the sketch's false-admission rate, and rows stored over a long id stream.

`python -m bench.admission sketch`: the count-min sketch against an exact counter on a Zipf id
stream over 10**11 ids (false admissions: requests of ids seen fewer than k times, admitted).
`python -m bench.admission stream`: the trainer's synthetic ids (Zipf over a 10**11-row table)
pushed through `TierStore.apply` for many steps, with and without `CountAdmission`; rows stored
and disk bytes as the stream goes.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch

import tierstore as ts
from tierstore.admission import CountMinSketch, parse_admission

from .common import OUT_DIR

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def zipf_stream(n: int, alpha: float, keys: int, seed: int) -> np.ndarray:
    """n Zipf(alpha) ranks mapped one-to-one-ish onto spread-out ids of a `keys`-row table."""
    rng = np.random.default_rng(seed)
    ranks = rng.zipf(alpha, n).astype(np.uint64)
    with np.errstate(over="ignore"):
        x = ranks * _GOLDEN
        x ^= x >> np.uint64(31)
    return (x % np.uint64(keys)).astype(np.int64)


def exact_counts(ids: np.ndarray, batch: int) -> np.ndarray:
    """Each request's exact count of its id after its batch (occurrences in batches <= its own)."""
    nb = -(-ids.size // batch)
    b = np.arange(ids.size, dtype=np.int64) // batch
    key = ids * nb + b  # ids < 10**11, nb < 10**6: no overflow
    srt = np.sort(key)
    return np.searchsorted(srt, key, side="right") - np.searchsorted(srt, ids * nb, side="left")


def sketch_bench(args: argparse.Namespace) -> dict:
    """False-admission rate of the sketch at its size against an exact counter."""
    cfg = parse_admission(args.admission)
    ids = zipf_stream(args.requests, args.alpha, args.keys, args.seed)
    sk = CountMinSketch(int(cfg.sketch), cfg.depth, cfg.min_count, salt=12345)
    got = np.zeros(ids.size, dtype=bool)
    t0 = time.perf_counter()
    for lo in range(0, ids.size, args.batch):
        part = ids[lo: lo + args.batch]
        uniq, inv, cnt = np.unique(part, return_inverse=True, return_counts=True)
        final, _ = sk.add(uniq, cnt)
        got[lo: lo + part.size] = (final >= cfg.min_count)[inv]
    secs = time.perf_counter() - t0
    want = exact_counts(ids, args.batch) >= cfg.min_count
    below = ~want
    distinct = np.unique(ids).size
    rec = {"admission": args.admission, "sketch_bytes": int(cfg.sketch), "requests": int(ids.size),
           "distinct_ids": int(distinct), "lines": int(cfg.sketch) // 64,
           "ids_per_line": distinct / (int(cfg.sketch) // 64),
           "missed_admissions": int(np.count_nonzero(want & ~got)),  # must be 0: never undercounts
           "false_admissions": int(np.count_nonzero(below & got)),
           "requests_below_k": int(np.count_nonzero(below)),
           "false_admission_rate": float(np.count_nonzero(below & got) / max(np.count_nonzero(below), 1)),
           "rows_exact": int(np.unique(ids[want]).size), "rows_sketch": int(np.unique(ids[got]).size),
           "sketch_ids_per_s": ids.size / secs}
    print(f"{args.admission}: {ids.size:,} requests, {distinct:,} distinct ids "
          f"({rec['ids_per_line']:.2f} per sketch line); false admissions "
          f"{rec['false_admissions']:,} of {rec['requests_below_k']:,} requests below k = "
          f"{rec['false_admission_rate']:.4%}; missed {rec['missed_admissions']}; rows "
          f"{rec['rows_sketch']:,} (exact counter: {rec['rows_exact']:,}); "
          f"{rec['sketch_ids_per_s'] / 1e6:.1f} M ids/s")
    return rec


def stream_bench(args: argparse.Namespace) -> dict:
    """Rows stored and disk bytes over a long stream of the trainer's ids, per admission setting."""
    from integration.data import SyntheticCriteo

    cards = (args.keys,) * 26
    synth = SyntheticCriteo(cards, seed=0, alpha=args.alpha, hot=args.hot)
    work = Path(args.work)
    out = {}
    for setting in args.settings.split(","):
        adm, ttl = None, None
        for part in setting.split("+"):  # e.g. "count:2:64MiB+ttl:1000"
            if part.startswith("ttl:"):
                ttl = int(part[4:])
            elif part != "none":
                adm = parse_admission(part)
        spec = ts.TableSpec("t", args.keys, args.dim, optimizer=ts.RowWiseAdagrad(0.05),
                            admission=adm, ttl=ttl)
        path = work / f"stream_{setting.replace(':', '_').replace('+', '_')}"
        shutil.rmtree(path, ignore_errors=True)
        store = ts.TierStore(path, spec, device_capacity=args.cache, host_capacity=args.cache,
                             device="cpu")
        gen = torch.Generator().manual_seed(0)
        curve = []
        t0 = time.perf_counter()
        for step in range(args.steps):
            ids = synth.batch(step, args.batch).ids[: args.features].reshape(-1)
            store.apply("t", ids, torch.randn(ids.numel(), args.dim, generator=gen))
            store.advance()
            if (step + 1) % args.every == 0 or step + 1 == args.steps:
                store.flush()
                store.expiry.wait()  # the ttl deleter removed what the flush made deletable
                st = store.stats()
                curve.append({"step": step + 1, "rows_stored": st["ssd"]["rows_stored"],
                              "disk_bytes": st["ssd"]["disk_bytes"]})
        secs = time.perf_counter() - t0
        st = store.stats()
        store.close()
        closed = (path / "data.mdb").stat().st_blocks * 512
        last = curve[-1]
        out[setting] = {"curve": curve, "rows_stored": last["rows_stored"],
                        "disk_bytes": last["disk_bytes"], "closed_disk_bytes": closed,
                        "admission": st.get("admission", {}).get("t"), "seconds": secs}
        print(f"{setting:>14}: {args.steps} steps x {args.batch * args.features:,} ids: rows stored "
              f"{last['rows_stored']:,}, disk {last['disk_bytes'] / 2**20:,.1f} MiB live, "
              f"{closed / 2**20:,.1f} MiB closed ({secs:.0f} s)", file=sys.stderr)
    base = out.get("none")
    if base:
        for k, v in out.items():
            v["rows_vs_none"] = base["rows_stored"] / max(v["rows_stored"], 1)
            v["disk_vs_none"] = base["closed_disk_bytes"] / max(v["closed_disk_bytes"], 1)
            print(f"{k:>14}: {v['rows_vs_none']:.2f}x fewer rows, {v['disk_vs_none']:.2f}x less disk "
                  f"than without admission")
    return {"settings": out}


def rows_bench(args: argparse.Namespace) -> dict:
    """Rows a store would hold after a stream of updates, from the ids alone (no store).

    Every update creates or refreshes its row, so rows stored = distinct admitted ids (admission
    by the store's own sketch code, batch by batch), and with a ttl only those whose last admitted
    update is at most `ttl` steps before the end. Fast enough for the issue's 5,000 steps here.
    """
    from integration.data import SyntheticCriteo

    synth = SyntheticCriteo((args.keys,) * 26, seed=0, alpha=args.alpha, hot=args.hot)
    cfg = parse_admission(args.admission)
    sk = CountMinSketch(int(cfg.sketch), cfg.depth, cfg.min_count, salt=7)
    all_ids, all_ok, all_step = [], [], []
    for step in range(args.steps):
        ids = synth.batch(step, args.batch).ids[: args.features].reshape(-1).numpy()
        uniq, inv, cnt = np.unique(ids, return_inverse=True, return_counts=True)
        final, _ = sk.add(uniq, cnt)
        all_ids.append(uniq)
        all_ok.append(final >= cfg.min_count)
        all_step.append(np.full(uniq.size, step, np.int32))
    ids, ok, step = np.concatenate(all_ids), np.concatenate(all_ok), np.concatenate(all_step)
    end = args.steps  # the clock after the last step

    def rows(mask: np.ndarray, ttl: int | None) -> int:
        u, last = ids[mask], step[mask]
        if ttl is None:
            return int(np.unique(u).size)
        order = np.lexsort((last, u))  # per id, its last update comes last
        u, last = u[order], last[order]
        tail = np.r_[u[1:] != u[:-1], True]
        return int(np.count_nonzero(end - last[tail] <= ttl))

    every = np.ones(ids.size, dtype=bool)
    out = {"none": rows(every, None), args.admission: rows(ok, None),
           f"ttl:{args.ttl}": rows(every, args.ttl),
           f"{args.admission}+ttl:{args.ttl}": rows(ok, args.ttl)}
    for k, v in out.items():
        print(f"{k:>26}: {v:>10,} rows after {args.steps} steps ({out['none'] / max(v, 1):.2f}x fewer)")
    return {"rows": out, "steps": args.steps, "ids": int(args.steps * args.batch * args.features)}


def main(argv: list[str] | None = None) -> int:
    """Run one of the admission benchmarks; prints a summary and writes bench/out JSON."""
    ap = argparse.ArgumentParser(prog="python -m bench.admission", description=__doc__)
    sub = ap.add_subparsers(dest="what", required=True)
    sk = sub.add_parser("sketch", help="false-admission rate against an exact counter")
    sk.add_argument("--admission", default="count:2:64MiB")
    sk.add_argument("--requests", type=int, default=20_000_000)
    sk.add_argument("--alpha", type=float, default=1.05)
    sk.add_argument("--keys", type=int, default=10**11)
    sk.add_argument("--batch", type=int, default=65536)
    sk.add_argument("--seed", type=int, default=0)
    st = sub.add_parser("stream", help="rows stored over a long stream, with and without admission")
    st.add_argument("--settings", default="none,count:2:64MiB,ttl:1000,count:2:64MiB+ttl:1000")
    st.add_argument("--steps", type=int, default=5000)
    st.add_argument("--batch", type=int, default=1024)
    st.add_argument("--features", type=int, default=1, help="sparse features feeding the table")
    st.add_argument("--keys", type=int, default=10**11)
    st.add_argument("--hot", type=int, default=2**24)
    st.add_argument("--alpha", type=float, default=1.05)
    st.add_argument("--dim", type=int, default=16)
    st.add_argument("--cache", default="16MiB")
    st.add_argument("--every", type=int, default=500, help="flush and sample every N steps")
    st.add_argument("--work", default="runs/bench_admission")
    rw = sub.add_parser("rows", help="rows stored after a long stream, from the ids alone")
    rw.add_argument("--admission", default="count:2:64MiB")
    rw.add_argument("--ttl", type=int, default=1000)
    rw.add_argument("--steps", type=int, default=5000)
    rw.add_argument("--batch", type=int, default=1024)
    rw.add_argument("--features", type=int, default=1)
    rw.add_argument("--keys", type=int, default=10**11)
    rw.add_argument("--hot", type=int, default=2**24)
    rw.add_argument("--alpha", type=float, default=1.05)
    args = ap.parse_args(argv)
    runs = {"sketch": sketch_bench, "stream": stream_bench, "rows": rows_bench}
    rec = runs[args.what](args)
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    path = OUT_DIR / f"admission_{args.what}.json"
    path.write_text(json.dumps({"bench": f"admission {args.what}", "machine": platform.platform(),
                                "args": vars(args), **rec}, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
