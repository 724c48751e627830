"""`python -m bench.gradcheck`: cost of the non-finite gradient check on bench.store's apply path.

The case is bench.store's device_hit apply (one table, dim 64, row-wise Adagrad, batches of unique
random ids, every row resident in the device tier). Blocks with the check (`validate.gradients`)
and without it (the same function minus the `isfinite` pass) alternate in one process; the
figures are the median over rounds of the per-call time ratio, and of the check's own time
(timed alone in the same rounds) as a share of the unchecked call.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from tierstore import RowWiseAdagrad, TableSpec, TierStore, validate


def _unchecked(spec, grads, what="gradient"):
    """validate.gradients without the isfinite pass (the baseline)."""
    return grads if spec.clip is None else grads.clamp(-spec.clip, spec.clip)


def measure(batch: int, dim: int, rounds: int, calls: int) -> dict:
    """Median per-call apply time with and without the check, and their ratio."""
    spec = TableSpec("t", 10**9, dim, optimizer=RowWiseAdagrad(0.01))
    checked = validate.gradients
    with tempfile.TemporaryDirectory() as tmp:
        store = TierStore(tmp, spec, device_capacity=4 * batch, host_capacity=0, device="cpu")
        g = torch.Generator().manual_seed(0)
        ids = torch.randperm(10**6, generator=g)[:batch] * 997
        grads = torch.randn(batch, dim, generator=g)
        store.apply("t", ids, grads)  # resident from now on
        on, off, alone = [], [], []
        try:
            for _ in range(rounds):
                for fn, out in ((checked, on), (_unchecked, off)):
                    validate.gradients = fn
                    t0 = time.perf_counter()
                    for _ in range(calls):
                        store.apply("t", ids, grads)
                    out.append((time.perf_counter() - t0) / calls)
                t0 = time.perf_counter()
                for _ in range(calls):
                    checked(spec, grads)
                alone.append((time.perf_counter() - t0) / calls)
        finally:
            validate.gradients = checked
            store.close()
    ratios = [a / b for a, b in zip(on, off)]
    shares = [c / b for c, b in zip(alone, off)]
    return {"batch": batch, "dim": dim, "checked_us": 1e6 * statistics.median(on),
            "unchecked_us": 1e6 * statistics.median(off), "ratio": statistics.median(ratios),
            "check_us": 1e6 * statistics.median(alone), "share": statistics.median(shares)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--batches", default="4096,65536")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--calls", type=int, default=20)
    args = p.parse_args()
    torch.set_num_threads(1)
    print("batch  dim  checked_us  unchecked_us  ratio  check_alone_us  share")
    for b in (int(x) for x in args.batches.split(",")):
        r = measure(b, args.dim, args.rounds, args.calls)
        print(f"{r['batch']:>5}  {r['dim']:>3}  {r['checked_us']:>10.1f}  {r['unchecked_us']:>12.1f}"
              f"  {r['ratio']:.3f}  {r['check_us']:>14.1f}  {100 * r['share']:.1f}%")


if __name__ == "__main__":
    main()
