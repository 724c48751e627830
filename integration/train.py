"""Train a DLRM whose embedding tables live in a TierStore: `python -m integration.train --help`."""

from __future__ import annotations

import argparse
import fcntl
import json
import math
import os
import resource
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import torch
import torch.nn.functional as F
from tqdm import tqdm

from tierstore import RowWiseAdagrad, TableSpec, TieredEmbeddingBagCollection, TierStore
from tierstore.admission import fit_sketch, parse_admission
from tierstore.errors import ConfigError, StoreCorruptError, StoreLockedError, TierstoreError
from tierstore.persistence import fsync_dir
from tierstore.prefetch import Prefetcher
from tierstore.stats import progress_line, tier_table

from .data import SPARSE_NAMES, Batch, CriteoTSV, SyntheticCriteo, parse_tables
from .model import DLRM

RUN_MARKER = "run.json"
EVAL_STREAM = 1
# options that must match when resuming (the rest -- capacities, policy, prefetch -- may change)
_FIXED = ("data", "tables", "dim", "seed", "batch", "alpha", "hot", "lr", "dense_lr", "bottom", "top",
          "admission", "ttl")


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
        _sizes(self.bottom), _sizes(self.top)


def _capacity(text: str) -> int | str:
    """A capacity option: a plain number is a row count, anything else a size like '64MiB'."""
    return int(text) if text.strip().isdigit() else text


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        sizes = [0]
    if any(s < 1 for s in sizes):
        raise ConfigError(f"layer sizes must be comma-separated positive ints, got {text!r}")
    return sizes


DEMO = dict(tables="criteo", steps=300, batch=4096, eval_interval=100, eval_batches=8, prefetch=2,
            checkpoint_interval=150, device_capacity="32MiB", host_capacity="128MiB",
            run_dir="runs/demo")
DEMO_MIN_AUC = 0.70  # the README's bar for the demo's held-out AUC


# helpers --------------------------------------------------------------------------------------
def auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the ROC curve (Mann-Whitney, ties averaged); nan with one class only."""
    labels = labels.to(torch.float64)
    pos = float(labels.sum())
    neg = labels.numel() - pos
    if pos == 0 or neg == 0:
        return float("nan")
    s, order = torch.sort(scores.to(torch.float64))
    _, counts = torch.unique_consecutive(s, return_counts=True)
    ends = torch.cumsum(counts, 0).to(torch.float64)
    mid = ends - (counts.to(torch.float64) - 1) / 2  # average 1-based rank of each tie group
    ranks = torch.repeat_interleave(mid, counts)
    rank_pos = float((ranks * labels[order]).sum())
    return (rank_pos - pos * (pos + 1) / 2) / (pos * neg)


def _write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def _save_torch(path: Path, obj: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def rss_parts() -> dict[str, int]:
    """Resident bytes now: total, anonymous (heap, tensors) and file-backed (LMDB's mmap)."""
    out = {"rss": psutil.Process().memory_info().rss, "anon": 0, "file": 0}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(("RssAnon:", "RssFile:", "RssShmem:")):
                    key = "anon" if line.startswith("RssAnon") else "file"
                    out[key] += int(line.split()[1]) * 1024
    except OSError:
        out["anon"] = out["rss"]
    return out


def peak_rss() -> int:
    """Peak resident set size of this process, bytes."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _lock_run(run_dir: Path) -> int:
    """Hold an exclusive lock on a run directory (a sibling lock file) for the trainer's life."""
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(run_dir.parent / f".{run_dir.name}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        raise StoreLockedError(f"run directory {run_dir} is in use by another trainer") from exc
    return fd


class Trainer:
    """One training run: the store, the DLRM, the data streams, checkpoints and metrics."""

    def __init__(self, cfg: TrainConfig) -> None:
        cfg.validate()
        self.cfg = cfg
        self.run_dir = Path(cfg.run_dir)
        self.ckpt_dir = self.run_dir / "ckpt"
        self.cards = parse_tables(cfg.tables)
        adm = parse_admission(cfg.admission) if cfg.admission else None
        self.specs = [TableSpec(name, rows, cfg.dim, optimizer=RowWiseAdagrad(lr=cfg.lr),
                                admission=fit_sketch(adm, rows), ttl=cfg.ttl)
                      for name, rows in zip(SPARSE_NAMES, self.cards, strict=True)]
        if cfg.data == "synthetic":
            self.synth: SyntheticCriteo | None = SyntheticCriteo(self.cards, seed=cfg.seed,
                                                                 alpha=cfg.alpha, hot=cfg.hot)
            self.tsv: CriteoTSV | None = None
        else:
            self.synth, self.tsv = None, CriteoTSV(cfg.data, self.cards)
        self.step = 0
        self._lock_fd = _lock_run(self.run_dir)
        try:
            self._prepare_dir()
            self.store = self._open_store()
        except BaseException:
            os.close(self._lock_fd)
            raise
        try:
            torch.manual_seed(cfg.seed)
            ebc = TieredEmbeddingBagCollection(self.store, SPARSE_NAMES)
            self.model = DLRM(ebc, bottom=_sizes(cfg.bottom), top=_sizes(cfg.top))
            self.opt = torch.optim.Adam(self.model.parameters(), lr=cfg.dense_lr)
            latest = self.latest() if cfg.resume else None
            if latest is not None:
                self._load_dense(latest)
        except BaseException:
            self.close()
            raise
        self.times = dict(data=0.0, lookup=0.0, compute=0.0, eval=0.0, checkpoint=0.0)
        self.evals: list[dict] = []
        self.checkpoints: list[int] = []
        self.rows_stored_start = 0
        self.peak_anon = 0
        self.peak_disk = 0

    # run directory / checkpoints ----------------------------------------------------------------
    def _prepare_dir(self) -> None:
        marker = self.run_dir / RUN_MARKER
        if self.cfg.resume:
            if not marker.is_file():
                raise ConfigError(f"--resume: {self.run_dir} holds no training run")
            old = json.loads(marker.read_text())
            diff = [f"{k}: run has {old.get(k)!r}, given {getattr(self.cfg, k)!r}" for k in _FIXED
                    if old.get(k) != getattr(self.cfg, k)]
            if diff:
                raise ConfigError("--resume with options that differ from the run's: " + "; ".join(diff))
            return
        if self.run_dir.exists() and any(self.run_dir.iterdir()):
            if not marker.is_file():
                raise ConfigError(f"{self.run_dir} exists and is not a training run directory; "
                                  f"pick another --run-dir")
            shutil.rmtree(self.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        _write_text(marker, json.dumps(asdict(self.cfg), indent=2))

    def latest(self) -> Path | None:
        """The newest complete checkpoint directory, or None."""
        ptr = self.ckpt_dir / "LATEST"
        if not ptr.is_file():
            return None
        path = self.ckpt_dir / ptr.read_text().strip()
        if not (path / "state.json").is_file():
            raise StoreCorruptError(f"checkpoint {path} named by {ptr} is incomplete")
        return path

    def _open_store(self) -> TierStore:
        kw = dict(device_capacity=_capacity(self.cfg.device_capacity),
                  host_capacity=_capacity(self.cfg.host_capacity),
                  policy=self.cfg.policy, seed=self.cfg.seed, device=self.cfg.device)
        store_path = self.run_dir / "store"
        latest = self.latest() if self.cfg.resume else None
        if latest is not None:
            return TierStore.restore(latest / "store", store_path, tables=self.specs, **kw)
        if self.cfg.resume:  # killed before its first checkpoint: start over
            shutil.rmtree(store_path, ignore_errors=True)
        return TierStore(store_path, self.specs, **kw)

    def _load_dense(self, path: Path) -> None:
        state = json.loads((path / "state.json").read_text())
        dense = torch.load(path / "dense.pt", weights_only=True)
        self.model.load_state_dict(dense["model"])
        self.opt.load_state_dict(dense["optimizer"])
        self.step = int(state["step"])

    def checkpoint(self) -> Path:
        """Write store + dense model + optimizer + step under ckpt/step-N, then point LATEST at it."""
        t0 = time.perf_counter()
        self.ckpt_dir.mkdir(parents=True, exist_ok=True)
        name = f"step-{self.step:09d}"
        final = self.ckpt_dir / name
        staging = self.ckpt_dir / f".{name}.partial"
        for leftover in self.ckpt_dir.glob(".step-*.partial"):  # from a run killed mid-checkpoint
            shutil.rmtree(leftover, ignore_errors=True)
        shutil.rmtree(final, ignore_errors=True)
        staging.mkdir()
        self.store.checkpoint(staging / "store", step=self.step)
        _save_torch(staging / "dense.pt", {"model": self.model.state_dict(),
                                           "optimizer": self.opt.state_dict()})
        _write_text(staging / "state.json", json.dumps({"step": self.step, "config": asdict(self.cfg)}))
        os.replace(staging, final)
        fsync_dir(self.ckpt_dir)
        _write_text(self.ckpt_dir / "LATEST", name)
        old = sorted(p for p in self.ckpt_dir.glob("step-*") if p.name != name)
        for p in old[: max(0, len(old) - self.cfg.keep_checkpoints + 1)]:
            shutil.rmtree(p, ignore_errors=True)
        self.checkpoints.append(self.step)
        self.times["checkpoint"] += time.perf_counter() - t0
        return final

    # data ---------------------------------------------------------------------------------------
    def train_batches(self) -> Iterator[Batch]:
        """Training batches from the current step on (synthetic: a pure function of the step)."""
        if self.synth is not None:
            yield from self.synth.batches(self.cfg.batch, start=self.step)
            return
        assert self.tsv is not None
        head = self.cfg.eval_batches
        skip = head + self.step
        while True:  # cycle over the file after the held-out head
            n = 0
            for b in self.tsv.batches(self.cfg.batch, skip=skip):
                n += 1
                yield b
            if n == 0 and skip == head:
                raise ConfigError(f"{self.cfg.data} has no training rows after the {head} held-out batches")
            if n == 0:  # resumed past the first epoch: find the position within the epoch
                per_epoch = sum(1 for _ in self.tsv.batches(self.cfg.batch, skip=head))
                skip = head + (skip - head) % max(per_epoch, 1)
                continue
            skip = head

    def eval_batches(self) -> list[Batch]:
        """Held-out batches: a separate synthetic stream, or the first batches of the file."""
        if self.synth is not None:
            return [self.synth.batch(i, self.cfg.batch, stream=EVAL_STREAM)
                    for i in range(self.cfg.eval_batches)]
        assert self.tsv is not None
        return [b for b, _ in zip(self.tsv.batches(self.cfg.batch), range(self.cfg.eval_batches),
                                  strict=False)]

    # training -----------------------------------------------------------------------------------
    def evaluate(self, batches: list[Batch]) -> dict:
        """AUC and log loss of the current model on held-out batches (no updates)."""
        t0 = time.perf_counter()
        self.model.eval()
        logits, labels = [], []
        with torch.no_grad():
            for b in batches:
                logits.append(self.model(b.dense, *b.jagged()))
                labels.append(b.labels)
        self.model.train()
        lg, lb = torch.cat(logits), torch.cat(labels)
        out = {"step": self.step, "auc": auc(lg, lb),
               "logloss": float(F.binary_cross_entropy_with_logits(lg, lb)),
               "ctr": float(lb.mean())}
        self.evals.append(out)
        self.times["eval"] += time.perf_counter() - t0
        return out

    def train_step(self, b: Batch) -> float:
        """One step: forward, loss, backward (embedding rows updated in the store), dense update."""
        t0 = time.perf_counter()
        keys, values, lengths = b.jagged()
        emb = self.model.embeddings(keys, values, lengths)
        t1 = time.perf_counter()
        x = self.model.bottom(b.dense)
        logit = self.model.top(self.model.interact(x, emb)).squeeze(1)
        loss = F.binary_cross_entropy_with_logits(logit, b.labels)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        t2 = time.perf_counter()
        self.times["lookup"] += t1 - t0
        self.times["compute"] += t2 - t1
        return float(loss.detach())

    def run(self) -> dict:
        """Train to `steps`, evaluating and checkpointing on the way; returns the summary."""
        cfg = self.cfg
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        held_out = self.eval_batches()
        start_step = self.step
        st0 = self.store.stats()
        self.rows_stored_start = st0["ssd"]["rows_stored"]
        t_start = time.perf_counter()
        bar = tqdm(total=cfg.steps, initial=self.step, unit="step", disable=not cfg.progress,
                   dynamic_ncols=True, file=sys.stderr)
        source = self.train_batches()
        it: Iterator[Batch] = (Prefetcher(self.store, source, depth=cfg.prefetch, extract=Batch.jagged)
                               if cfg.prefetch else source)
        try:
            self._loop(it, bar, t_start, start_step, held_out)
        finally:
            if cfg.prefetch:
                it.close()  # type: ignore[attr-defined]
            bar.close()
        train_s = time.perf_counter() - t_start
        final = self.evaluate(held_out)
        self.store.flush()
        dense_path = self.run_dir / "final_dense.pt"
        _save_torch(dense_path, {"model": self.model.state_dict(), "optimizer": self.opt.state_dict(),
                                 "step": self.step})
        return self._summary(train_s, start_step, final)

    def _loop(self, it: Iterator[Batch], bar: tqdm, t_start: float, start_step: int,
              held_out: list[Batch]) -> None:
        cfg = self.cfg
        loss_ema = math.nan
        while self.step < cfg.steps:
            t0 = time.perf_counter()
            b = next(it)
            self.times["data"] += time.perf_counter() - t0
            loss = self.train_step(b)
            loss_ema = loss if math.isnan(loss_ema) else 0.98 * loss_ema + 0.02 * loss
            self.step += 1
            self.store.advance()  # the store's clock: row stamps, expiry
            bar.update(1)
            if cfg.eval_interval and self.step % cfg.eval_interval == 0 and self.step < cfg.steps:
                e = self.evaluate(held_out)
                bar.write(f"step {self.step}: held-out AUC {e['auc']:.4f}, log loss {e['logloss']:.4f}")
            if cfg.checkpoint_interval and self.step % cfg.checkpoint_interval == 0:
                path = self.checkpoint()
                bar.write(f"checkpoint step {self.step}: {path}", file=sys.stdout)
                sys.stdout.flush()
            if self.step % 10 == 0 or self.step == cfg.steps:
                self.peak_anon = max(self.peak_anon, rss_parts()["anon"])
                self.peak_disk = max(self.peak_disk, self.store.backend.disk_bytes())
            if self.step == cfg.steps or (cfg.progress and self.step % 10 == 0):
                st = self.store.stats()
                if self.step == cfg.steps:
                    self.train_stats = st  # the final table shows the bar's last figures
                if cfg.progress:
                    bar.set_postfix_str(self._postfix(st, t_start, start_step, loss_ema))

    def _postfix(self, st: dict, t_start: float, start_step: int, loss: float) -> str:
        secs = max(time.perf_counter() - t_start, 1e-9)
        sps = (self.step - start_step) * self.cfg.batch / secs
        stall = self.times["data"] + self.times["lookup"]
        return f"{sps:,.0f} samples/s, loss {loss:.4f}, {progress_line(st)}, stall {stall:.1f}s"

    def _summary(self, train_s: float, start_step: int, final: dict) -> dict:
        st = self.store.stats()
        steps = self.step - start_step
        rows_stored = st["ssd"]["rows_stored"]
        latest = self.latest() if self.checkpoints else None
        mem = rss_parts()
        payload_bytes = 4 * self.specs[0].payload_dim
        return {
            "config": asdict(self.cfg),
            "total_rows": int(sum(self.cards)),
            "steps": steps,
            "samples": steps * self.cfg.batch,
            "train_s": train_s,
            "samples_per_s": steps * self.cfg.batch / train_s if train_s else 0.0,
            "ids_per_s": steps * self.cfg.batch * len(SPARSE_NAMES) / train_s if train_s else 0.0,
            "times": dict(self.times),
            "stall_s": self.times["data"] + self.times["lookup"],
            "tiers": {k: getattr(self, "train_stats", st)[k] for k in ("device", "host", "ssd")},
            "prefetch": st.get("prefetch", {}),
            "admission": st.get("admission", {}),
            "expiry": st.get("expiry", {}),
            "rows_stored": rows_stored,
            "disk_bytes": st["ssd"]["disk_bytes"],
            "peak_disk_bytes": max(self.peak_disk, st["ssd"]["disk_bytes"]),
            "raw_row_bytes": rows_stored * payload_bytes,
            "disk_per_row": st["ssd"]["disk_bytes"] / rows_stored if rows_stored else 0.0,
            "payload_bytes_per_row": payload_bytes,
            "checkpoint_bytes": _dir_bytes(self.ckpt_dir),
            "last_checkpoint_store_bytes": _dir_bytes(latest / "store") if latest else 0,
            "checkpoints": list(self.checkpoints),
            "rss_bytes": mem["rss"],
            "rss_anon_bytes": mem["anon"],
            "rss_file_bytes": mem["file"],
            "peak_rss_bytes": peak_rss(),
            "peak_anon_bytes": max(self.peak_anon, mem["anon"]),
            "cache_bytes": (st["device"]["capacity"] + st["host"]["capacity"]) * 4 * self.store.width,
            "evals": list(self.evals),
            "final_auc": final["auc"],
            "final_logloss": final["logloss"],
            "eval_ctr": final["ctr"],
        }

    def close(self) -> None:
        """Flush and close the store, and release the run directory."""
        try:
            self.store.close()
        finally:
            if self._lock_fd >= 0:
                os.close(self._lock_fd)
                self._lock_fd = -1


def _prefetch_line(s: dict) -> str:
    p = s.get("prefetch") or {}
    if not s["config"]["prefetch"] or not p.get("batches"):
        return ""
    return (f"; prefetch depth {s['config']['prefetch']}: waited {p['stall_seconds']:.1f} s for staging, "
            f"staged {p['rows_staged']:,} rows, {p['hit_rate']:.3f} of used rows resident in time")


def format_summary(s: dict) -> str:
    """The end-of-run summary table."""
    mib = 2**20
    tiers = s["tiers"]
    lines = [
        "",
        f"{'trained':<22} {s['steps']} steps x {s['config']['batch']} samples, 26 tables, "
        f"{s['total_rows']:.3g} rows in all",
        f"{'throughput':<22} {s['samples_per_s']:,.0f} samples/s ({s['ids_per_s'] / 1e6:.2f} M ids/s), "
        f"{s['train_s']:.1f} s",
        f"{'time split':<22} " + ", ".join(f"{k} {v:.1f}s" for k, v in s["times"].items()),
        f"{'stall (data + lookup)':<22} {s['stall_s']:.1f} s" + _prefetch_line(s),
        f"{'held-out AUC':<22} {s['final_auc']:.4f}  (log loss {s['final_logloss']:.4f}, "
        f"CTR {s['eval_ctr']:.3f})",
        f"{'resident memory':<22} {s['rss_bytes'] / mib:,.0f} MiB now ({s['rss_anon_bytes'] / mib:,.0f} "
        f"anonymous + {s['rss_file_bytes'] / mib:,.0f} LMDB/file pages), "
        f"peak {s['peak_rss_bytes'] / mib:,.0f} MiB (anonymous {s['peak_anon_bytes'] / mib:,.0f}); "
        f"caches {s['cache_bytes'] / mib:,.0f} MiB",
        f"{'bytes on disk':<22} {s['disk_bytes'] / mib:,.1f} MiB store for {s['rows_stored']:,} rows "
        f"({s['disk_per_row']:.0f} B/row, raw {s['payload_bytes_per_row']} B), "
        f"checkpoints {s['checkpoint_bytes'] / mib:,.1f} MiB; store peak {s['peak_disk_bytes'] / mib:,.1f} "
        f"MiB during training, {s.get('disk_bytes_closed', 0) / mib:,.1f} MiB after close",
        "",
    ]
    lines += tier_table(tiers)
    if s["evals"]:
        lines.append("")
        lines.append("held-out: " + ", ".join(f"step {e['step']} AUC {e['auc']:.4f}" for e in s["evals"]))
    return "\n".join(lines)


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
    ap.add_argument("--sharding", default="row", choices=("row", "table"),
                    help="with --distributed: row- or table-wise sharding")
    ap.add_argument("--timeout", type=float, default=300.0,
                    help="with --distributed: seconds before a dead rank is reported")
    ap.add_argument("--admission", default=None,
                    help="feature admission of every table, e.g. 'count:2' (docs/admission.md)")
    ap.add_argument("--ttl", type=int, default=None,
                    help="expire rows not updated for this many steps (docs/admission.md)")
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
