"""`python -m bench.kernels`: the step engine's kernels alone, phase by phase.

One collection step of `bench.training`'s shape (8 tables x 1M x 64, batch 2048, Zipf(1.05)
bags, row-wise Adagrad) run on a slab that holds every row, without the store: the host's
linearization (`Plan.step`), the forward (pooling), and the backward (gradient CSR, sum and
fused update), each timed on its own (CUDA events around each phase on a GPU); then the same
step keyed, as a direct cache runs it (`keyed`: the slots copied to the device and
`Engine.keyed_step`, then its forward and backward). Beside them,
in the same run, `torch.nn.functional.embedding_bag` forward and backward over the same rows
(one call a table) as the floor a plain PyTorch step pays for the same lookups. It is the quick
check for a kernel change on a lent GPU: seconds, not the minutes `bench.training` takes.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch

from tierstore import RowWiseAdagrad, TableSpec
from tierstore.engine import Engine, Plan, check_kernels

from .common import OUT_DIR, save, table
from .training import add_workload_options, workload_from


def _timer(device: torch.device) -> Callable[[Callable[[], object]], float]:
    """ms one call of `fn` takes (CUDA events on a GPU, so queued work is counted)."""
    if device.type == "cuda":
        def cuda(fn: Callable[[], object]) -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end)
        return cuda

    def host(fn: Callable[[], object]) -> float:
        t0 = time.perf_counter()
        fn()
        return 1000 * (time.perf_counter() - t0)
    return host


def run(args: argparse.Namespace) -> list[dict]:
    """Median ms of each phase over `args.reps` steps of the pool's batches."""
    device = torch.device(args.device)
    kernels = check_kernels(args.kernels, device)
    wl = workload_from(args, args.pool)
    specs = [TableSpec(n, args.rows, args.dim, optimizer=RowWiseAdagrad(lr=0.01)) for n in wl.names]
    plan = Plan(specs, [(n, n, "sum") for n in wl.names])
    engine = Engine(plan, kernels)
    width = specs[0].row_dim
    slab = (torch.randn(args.tables * args.rows, width, device=device) * 0.05).abs_()
    grad = wl.grad_out.to(device)
    weights = [torch.randn(args.rows, args.dim, device=device, requires_grad=True)
               for _ in range(args.tables)]
    timed = _timer(device)
    phases: dict[str, list[float]] = {k: [] for k in ("plan", "forward", "backward", "keyed",
                                                      "keyed_forward", "keyed_backward", "torch_bag")}
    table_of = torch.arange(args.tables).repeat_interleave(args.batch)  # each bag's table
    def one(i: int) -> dict[str, float]:
        """The phases' ms of pool step i."""
        values, lengths = wl.steps[i % len(wl.steps)]
        parts = values.split(lengths.view(args.tables, args.batch).sum(1).tolist())
        inverse, n_unique, slots = [], [], []
        for t, ids in enumerate(parts):
            uniq, inv = torch.unique(ids, return_inverse=True)
            inverse.append(inv)
            n_unique.append(uniq.numel())
            slots.append(uniq + t * args.rows)
        slot_t = torch.cat(slots).to(device)
        got: dict[str, object] = {}
        ms = {"plan": timed(lambda: got.__setitem__(
            "batch", plan.step(inverse, n_unique, lengths).to(device)))}
        batch = got["batch"]
        ms["forward"] = timed(lambda: got.__setitem__("fwd", engine.forward(batch, slab, slot_t)))
        _, fwd = got["fwd"]
        ms["backward"] = timed(lambda: engine.backward(batch, fwd, grad, slab, slot_t))
        # the same step with the ids as slots (a direct cache's step: `Engine.keyed_step` from
        # the host's slots, their copy to the device included)
        keys = (values + table_of.repeat_interleave(lengths) * args.rows).pin_memory() \
            if device.type == "cuda" else values + table_of.repeat_interleave(lengths) * args.rows
        counts = lengths.view(args.tables, args.batch).sum(1).tolist()
        ms["keyed"] = timed(lambda: got.__setitem__("keyed", engine.keyed_step(
            keys.to(device, non_blocking=True), counts, lengths)))
        kbatch, kslots = got["keyed"]
        ms["keyed_forward"] = timed(lambda: got.__setitem__(
            "kfwd", engine.forward(kbatch, slab, kslots)))
        _, kfwd = got["kfwd"]
        ms["keyed_backward"] = timed(lambda: engine.backward(kbatch, kfwd, grad, slab, kslots))
        dev_parts = [p.to(device) for p in parts]
        starts = torch.zeros_like(lengths)
        starts[1:] = lengths.cumsum(0)[:-1]
        offs = [(starts.view(args.tables, -1)[t] - starts.view(args.tables, -1)[t, 0]).to(device)
                for t in range(args.tables)]

        def torch_bag() -> None:
            outs = [torch.nn.functional.embedding_bag(p, w, o, mode="sum", sparse=True)
                    for p, w, o in zip(dev_parts, weights, offs)]
            torch.cat(outs, 1).backward(grad)

        ms["torch_bag"] = timed(torch_bag)
        for w in weights:
            w.grad = None
        return ms

    for i in range(args.warmup + args.reps):
        ms = one(i)
        if i >= args.warmup:
            for k, v in ms.items():
                phases[k].append(v)
    ids = statistics.mean(wl.ids_per_step(i) for i in range(len(wl.steps)))
    return [{"phase": k, "ms": statistics.median(v), "ms_min": min(v), "kernels": kernels,
             "device": str(device), "ids_per_step": ids} for k, v in phases.items()]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(prog="python -m bench.kernels", description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--kernels", default="auto", choices=("auto", "numba", "triton"))
    add_workload_options(p)  # bench.training's shape
    p.add_argument("--pool", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--out", default=str(OUT_DIR))
    p.add_argument("--quick", action="store_true", help="8 x 20k rows, batch 256")
    args = p.parse_args(argv)
    if args.quick:
        args.rows, args.batch, args.reps, args.warmup = 20_000, 256, 3, 1
    return args


def main(argv: list[str] | None = None) -> int:
    """Time the phases, print a table, write JSON under --out."""
    args = parse_args(argv)
    records = run(args)
    print(table(records, [("phase", "phase", "s"), ("ms", "ms (median)", ".3f"),
                          ("ms_min", "ms (min)", ".3f"), ("kernels", "kernels", "s"),
                          ("device", "device", "s")]))
    path = save("kernels", records, vars(args), args.out)
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
