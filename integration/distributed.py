"""The DLRM trainer over sharded tables: `torchrun --nproc-per-node 2 -m integration.train --distributed`.

Each rank trains on the r-th contiguous block of every global batch, from the same data sources
as one process (synthetic, or a Criteo TSV file every rank reads, keeping its share); the
embedding tables are sharded over the ranks by a `ShardedTierStore`; the dense layers are
replicated under DDP; the held-out AUC is computed over every rank's logits. Checkpoints every
`--checkpoint-interval` steps (`ckpt/step-N`: every shard, the dense model and optimizer, the
step; `ckpt/LATEST` names the newest complete one); `--resume` continues from it, bit-identical
to an uninterrupted run at the same world size, also after a `kill -9` of any rank.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from tierstore import RowWiseAdagrad, TableSpec
from tierstore.distributed import ShardedEmbeddingBagCollection, ShardedTierStore
from tierstore.errors import ConfigError
from tierstore.persistence import fsync_dir
from tierstore.prefetch import Prefetcher

from . import streams
from .checkpoint import latest_checkpoint
from .config import parse_capacity, parse_sizes
from .data import SPARSE_NAMES, Batch, parse_tables
from .metrics import auc
from .model import DLRM
from .rundir import save_torch, write_text


def _slice(b: Batch, rank: int, world: int) -> Batch:
    """This rank's contiguous block of a global batch (rank 0 first, as in the global order)."""
    n = b.size
    lo, hi = rank * n // world, (rank + 1) * n // world
    return Batch(b.dense[lo:hi], b.ids[:, lo:hi], b.labels[lo:hi])


class _ShardedDLRM(torch.nn.Module):
    """DLRM whose embedding gradients are scaled to the global-batch mean (DDP averages dense)."""

    def __init__(self, model: DLRM, world: int) -> None:
        super().__init__()
        self.model, self.world = model, world

    def forward(self, dense: torch.Tensor, keys, values, lengths) -> torch.Tensor:
        m = self.model
        e = m.embeddings(keys, values, lengths)
        if e.requires_grad:  # the loss is a per-rank mean: embeddings need the global mean
            e.register_hook(lambda g: g / self.world)
        return m.top(m.interact(m.bottom(dense), e)).squeeze(1)


def _checkpoint(ckpt_dir: Path, step: int, store: ShardedTierStore, model: torch.nn.Module,
                opt: torch.optim.Optimizer, cfg, rank: int) -> Path:
    """Collective: every shard, then (rank 0) the dense state, the rename and LATEST."""
    name = f"step-{step:09d}"
    final, staging = ckpt_dir / name, ckpt_dir / f".{name}.partial"
    if rank == 0:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        for leftover in ckpt_dir.glob(".step-*.partial"):  # from a run killed mid-checkpoint
            shutil.rmtree(leftover, ignore_errors=True)
        shutil.rmtree(final, ignore_errors=True)
        staging.mkdir()
    store.comm.barrier("ckpt:staging")
    store.checkpoint(staging / "store", step=step)  # every shard, then the global manifest
    if rank == 0:
        save_torch(staging / "dense.pt", {"model": model.state_dict(), "optimizer": opt.state_dict()})
        write_text(staging / "state.json", json.dumps({"step": step, "config": asdict(cfg),
                                                       "world_size": store.world_size}))
        os.replace(staging, final)
        fsync_dir(ckpt_dir)
        write_text(ckpt_dir / "LATEST", name)
        old = sorted(p for p in ckpt_dir.glob("step-*") if p.name != name)
        for p in old[: max(0, len(old) - cfg.keep_checkpoints + 1)]:
            shutil.rmtree(p, ignore_errors=True)
    store.comm.barrier("ckpt:done")
    return final


def _open(cfg, specs: list[TableSpec], sharding, timeout_s: float, rank: int
          ) -> tuple[ShardedTierStore, Path | None]:
    """The run's sharded store: restored from the latest checkpoint with --resume, else new."""
    run_dir = Path(cfg.run_dir)
    # each rank's shard on cfg.device (its pooled rows come out there), as the one-process
    # trainer's store: not the default device, which is CUDA where there is one while the dense
    # model trains on the CPU
    kw = dict(device_capacity=parse_capacity(cfg.device_capacity),
              host_capacity=parse_capacity(cfg.host_capacity), policy=cfg.policy, seed=cfg.seed,
              timeout=timeout_s, device=cfg.device)
    latest = latest_checkpoint(run_dir / "ckpt") if cfg.resume else None
    if latest is not None:
        return ShardedTierStore.restore(latest / "store", run_dir / "store", **kw), latest
    if rank == 0 and (cfg.resume or (run_dir / "store").exists()):
        shutil.rmtree(run_dir / "store", ignore_errors=True)  # a fresh run, or killed before
        shutil.rmtree(run_dir / "ckpt", ignore_errors=True)  # its first checkpoint
    dist.barrier()
    return ShardedTierStore(run_dir / "store", specs, sharding=sharding, **kw), None


def run_distributed(cfg, sharding: str | dict = "row", timeout_s: float = 300.0, *,
                    comm_dtype: str = "float32", exact: bool = False,
                    on_step: Callable[[int, int], None] | None = None) -> dict | None:
    """Train with sharded tables; every rank returns, rank 0 with the summary.

    `on_step(rank, step)` runs after every step (tests use it to kill a rank mid-run).
    """
    if torch.device(cfg.device).type != "cpu":
        raise ConfigError("--distributed trains the dense model on the CPU over gloo: it takes "
                          f"--device cpu, got {cfg.device!r}")
    if not dist.is_initialized():
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    cards = parse_tables(cfg.tables)
    specs = [TableSpec(n, r, cfg.dim, optimizer=RowWiseAdagrad(lr=cfg.lr))
             for n, r in zip(SPARSE_NAMES, cards, strict=True)]
    synth, tsv = streams.open_source(cfg, cards)
    run_dir = Path(cfg.run_dir)
    store, latest = _open(cfg, specs, sharding, timeout_s, rank)
    torch.manual_seed(cfg.seed)  # the same dense init on every rank (DDP also broadcasts it)
    ebc = ShardedEmbeddingBagCollection(store, SPARSE_NAMES, comm_dtype=comm_dtype, exact=exact)
    model = _ShardedDLRM(DLRM(ebc, bottom=parse_sizes(cfg.bottom), top=parse_sizes(cfg.top)), world)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.dense_lr)
    step = 0
    if latest is not None:  # the dense model and its optimizer as checkpointed (rank 0 wrote them)
        dense = torch.load(latest / "dense.pt", weights_only=True)
        model.load_state_dict(dense["model"])
        opt.load_state_dict(dense["optimizer"])
        step = int(json.loads((latest / "state.json").read_text())["step"])
    ddp = DistributedDataParallel(model)
    start = step
    source = (_slice(b, rank, world)
              for b, _ in zip(streams.train_batches(cfg, synth, tsv, step), range(cfg.steps - step)))
    it = Prefetcher(ebc, source, cfg.prefetch, extract=Batch.jagged) if cfg.prefetch else source
    t0 = time.perf_counter()
    checkpoints = []
    for b in it:
        logit = ddp(b.dense, *b.jagged())
        loss = F.binary_cross_entropy_with_logits(logit, b.labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        step += 1
        if on_step is not None:
            on_step(rank, step)
        if cfg.checkpoint_interval and step % cfg.checkpoint_interval == 0:
            _checkpoint(run_dir / "ckpt", step, store, model, opt, cfg, rank)
            checkpoints.append(step)
        if rank == 0 and cfg.progress and step % 10 == 0:
            print(f"step {step}: loss {loss.detach().item():.4f}", file=sys.stderr, flush=True)
    train_s = time.perf_counter() - t0
    # held-out AUC over every rank's logits
    model.eval()
    logits, labels = [], []
    with torch.no_grad():
        for hb in streams.eval_batches(cfg, synth, tsv):
            b = _slice(hb, rank, world)
            logits.append(ddp(b.dense, *b.jagged()))
            labels.append(b.labels)
    mine = torch.stack([torch.cat(logits), torch.cat(labels)])
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([mine.shape[1]]))
    gathered = [torch.empty(2, int(s)) for s in sizes]
    dist.all_gather(gathered, mine)
    every = torch.cat(gathered, dim=1)
    comm = store.stats()["comm"]
    if not checkpoints or checkpoints[-1] != step:
        _checkpoint(run_dir / "ckpt", step, store, model, opt, cfg, rank)
    store.close()
    summary = {"config": asdict(cfg), "world_size": world, "sharding": sharding, "steps": step,
               "start_step": start, "comm_dtype": comm_dtype, "exact": exact,
               "train_s": train_s,
               "samples_per_s": (step - start) * cfg.batch / train_s if train_s else 0.0,
               "final_auc": auc(every[0], every[1]),
               "final_logloss": float(F.binary_cross_entropy_with_logits(every[0], every[1])),
               "rank0_bytes_sent": sum(v["bytes_sent"] for v in comm.values()),
               "rank0_collective_s": sum(v["seconds"] for v in comm.values())}
    return summary if rank == 0 else None


def main_distributed(cfg, args) -> int:
    """Entry point used by `integration.train --distributed`."""
    cfg = replace(cfg, progress=cfg.progress and int(os.environ.get("RANK", "0")) == 0)
    summary = run_distributed(cfg, sharding=args.sharding, timeout_s=args.timeout,
                              comm_dtype=args.comm_dtype, exact=args.exact)
    if summary is not None:
        print(f"trained steps {summary['start_step']} -> {summary['steps']} on "
              f"{summary['world_size']} ranks ({summary['sharding']}): "
              f"{summary['samples_per_s']:,.0f} samples/s, "
              f"held-out AUC {summary['final_auc']:.4f}, log loss {summary['final_logloss']:.4f}; "
              f"rank 0 sent {summary['rank0_bytes_sent'] / 2**20:.1f} MiB in collectives "
              f"({summary['rank0_collective_s']:.1f} s)", flush=True)
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(summary, indent=2, default=float))
    dist.destroy_process_group()
    return 0
