"""A demo of the store alone: train-like traffic on a 10**11-row table, then its stats."""

from __future__ import annotations

import argparse
import shutil
import time

import numpy as np
import torch
from tqdm import tqdm

from . import RowWiseAdagrad, TableSpec, TierStore


def zipf_ids(rng: np.random.Generator, n: int, num_rows: int, alpha: float,
             hot: int) -> torch.Tensor:
    """Zipf-skewed ids over a hot set of `hot` ranks, scattered over the whole id range."""
    ranks = np.minimum(rng.zipf(alpha, n), hot).astype(np.uint64)
    with np.errstate(over="ignore"):
        spread = (ranks * np.uint64(0x9E3779B97F4A7C15)) % np.uint64(num_rows)
    return torch.from_numpy(spread.astype(np.int64))


def main(argv: list[str] | None = None) -> int:
    """Run the demo; returns an exit code."""
    ap = argparse.ArgumentParser(prog="python -m tierstore.demo", description=__doc__)
    ap.add_argument("--path", default="demo_store")
    ap.add_argument("--rows", type=int, default=10**11)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=8192)
    ap.add_argument("--device-capacity", default="16MiB")
    ap.add_argument("--host-capacity", default="128MiB")
    ap.add_argument("--policy", default="lru")
    ap.add_argument("--keep", action="store_true", help="keep the store from an earlier run")
    args = ap.parse_args(argv)
    if not args.keep:
        shutil.rmtree(args.path, ignore_errors=True)
    spec = TableSpec("items", args.rows, args.dim, optimizer=RowWiseAdagrad(lr=0.05))
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    with TierStore(args.path, [spec], device_capacity=args.device_capacity,
                   host_capacity=args.host_capacity, policy=args.policy) as store:
        for _ in tqdm(range(args.steps), desc="steps", unit="batch"):
            ids = zipf_ids(rng, args.batch, args.rows, 1.05, 5_000_000)
            g = store.gather("items", ids)
            grads = torch.randn(g.unique.numel(), args.dim, generator=torch.Generator().manual_seed(1))
            store.apply_unique("items", g.unique, grads * 0.01)
        store.flush()
        secs = time.perf_counter() - t0
        stats = store.stats()
    ids_total = args.steps * args.batch
    print(f"\n{args.steps} steps x {args.batch} ids on a {args.rows:.3g}-row table: "
          f"{ids_total / secs / 1e6:.2f} M ids/s ({secs:.1f} s)")
    print(f"{'tier':<8} {'capacity':>10} {'resident':>10} {'lookups':>10} {'hit rate':>9} "
          f"{'evictions':>10} {'writebacks':>10}")
    for name in ("device", "host", "ssd"):
        s = stats[name]
        print(f"{name:<8} {s.get('capacity', '-')!s:>10} {s.get('resident', '-')!s:>10} "
              f"{s['lookups']:>10} {s['hit_rate']:>9.3f} {s['evictions']:>10} {s['writebacks']:>10}")
    print(f"rows stored in LMDB: {stats['ssd']['rows_stored']}, "
          f"disk: {stats['ssd']['disk_bytes'] / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
