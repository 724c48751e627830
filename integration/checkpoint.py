"""Training checkpoints: `ckpt/step-N` (store + dense model + optimizer + step) and `ckpt/LATEST`."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict
from pathlib import Path

import torch

from tierstore import TierStore, persistence
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


class PendingStepCheckpoint:
    """A checkpoint written but for its store's copy, which runs on in a background thread
    while training goes on; `finish()` publishes it (rename, LATEST) once the copy is done."""

    def __init__(self, ckpt_dir: Path, step: int, staging: Path, final: Path, keep: int,
                 store_copy: persistence.PendingCheckpoint) -> None:
        self.ckpt_dir, self.step, self.staging, self.final = ckpt_dir, step, staging, final
        self.keep = keep
        self.store_copy = store_copy

    def done(self) -> bool:
        """Whether the store's copy has finished (`finish` then returns at once)."""
        return self.store_copy.done()

    def finish(self) -> Path:
        """Wait for the store's copy (raising its error), then rename the checkpoint into
        place, point LATEST at it and drop the older ones beyond `keep`; returns its path."""
        self.store_copy.wait()
        os.replace(self.staging, self.final)
        fsync_dir(self.ckpt_dir)
        write_text(self.ckpt_dir / "LATEST", self.final.name)
        old = sorted(p for p in self.ckpt_dir.glob("step-*") if p.name != self.final.name)
        for p in old[: max(0, len(old) - self.keep + 1)]:
            shutil.rmtree(p, ignore_errors=True)
        return self.final


def start_checkpoint(ckpt_dir: Path, step: int, store: TierStore, model: torch.nn.Module,
                     opt: torch.optim.Optimizer, cfg: TrainConfig) -> PendingStepCheckpoint:
    """Begin ckpt/step-N in a staging directory: the store's pause (its rows handed to its
    log; `persistence.start_checkpoint`), then the dense model, optimizer and step written
    now. The store's copy goes on in the background; `finish()` publishes the checkpoint."""
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    name = f"step-{step:09d}"
    final = ckpt_dir / name
    staging = ckpt_dir / f".{name}.partial"
    for leftover in ckpt_dir.glob(".step-*.partial"):  # from a run killed mid-checkpoint
        shutil.rmtree(leftover, ignore_errors=True)
    shutil.rmtree(final, ignore_errors=True)
    staging.mkdir()
    store_copy = persistence.start_checkpoint(store, staging / "store", step=step)
    save_torch(staging / "dense.pt", {"model": model.state_dict(), "optimizer": opt.state_dict()})
    write_text(staging / "state.json", json.dumps({"step": step, "config": asdict(cfg)}))
    return PendingStepCheckpoint(ckpt_dir, step, staging, final, cfg.keep_checkpoints, store_copy)


def write_checkpoint(ckpt_dir: Path, step: int, store: TierStore, model: torch.nn.Module,
                     opt: torch.optim.Optimizer, cfg: TrainConfig) -> Path:
    """Write ckpt/step-N in a staging directory, rename it, point LATEST at it, drop old ones."""
    return start_checkpoint(ckpt_dir, step, store, model, opt, cfg).finish()
