"""`python -m bench.prefetch`: training throughput with the look-ahead pipeline off and on.

The training benchmark's workload (bench.training) with caches holding 1% of the rows and LMDB
holding every row, page-cached and cold (pages dropped with posix_fadvise(DONTNEED) before each
measured run), with prefetch off (depth 0) and on (depths 1, 2, 4), beside the all-resident
throughput measured in the same run. Reports samples/s, ratio to all-resident, and stall time.
Its store keeps B-tree tables (`table_format="btree"`), which its raw py-lmdb I/O floor reads.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from tierstore.prefetch import Prefetcher

from .common import OUT_DIR, bar_plot, num_threads, save, table
from .store import RawLmdb, drop_page_cache
from .training import TierstoreRunner, Workload


def run(runner: TierstoreRunner, wl: Workload, depth: int, start: int, blocks: int,
        steps: int) -> dict:
    """Median samples/s over blocks of steps fed through a Prefetcher of the given depth."""
    store = runner.store
    rates, stalls = [], []
    ssd0 = store.stats()["ssd"]
    i = start
    for _ in range(blocks):
        batches = (wl.steps[j % len(wl.steps)] for j in range(i, i + steps))
        before = store.prefetch_stats.stall_seconds
        t0 = time.perf_counter()
        with Prefetcher(store, batches, depth=depth, features={n: n for n in wl.names},
                        extract=lambda b: (wl.names, b[0], b[1])) as pf:
            for values, lengths in pf:
                out = runner.ebc(wl.names, values, lengths)
                out.backward(wl.grad_out.to(out.device))
        dt = time.perf_counter() - t0
        rates.append(wl.batch * steps / dt)
        stalls.append((store.prefetch_stats.stall_seconds - before) / steps * 1000)
        i += steps
    ssd1 = store.stats()["ssd"]
    n = blocks * steps
    return {"samples_per_s": statistics.median(rates), "stall_ms_per_step": statistics.median(stalls),
            "samples_per_s_blocks": rates, "next_step": i,
            "lmdb_rows_read_per_step": (ssd1["lookups"] - ssd0["lookups"]) / n,
            "lmdb_rows_written_per_step": (ssd1["writebacks"] - ssd0["writebacks"]) / n}


def io_floor(runner: TierstoreRunner, wl: Workload, reads: float, writes: float, reps: int = 5) -> dict:
    """The LMDB traffic of a step done by raw py-lmdb alone: the best a 1% cache could reach.

    Times sorted batched `txn.get` of `reads` random stored rows and one `putmulti` transaction
    of `writes` rows (the per-step counts the store really moved), on the store's own
    environment; the minimum over `reps` tries. Nothing else of a step is counted.
    """
    name = wl.names[0]
    backend = runner.store.backend
    raw = RawLmdb(backend.env, backend.table_db(name), runner.store.table_specs[name].row_dim)
    rng = np.random.default_rng(7)
    best_r = best_w = float("inf")
    for _ in range(reps):
        ids_r = rng.choice(wl.rows, size=int(reads), replace=False).astype(np.int64)
        ids_w = np.sort(rng.choice(wl.rows, size=int(writes), replace=False).astype(np.int64))
        payload = raw.read(ids_w)  # the rows to write back, read before the clock starts
        t0 = time.perf_counter()
        raw.read(ids_r)
        t1 = time.perf_counter()
        raw.write(ids_w, payload)
        t2 = time.perf_counter()
        best_r = min(best_r, t1 - t0)
        best_w = min(best_w, t2 - t1)
    step_s = best_r + best_w
    return {"read_ms": best_r * 1000, "write_ms": best_w * 1000,
            "samples_per_s": wl.batch / step_s if step_s > 0 else float("inf")}


def main(argv: list[str] | None = None) -> int:
    """Run the prefetch benchmark; print a table and write JSON under --out."""
    p = argparse.ArgumentParser(prog="python -m bench.prefetch", description=__doc__.splitlines()[0])
    p.add_argument("--tables", type=int, default=8)
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=2048)
    p.add_argument("--max-len", type=int, default=20)
    p.add_argument("--alpha", type=float, default=1.05)
    p.add_argument("--pool", type=int, default=64)
    p.add_argument("--depths", default="0,1,2,4")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--blocks", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--out", default=str(OUT_DIR))
    p.add_argument("--quick", action="store_true", help="8 x 100k rows, batch 512, short blocks")
    args = p.parse_args(argv)
    if args.quick:
        args.rows, args.batch, args.pool, args.blocks, args.steps, args.warmup = 100_000, 512, 16, 2, 4, 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench_prefetch_", dir=out))
    wl = Workload(args.tables, args.rows, args.dim, args.batch, args.max_len, args.alpha, args.pool)
    records = []
    try:
        with num_threads(args.threads):
            resident = TierstoreRunner(wl, "resident", work, None, "lazy", log=print)
            for i in range(args.warmup):
                resident.step(i)
            base = run(resident, wl, 0, args.warmup, args.blocks, args.steps)
            resident.close()
            records.append({"config": "all_resident", "lmdb": "-", "depth": 0, **base, "ratio": 1.0})
            print(f"all resident: {base['samples_per_s']:,.0f} samples/s", file=sys.stderr)
            # B-tree tables: the I/O floor below is raw py-lmdb on the table's B-tree database
            cached = TierstoreRunner(wl, "cache1", work, 0.01, "populated", log=print,
                                     table_format="btree")
            step = 0
            for i in range(args.warmup):
                cached.step(i)
                step += 1
            for lmdb_state in ("page-cached", "cold"):
                for depth in [int(d) for d in args.depths.split(",")]:
                    cached.store.flush()
                    if lmdb_state == "cold":
                        drop_page_cache(cached.path / "data.mdb")
                    rec = run(cached, wl, depth, step, args.blocks, args.steps)
                    step = rec["next_step"]
                    rec.update(config="cache_1pct", lmdb=lmdb_state, depth=depth,
                               ratio=rec["samples_per_s"] / base["samples_per_s"])
                    records.append(rec)
                    print(f"1% cache, {lmdb_state}, depth {depth}: {rec['samples_per_s']:,.0f} "
                          f"samples/s ({rec['ratio']:.2f}x), stall {rec['stall_ms_per_step']:.1f} ms/step",
                          file=sys.stderr, flush=True)
            d0 = next(r for r in records if r["lmdb"] == "page-cached" and r["depth"] == 0)
            floor = io_floor(cached, wl, d0["lmdb_rows_read_per_step"], d0["lmdb_rows_written_per_step"])
            floor_ratio = floor["samples_per_s"] / base["samples_per_s"]
            print(f"raw py-lmdb alone, moving a step's {d0['lmdb_rows_read_per_step']:,.0f} reads and "
                  f"{d0['lmdb_rows_written_per_step']:,.0f} writes: {floor['read_ms']:.1f} + "
                  f"{floor['write_ms']:.1f} ms/step = at most {floor['samples_per_s']:,.0f} samples/s "
                  f"({floor_ratio:.2f}x all-resident)", file=sys.stderr)
            stats = cached.store.stats()
            cached.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(table(records, [("config", "config", "s"), ("lmdb", "LMDB", "s"), ("depth", "depth", "d"),
                          ("samples_per_s", "samples/s", ",.0f"), ("ratio", "x resident", ".2f"),
                          ("stall_ms_per_step", "stall ms/step", ".1f")]))
    meta = {"args": vars(args), "torch_threads": args.threads, "final_stats": stats,
            "lmdb_io_floor": {**floor, "ratio_to_resident": floor_ratio}}
    path = save("prefetch", records, meta, out)
    print(f"wrote {path}")
    depths = sorted({r["depth"] for r in records[1:]})
    bar_plot(out / "prefetch.png", [f"depth {d}" for d in depths],
             {state: [next(r["ratio"] for r in records[1:] if r["lmdb"] == state and r["depth"] == d)
                      for d in depths] for state in ("page-cached", "cold")},
             "samples/s vs all-resident", "1% caches with the prefetch pipeline", target=0.8)
    print(f"wrote {out / 'prefetch.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
