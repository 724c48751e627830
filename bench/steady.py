"""`python -m bench.steady`: where a steady-state training step's CPU goes, thread by thread.

`bench.training` times blocks of steps and quiesces the pipeline between them, so a log merge
that runs after a block is not in its time. This benchmark runs one `bench.training`
configuration continuously (warm-up steps, then `--steps` timed steps: use enough of them to span
several log merges) and reports per step: the wall time, the CPU time of each thread (training,
staging, readers, writer, merger; from /proc/self/task, Linux), the bytes the process sent to
storage (/proc/self/io `write_bytes`), and the store's I/O counters (`rows_written`: rows the
writer appended to the log; `rows_merged`: log rows folded into the tables, the rest having been
superseded by a later append). With `--calls`, it also times the methods of the miss path and
the background I/O per thread (`bench.cpu_calls`: inclusive CPU time of each call, exact per
thread, unlike a sampling profiler on a loaded machine). Run the resident config the same hour
for the baseline: `--config tierstore_resident`. No batch repeats by default (`--pool`): a
cycled pool would let a log longer than one cycle of evictions absorb every rewrite.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from .common import OUT_DIR, io_bytes, save, table
from .cpu_calls import CallTimer, thread_cpu
from .training import FRACTIONS, TierstoreRunner, add_cache_options, add_workload_options, workload_from


def written_bytes() -> int:
    """Bytes this process has caused to be sent to storage (page-cache writes included)."""
    return io_bytes("write_bytes")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(prog="python -m bench.steady", description=__doc__.splitlines()[0])
    p.add_argument("--config", default="tierstore_cache10", choices=sorted(FRACTIONS))
    p.add_argument("--steps", type=int, default=150, help="timed steps (span several merges)")
    p.add_argument("--warmup", type=int, default=60, help="untimed steps first (fill the caches)")
    add_workload_options(p)
    p.add_argument("--pool", type=int, default=None,
                   help="distinct pre-generated batches (default: warmup + steps, so none repeats: "
                        "with a repeating pool a log longer than one cycle of evictions absorbs "
                        "every rewrite, and a large --write-log looks far cheaper than it is)")
    add_cache_options(p)
    p.add_argument("--calls", action="store_true",
                   help="also report the CPU time of the methods of the miss path and the "
                        "background I/O, per thread (bench.cpu_calls; ~1 us a call of overhead)")
    p.add_argument("--workdir", default=None, help="where the store lives (default: under --out)")
    p.add_argument("--out", default=str(OUT_DIR))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run one configuration continuously; print and save per-thread CPU and I/O per step."""
    args = parse_args(argv)
    if not os.path.exists("/proc/self/task"):
        raise SystemExit("bench.steady reads /proc/self/task: Linux only")
    torch.set_num_threads(1)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench_steady_", dir=args.workdir or out_dir))
    args.pool = args.pool or args.warmup + args.steps
    wl = workload_from(args, args.pool)
    runner = TierstoreRunner(wl, args.config, work, FRACTIONS[args.config], "populated",
                             write_log=args.write_log, split=args.split, policy=args.policy,
                             staging=args.staging)
    try:
        with CallTimer() if args.calls else contextlib.nullcontext() as timer:
            for i in range(args.warmup):
                runner.step(i)
            if timer is not None:
                timer.reset()
            cpu0, wb0, k0 = thread_cpu(), written_bytes(), runner.counters()
            t0 = time.perf_counter()
            for i in range(args.warmup, args.warmup + args.steps):
                runner.step(i)
            wall = time.perf_counter() - t0
            cpu1, wb1, k1 = thread_cpu(), written_bytes(), runner.counters()
            calls = timer.totals() if timer is not None else []
        memory = runner.store.memory()
    finally:
        runner.close()
        shutil.rmtree(work, ignore_errors=True)
    per = 1e3 / args.steps
    threads: dict[str, float] = {}
    for key, sec in cpu1.items():
        threads[key[1]] = threads.get(key[1], 0.0) + (sec - cpu0.get(key, 0.0)) * per
    record = {"config": args.config, "steps": args.steps, "warmup": args.warmup,
              "capacity": runner.capacity, "policy": runner.store.layout.policy,
              "write_log": args.write_log, "ms_per_step": wall * per,
              "disk_mb_per_step": (wb1 - wb0) / args.steps / 1e6,
              "merges": int(k1["log_merges"] - k0["log_merges"]),  # background log merges timed
              "cpu_ms_per_step": {k: v for k, v in sorted(threads.items(), key=lambda x: -x[1]) if v > 0},
              "counters_per_step": {k: (k1[k] - k0[k]) * (per if k.endswith("_s") else 1 / args.steps)
                                    for k in k0},
              "memory": memory,
              "calls": [{"thread": c["thread"], "method": c["method"],
                         "cpu_ms_per_step": c["cpu_s"] * per, "calls_per_step": c["calls"] / args.steps}
                        for c in calls]}
    print(f"{args.config}: {record['ms_per_step']:.1f} ms/step, "
          f"{record['disk_mb_per_step']:.1f} MB/step to storage, over {args.steps} steps "
          f"({record['merges']} background log merges in them)")
    print(table([{"thread": k, "ms": v} for k, v in record["cpu_ms_per_step"].items()],
                [("thread", "thread", "s"), ("ms", "CPU ms/step", ".1f")]))
    print(table([{"counter": k, "v": v} for k, v in record["counters_per_step"].items()],
                [("counter", "counter (ms or rows per step)", "s"), ("v", "value", ",.1f")]))
    if record["calls"]:
        print(table(record["calls"], [("thread", "thread", "s"), ("method", "method (inclusive)", "s"),
                                      ("cpu_ms_per_step", "CPU ms/step", ".2f"),
                                      ("calls_per_step", "calls/step", ".1f")]))
    path = save(f"steady_{args.config}", [record], vars(args), out_dir)
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
