"""`python -m bench.serving`: read-only lookups while a trainer writes, and quantized AUC.

Part 1 (latency): a trainer process populates a table, then trains it (Zipf ids, dirty rows
evicted to LMDB between flushes, a flush every `--flush-every` steps). Meanwhile this process
serves requests of 1, 64 and 512 Zipf ids through a `ReadOnlyStore` with a host cache of 1% and
10% of the rows, refreshing to the newest flush every `--refresh-every` requests. Per request:
p50/p99 latency of the first read (cache hits and misses as they come) and of the same ids read
again right away (every id a cache hit). Then the same with the trainer stopped ("idle"), to
separate the reader's own cost from contention for the CPU with the trainer.

Part 2 (quantized AUC): trains the integration DLRM on synthetic data, exports its tables as
float32 / int8 / int4 and evaluates held-out AUC with the embeddings read from each export
through a read-only store. Also bytes per row.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from .common import num_threads, save, table


# part 1: latency ------------------------------------------------------------------------------
def _zipf_ids(rng: np.random.Generator, n: int, rows: int, perm: np.ndarray, a: float = 1.1
              ) -> np.ndarray:
    """Zipf-ranked ids spread over the table by a fixed permutation."""
    return perm[(rng.zipf(a, n) - 1) % rows]


def _trainer(path: str, rows: int, dim: int, batch: int, flush_every: int, ready, stop,
             counts) -> None:
    """Populate every row, then train until `stop` is set (runs in its own process)."""
    import tierstore as ts

    torch.set_num_threads(1)
    spec = ts.TableSpec("t", rows, dim, optimizer=ts.RowWiseAdagrad(0.05))
    store = ts.TierStore(path, [spec], device_capacity=rows // 100, host_capacity=rows // 100,
                         device="cpu")
    for lo in range(0, rows, 65536):  # populated: every row is in LMDB, as in a long run
        ids = torch.arange(lo, min(rows, lo + 65536))
        store.apply("t", ids, torch.zeros(ids.numel(), dim))
    store.flush()
    ready.set()
    rng = np.random.default_rng(1)
    perm = np.random.default_rng(0).permutation(rows)
    step = 0
    while not stop.is_set():
        ids = torch.from_numpy(_zipf_ids(rng, batch, rows, perm))
        store.apply("t", ids, torch.randn(batch, dim))
        step += 1
        if step % flush_every == 0:
            store.flush()
            counts[0] += 1
        counts[1] = step
    store.close()


def _pcts(xs: list[float]) -> tuple[float, float]:
    a = np.asarray(xs) * 1e3
    return float(np.percentile(a, 50)), float(np.percentile(a, 99))


def latency(args: argparse.Namespace, work: Path) -> list[dict]:
    """p50/p99 request latency for each (cache size, request size) while the trainer writes."""
    from tierstore.serving import ReadOnlyStore

    path = work / "live"
    ctx = mp.get_context("spawn")
    ready, stop = ctx.Event(), ctx.Event()
    counts = ctx.Array("l", 2)
    proc = ctx.Process(target=_trainer, args=(str(path), args.rows, args.dim, args.train_batch,
                                              args.flush_every, ready, stop, counts))
    proc.start()
    records = []
    try:
        if not ready.wait(600):
            raise RuntimeError("the trainer did not populate its store in time")
        perm = np.random.default_rng(0).permutation(args.rows)
        rng = np.random.default_rng(2)
        for phase, frac in (("writing", 0.01), ("writing", 0.10), ("idle", 0.01), ("idle", 0.10)):
            if phase == "idle" and proc.is_alive():  # the same store, its trainer stopped
                stop.set()
                proc.join(300)
            cap = int(args.rows * frac)
            with ReadOnlyStore(path, host_capacity=cap, device="cpu") as reader:
                for size in (1, 64, 512):
                    first, again, looks, hits = [], [], 0, 0
                    steps0, flushes0 = counts[1], counts[0]
                    for i in range(args.warmup + args.requests):
                        if i % args.refresh_every == 0:
                            reader.refresh()
                        ids = torch.from_numpy(_zipf_ids(rng, size, args.rows, perm))
                        h0 = reader.stats()["host"]
                        t0 = time.perf_counter()
                        reader.read("t", ids)
                        t1 = time.perf_counter()
                        h1 = reader.stats()["host"]
                        reader.read("t", ids)
                        t2 = time.perf_counter()
                        if i >= args.warmup:
                            first.append(t1 - t0)
                            again.append(t2 - t1)
                            looks += h1["lookups"] - h0["lookups"]
                            hits += h1["hits"] - h0["hits"]
                    hit_first = hits / max(looks, 1)  # of the first reads (unique ids)
                    p50, p99 = _pcts(first)
                    h50, h99 = _pcts(again)
                    rec = {"trainer": phase, "cache": f"{frac:.0%}", "ids": size,
                           "p50_ms": p50, "p99_ms": p99,
                           "hit_rate": hit_first, "hit_p50_ms": h50, "hit_p99_ms": h99,
                           "trainer_steps": counts[1] - steps0,
                           "flushes": counts[0] - flushes0, "requests": args.requests}
                    records.append(rec)
                    print(f"  trainer {phase}, cache {rec['cache']:>3} ids {size:>3}: p50 {p50:.3f} ms, p99 "
                          f"{p99:.3f} ms (hit rate {hit_first:.2f}); all-hit p50 {h50:.3f} ms, "
                          f"p99 {h99:.3f} ms; trainer {rec['trainer_steps']} steps, "
                          f"{rec['flushes']} flushes", flush=True)
    finally:
        stop.set()
        proc.join(120)
        if proc.is_alive():
            proc.kill()
    return records


# part 3: the writer's cost of keeping flushed states readable ------------------------------------
def writer_cost(args: argparse.Namespace, work: Path) -> list[dict]:
    """Trainer ms/step with and without a registered reader (undo values kept), same workload."""
    import fcntl
    import os

    import tierstore as ts

    out = []
    # the default ring (64 MiB) rarely merges its log between flushes, so undo values are rare;
    # a small ring merges several times per flush interval: every merged row then pays its undo
    cases = [(rep, buf, reader) for rep in range(2) for buf in (None, args.small_write_buffer)
             for reader in (False, True)]
    for rep, buf, reader in cases:
        path = work / f"writer-{rep}-{buf}-{int(reader)}"
        spec = ts.TableSpec("t", args.rows, args.dim, optimizer=ts.RowWiseAdagrad(0.05))
        store = ts.TierStore(path, [spec], device_capacity=args.rows // 100,
                             host_capacity=args.rows // 100, device="cpu", write_buffer=buf)
        for lo in range(0, args.rows, 65536):
            ids = torch.arange(lo, min(args.rows, lo + 65536))
            store.apply("t", ids, torch.zeros(ids.numel(), args.dim))
        store.flush()
        fd = None
        if reader:  # what a ReadOnlyStore holds while open
            fd = os.open(path / "readers.lock", os.O_RDWR | os.O_CREAT)
            fcntl.flock(fd, fcntl.LOCK_SH)
        rng = np.random.default_rng(1)
        perm = np.random.default_rng(0).permutation(args.rows)
        wb0 = store.stats()["ssd"]["writebacks"]
        merged0 = store.stats()["writeback"]["log_merged"]
        t0 = time.perf_counter()
        for i in range(args.writer_steps):
            ids = torch.from_numpy(_zipf_ids(rng, args.train_batch, args.rows, perm))
            store.apply("t", ids, torch.randn(args.train_batch, args.dim))
            if (i + 1) % args.flush_every == 0:
                store.flush()
        ms = (time.perf_counter() - t0) / args.writer_steps * 1e3
        written = store.stats()["ssd"]["writebacks"] - wb0
        merged = store.stats()["writeback"]["log_merged"] - merged0
        store.close()
        if fd is not None:
            os.close(fd)
        shutil.rmtree(path, ignore_errors=True)
        ring = "default" if buf is None else f"{buf} rows"
        out.append({"rep": rep, "reader": reader, "write_buffer": ring, "ms_per_step": ms,
                    "rows_written_per_step": written / args.writer_steps,
                    "rows_merged_per_step": merged / args.writer_steps})
        print(f"  rep {rep}, ring {ring}, reader registered {reader}: {ms:.1f} ms/step, "
              f"{written / args.writer_steps:.0f} rows written back/step, "
              f"{merged / args.writer_steps:.0f} merged into the tables/step", flush=True)
    return out


# part 2: quantized AUC ----------------------------------------------------------------------------
class _ServedBags(torch.nn.Module):
    """Sum-pooled bags read from a read-only store, in the DLRM's embedding-collection shape."""

    def __init__(self, reader, feature_names: list[str]) -> None:
        super().__init__()
        self.reader = reader
        self.feature_names = feature_names
        self.dims = [reader.table_specs[f].dim for f in feature_names]

    def forward(self, keys, values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        batch = lengths.numel() // len(keys)
        starts = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
        torch.cumsum(lengths, 0, out=starts[1:])
        out = []
        for i, k in enumerate(keys):
            lo, hi = int(starts[i * batch]), int(starts[(i + 1) * batch])
            rows = self.reader.read(k, values[lo:hi])
            bag = torch.repeat_interleave(torch.arange(batch), lengths[i * batch:(i + 1) * batch])
            out.append(torch.zeros(batch, rows.shape[1]).index_add_(0, bag, rows))
        return torch.cat(out, dim=1)


def quantized_auc(args: argparse.Namespace, work: Path) -> list[dict]:
    """Held-out AUC of the trained DLRM with its tables read as float32, int8 and int4."""
    from integration.train import TrainConfig, Trainer
    from tierstore.quantize import export_quantized
    from tierstore.serving import ReadOnlyStore

    cfg = TrainConfig(run_dir=str(work / "dlrm"), tables=args.dlrm_tables, dim=16,
                      steps=args.dlrm_steps, batch=args.dlrm_batch, eval_batches=args.eval_batches,
                      device_capacity="16MiB", host_capacity="64MiB", progress=False)
    trainer = Trainer(cfg)
    try:
        trainer.run()
        held = trainer.eval_batches()
        direct = trainer.evaluate(held)["auc"]
        store_dir = work / "dlrm" / "store"
        records = []
        model = trainer.model
        live_bags = model.embeddings
        dim = trainer.specs[0].dim
        for dtype in ("float32", "int8", "int4"):
            if dtype == "float32":  # the live store itself, through a read-only handle
                per_row, src = 4 * dim, store_dir
            else:
                src = work / f"q-{dtype}"
                m = export_quantized(trainer.store, src, dtype)
                per_row = m["tables"][0]["bytes_per_row"]
            with ReadOnlyStore(src, host_capacity=0, device="cpu") as reader:
                model.embeddings = _ServedBags(reader, list(live_bags.feature_names))
                try:
                    a = trainer.evaluate(held)["auc"]
                finally:
                    model.embeddings = live_bags
            records.append({"dtype": dtype, "bytes_per_row": per_row, "auc": a,
                            "auc_delta": a - direct})
            print(f"  {dtype:>7}: {per_row} bytes/row (weights), held-out AUC {a:.5f} "
                  f"(trained model, read in training: {direct:.5f}; {a - direct:+.5f})", flush=True)
        return records
    finally:
        trainer.close()


def main(argv: list[str] | None = None) -> int:
    """Run the serving benchmarks and print tables."""
    p = argparse.ArgumentParser(prog="python -m bench.serving", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=200_000, help="rows of the served table")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--train-batch", type=int, default=4096)
    p.add_argument("--flush-every", type=int, default=10, help="trainer steps between flushes")
    p.add_argument("--requests", type=int, default=400, help="measured requests per setting")
    p.add_argument("--warmup", type=int, default=200, help="requests before measuring")
    p.add_argument("--refresh-every", type=int, default=100, help="requests between refresh()")
    p.add_argument("--dlrm-tables", default="uniform:100000")
    p.add_argument("--dlrm-steps", type=int, default=400)
    p.add_argument("--dlrm-batch", type=int, default=1024)
    p.add_argument("--eval-batches", type=int, default=16)
    p.add_argument("--writer-steps", type=int, default=30, help="trainer steps per writer run")
    p.add_argument("--small-write-buffer", type=int, default=4096,
                   help="rows of the small write-behind ring in the writer-cost part")
    p.add_argument("--parts", default="latency,auc,writer")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    p.add_argument("--out", default=None, help="directory for the JSON results")
    args = p.parse_args(argv)
    if args.quick:
        args.rows, args.requests, args.warmup, args.train_batch = 20_000, 40, 20, 512
        args.writer_steps = 10
        args.dlrm_tables, args.dlrm_steps, args.dlrm_batch, args.eval_batches = \
            "uniform:2000", 20, 256, 2
    parts = set(args.parts.split(","))
    work = Path(tempfile.mkdtemp(prefix="bench-serving-"))
    records: list[dict] = []
    try:
        with num_threads(args.threads):
            if "latency" in parts:
                print(f"latency: {args.rows} rows x {args.dim}, trainer batch {args.train_batch}, "
                      f"flush every {args.flush_every} steps, refresh every {args.refresh_every} "
                      f"requests", flush=True)
                lat = latency(args, work)
                records += [{"part": "latency", **r} for r in lat]
                print(table(lat, [("trainer", "trainer", "s"), ("cache", "cache", "s"), ("ids", "ids", "d"),
                                  ("p50_ms", "p50 ms", ".3f"), ("p99_ms", "p99 ms", ".3f"),
                                  ("hit_rate", "hit rate", ".2f"),
                                  ("hit_p50_ms", "all-hit p50", ".3f"),
                                  ("hit_p99_ms", "all-hit p99", ".3f"),
                                  ("flushes", "writer flushes", "d")]))
            if "auc" in parts:
                print(f"quantized AUC: DLRM, tables {args.dlrm_tables}, {args.dlrm_steps} steps "
                      f"x {args.dlrm_batch}", flush=True)
                q = quantized_auc(args, work)
                records += [{"part": "auc", **r} for r in q]
                print(table(q, [("dtype", "dtype", "s"), ("bytes_per_row", "bytes/row", "d"),
                                ("auc", "held-out AUC", ".5f"), ("auc_delta", "vs float32", "+.5f")]))
            if "writer" in parts:
                print("writer cost of a registered reader (undo values):", flush=True)
                wc = writer_cost(args, work)
                records += [{"part": "writer", **r} for r in wc]
                print(table(wc, [("rep", "rep", "d"), ("write_buffer", "ring", "s"),
                                 ("reader", "reader", ""), ("ms_per_step", "ms/step", ".1f"),
                                 ("rows_merged_per_step", "merged rows/step", ".0f")]))
        out = save("serving", records, {"args": vars(args)}, args.out)
        print(f"wrote {out}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
