"""A demo of the store alone: train-like traffic on a 10**11-row table, then its stats."""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from typing import TYPE_CHECKING

from .errors import TierstoreError

if TYPE_CHECKING:
    import numpy as np
    import torch

# torch, numpy, numba and the store are imported by `_run`, not here: `tierstore demo --help`
# answers without them (tests/test_cli_startup.py)


def zipf_ids(rng: np.random.Generator, n: int, num_rows: int, alpha: float,
             hot: int) -> torch.Tensor:
    """Zipf-skewed ids over a hot set of `hot` ranks, scattered over the whole id range."""
    import numpy as np
    import torch

    ranks = np.minimum(rng.zipf(alpha, n), hot).astype(np.uint64)
    with np.errstate(over="ignore"):
        spread = (ranks * np.uint64(0x9E3779B97F4A7C15)) % np.uint64(num_rows)
    return torch.from_numpy(spread.astype(np.int64))


def main(argv: list[str] | None = None, prog: str = "python -m tierstore.demo") -> int:
    """Run the demo; returns an exit code."""
    ap = argparse.ArgumentParser(prog=prog, description=__doc__,
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--path", default="demo_store", help="store directory (replaced unless --keep)")
    ap.add_argument("--rows", type=int, default=10**11, help="rows in the table")
    ap.add_argument("--dim", type=int, default=64, help="embedding dim")
    ap.add_argument("--steps", type=int, default=200, help="batches to run")
    ap.add_argument("--batch", type=int, default=8192, help="ids per batch")
    ap.add_argument("--device-capacity", default="16MiB", help="device tier size (bytes or rows)")
    ap.add_argument("--host-capacity", default="128MiB", help="host tier size (bytes or rows)")
    ap.add_argument("--policy", default="lru", help="eviction policy of both cache tiers")
    ap.add_argument("--keep", action="store_true", help="keep the store from an earlier run")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)
    if args.steps < 0 or args.batch < 1:
        ap.error("--steps must be >= 0 and --batch >= 1")
    try:
        return _run(args)
    except TierstoreError as exc:  # bad capacities, policy, a locked store...
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    import numpy as np
    import torch
    from tqdm import tqdm

    from .compile_watch import watch_compilation
    from .config import TableSpec
    from .optimizers import RowWiseAdagrad
    from .stats import progress_line, tier_table
    from .store import TierStore

    if not args.keep:
        shutil.rmtree(args.path, ignore_errors=True)
    spec = TableSpec("items", args.rows, args.dim, optimizer=RowWiseAdagrad(lr=0.05))
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    with watch_compilation(lambda text: tqdm.write(text, file=sys.stderr)) as watch, \
            TierStore(args.path, [spec], device_capacity=args.device_capacity,
                      host_capacity=args.host_capacity, policy=args.policy) as store:
        bar = tqdm(range(args.steps), desc="steps", unit="batch", disable=args.no_progress)
        for step in bar:
            ids = zipf_ids(rng, args.batch, args.rows, 1.05, 5_000_000)
            g = store.gather("items", ids)
            grads = torch.randn(g.unique.numel(), args.dim, generator=torch.Generator().manual_seed(1))
            store.apply_unique("items", g.unique, grads * 0.01)
            if step % 10 == 9 or step == args.steps - 1:
                bar.set_postfix_str(progress_line(store.stats()))
        stats = store.stats()  # the bar's last figures and the table below are this snapshot
        bar.set_postfix_str(progress_line(stats))
        bar.close()
        store.flush()
        secs = time.perf_counter() - t0
        stored = store.stats()["ssd"]
    ids_total = args.steps * args.batch
    compiled = f", of which {watch.seconds:.1f} s compiling kernels (first use)" if watch.seconds else ""
    print(f"\n{args.steps} steps x {args.batch} ids on a {args.rows:.3g}-row table: "
          f"{ids_total / max(secs, 1e-9) / 1e6:.2f} M ids/s ({secs:.1f} s{compiled})")
    print("\n".join(tier_table(stats)))
    print(f"after the final flush: {stored['rows_stored']:,} rows stored in LMDB, "
          f"disk {stored['disk_bytes'] / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
