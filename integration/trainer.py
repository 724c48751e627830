"""The single-process trainer: one run's store, DLRM, optimizer, training loop and evaluation."""

from __future__ import annotations

import math
import os
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from tierstore import RowWiseAdagrad, TableSpec, TieredEmbeddingBagCollection, TierStore
from tierstore.admission import fit_sketch, parse_admission
from tierstore.compile_watch import CompileWatch, watch_compilation
from tierstore.prefetch import Prefetcher
from tierstore.stats import progress_line

from . import streams
from .checkpoint import PendingStepCheckpoint, latest_checkpoint, load_dense, start_checkpoint
from .config import TrainConfig, parse_capacity, parse_sizes
from .data import SPARSE_NAMES, Batch, CriteoTSV, SyntheticCriteo, parse_tables
from .metrics import auc, rss_parts
from .model import DLRM
from .rundir import lock_run, prepare_run_dir, save_torch
from .summary import build_summary


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
        self.synth: SyntheticCriteo | None
        self.tsv: CriteoTSV | None
        self.synth, self.tsv = streams.open_source(cfg, self.cards)
        self.step = 0
        self.pending_checkpoint: PendingStepCheckpoint | None = None  # begun, its store still copying
        self._lock_fd = lock_run(self.run_dir)
        try:
            prepare_run_dir(self.run_dir, cfg)
            self.store = self._open_store()
        except BaseException:
            os.close(self._lock_fd)
            raise
        try:
            torch.manual_seed(cfg.seed)
            ebc = TieredEmbeddingBagCollection(self.store, SPARSE_NAMES)
            # the dense model and the batches' dense features live on the store's device, where
            # the embeddings' pooled rows come out (--device cuda: all of the step on the GPU)
            self.device = self.store.device
            self.model = DLRM(ebc, bottom=parse_sizes(cfg.bottom), top=parse_sizes(cfg.top))
            self.model.to(self.device)
            self.opt = torch.optim.Adam(self.model.parameters(), lr=cfg.dense_lr)
            latest = self.latest() if cfg.resume else None
            if latest is not None:
                self.step = load_dense(latest, self.model, self.opt)
        except BaseException:
            self.close()
            raise
        # "compile": numba compiling kernels at their first use, counted apart from the phase
        # (data, lookup, compute) it happened in, so it never shows as stall
        self.times = dict(data=0.0, lookup=0.0, compute=0.0, eval=0.0, checkpoint=0.0, compile=0.0)
        self.compile_watch: CompileWatch | None = None
        self.evals: list[dict] = []
        self.checkpoints: list[int] = []
        self.rows_stored_start = 0
        self.peak_anon = 0
        self.peak_disk = 0
        self.peak_data = 0  # the tables' file and the log's, each at its own peak
        self.peak_log = 0

    # store / checkpoints ------------------------------------------------------------------------
    def latest(self) -> Path | None:
        """The newest complete checkpoint directory, or None."""
        return latest_checkpoint(self.ckpt_dir)

    def _open_store(self) -> TierStore:
        kw = dict(device_capacity=parse_capacity(self.cfg.device_capacity),
                  host_capacity=parse_capacity(self.cfg.host_capacity),
                  policy=self.cfg.policy, seed=self.cfg.seed, device=self.cfg.device,
                  **({} if self.cfg.table_format is None else {"table_format": self.cfg.table_format}))
        store_path = self.run_dir / "store"
        latest = self.latest() if self.cfg.resume else None
        if latest is not None:
            return TierStore.restore(latest / "store", store_path, tables=self.specs, **kw)
        if self.cfg.resume:  # killed before its first checkpoint: start over
            shutil.rmtree(store_path, ignore_errors=True)
        return TierStore(store_path, self.specs, **kw)

    def checkpoint(self) -> None:
        """Begin ckpt/step-N (store + dense model + optimizer + step): the store's pause and the
        dense files now; its copy goes on while training does (`finish_checkpoint` publishes it
        and points LATEST at it). One at a time: an earlier one is finished first."""
        self.finish_checkpoint()
        t0 = time.perf_counter()
        self.pending_checkpoint = start_checkpoint(self.ckpt_dir, self.step, self.store, self.model,
                                                   self.opt, self.cfg)
        self.times["checkpoint"] += time.perf_counter() - t0

    def finish_checkpoint(self, wait: bool = True) -> Path | None:
        """Publish the checkpoint begun last, waiting for its copy (or, `wait=False`, only if
        the copy is done); returns its path, or None when there is none to publish."""
        pending = self.pending_checkpoint
        if pending is None or (not wait and not pending.done()):
            return None
        t0 = time.perf_counter()
        self.pending_checkpoint = None
        final = pending.finish()
        self.checkpoints.append(pending.step)
        self.times["checkpoint"] += time.perf_counter() - t0
        return final

    # data ---------------------------------------------------------------------------------------
    def train_batches(self) -> Iterator[Batch]:
        """Training batches from the current step on (synthetic: a pure function of the step)."""
        yield from streams.train_batches(self.cfg, self.synth, self.tsv, self.step)

    def eval_batches(self) -> list[Batch]:
        """Held-out batches: a separate synthetic stream, or the first batches of the file."""
        return streams.eval_batches(self.cfg, self.synth, self.tsv)

    # training -----------------------------------------------------------------------------------
    def evaluate(self, batches: list[Batch]) -> dict:
        """AUC and log loss of the current model on held-out batches (no updates)."""
        t0 = time.perf_counter()
        self.model.eval()
        logits, labels = [], []
        with torch.no_grad():
            for b in batches:
                logits.append(self.model(b.dense.to(self.device), *b.jagged()).cpu())
                labels.append(b.labels)
        self.model.train()
        lg, lb = torch.cat(logits), torch.cat(labels)
        out = {"step": self.step, "auc": auc(lg, lb),
               "logloss": float(F.binary_cross_entropy_with_logits(lg, lb)),
               "ctr": float(lb.mean())}
        self.evals.append(out)
        self.times["eval"] += time.perf_counter() - t0
        return out

    def _compiled(self) -> float:
        return self.compile_watch.seconds if self.compile_watch is not None else 0.0

    def _account(self, phase: str, seconds: float, compiled: float) -> None:
        """Add a phase's wall time, less the kernel compilation inside it (counted apart)."""
        c = min(max(compiled, 0.0), seconds)
        self.times[phase] += seconds - c
        self.times["compile"] += c

    def train_step(self, b: Batch) -> float:
        """One step: forward, loss, backward (embedding rows updated in the store), dense update."""
        c0 = self._compiled()
        t0 = time.perf_counter()
        keys, values, lengths = b.jagged()
        emb = self.model.embeddings(keys, values, lengths)
        t1, c1 = time.perf_counter(), self._compiled()
        x = self.model.bottom(b.dense.to(self.device, non_blocking=True))
        logit = self.model.top(self.model.interact(x, emb)).squeeze(1)
        loss = F.binary_cross_entropy_with_logits(logit, b.labels.to(self.device, non_blocking=True))
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        t2 = time.perf_counter()
        self._account("lookup", t1 - t0, c1 - c0)
        self._account("compute", t2 - t1, self._compiled() - c1)
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
            with watch_compilation(lambda text: bar.write(text, file=sys.stderr)) as watch:
                self.compile_watch = watch
                self._loop(it, bar, t_start, start_step, held_out)
        finally:
            self.compile_watch = None
            if cfg.prefetch:
                it.close()  # type: ignore[attr-defined]
            bar.close()
        train_s = time.perf_counter() - t_start
        final = self.evaluate(held_out)  # while the last checkpoint's copy runs
        self._published(bar, self.finish_checkpoint())
        self.store.flush()
        dense_path = self.run_dir / "final_dense.pt"
        save_torch(dense_path, {"model": self.model.state_dict(), "optimizer": self.opt.state_dict(),
                                "step": self.step})
        return build_summary(self, train_s, start_step, final)

    def _loop(self, it: Iterator[Batch], bar: tqdm, t_start: float, start_step: int,
              held_out: list[Batch]) -> None:
        cfg = self.cfg
        loss_ema = math.nan
        while self.step < cfg.steps:
            c0, t0 = self._compiled(), time.perf_counter()
            b = next(it)
            self._account("data", time.perf_counter() - t0, self._compiled() - c0)
            loss = self.train_step(b)
            loss_ema = loss if math.isnan(loss_ema) else 0.98 * loss_ema + 0.02 * loss
            self.step += 1
            self.store.advance()  # the store's clock: row stamps, expiry
            bar.update(1)
            if cfg.eval_interval and self.step % cfg.eval_interval == 0 and self.step < cfg.steps:
                e = self.evaluate(held_out)
                bar.write(f"step {self.step}: held-out AUC {e['auc']:.4f}, log loss {e['logloss']:.4f}")
            if cfg.checkpoint_interval and self.step % cfg.checkpoint_interval == 0:
                self._published(bar, self.finish_checkpoint())  # the one before, if still copying
                self.checkpoint()
            self._published(bar, self.finish_checkpoint(wait=False))
            if self.step % 10 == 0 or self.step == cfg.steps:
                self.peak_anon = max(self.peak_anon, rss_parts()["anon"])
                data, log = self.store.backend.data_bytes(), self.store.backend.log_bytes()
                self.peak_disk = max(self.peak_disk, data + log)
                self.peak_data, self.peak_log = max(self.peak_data, data), max(self.peak_log, log)
            if self.step == cfg.steps or (cfg.progress and self.step % 10 == 0):
                st = self.store.stats()
                if self.step == cfg.steps:
                    self.train_stats = st  # the final table shows the bar's last figures
                if cfg.progress:
                    bar.set_postfix_str(self._postfix(st, t_start, start_step, loss_ema))

    def _published(self, bar: tqdm, path: Path | None) -> None:
        """Say that a checkpoint is published (LATEST names it: a run killed now resumes there)."""
        if path is not None:
            bar.write(f"checkpoint step {self.checkpoints[-1]}: {path}", file=sys.stdout)
            sys.stdout.flush()

    def _postfix(self, st: dict, t_start: float, start_step: int, loss: float) -> str:
        secs = max(time.perf_counter() - t_start, 1e-9)
        sps = (self.step - start_step) * self.cfg.batch / secs
        stall = self.times["data"] + self.times["lookup"]
        return f"{sps:,.0f} samples/s, loss {loss:.4f}, {progress_line(st)}, stall {stall:.1f}s"

    def close(self) -> None:
        """Publish a checkpoint still copying, flush and close the store, and release the run
        directory."""
        try:
            try:
                self.finish_checkpoint()
            finally:
                self.store.close()
        finally:
            if self._lock_fd >= 0:
                os.close(self._lock_fd)
                self._lock_fd = -1
