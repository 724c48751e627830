"""Training checkpoints: `ckpt/step-N` (store + dense model + optimizer + step) and `ckpt/LATEST`."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict
from pathlib import Path

import torch

from tierstore import TierStore
from tierstore.errors import StoreCorruptError
from tierstore.persistence import fsync_dir

from .config import TrainConfig
from .rundir import save_torch, write_text


def latest_checkpoint(ckpt_dir: Path) -> Path | None:
    """The newest complete checkpoint directory under `ckpt_dir`, or None."""
    ptr = ckpt_dir / "LATEST"
    if not ptr.is_file():
        return None
    path = ckpt_dir / ptr.read_text().strip()
    if not (path / "state.json").is_file():
        raise StoreCorruptError(f"checkpoint {path} named by {ptr} is incomplete")
    return path


def load_dense(path: Path, model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    """Load a checkpoint's dense model and optimizer state; returns its step."""
    state = json.loads((path / "state.json").read_text())
    # on the CPU first (a checkpoint written on CUDA resumes anywhere); loading copies the
    # model's tensors to its device, and the optimizer's state follows its parameters
    dense = torch.load(path / "dense.pt", weights_only=True, map_location="cpu")
    model.load_state_dict(dense["model"])
    opt.load_state_dict(dense["optimizer"])
    return int(state["step"])


def write_checkpoint(ckpt_dir: Path, step: int, store: TierStore, model: torch.nn.Module,
                     opt: torch.optim.Optimizer, cfg: TrainConfig) -> Path:
    """Write ckpt/step-N in a staging directory, rename it, point LATEST at it, drop old ones."""
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    name = f"step-{step:09d}"
    final = ckpt_dir / name
    staging = ckpt_dir / f".{name}.partial"
    for leftover in ckpt_dir.glob(".step-*.partial"):  # from a run killed mid-checkpoint
        shutil.rmtree(leftover, ignore_errors=True)
    shutil.rmtree(final, ignore_errors=True)
    staging.mkdir()
    store.checkpoint(staging / "store", step=step)
    save_torch(staging / "dense.pt", {"model": model.state_dict(), "optimizer": opt.state_dict()})
    write_text(staging / "state.json", json.dumps({"step": step, "config": asdict(cfg)}))
    os.replace(staging, final)
    fsync_dir(ckpt_dir)
    write_text(ckpt_dir / "LATEST", name)
    old = sorted(p for p in ckpt_dir.glob("step-*") if p.name != name)
    for p in old[: max(0, len(old) - cfg.keep_checkpoints + 1)]:
        shutil.rmtree(p, ignore_errors=True)
    return final
