"""A run directory on disk: its lock, its `run.json` marker, and atomic file writes inside it."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from tierstore.errors import ConfigError, StoreLockedError
from tierstore.persistence import fsync_dir

from .config import TrainConfig

RUN_MARKER = "run.json"
# options that must match when resuming (the rest -- capacities, policy, prefetch -- may change)
FIXED = ("data", "tables", "dim", "seed", "batch", "alpha", "hot", "lr", "dense_lr", "bottom", "top",
         "admission", "ttl")


def write_text(path: Path, text: str) -> None:
    """Write a text file atomically and durably (temp file, fsync, rename, fsync the directory)."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def save_torch(path: Path, obj: Any) -> None:
    """`torch.save` to a temp file, fsync it, then rename it over `path`."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def lock_run(run_dir: Path) -> int:
    """Hold an exclusive lock on a run directory (a sibling lock file) for the trainer's life."""
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(run_dir.parent / f".{run_dir.name}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        raise StoreLockedError(f"run directory {run_dir} is in use by another trainer") from exc
    return fd


def prepare_run_dir(run_dir: Path, cfg: TrainConfig) -> None:
    """Check a run to resume against `cfg`, or start `run_dir` afresh with its marker."""
    marker = run_dir / RUN_MARKER
    if cfg.resume:
        if not marker.is_file():
            raise ConfigError(f"--resume: {run_dir} holds no training run")
        old = json.loads(marker.read_text())
        diff = [f"{k}: run has {old.get(k)!r}, given {getattr(cfg, k)!r}" for k in FIXED
                if old.get(k) != getattr(cfg, k)]
        if diff:
            raise ConfigError("--resume with options that differ from the run's: " + "; ".join(diff))
        return
    if run_dir.exists() and any(run_dir.iterdir()):
        if not marker.is_file():
            raise ConfigError(f"{run_dir} exists and is not a training run directory; "
                              f"pick another --run-dir")
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    write_text(marker, json.dumps(asdict(cfg), indent=2))
