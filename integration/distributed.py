"""The DLRM trainer over sharded tables: `torchrun --nproc-per-node 2 -m integration.train --distributed`.

Each rank trains on the r-th contiguous block of every global batch; the embedding tables are
sharded over the ranks by a `ShardedTierStore`; the dense layers are replicated under DDP; the
held-out AUC is computed over every rank's logits.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from tierstore import RowWiseAdagrad, TableSpec
from tierstore.distributed import ShardedEmbeddingBagCollection, ShardedTierStore
from tierstore.prefetch import Prefetcher

from .config import parse_capacity
from .data import SPARSE_NAMES, Batch, SyntheticCriteo, parse_tables
from .metrics import auc
from .model import DLRM


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


def run_distributed(cfg, sharding: str = "row", timeout_s: float = 300.0) -> dict | None:
    """Train with sharded tables; every rank returns, rank 0 with the summary."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    if cfg.data != "synthetic":
        raise SystemExit("--distributed supports --data synthetic for now")
    cards = parse_tables(cfg.tables)
    specs = [TableSpec(n, r, cfg.dim, optimizer=RowWiseAdagrad(lr=cfg.lr))
             for n, r in zip(SPARSE_NAMES, cards, strict=True)]
    run_dir = Path(cfg.run_dir)
    store = ShardedTierStore(run_dir / "store", specs, sharding=sharding,
                             device_capacity=parse_capacity(cfg.device_capacity),
                             host_capacity=parse_capacity(cfg.host_capacity), policy=cfg.policy,
                             seed=cfg.seed, timeout=timeout_s)
    torch.manual_seed(cfg.seed)  # the same dense init on every rank (DDP also broadcasts it)
    ebc = ShardedEmbeddingBagCollection(store, SPARSE_NAMES)
    model = _ShardedDLRM(DLRM(ebc, bottom=[int(x) for x in cfg.bottom.split(",")],
                              top=[int(x) for x in cfg.top.split(",")]), world)
    ddp = DistributedDataParallel(model)
    opt = torch.optim.Adam(ddp.parameters(), lr=cfg.dense_lr)
    synth = SyntheticCriteo(cards, seed=cfg.seed, alpha=cfg.alpha, hot=cfg.hot)
    source = (_slice(b, rank, world) for b in synth.batches(cfg.batch, stop=cfg.steps))
    it = Prefetcher(ebc, source, cfg.prefetch, extract=Batch.jagged) if cfg.prefetch else source
    t0 = time.perf_counter()
    step = 0
    for b in it:
        logit = ddp(b.dense, *b.jagged())
        loss = F.binary_cross_entropy_with_logits(logit, b.labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        step += 1
        if rank == 0 and cfg.progress and step % 10 == 0:
            print(f"step {step}: loss {float(loss):.4f}", file=sys.stderr, flush=True)
    train_s = time.perf_counter() - t0
    # held-out AUC over every rank's logits
    model.eval()
    logits, labels = [], []
    with torch.no_grad():
        for i in range(cfg.eval_batches):
            b = _slice(synth.batch(i, cfg.batch, stream=1), rank, world)
            logits.append(ddp(b.dense, *b.jagged()))
            labels.append(b.labels)
    mine = torch.stack([torch.cat(logits), torch.cat(labels)])
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([mine.shape[1]]))
    gathered = [torch.empty(2, int(s)) for s in sizes]
    dist.all_gather(gathered, mine)
    every = torch.cat(gathered, dim=1)
    stats = store.stats()
    comm = stats["comm"]
    store.checkpoint(run_dir / "ckpt" / f"step-{step:09d}", step=step, overwrite=True)
    store.close()
    summary = {"config": asdict(cfg), "world_size": world, "sharding": sharding, "steps": step,
               "train_s": train_s, "samples_per_s": step * cfg.batch / train_s if train_s else 0.0,
               "final_auc": auc(every[0], every[1]),
               "final_logloss": float(F.binary_cross_entropy_with_logits(every[0], every[1])),
               "rank0_bytes_sent": sum(v["bytes_sent"] for v in comm.values()),
               "rank0_collective_s": sum(v["seconds"] for v in comm.values())}
    return summary if rank == 0 else None


def main_distributed(cfg, args) -> int:
    """Entry point used by `integration.train --distributed`."""
    cfg = replace(cfg, progress=cfg.progress and int(os.environ.get("RANK", "0")) == 0)
    summary = run_distributed(cfg, sharding=args.sharding, timeout_s=args.timeout)
    if summary is not None:
        print(f"trained {summary['steps']} steps on {summary['world_size']} ranks "
              f"({summary['sharding']}-wise): {summary['samples_per_s']:,.0f} samples/s, "
              f"held-out AUC {summary['final_auc']:.4f}, log loss {summary['final_logloss']:.4f}; "
              f"rank 0 sent {summary['rank0_bytes_sent'] / 2**20:.1f} MiB in collectives "
              f"({summary['rank0_collective_s']:.1f} s)", flush=True)
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(summary, indent=2, default=float))
    dist.destroy_process_group()
    return 0
