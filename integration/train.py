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


def _default(d: TrainConfig, name: str) -> str:
    """'(default: X)' from TrainConfig, with --demo's value where the preset changes it."""
    base = getattr(d, name)
    base = "none" if base is None else base
    demo = DEMO.get(name)
    return f"(default: {base}; --demo: {demo})" if demo is not None and demo != base else \
        f"(default: {base})"


def build_parser() -> argparse.ArgumentParser:
    """The command-line options (defaults from TrainConfig; the --demo preset's where it differs)."""
    d = TrainConfig()
    ap = argparse.ArgumentParser(
        prog="python -m integration.train", description=__doc__.split(":")[0] + ".",
        epilog="Every option's default comes from integration.config.TrainConfig; --demo fills the "
               "options not given from its preset (integration.train.DEMO).")

    def opt(flag: str, text: str, **kw) -> None:
        name = flag.lstrip("-").replace("-", "_")
        kw.setdefault("default", getattr(d, name))
        ap.add_argument(flag, help=f"{text} {_default(d, name)}", **kw)

    ap.add_argument("--demo", action="store_true",
                    help="the README's preset: 26 tables, 1.1e11 rows, ~2 minutes on 2 cores")
    opt("--run-dir", "run directory: the store, checkpoints, the final dense weights", default=None)
    opt("--data", "'synthetic' (planted-label ids, a pure function of the step) or a Criteo "
        "TSV/CSV file (.gz ok)")
    opt("--tables", "row counts of the 26 tables: 'criteo' (1.1e11 rows in all), 'kaggle', "
        "'uniform:N' or 26 comma-separated counts", default=None)
    opt("--dim", "embedding dimension of every table", type=int)
    opt("--seed", "seed of the lazy row init, the dense weights and the synthetic data", type=int)
    opt("--alpha", "Zipf exponent of synthetic ids", type=float)
    opt("--hot", "distinct ids per synthetic feature", type=int)
    opt("--batch", "samples per step", type=int, default=None)
    opt("--steps", "training steps (the run's total, also when resuming)", type=int, default=None)
    opt("--lr", "row-wise Adagrad learning rate of the embeddings", type=float)
    opt("--dense-lr", "Adam learning rate of the MLPs", type=float)
    opt("--bottom", "bottom MLP widths, comma-separated")
    opt("--top", "top MLP widths, comma-separated")
    opt("--device-capacity", "device cache tier: rows or a size like 64MiB", default=None)
    opt("--host-capacity", "host cache tier: rows or a size like 512MiB", default=None)
    opt("--policy", "cache policy of both tiers (lru, lfu, hlfu, s3fifo, ...; docs/policies.md)")
    opt("--prefetch", "look-ahead depth in batches of the Prefetcher (0: off)", type=int, default=None)
    opt("--table-format", "the store's tables on disk: chunks (format 4, the default) or btree "
        "(format 3)", choices=("chunks", "btree"))
    opt("--eval-interval", "held-out evaluation every N steps (0: only at the end)", type=int,
        default=None)
    opt("--eval-batches", "held-out batches per evaluation", type=int, default=None)
    opt("--checkpoint-interval", "checkpoint (store + dense) every N steps (0: never)", type=int,
        default=None)
    opt("--keep-checkpoints", "checkpoints kept under RUN_DIR/ckpt", type=int)
    ap.add_argument("--resume", action="store_true",
                    help="continue the run in --run-dir from its latest checkpoint")
    opt("--threads", "torch threads (0: torch's default; 1 is fastest on a busy 2-core machine)",
        type=int)
    opt("--device", "torch device of the device tier and the model (cpu, cuda)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    ap.add_argument("--json", default=None, help="write the summary to this JSON file "
                    "(default: print it only)")
    ap.add_argument("--distributed", action="store_true",
                    help="shard the tables over torchrun's ranks (see integration/distributed.py)")
    ap.add_argument("--sharding", default="row", choices=("row", "table", "column", "data", "auto"),
                    help="with --distributed: how the tables are sharded (docs/distributed.md) "
                         "(default: row)")
    ap.add_argument("--comm-dtype", default="float32", choices=("float32", "float16", "bfloat16"),
                    help="with --distributed: pooled bags and gradients on the wire (default: float32)")
    ap.add_argument("--exact", action="store_true",
                    help="with --distributed: exact row-wise (bit-identical to one process)")
    opt("--admission", "feature admission of every table, e.g. 'count:2' (docs/admission.md)",
        default=None)
    opt("--ttl", "expire rows not updated for this many steps (the store clock advances once "
        "per step; docs/admission.md)", type=int, default=None)
    ap.add_argument("--timeout", type=float, default=300.0,
                    help="with --distributed: seconds before a dead rank is reported (default: 300)")
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
