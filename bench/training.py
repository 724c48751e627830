"""`python -m bench.training`: embedding training steps/s of tierstore vs torch and FBGEMM, same run.

Workload (issue 4): 8 tables x 1,000,000 rows x dim 64, batch 2048, 1-20 ids per bag drawn from
Zipf(1.05) (rank -> id through a fixed random permutation per table), row-wise Adagrad; each step
is forward (sum pooling) + backward (grad_out fixed) + optimizer update of the touched rows.

Configurations:
- tierstore_resident: device tier large enough for every row; the rows the run touches are
  loaded into it before timing (lazily initialized, so LMDB holds nothing).
- tierstore_cache10 / tierstore_cache1: device + host tiers (half each) hold 10% / 1% of all rows;
  LMDB holds every row (pre-populated before timing unless --init lazy); caches warmed up first.
  Every tierstore config trains through `Prefetcher(depth=--depth)` (the real training path: the
  pipeline's threads read the next batches' rows ahead and stage them, the write-behind writer
  drains evicted rows). Per step they report the training thread's time inside LMDB, the stall
  waiting for the pipeline, the background threads' time (wall time of their tasks), the rows
  read and written, and the CPU time of each thread by role (training, staging, readers,
  writer, merger, the kernels' pool; Linux) with the cores they kept busy.
- torch_embeddingbag: nn.EmbeddingBag(sparse=True) per table + row-wise Adagrad in torch ops.
- fbgemm_cpu: FBGEMM's SplitTableBatchedEmbeddingBagsCodegen (HOST / CPU, EXACT_ROWWISE_ADAGRAD),
  skipped when fbgemm_gpu is not importable.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import pstats
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import nn

from tierstore import RowWiseAdagrad, TableSpec, TieredEmbeddingBagCollection, TierStore, _parallel
from tierstore.prefetch import Prefetcher

from .cold import add_cold_options, disk_iops, drop_cache, pipeline_options, print_cold, store_files
from .common import OUT_DIR, bar_plot, num_threads, save, table, thread_settings
from .cpu_calls import thread_cpu

LR, EPS = 0.01, 1e-8
# the threads whose CPU time a tierstore config reports, per role (`TierstoreRunner.counters`)
CPU_ROLES = ("training", "staging", "readers", "writer", "merger", "kernels")
BASELINE = "fbgemm_cpu"


class Workload:
    """A pool of pre-generated batches (jagged, feature-major) cycled through by every config."""

    def __init__(self, tables: int, rows: int, dim: int, batch: int, max_len: int, alpha: float,
                 pool: int, seed: int = 0) -> None:
        self.tables, self.rows, self.dim, self.batch = tables, rows, dim, batch
        rng = np.random.default_rng(seed)
        ranks = np.arange(1, rows + 1, dtype=np.float64)
        cdf = np.cumsum(ranks ** -alpha)
        cdf /= cdf[-1]
        perms = [rng.permutation(rows) for _ in range(tables)]
        self.steps = []
        for _ in range(pool):
            lengths = rng.integers(1, max_len + 1, size=(tables, batch))
            ids = []
            for t in range(tables):
                r = np.searchsorted(cdf, rng.random(int(lengths[t].sum())), side="right")
                ids.append(perms[t][np.minimum(r, rows - 1)])
            self.steps.append((torch.from_numpy(np.concatenate(ids)).to(torch.int64),
                               torch.from_numpy(lengths.reshape(-1)).to(torch.int64)))
        self.grad_out = torch.randn(batch, tables * dim, generator=torch.Generator().manual_seed(seed))
        self.names = [f"t{i}" for i in range(tables)]

    def touched(self, t: int) -> torch.Tensor:
        """Sorted unique ids of table t over the whole pool."""
        parts = []
        for values, lengths in self.steps:
            per = lengths.view(self.tables, self.batch).sum(1)
            lo = int(per[:t].sum())
            parts.append(values[lo : lo + int(per[t])])
        return torch.unique(torch.cat(parts))

    def ids_per_step(self, i: int) -> int:
        """Number of ids in pool step i."""
        return int(self.steps[i % len(self.steps)][0].numel())


class Runner:
    """One configuration: `step(i)` runs forward + backward + update on pool batch i."""

    name = ""

    def step(self, i: int) -> None:
        """One training step."""
        raise NotImplementedError

    def close(self) -> None:
        """Release memory and files."""


class TierstoreRunner(Runner):
    """TieredEmbeddingBagCollection over a TierStore with the given cache capacities."""

    def __init__(self, wl: Workload, name: str, work: Path, frac: float | None, init: str,
                 depth: int = 2, log=print, write_log: int | str | None = None,
                 split: str = "even", policy: str | None = None,
                 staging: float | None = None, device: str = "cpu", kernels: str = "auto",
                 pipeline: dict | None = None, device_cache: str = "auto",
                 table_format: str = "chunks") -> None:
        self.name, self.wl = name, wl
        self.depth = depth
        total = wl.tables * wl.rows
        specs = [TableSpec(n, wl.rows, wl.dim, optimizer=RowWiseAdagrad(lr=LR, eps=EPS))
                 for n in wl.names]
        if frac is None:
            dcap, hcap = total, 0
        elif split == "device":  # one cache tier: on a CPU-only machine both tiers are host memory
            dcap, hcap = max(1, int(total * frac)), 0
        else:
            dcap = hcap = max(1, int(total * frac / 2))
        # None: the store resolves the policy, the tier split and staging slots (tierstore.resolve)
        scap = None if staging is None else int(total * staging) if frac is not None else 0
        self.path = work / name
        self.store = TierStore(self.path, specs, device_capacity=dcap, host_capacity=hcap,
                               write_log=write_log, policy=policy, staging_capacity=scap,
                               device=device, kernels=kernels, device_cache=device_cache,
                               table_format=table_format)
        # the capacities as given; the staging slots the store has (named, or its reserve)
        self.capacity = {"device": dcap, "host": hcap, "staging": self.store.layout.staging_rows}
        self.init = "lazy (touched rows preloaded into the device tier)" if frac is None else init
        t0 = time.perf_counter()
        if frac is None:
            for n, t in zip(wl.names, range(wl.tables)):
                self.store.read(n, wl.touched(t))
        elif init == "populated":
            width = specs[0].row_dim
            rng = np.random.default_rng(3)
            chunk = 1 << 20  # (a chunked table merges each piece: fewer, larger pieces)
            for n in wl.names:
                for lo in range(0, wl.rows, chunk):
                    ids = np.arange(lo, min(lo + chunk, wl.rows), dtype=np.int64)
                    pay = rng.standard_normal((len(ids), width), dtype=np.float32) * 0.05
                    pay[:, wl.dim :] = 0.0  # accumulators and the last-update stamp
                    self.store.backend.put({n: (ids, pay)})
            self.store.backend.sync()
        self.setup_s = time.perf_counter() - t0
        log(f"{name}: setup {self.setup_s:.1f} s", file=sys.stderr, flush=True)
        self.ebc = TieredEmbeddingBagCollection(self.store, wl.names)
        # on the store's device once, as TorchRunner's (a copy a step would make a CUDA step wait)
        self.grad_out = wl.grad_out.to(self.store.device)
        self.next_step = 0  # the pool step the pipeline delivers next
        self.pf = Prefetcher(self.ebc, self._batches(), depth=depth, **(pipeline or {}))

    def _batches(self):
        """The pool's batches in step order, forever (what the pipeline reads ahead)."""
        i = 0
        while True:
            values, lengths = self.wl.steps[i % len(self.wl.steps)]
            yield self.wl.names, values, lengths
            i += 1

    def step(self, i: int) -> None:
        """One training step (batch i of the pool, delivered by the prefetch pipeline)."""
        if i != self.next_step:
            raise RuntimeError("TierstoreRunner steps must be consecutive")
        self.next_step += 1
        keys, values, lengths = next(self.pf)
        out = self.ebc(keys, values, lengths)
        out.backward(self.grad_out)

    def _thread_roles(self) -> dict[int, str]:
        """Native id -> role of every thread that works for this runner's steps."""
        roles = {threading.main_thread().native_id: "training"}
        pf = self.pf
        if pf._thread is not None:
            roles[pf._thread.native_id] = "staging"
        for t in threading.enumerate():  # reader threads (warm and cold ones), by name: other
            if t.name.startswith("tierstore-read"):  # runners' readers idle during this block
                roles[t.native_id] = "readers"
        roles[self.store.writeback._thread.native_id] = "writer"
        merger = self.store.log.merger
        if merger is not None:
            roles[merger.native_id] = "merger"
        for t in getattr(_parallel._pool, "_threads", ()):  # the kernels' pool (process-wide)
            roles[t.native_id] = "kernels"
        return roles

    def counters(self) -> dict[str, float]:
        """Cumulative I/O and pipeline counters (differences over the timed steps go in the record)."""
        st = self.store
        pf, wb = st.prefetch_stats, st.writeback
        read_fg = st.ssd_stats.lookups - pf.rows_read_ahead  # read at use: no read-ahead buffer held them
        cpu = dict.fromkeys(CPU_ROLES, 0.0)
        roles = self._thread_roles()
        for (tid, _), sec in thread_cpu().items():
            if tid in roles:
                cpu[roles[tid]] += sec
        return {**{f"cpu_{r}_s": v for r, v in cpu.items()},
                "lmdb_training_s": st.io_seconds["training"],
                "lmdb_background_s": st.io_seconds["background"],
                "stall_s": pf.stall_seconds,
                "background_s": pf.read_seconds + pf.stage_seconds + wb.writer_seconds,
                "writer_s": wb.writer_seconds, "readahead_s": pf.read_seconds,
                "stage_s": pf.stage_seconds, "writeback_wait_s": wb.wait_seconds,
                # rows read below the caches once each: by the pipeline's readers ahead of use,
                # plus those read at use
                "rows_read": pf.rows_read_ahead_from_ssd + read_fg, "rows_read_fg": read_fg,
                "rows_written": wb.rows_written,
                "rows_merged": st.log.rows_merged, "log_merges": st.log.background_merges}

    cold = False  # --cold: the store's files leave the page cache before each timed block

    def before_block(self, i: int) -> int:
        """With --cold: let the background work finish, drop the store's files from the page
        cache, then run untimed steps from pool step `i` until the pipeline reads ahead from
        the disk again (its look-ahead read before the drop would serve the block from memory);
        returns the steps run. The process's own mappings of the file go first: the page cache
        keeps a page that a process still maps, whatever `posix_fadvise(DONTNEED)` asks."""
        if not self.cold:
            return 0
        self.quiesce()
        self.store.backend.trim_map()
        drop_cache(store_files(self.path))
        settle = self.pf.depth + self.pf.reads_ahead + 1
        for k in range(settle):
            self.step(i + k)
        return settle

    def quiesce(self, timeout: float = 5.0) -> None:
        """Wait until this runner's background work is idle (its window staged and read, its
        write-behind ring drained, no log merge due or running), so another runner's timed block
        runs alone."""
        end = time.perf_counter() + timeout
        # the window staged and its reads done: reads left in flight (the next batches' rows,
        # read ahead) would run inside the next runner's block, not this one's
        self.pf.settle(timeout)
        self.store.writeback.drain(timeout=timeout)
        log = self.store.log
        # a merge the drain set off, too
        while log.merger is not None and log.wants_merge() and time.perf_counter() < end:
            time.sleep(0.005)
        with log.merging:  # a merge in progress finishes first
            pass

    def close(self) -> None:
        """Close the pipeline and the store, and delete it."""
        self.pf.close()
        self.store.close()
        shutil.rmtree(self.path, ignore_errors=True)


def _sync() -> None:
    """Wait for queued CUDA work (timing blocks on a GPU); nothing on the CPU."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class TorchRunner(Runner):
    """nn.EmbeddingBag(sparse=True) per table + row-wise Adagrad written in torch ops."""

    name = "torch_embeddingbag"

    def __init__(self, wl: Workload, device: str = "cpu") -> None:
        self.wl = wl
        self.device = torch.device(device)
        self.embs = nn.ModuleList(nn.EmbeddingBag(wl.rows, wl.dim, mode="sum", sparse=True)
                                  for _ in range(wl.tables)).to(self.device)
        self.acc = [torch.zeros(wl.rows, device=self.device) for _ in range(wl.tables)]
        self.grad_out = wl.grad_out.to(self.device)

    def step(self, i: int) -> None:
        """One training step."""
        values, lengths = self.wl.steps[i % len(self.wl.steps)]
        per = lengths.view(self.wl.tables, self.wl.batch)
        values = values.to(self.device)
        outs, lo = [], 0
        for t, emb in enumerate(self.embs):
            n = int(per[t].sum())
            offs = torch.zeros(self.wl.batch, dtype=torch.int64)
            torch.cumsum(per[t][:-1], 0, out=offs[1:])
            outs.append(emb(values[lo : lo + n], offs.to(self.device)))
            lo += n
        torch.cat(outs, 1).backward(self.grad_out)
        with torch.no_grad():
            for emb, acc in zip(self.embs, self.acc):
                g = emb.weight.grad.coalesce()
                idx, v = g.indices()[0], g.values()
                acc.index_add_(0, idx, v.mul(v).mean(1))
                scale = acc.index_select(0, idx).sqrt_().add_(EPS).reciprocal_().mul_(-LR)
                emb.weight.index_add_(0, idx, v.mul_(scale.unsqueeze(1)))
                emb.weight.grad = None


class FbgemmRunner(Runner):
    """FBGEMM's CPU table-batched embedding bags with fused exact row-wise Adagrad."""

    name = BASELINE

    def __init__(self, wl: Workload) -> None:
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
            EmbeddingLocation,
            PoolingMode,
        )
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            ComputeDevice,
            OptimType,
            SplitTableBatchedEmbeddingBagsCodegen,
        )

        self.wl = wl
        specs = [(wl.rows, wl.dim, EmbeddingLocation.HOST, ComputeDevice.CPU)] * wl.tables
        self.tbe = SplitTableBatchedEmbeddingBagsCodegen(
            embedding_specs=specs, optimizer=OptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=LR,
            eps=EPS, pooling_mode=PoolingMode.SUM)
        self.offsets = []
        for _, lengths in wl.steps:
            offs = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
            torch.cumsum(lengths, 0, out=offs[1:])
            self.offsets.append(offs)

    def step(self, i: int) -> None:
        """One training step."""
        k = i % len(self.wl.steps)
        out = self.tbe(self.wl.steps[k][0], self.offsets[k])
        out.backward(self.wl.grad_out.to(out.device))


def fbgemm_available() -> str | None:
    """None when FBGEMM's CPU TBE imports, else the reason it does not."""
    try:
        import fbgemm_gpu  # noqa: F401
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (  # noqa: F401
            SplitTableBatchedEmbeddingBagsCodegen,
        )
    except Exception as exc:  # ImportError, or an OSError from its shared library
        return f"{type(exc).__name__}: {exc}"
    return None


def _kernel_profile(name: str, block: Callable[[], None], steps: int) -> str:
    """One block under torch's profiler: the device time by kernel and the launches a step."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        block()
        _sync()
    events = prof.key_averages()
    kernels = [e for e in events if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]
    launches = sum(e.count for e in kernels)
    busy = sum(e.self_device_time_total for e in kernels) / 1000
    table = events.table(sort_by="self_device_time_total", row_limit=25)
    return (f"==== {name}: device kernels ({steps} steps): {launches / steps:.0f} launches a step, "
            f"{busy / steps:.2f} ms of kernel time a step ====\n{table}")


def measure(runners: list[Runner], wl: Workload, threads: int, warmup: int, blocks: int, steps: int,
            profile: list[str] | None) -> list[dict]:
    """Median samples/s and ids/s per runner over `blocks` blocks of `steps` steps, after `warmup`.

    Blocks are interleaved across runners (A B C A B C ...), so a burst of load on this shared
    machine hits every configuration alike instead of whichever happened to run then. Before a
    block, every other runner's background work (staging, write-behind, log merges) is let
    finish, so a block pays for its own configuration's background work only.
    """
    pos = {id(r): getattr(r, "next_step", 0) for r in runners}  # a pipeline goes on in order

    def run_block(r: Runner) -> None:
        for _ in range(steps):
            r.step(pos[id(r)])
            pos[id(r)] += 1

    for r in runners:
        for _ in range(warmup):
            r.step(pos[id(r)])
            pos[id(r)] += 1
    times: dict[int, list[tuple[float, int]]] = {id(r): [] for r in runners}
    counted: dict[int, dict[str, float]] = {}
    for _ in range(blocks):
        for r in runners:
            for other in runners:
                if other is not r and hasattr(other, "quiesce"):
                    other.quiesce()
            if hasattr(r, "before_block"):
                pos[id(r)] += r.before_block(pos[id(r)])
            i = pos[id(r)]
            n_ids = sum(wl.ids_per_step(j) for j in range(i, i + steps))
            before = r.counters() if hasattr(r, "counters") else None
            _sync()
            t0 = time.perf_counter()
            run_block(r)
            _sync()  # a CUDA block ends when its kernels do
            times[id(r)].append((time.perf_counter() - t0, n_ids))
            if before is not None:
                after = r.counters()
                acc = counted.setdefault(id(r), dict.fromkeys(after, 0.0))
                for k in after:
                    acc[k] += after[k] - before[k]
    if profile is not None:
        for r in runners:
            prof = cProfile.Profile()
            prof.enable()
            run_block(r)
            prof.disable()
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
            pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(40)
            profile.append(f"==== {r.name} threads={threads} ({steps} steps) ====\n{buf.getvalue()}")
            dev = getattr(r, "device", None) or getattr(getattr(r, "store", None), "device", None)
            if torch.cuda.is_available() and dev is not None and torch.device(dev).type == "cuda":
                profile.append(_kernel_profile(r.name, lambda r=r: run_block(r), steps))
    out = []
    for r in runners:
        srates = [wl.batch * steps / dt for dt, _ in times[id(r)]]
        out.append({"config": r.name, "threads": threads, "samples_per_s": statistics.median(srates),
                    "ids_per_s": statistics.median(n / dt for dt, n in times[id(r)]),
                    "ms_per_step": statistics.median(1000 * dt / steps for dt, _ in times[id(r)]),
                    "ms_per_step_mean": 1000 * sum(dt for dt, _ in times[id(r)]) / (blocks * steps),
                    "samples_per_s_blocks": srates, "blocks": blocks, "steps_per_block": steps})
        if id(r) in counted:  # per-step averages over the timed blocks
            n = blocks * steps
            out[-1]["per_step"] = {k: (v * 1000 / n if k.endswith("_s") else v / n)
                                   for k, v in counted[id(r)].items()}
            out[-1]["per_step"] = {k[:-2] + "_ms" if k.endswith("_s") else k: v
                                   for k, v in out[-1]["per_step"].items()}
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(prog="python -m bench.training", description=__doc__.splitlines()[0])
    add_workload_options(p)
    p.add_argument("--pool", type=int, default=64, help="distinct pre-generated batches, cycled")
    p.add_argument("--threads", default="1,default")
    p.add_argument("--warmup", type=int, default=10, help="untimed steps per config and thread count")
    p.add_argument("--blocks", type=int, default=5)
    p.add_argument("--steps", type=int, default=10, help="steps per timed block")
    p.add_argument("--configs", default="tierstore_resident,tierstore_cache10,tierstore_cache1,"
                   "torch_embeddingbag,fbgemm_cpu")
    p.add_argument("--init", choices=("populated", "lazy"), default="populated",
                   help="cache configs: LMDB pre-populated with every row, or rows lazily initialized")
    p.add_argument("--device", default="cpu",
                   help="the tierstore configs' device tier and torch_embeddingbag's device "
                        "(fbgemm_cpu stays on the CPU); CUDA blocks are timed synchronized")
    p.add_argument("--kernels", default="auto", choices=("auto", "numba", "triton"),
                   help="TierStore(kernels=...): the step engine's backend")
    p.add_argument("--device-cache", default="auto", choices=("auto", "slab", "sets"),
                   help="TierStore(device_cache=...): the device tier's structure (auto: sets on CUDA)")
    p.add_argument("--table-format", default="chunks", choices=("chunks", "btree"),
                   help="TierStore(table_format=...): the stores' tables on disk, page-chunk "
                        "levels (format 4, the default) or B-trees (format 3)")
    p.add_argument("--workdir", default=None)
    p.add_argument("--out", default=str(OUT_DIR))
    p.add_argument("--profile", action="store_true", help="also cProfile one block per config")
    p.add_argument("--depth", type=int, default=2, help="prefetch depth of the tierstore configs")
    add_cache_options(p)
    p.add_argument("--no-plot", action="store_true")
    add_cold_options(p)
    p.add_argument("--quick", action="store_true", help="a short run: 8 x 100k rows, batch 512")
    args = p.parse_args(argv)
    if args.quick:
        args.rows, args.batch, args.pool = 100_000, 512, 16
        args.warmup, args.blocks, args.steps = 3, 3, 5
    return args


FRACTIONS = {"tierstore_resident": None, "tierstore_cache10": 0.10, "tierstore_cache1": 0.01}


def add_workload_options(p: argparse.ArgumentParser) -> None:
    """The workload options bench.training, bench.steady and bench.staging_floor share."""
    p.add_argument("--tables", type=int, default=8)
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=2048)
    p.add_argument("--max-len", type=int, default=20, help="bag lengths are uniform in 1..max-len")
    p.add_argument("--alpha", type=float, default=1.05, help="Zipf exponent of the ids")


def workload_from(args: argparse.Namespace, pool: int) -> Workload:
    """The workload `add_workload_options` describes, with `pool` distinct batches."""
    return Workload(args.tables, args.rows, args.dim, args.batch, args.max_len, args.alpha, pool)


def add_cache_options(p: argparse.ArgumentParser) -> None:
    """The store options bench.training and bench.steady share: tier split, policy, log size."""
    p.add_argument("--split", choices=("even", "device"), default="even",
                   help="how a cacheN config splits its rows: half device tier, half host tier "
                        "(even), or all in the device tier, host tier empty (device: on a "
                        "CPU-only machine both tiers are host memory, and each miss then moves "
                        "once instead of twice; without --policy the store folds them itself)")
    p.add_argument("--policy", default=None,
                   help="the cache policy of both tiers; default: the store's resolved layout "
                        "(on a CPU device one hlfu tier with automatic staging slots)")
    p.add_argument("--write-log", default=None, type=lambda v: int(v) if v.isdigit() else v,
                   help="TierStore(write_log=...): rows (or a size) of the write-behind log; "
                        "default: the store's")
    p.add_argument("--staging", type=float, default=None,
                   help="TierStore(staging_capacity=...) of a cacheN config, as a fraction of all "
                        "rows (e.g. 0.025): slots beyond the caches for the staged rows the "
                        "policy refuses (with --policy: needs --split device --policy hlfu); "
                        "default: the store's (automatic without --policy)")


def main(argv: list[str] | None = None) -> int:
    """Run the training benchmark, print a table, write JSON (+ PNG) under --out."""
    args = parse_args(argv)
    threads = thread_settings(args.threads)
    configs = [c for c in args.configs.split(",") if c]
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench_training_", dir=args.workdir or out_dir))
    t0 = time.perf_counter()
    wl = workload_from(args, args.pool)
    print(f"workload: {len(wl.steps)} batches in {time.perf_counter() - t0:.1f} s, "
          f"{statistics.mean(wl.ids_per_step(i) for i in range(len(wl.steps))):,.0f} ids/step",
          file=sys.stderr, flush=True)
    skipped: dict[str, str] = {}
    prof: list[str] | None = [] if args.profile else None
    records: list[dict] = []
    runners: list[Runner] = []
    try:
        for name in configs:
            if name == BASELINE:
                why = fbgemm_available()
                if why is not None:
                    skipped[name] = why
                    print(f"skipping {name}: {why}", file=sys.stderr)
                    continue
                runners.append(FbgemmRunner(wl))
            elif name == "torch_embeddingbag":  # on the device in use
                runners.append(TorchRunner(wl, args.device))
            elif name in FRACTIONS:
                runners.append(TierstoreRunner(wl, name, work, FRACTIONS[name], args.init,
                                               depth=args.depth, write_log=args.write_log,
                                               split=args.split, policy=args.policy,
                                               staging=args.staging, device=args.device,
                                               kernels=args.kernels,
                                               pipeline=pipeline_options(args),
                                               device_cache=args.device_cache,
                                               table_format=args.table_format))
            else:
                raise SystemExit(f"unknown config {name!r}")
        cold_runners = [r for r in runners if isinstance(r, TierstoreRunner) and r.capacity["device"]
                        < args.tables * args.rows] if args.cold else []
        iops: dict[str, list[dict]] = {}
        for r in cold_runners:  # the disk's floor, measured on the store's file in this run
            r.cold = True
            r.quiesce()
            iops[r.name] = [disk_iops(r.path / "data.mdb", args.iops_seconds)]
        for n in threads:
            with num_threads(n):
                recs = measure(runners, wl, n, args.warmup, args.blocks, args.steps, prof)
            for runner, rec in zip(runners, recs):
                if isinstance(runner, TierstoreRunner):
                    rec.update(capacity=runner.capacity, policy=runner.store.layout.policy,
                               table_format=args.table_format,
                               device_cache=runner.store.device_cache,
                               layout=runner.store.layout.as_dict(),
                               init=runner.init, setup_s=runner.setup_s,
                               depth=runner.depth, stats=runner.store.stats(),
                               memory=runner.store.memory())
                records.append(rec)
                print(f"{rec['config']} threads={n}: {rec['samples_per_s']:,.0f} samples/s, "
                      f"{rec['ms_per_step']:.1f} ms/step", file=sys.stderr, flush=True)
        for r in cold_runners:  # and again after the timed blocks
            iops[r.name].append(disk_iops(r.path / "data.mdb", args.iops_seconds))
    finally:
        for runner in runners:
            runner.close()
        runners.clear()
        gc.collect()
        shutil.rmtree(work, ignore_errors=True)
    for r in records:
        same = {x["config"]: x for x in records if x["threads"] == r["threads"]}
        base = same.get(BASELINE)
        res = same.get("tierstore_resident")
        r["vs_fbgemm"] = r["samples_per_s"] / base["samples_per_s"] if base else None
        r["vs_resident"] = r["samples_per_s"] / res["samples_per_s"] if res else None
    print(table(records, [("config", "config", "s"), ("threads", "thr", "d"),
                          ("samples_per_s", "samples/s", ",.0f"), ("ids_per_s", "ids/s", ",.0f"),
                          ("ms_per_step", "ms/step", ".1f"), ("vs_fbgemm", "vs fbgemm", ".3f"),
                          ("vs_resident", "vs resident", ".3f")]))
    io_rows = [{"config": r["config"], "threads": r["threads"], **r["per_step"],
                "anon_mib": r["memory"]["anon_rss_bytes"] / 2**20,
                "budget_mib": r["memory"]["budget_bytes"] / 2**20}
               for r in records if "per_step" in r]
    if io_rows:
        print("per step (means over the timed steps): training-thread LMDB time, stall, background")
        print(table(io_rows, [("config", "config", "s"), ("threads", "thr", "d"),
                              ("lmdb_training_ms", "lmdb fg ms", ".2f"), ("stall_ms", "stall ms", ".1f"),
                              ("background_ms", "bg ms", ".1f"), ("writer_ms", "writer ms", ".1f"),
                              ("readahead_ms", "read ms", ".1f"), ("stage_ms", "stage ms", ".1f"),
                              ("rows_read", "rows read", ",.0f"), ("rows_written", "rows written", ",.0f"),
                              ("anon_mib", "anon MiB", ",.0f"), ("budget_mib", "budget MiB", ",.0f")]))
    cpu_rows = [{"config": r["config"], "threads": r["threads"],
                 **{role: r["per_step"][f"cpu_{role}_ms"] for role in CPU_ROLES}}
                for r in records if "per_step" in r]
    for row, rec in zip(cpu_rows, [r for r in records if "per_step" in r]):
        row["sum"] = sum(row[role] for role in CPU_ROLES)
        row["cores"] = row["sum"] / rec["ms_per_step_mean"]  # CPU and wall over the same steps
    if any(row["sum"] for row in cpu_rows):
        print("CPU time per step by thread (ms; /proc/self/task, 10 ms ticks), and cores kept busy")
        print(table(cpu_rows, [("config", "config", "s"), ("threads", "thr", "d"),
                               *[(role, role, ".1f") for role in CPU_ROLES],
                               ("sum", "sum", ".1f"), ("cores", "cores", ".2f")]))
    if iops:
        print_cold(records, iops)
    for name, why in skipped.items():
        print(f"skipped {name}: {why}")
    meta = {"bench": "training", "argv": sys.argv[1:] if argv is None else argv,
            "tables": args.tables, "rows": args.rows, "dim": args.dim, "batch": args.batch,
            "max_len": args.max_len, "alpha": args.alpha, "pool": args.pool, "init": args.init,
            "threads": threads, "quick": args.quick, "skipped": skipped, "cold": args.cold,
            "iops": iops, "pipeline": pipeline_options(args),
            "targets": {"tierstore_resident vs fbgemm_cpu": 1.0, "tierstore_cache1 vs resident": 0.5}}
    path = save("training", records, meta, out_dir)
    print(f"wrote {path}")
    if prof is not None:
        ppath = out_dir / "training_profile.txt"
        ppath.write_text("\n".join(prof))
        print(f"wrote {ppath}")
    if not args.no_plot and records:
        names = list(dict.fromkeys(r["config"] for r in records))
        groups = {f"{n} thread(s)": [next((r["samples_per_s"] for r in records
                                           if r["config"] == c and r["threads"] == n), 0.0)
                                     for c in names] for n in threads}
        bar_plot(out_dir / "training.png", names, groups, "samples/s (median of blocks)",
                 f"bench.training: {args.tables} x {args.rows:,} x {args.dim}, batch {args.batch}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
