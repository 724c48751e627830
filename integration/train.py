"""Train a DLRM whose embedding tables live in a TierStore: `python -m integration.train --help`."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

from tierstore.errors import ConfigError, TierstoreError
from tierstore.prefetch import Prefetcher

from .config import TrainConfig
from .metrics import auc, peak_rss, rss_parts
from .rundir import RUN_MARKER
from .streams import EVAL_STREAM
from .summary import format_summary
from .trainer import Trainer

# the CLI lives here; the rest is re-exported so `from integration.train import X` keeps working
__all__ = ["DEMO", "DEMO_MIN_AUC", "EVAL_STREAM", "RUN_MARKER", "Prefetcher", "TrainConfig", "Trainer",
           "auc", "build_parser", "config_from_args", "format_summary", "main", "peak_rss", "rss_parts"]

DEMO = dict(tables="criteo", steps=300, batch=4096, eval_interval=100, eval_batches=8, prefetch=2,
            checkpoint_interval=150, device_capacity="32MiB", host_capacity="128MiB",
            run_dir="runs/demo")
DEMO_MIN_AUC = 0.70  # the README's bar for the demo's held-out AUC


def build_parser() -> argparse.ArgumentParser:
    """The command-line options (defaults from TrainConfig)."""
    d = TrainConfig()
    ap = argparse.ArgumentParser(prog="python -m integration.train", description=__doc__)
    ap.add_argument("--demo", action="store_true",
                    help="the README's preset: 26 tables, 1.1e11 rows, ~2 minutes on 2 cores")
    ap.add_argument("--run-dir", default=None, help=f"run directory (default {d.run_dir})")
    ap.add_argument("--data", default=d.data, help="'synthetic' or a Criteo TSV/CSV file (.gz ok)")
    ap.add_argument("--tables", default=None,
                    help="'criteo' (1.1e11 rows), 'kaggle', 'uniform:N' or 26 comma-separated row counts")
    ap.add_argument("--dim", type=int, default=d.dim)
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--alpha", type=float, default=d.alpha, help="Zipf exponent of synthetic ids")
    ap.add_argument("--hot", type=int, default=d.hot, help="distinct ids per synthetic feature")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--lr", type=float, default=d.lr, help="row-wise Adagrad lr of the embeddings")
    ap.add_argument("--dense-lr", type=float, default=d.dense_lr, help="Adam lr of the MLPs")
    ap.add_argument("--bottom", default=d.bottom)
    ap.add_argument("--top", default=d.top)
    ap.add_argument("--device-capacity", default=None)
    ap.add_argument("--host-capacity", default=None)
    ap.add_argument("--policy", default=d.policy)
    ap.add_argument("--prefetch", type=int, default=None, help="look-ahead depth in batches (default 0)")
    ap.add_argument("--eval-interval", type=int, default=None)
    ap.add_argument("--eval-batches", type=int, default=None)
    ap.add_argument("--checkpoint-interval", type=int, default=None)
    ap.add_argument("--keep-checkpoints", type=int, default=d.keep_checkpoints)
    ap.add_argument("--resume", action="store_true", help="continue the run in --run-dir")
    ap.add_argument("--threads", type=int, default=d.threads,
                    help="torch threads (0: torch default; 1 is fastest on a busy 2-core machine)")
    ap.add_argument("--device", default=d.device)
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--json", default=None, help="write the summary to this JSON file")
    ap.add_argument("--distributed", action="store_true",
                    help="shard the tables over torchrun's ranks (see integration/distributed.py)")
    ap.add_argument("--sharding", default="row", choices=("row", "table", "column", "data", "auto"),
                    help="with --distributed: how the tables are sharded (docs/distributed.md)")
    ap.add_argument("--comm-dtype", default="float32", choices=("float32", "float16", "bfloat16"),
                    help="with --distributed: pooled bags and gradients on the wire")
    ap.add_argument("--exact", action="store_true",
                    help="with --distributed: exact row-wise (bit-identical to one process)")
    ap.add_argument("--admission", default=None,
                    help="feature admission of every table, e.g. 'count:2' (docs/admission.md)")
    ap.add_argument("--ttl", type=int, default=None,
                    help="expire rows not updated for this many steps (docs/admission.md)")
    ap.add_argument("--timeout", type=float, default=300.0,
                    help="with --distributed: seconds before a dead rank is reported")
    return ap


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """A TrainConfig from parsed options (the --demo preset fills what was not given)."""
    base = replace(TrainConfig(), **DEMO) if args.demo else TrainConfig()
    given = {k: v for k, v in vars(args).items()
             if k in TrainConfig.__dataclass_fields__ and v is not None}
    given["progress"] = not args.no_progress
    return replace(base, **given)


def main(argv: list[str] | None = None) -> int:
    """Run the trainer; returns an exit code."""
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.distributed:
        from .distributed import main_distributed

        return main_distributed(config_from_args(args), args)
    try:
        cfg = config_from_args(args)
        trainer = Trainer(cfg)
    except ConfigError as exc:
        ap.error(str(exc))
    except TierstoreError as exc:  # a locked, corrupt or foreign store or checkpoint
        print(f"{ap.prog}: error: {exc}", file=sys.stderr)
        return 1
    try:
        print(f"training DLRM: 26 tables, {sum(trainer.cards):.3g} rows, dim {cfg.dim}, "
              f"batch {cfg.batch}, steps {trainer.step} -> {cfg.steps}, caches "
              f"{cfg.device_capacity} + {cfg.host_capacity} ({cfg.policy}), run dir {cfg.run_dir}",
              flush=True)
        summary = trainer.run()
    finally:
        trainer.close()
    # close() compacts a store whose file has outgrown its rows (LmdbBackend.compact_on_close)
    data = trainer.run_dir / "store" / "data.mdb"
    summary["disk_bytes_closed"] = data.stat().st_blocks * 512 if data.exists() else 0
    print(format_summary(summary), flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(summary, indent=2, default=float))
    if args.demo and not summary["final_auc"] >= DEMO_MIN_AUC:  # NaN fails too
        print(f"{ap.prog}: error: held-out AUC {summary['final_auc']:.4f} is below the demo's bar "
              f"{DEMO_MIN_AUC}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    np.seterr(over="ignore")
    raise SystemExit(main())
