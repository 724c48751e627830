"""The options of a training run: `TrainConfig` and the parsers of its text-valued fields."""

from __future__ import annotations

from dataclasses import dataclass

from tierstore.admission import parse_admission
from tierstore.errors import ConfigError

from .data import parse_tables


@dataclass(frozen=True)
class TrainConfig:
    """Everything that defines a training run."""

    run_dir: str = "runs/dlrm"
    data: str = "synthetic"
    tables: str = "criteo"
    dim: int = 16
    seed: int = 0
    alpha: float = 1.1
    hot: int = 2_000_000
    batch: int = 4096
    steps: int = 200
    lr: float = 0.05
    dense_lr: float = 0.002
    bottom: str = "64,32"
    top: str = "128,64"
    device_capacity: str = "64MiB"
    host_capacity: str = "512MiB"
    policy: str = "lru"
    prefetch: int = 0
    eval_interval: int = 0
    eval_batches: int = 8
    checkpoint_interval: int = 0
    keep_checkpoints: int = 2
    resume: bool = False
    threads: int = 1
    progress: bool = True
    device: str = "cpu"
    admission: str | None = None  # e.g. "count:2": feature admission of every table
    ttl: int | None = None  # expire rows not updated for this many steps (every table)
    # the store's tables on disk: "chunks" (format 4) or "btree" (format 3); None: the library's
    # default (StoreConfig.table_format: chunks)
    table_format: str | None = None

    def validate(self) -> None:
        """Raise ConfigError on inconsistent options."""
        for name in ("dim", "batch", "eval_batches", "keep_checkpoints"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("steps", "prefetch", "eval_interval", "checkpoint_interval", "threads"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not (self.lr >= 0 and self.dense_lr >= 0):
            raise ConfigError("learning rates must be >= 0")
        parse_tables(self.tables)
        if self.admission:
            parse_admission(self.admission)
        parse_sizes(self.bottom), parse_sizes(self.top)


def parse_capacity(text: str) -> int | str:
    """A capacity option: a plain number is a row count, anything else a size like '64MiB'."""
    return int(text) if text.strip().isdigit() else text


def parse_sizes(text: str) -> list[int]:
    """MLP layer sizes from '64,32'; ConfigError unless every one is a positive int."""
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        sizes = [0]
    if any(s < 1 for s in sizes):
        raise ConfigError(f"layer sizes must be comma-separated positive ints, got {text!r}")
    return sizes
