"""`python -m bench.precision`: what 16-bit row storage costs in accuracy, bytes and speed.

The DLRM of `integration/` on synthetic Criteo-like data (planted labels), trained the same way
(same seed, batches and dense optimizer) with the embedding tables stored as float32, bfloat16
and float16 (stochastic rounding on update). Reports held-out AUC and log loss, the drift of the
16-bit weights from the float32 run's, payload and LMDB bytes per row, and step throughput; the
float32 run of the same invocation is the baseline of every ratio.
"""

from __future__ import annotations

import argparse
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from integration.data import NUM_SPARSE, SPARSE_NAMES, SyntheticCriteo
from integration.metrics import auc
from integration.model import DLRM
from tierstore import RowWiseAdagrad, TableSpec, TieredEmbeddingBagCollection, TierStore

from .common import OUT_DIR, bar_plot, num_threads, save, table

DTYPES = ("float32", "bfloat16", "float16")


def train_one(dtype: str, args: argparse.Namespace, work: Path) -> tuple[dict, torch.Tensor]:
    """Train one model with tables stored as `dtype`; its metrics and a sample of final weights."""
    torch.manual_seed(args.seed)
    cards = [args.rows] * NUM_SPARSE
    specs = [TableSpec(name, args.rows, args.dim, optimizer=RowWiseAdagrad(lr=args.lr), dtype=dtype)
             for name in SPARSE_NAMES]
    data = SyntheticCriteo(cards, seed=args.seed, alpha=args.alpha, hot=min(args.rows, 2_000_000))
    path = work / dtype
    with TierStore(path, specs, device_capacity=args.cache, host_capacity=args.cache,
                   seed=args.seed) as store:
        model = DLRM(TieredEmbeddingBagCollection(store, list(SPARSE_NAMES)))
        opt = torch.optim.Adam(model.parameters(), lr=args.dense_lr)  # the MLPs (tables update in backward)
        loss_fn = torch.nn.BCEWithLogitsLoss()
        t0 = time.perf_counter()
        for step in range(args.steps):
            b = data.batch(step, args.batch)
            keys, values, lengths = b.jagged()
            loss = loss_fn(model(b.dense, keys, values, lengths), b.labels)
            opt.zero_grad()
            loss.backward()
            opt.step()
        train_s = time.perf_counter() - t0
        model.eval()
        scores, labels = [], []
        with torch.no_grad():
            for step in range(args.eval_batches):
                b = data.batch(step, args.batch, stream=1)
                keys, values, lengths = b.jagged()
                scores.append(torch.sigmoid(model(b.dense, keys, values, lengths)))
                labels.append(b.labels)
        s, y = torch.cat(scores), torch.cat(labels)
        p = s.clamp(1e-7, 1 - 1e-7)
        logloss = float(-(y * p.log() + (1 - y) * (1 - p).log()).mean())
        sample_ids = data.batch(0, 512).ids[0].unique()
        weights = store.read(SPARSE_NAMES[0], sample_ids)
        store.flush()
        st = store.stats()["ssd"]
        rec = {"dtype": dtype, "auc": auc(s, y), "logloss": logloss,
               "samples_per_s": args.steps * args.batch / train_s,
               "payload_bytes_per_row": 4 * specs[0].payload_dim,
               "rows_stored": st["rows_stored"], "disk_bytes": st["disk_bytes"]}
    shutil.rmtree(path, ignore_errors=True)
    return rec, weights


def main(argv: list[str] | None = None) -> int:
    """Run the precision benchmark; print a table, write JSON and a PNG under --out."""
    ap = argparse.ArgumentParser(prog="python -m bench.precision", description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1_000_000, help="rows per table (26 tables)")
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--eval-batches", type=int, default=8)
    ap.add_argument("--alpha", type=float, default=1.1)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--dense-lr", type=float, default=0.002)
    ap.add_argument("--cache", default="256MiB", help="device and host capacity each")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(OUT_DIR))
    ap.add_argument("--quick", action="store_true", help="100k rows per table, 60 steps")
    args = ap.parse_args(argv)
    if args.quick:
        args.rows, args.steps, args.batch, args.eval_batches = 100_000, 60, 512, 4
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench_precision_", dir=out))
    records, weights = [], {}
    try:
        with num_threads(args.threads):
            for dtype in DTYPES:
                rec, weights[dtype] = train_one(dtype, args, work)
                records.append(rec)
                print(f"{dtype}: AUC {rec['auc']:.4f}, log loss {rec['logloss']:.4f}, "
                      f"{rec['samples_per_s']:,.0f} samples/s", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    base = records[0]
    ref = weights["float32"]
    for r in records:
        w = weights[r["dtype"]]
        r["auc_delta"] = r["auc"] - base["auc"]
        r["logloss_delta"] = r["logloss"] - base["logloss"]
        r["weight_rel_rms_vs_float32"] = float((w - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt())
        r["speed_vs_float32"] = r["samples_per_s"] / base["samples_per_s"]
        r["disk_vs_float32"] = r["disk_bytes"] / base["disk_bytes"] if base["disk_bytes"] else math.nan
    print(table(records, [("dtype", "dtype", "s"), ("auc", "AUC", ".4f"), ("auc_delta", "dAUC", "+.4f"),
                          ("logloss", "log loss", ".4f"), ("logloss_delta", "d log loss", "+.4f"),
                          ("weight_rel_rms_vs_float32", "weight drift", ".4f"),
                          ("payload_bytes_per_row", "B/row", "d"),
                          ("disk_vs_float32", "disk x f32", ".2f"),
                          ("speed_vs_float32", "speed x f32", ".2f")]))
    path = save("precision", records, {"args": vars(args)}, out)
    print(f"wrote {path}")
    bar_plot(out / "precision.png", [r["dtype"] for r in records],
             {"AUC": [r["auc"] for r in records],
              "disk vs float32": [r["disk_vs_float32"] for r in records],
              "speed vs float32": [r["speed_vs_float32"] for r in records]},
             "value / ratio", f"16-bit row storage: DLRM, 26 x {args.rows:,} rows, {args.steps} steps")
    print(f"wrote {out / 'precision.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
