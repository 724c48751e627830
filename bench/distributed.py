"""`python -m bench.distributed`: sharded training on 1 vs 2 gloo ranks, bytes, collectives, scaling.

Workload: bench.training's (tables x rows x dim, 1-20 Zipf(1.05) ids per bag, row-wise Adagrad,
sum pooling, grad_out fixed) at cache10: LMDB holds every row, the caches (device + host, half
each) hold 10% of the rows a process owns. The global batch is the same in every configuration:
one process trains it whole (`single`, TieredEmbeddingBagCollection); N ranks train a 1/N block
each through ShardedEmbeddingBagCollection. A config is a sharding (`row`, `table`, `column`,
`data`, `auto`) with options joined by `-`: `f16` / `bf16` (16-bit comms), `i64` (int64 ids
instead of int32), `exact` (exact row-wise); e.g. `row-f16`. Reported: global samples/s, bytes
each rank sends per step (ids apart; and the minimum for row/table: unique ids out, the smaller
of rows or pooled partials back, gradients back), seconds in collectives vs the rest, the
planner's modeled step per rank vs the measured one, an all-to-all bandwidth sweep, a model of
8-128 nodes fitted to it; `--auc N` also trains the demo's data for N steps with float32 and
float16 comms and compares the held-out AUCs. `--criteo`: 26 tables.
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from tierstore import RowWiseAdagrad, TableSpec, TieredEmbeddingBagCollection, TierStore
from tierstore.distributed import (
    CostModel,
    ShardedEmbeddingBagCollection,
    ShardedTierStore,
    lookups_from_batches,
    row_owner,
)
from tierstore.distributed.launch import run_local
from tierstore.distributed.planner import table_cost

from .common import OUT_DIR, save, table
from .training import EPS, LR, Workload


def _block(values: torch.Tensor, lengths: torch.Tensor, tables: int, batch: int, lo: int, hi: int):
    """Samples [lo, hi) of a feature-major jagged batch."""
    lens = lengths.view(tables, batch)
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).view(-1)
    parts = [values[int(starts[t * batch + lo]) : int(starts[t * batch + hi])] for t in range(tables)]
    return torch.cat(parts), lens[:, lo:hi].reshape(-1)


def _populate(store: TierStore, names: list[str], rows: int, keep) -> None:
    """Write every row this process owns to LMDB (so reads miss the caches into the disk)."""
    rng = np.random.default_rng(3)
    chunk = 1 << 17
    for n in names:
        if n not in store.table_specs:  # a column-wise table with no shard here
            continue
        width, dim = store.table_specs[n].row_dim, store.table_specs[n].dim
        for lo in range(0, rows, chunk):
            ids = torch.arange(lo, min(lo + chunk, rows))
            pay = rng.standard_normal((len(ids), width), dtype=np.float32) * 0.05
            pay[:, dim:] = 0.0
            mine = keep(n, ids).numpy()
            if mine.any():
                store.backend.put({n: (ids.numpy()[mine], pay[mine])})
    store.backend.sync()


def _min_bytes(plan, rank: int, world: int, name: str, ids: torch.Tensor, lengths: torch.Tensor,
               dim: int) -> int:
    """The floor for one table: unique remote ids out + min(rows, partials) back + grads back."""
    own = plan.owners(name, ids)
    remote = own != rank
    u = int(torch.unique(ids[remote]).numel())
    bag_of = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    pairs = torch.unique(own[remote] * lengths.numel() + bag_of[remote]).numel()  # (owner, bag)
    return 8 * u + 2 * 4 * dim * min(u, int(pairs))


def _options(mode: str) -> tuple[str, dict]:
    """(sharding, module keyword arguments) of a config name like `row-f16-i64`."""
    kind, *opts = mode.split("-")
    kw: dict = {}
    for o in opts:
        if o in ("f16", "bf16"):
            kw["comm_dtype"] = {"f16": "float16", "bf16": "bfloat16"}[o]
        elif o == "i64":
            kw["id_dtype"] = "int64"
        elif o == "exact":
            kw["exact"] = True
        else:
            raise SystemExit(f"unknown config option {o!r} in {mode!r}")
    return kind, kw


def _keeps(plan, rank: int):
    """Which ids of a table this rank stores under `plan`."""
    def keep(n: str, ids: torch.Tensor) -> torch.Tensor:
        p = plan.placement(n)
        if p.kind in ("row", "table"):
            return plan.owners(n, ids) == rank
        return torch.ones_like(ids, dtype=torch.bool)  # a column shard or a replica: every row
    return keep


def _modeled(store, specs, looks: dict, kw: dict, world: int) -> list[tuple[float, float, float]]:
    """Each rank's modeled (seconds, compute units, bytes) under the store's plan (CostModel())."""
    m = CostModel(id_bytes=8 if kw.get("id_dtype") == "int64" else 4,
                  float_bytes=2 if kw.get("comm_dtype") else 4)
    per = [[0.0, 0.0, 0.0] for _ in range(world)]
    for s in specs:
        p = store.plan.placement(s.name)
        if kw.get("exact") and p.kind == "row":
            p = dataclasses.replace(p, exact=True)
        for r, c in enumerate(table_cost(s, p, looks[s.name], world, m)):
            per[r][0] += c.seconds
            per[r][1] += c.compute
            per[r][2] += c.bytes
    return [tuple(x) for x in per]


def _rank(rank: int, world: int, cfg: dict) -> dict:
    torch.set_num_threads(1)
    wl = Workload(cfg["tables"], cfg["rows"], cfg["dim"], cfg["batch"], cfg["max_len"],
                  cfg["alpha"], cfg["pool"])
    specs = [TableSpec(n, wl.rows, wl.dim, optimizer=RowWiseAdagrad(lr=LR, eps=EPS))
             for n in wl.names]
    lo, hi = rank * wl.batch // world, (rank + 1) * wl.batch // world
    work = Path(cfg["work"]) / f"{cfg['mode']}-{world}"
    total_rows = wl.tables * wl.rows
    cap = max(1, int(total_rows * cfg["frac"] / world / 2))
    if cfg["mode"] == "single":
        store = TierStore(work, specs, device_capacity=cap, host_capacity=cap,
                          policy="lru")  # the layout the sharded store keeps (LRU, two tiers)
        local, ebc = store, TieredEmbeddingBagCollection(store, wl.names)
        _populate(store, wl.names, wl.rows, lambda n, ids: torch.ones_like(ids, dtype=torch.bool))
        comm = None
    batches = [_block(v, ln, wl.tables, wl.batch, lo, hi) for v, ln in wl.steps]
    looks = lookups_from_batches([(wl.names, v, ln) for v, ln in batches], {n: n for n in wl.names})
    if cfg["mode"] != "single":
        sharding, kw = _options(cfg["mode"])
        store = ShardedTierStore(work, specs, sharding=sharding, lookups=looks, device_capacity=cap,
                                 host_capacity=cap, timeout=300)
        local, ebc = store.local, ShardedEmbeddingBagCollection(store, wl.names, **kw)
        _populate(local, wl.names, wl.rows, _keeps(store.plan, rank))
        comm = store.comm
    grad = wl.grad_out[lo:hi]

    def step(i: int) -> None:
        values, lengths = batches[i % len(batches)]
        ebc(wl.names, values, lengths).backward(grad)

    for i in range(cfg["warmup"]):
        step(i)
    if comm is not None:
        comm.barrier("bench:start")
        base = {k: (v.bytes_sent, v.seconds) for k, v in comm.stats.items()}
    t0 = time.perf_counter()
    for i in range(cfg["steps"]):
        step(cfg["warmup"] + i)
    if comm is not None:
        comm.barrier("bench:end")
    wall = time.perf_counter() - t0
    out = {"wall_s": wall, "steps": cfg["steps"]}
    if comm is not None:
        sent = coll = ids_sent = 0.0
        for k, v in comm.stats.items():
            if k.startswith(("fwd:", "bwd:")):
                b0, s0 = base.get(k, (0, 0.0))
                sent += v.bytes_sent - b0
                coll += v.seconds - s0
                if k == "fwd:ids":
                    ids_sent += v.bytes_sent - b0
        floor = 0
        for i in range(cfg["steps"] if store.plan.kinds() <= {"row", "table"} else 0):
            values, lengths = batches[(cfg["warmup"] + i) % len(batches)]
            per = lengths.view(wl.tables, -1)
            starts = torch.cat([torch.zeros(1, dtype=torch.int64), per.sum(1).cumsum(0)])
            for t, n in enumerate(wl.names):
                floor += _min_bytes(store.plan, rank, world, n, values[int(starts[t]) : int(starts[t + 1])],
                                    per[t], wl.dim)
        out.update(bytes_per_step=sent / cfg["steps"], ids_bytes_per_step=ids_sent / cfg["steps"],
                   min_bytes_per_step=floor / cfg["steps"] if floor else None,
                   collective_s=coll, by_phase={k: v.as_dict() for k, v in comm.stats.items()},
                   modeled_s=_modeled(store, specs, looks, kw, world),
                   plan={t: p.kind for t, p in store.plan.tables})
        if cfg.get("sweep"):
            out["sweep"] = _sweep(comm, cfg["sweep"])
        if cfg.get("model_ids"):
            out["model_ids"] = [batches[i][0] for i in range(min(4, len(batches)))]
            out["model_lengths"] = [batches[i][1] for i in range(min(4, len(batches)))]
        store.close()
    else:
        store.close()
    return out


def _sweep(comm, sizes: list[int]) -> list[dict]:
    """Median seconds of an all_to_all_single with `size` bytes to each peer."""
    res = []
    for size in sizes:
        n = size // 4
        send = torch.zeros(n * comm.world)
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            comm.exchange("bench:sweep", send, [n] * comm.world, [n] * comm.world)
            times.append(time.perf_counter() - t0)
        res.append({"bytes_per_peer": size, "seconds": float(np.median(times))})
    return res


def scaling_model(fit: tuple[float, float], ids: list[torch.Tensor], lengths: list[torch.Tensor],
                  tables: int, dim: int, compute_s: float, nodes: list[int], net_bps: float,
                  latency_s: float, fast_compute_s: float) -> list[dict]:
    """Row-wise weak scaling: per-rank batch fixed; bytes per rank from the real ids, hashed for N."""
    out = []
    for n in nodes:
        sent = 0.0
        for v, ln in zip(ids, lengths):
            per = ln.view(tables, -1)
            starts = torch.cat([torch.zeros(1, dtype=torch.int64), per.sum(1).cumsum(0)])
            for t in range(tables):
                x = v[int(starts[t]) : int(starts[t + 1])]
                own = row_owner(x, n)
                remote = own != 0
                bag_of = torch.repeat_interleave(torch.arange(per[t].numel()), per[t])
                pairs = torch.unique(own[remote] * per[t].numel() + bag_of[remote]).numel()
                sent += 8 * (int(remote.sum()) + per[t].numel() * (n - 1)) + 2 * 4 * dim * pairs
        sent /= len(ids)
        comm_s = 4 * (n - 1) * latency_s + sent / net_bps
        here_s = 4 * (n - 1) * fit[0] + sent / fit[1]  # this machine's gloo, if it scaled so
        out.append({"nodes": n, "bytes_per_rank_step": sent, "comm_s": comm_s,
                    "compute_s": compute_s, "comm_share": comm_s / (comm_s + compute_s),
                    "gloo_here_s": here_s,
                    "fast_share": comm_s / (comm_s + fast_compute_s)})
    return out


def _calibrate(per_rank: list[dict], records: list[dict], runs: dict, a) -> None:
    """Add `calibrated_ms`: the planner's formula with this machine's fitted constants."""
    single = next((r for r in records if r["config"] == "single"), None)
    sweep = next((v[0]["sweep"] for v in runs.values() if 0 in v and v[0].get("sweep")), None)
    if single is None or sweep is None:
        return
    wl_ids = a.batch * a.tables * (a.max_len + 1) / 2  # mean ids per global step
    rate = wl_ids * a.dim / 64 / (single["step_ms"] / 1e3)  # 64-wide lookups per second
    lat = sweep[0]["seconds"]
    bw = (sweep[-1]["bytes_per_peer"] - sweep[0]["bytes_per_peer"]) / \
        max(sweep[-1]["seconds"] - sweep[0]["seconds"], 1e-9)
    for r in per_rank:
        r["calibrated_ms"] = 1e3 * (r["units"] / rate + r["model_bytes"] / bw + 4 * lat)
    print(f"\ncalibration: {rate:,.0f} 64-wide lookups/s (one process), all-to-all "
          f"{bw / 1e9:.2f} GB/s and {lat * 1e3:.1f} ms latency (gloo, loopback)")


def _auc_rank(rank: int, world: int, run_dir: str, steps: int, comm_dtype: str) -> dict | None:
    from integration.distributed import run_distributed
    from integration.train import DEMO, TrainConfig

    demo = {k: v for k, v in DEMO.items() if k not in ("run_dir", "checkpoint_interval", "eval_interval")}
    cfg = TrainConfig(**{**demo, "steps": steps, "run_dir": run_dir, "progress": False})
    return run_distributed(cfg, sharding="row", timeout_s=600, comm_dtype=comm_dtype)


def _auc_compare(steps: int, work: Path) -> dict:
    """Held-out AUC of the demo's data after `steps` on 2 ranks, float32 vs float16 comms."""
    out = {}
    for dt in ("float32", "float16"):
        print(f"demo data, {steps} steps, {dt} comms on 2 ranks ...", file=sys.stderr, flush=True)
        res = run_local(2, _auc_rank, str(work / f"auc-{dt}"), steps, dt, timeout_s=7200,
                        preload=["integration.distributed"])
        out[dt] = {"auc": res[0]["final_auc"], "logloss": res[0]["final_logloss"],
                   "bytes_sent": res[0]["rank0_bytes_sent"], "samples_per_s": res[0]["samples_per_s"]}
    diff = out["float16"]["auc"] - out["float32"]["auc"]
    out["auc_diff"] = diff
    print(f"\ndemo data, {steps} steps on 2 ranks: held-out AUC float32 comms "
          f"{out['float32']['auc']:.5f}, float16 comms {out['float16']['auc']:.5f} "
          f"(difference {diff:+.5f}; bytes sent by rank 0 {out['float32']['bytes_sent'] / 2**20:.1f} "
          f"-> {out['float16']['bytes_sent'] / 2**20:.1f} MiB)")
    return out


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; prints tables and writes JSON."""
    p = argparse.ArgumentParser(prog="python -m bench.distributed", description=__doc__.splitlines()[0])
    p.add_argument("--tables", type=int, default=8)
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=2048)
    p.add_argument("--max-len", type=int, default=20)
    p.add_argument("--alpha", type=float, default=1.05)
    p.add_argument("--pool", type=int, default=16)
    p.add_argument("--frac", type=float, default=0.10, help="cache fraction (cache10)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--configs", default="single,row,table")
    p.add_argument("--net-gbps", type=float, default=100.0, help="NIC speed for the node model")
    p.add_argument("--latency-us", type=float, default=20.0, help="per-peer latency for the model")
    p.add_argument("--fast-compute-ms", type=float, default=10.0,
                   help="a GPU-class step time per rank, to show when the all-to-all dominates")
    p.add_argument("--quick", action="store_true", help="8 x 100k rows, batch 512, 6 steps")
    p.add_argument("--criteo", action="store_true",
                   help="26 tables (the Criteo feature count) x --rows, dim 16")
    p.add_argument("--auc", type=int, default=0, metavar="STEPS",
                   help="also train the demo's data STEPS steps on 2 ranks with float32 and float16 "
                        "comms and compare the held-out AUCs")
    p.add_argument("--workdir", default=None)
    p.add_argument("--out", default=str(OUT_DIR))
    a = p.parse_args(argv)
    if a.quick:
        a.rows, a.batch, a.pool, a.warmup, a.steps = 100_000, 512, 8, 3, 6
    if a.criteo:
        a.tables, a.dim = 26, 16
    work = Path(a.workdir or tempfile.mkdtemp(prefix="bench-dist-"))
    base = dict(tables=a.tables, rows=a.rows, dim=a.dim, batch=a.batch, max_len=a.max_len,
                alpha=a.alpha, pool=a.pool, frac=a.frac, warmup=a.warmup, steps=a.steps,
                work=str(work))
    sweep = [1 << 12, 1 << 16, 1 << 20, 1 << 23]
    records, runs, per_rank = [], {}, []
    for mode in a.configs.split(","):
        world = 1 if mode == "single" else 2
        cfg = dict(base, mode=mode, sweep=sweep if mode == "row" else None,
                   model_ids=mode == "row")
        print(f"{mode}: {world} rank(s) ...", file=sys.stderr, flush=True)
        res = run_local(world, _rank, cfg, timeout_s=3600)
        runs[mode] = res
        wall = max(r["wall_s"] for r in res.values())
        rec = {"config": mode, "ranks": world, "samples_per_s": a.batch * a.steps / wall,
               "step_ms": 1e3 * wall / a.steps}
        if world > 1:
            floors = [r["min_bytes_per_step"] for r in res.values()]
            rec.update(
                bytes_per_rank_step=float(np.mean([r["bytes_per_step"] for r in res.values()])),
                ids_bytes_per_rank_step=float(np.mean([r["ids_bytes_per_step"] for r in res.values()])),
                min_bytes_per_rank_step=float(np.mean(floors)) if None not in floors else None,
                collective_ms=1e3 * float(np.mean([r["collective_s"] for r in res.values()])) / a.steps,
                plan=res[0]["plan"])
            if rec["min_bytes_per_rank_step"]:
                rec["volume_vs_min"] = rec["bytes_per_rank_step"] / rec["min_bytes_per_rank_step"]
            rec["compute_ms"] = rec["step_ms"] - rec["collective_ms"]
            for r, v in sorted(res.items()):
                per_rank.append({"config": mode, "rank": r, "modeled_ms": 1e3 * v["modeled_s"][r][0],
                                 "units": v["modeled_s"][r][1], "model_bytes": v["modeled_s"][r][2],
                                 "measured_ms": 1e3 * v["wall_s"] / a.steps,
                                 "collective_ms": 1e3 * v["collective_s"] / a.steps,
                                 "bytes_per_step": v["bytes_per_step"]})
        records.append(rec)
    single = next((r for r in records if r["config"] == "single"), None)
    for r in records:
        r["vs_single"] = r["samples_per_s"] / single["samples_per_s"] if single else float("nan")
    print(table(records, [("config", "config", "s"), ("ranks", "ranks", "d"),
                          ("samples_per_s", "samples/s", ",.0f"), ("vs_single", "vs 1 rank", ".2f"),
                          ("step_ms", "step ms", ".1f"), ("collective_ms", "collective ms", ".1f"),
                          ("compute_ms", "other ms", ".1f"),
                          ("bytes_per_rank_step", "bytes/rank/step", ",.0f"),
                          ("ids_bytes_per_rank_step", "of which ids", ",.0f"),
                          ("volume_vs_min", "vs min", ".2f")]))
    print("(2 ranks on this shared 2-core machine cannot show a speedup over one process: the ranks "
          "share the cores; the table shows the overhead of sharding.)")
    if per_rank:
        _calibrate(per_rank, records, runs, a)
        print("\nthe planner's model vs measured, per rank (lookups measured from this rank's "
              "batches; `modeled`: CostModel defaults; `calibrated`: lookup_rate from the one-process "
              "run, bandwidth and latency from the all-to-all sweep, 4 collectives a step):")
        print(table(per_rank, [("config", "config", "s"), ("rank", "rank", "d"),
                               ("modeled_ms", "modeled ms", ".2f"),
                               ("calibrated_ms", "calibrated ms", ".1f"),
                               ("measured_ms", "measured ms", ".1f"),
                               ("collective_ms", "collective ms", ".1f"),
                               ("bytes_per_step", "bytes sent/step", ",.0f")]))
        for r in records:
            if r.get("plan") and len(set(r["plan"].values())) > 1 or r["config"].startswith("auto"):
                print(f"{r['config']} plan: {r['plan']}")
    meta = {"args": vars(a), "per_rank": per_rank}
    if a.auc:
        meta["auc"] = _auc_compare(a.auc, work)
    if "row" in runs:
        r0 = runs["row"][0]
        sw = r0["sweep"]
        x = np.array([s["bytes_per_peer"] for s in sw], dtype=np.float64)
        y = np.array([s["seconds"] for s in sw])
        # latency: the smallest message; bandwidth: the slope from it to the largest (a least
        # squares line goes negative at the origin on a noisy, shared machine)
        icpt = float(y[0])
        bw = (x[-1] - x[0]) / (y[-1] - y[0]) if y[-1] > y[0] else float("inf")
        print(f"\nall-to-all on this machine (2 gloo ranks, loopback): latency {icpt * 1e6:.0f} us, "
              f"{bw / 1e9:.2f} GB/s per peer")
        rrow = next(r for r in records if r["config"] == "row")
        predicted = 4 * icpt + rrow["bytes_per_rank_step"] / bw
        print(f"model check at 2 ranks: predicted collectives {predicted * 1e3:.1f} ms/step, "
              f"measured {rrow['collective_ms']:.1f} ms/step (measured includes waiting for the "
              "slower rank)")
        compute_s = rrow["compute_ms"] / 1e3
        model = scaling_model((icpt, bw), r0["model_ids"], r0["model_lengths"], a.tables, a.dim,
                              compute_s, [2, 8, 16, 32, 64, 128], a.net_gbps * 1e9 / 8,
                              a.latency_us * 1e-6, a.fast_compute_ms / 1e3)
        print(f"\nrow-wise weak scaling model ({a.batch // 2} samples per rank, {a.net_gbps:g} Gb/s "
              f"NIC, {a.latency_us:g} us per peer, compute per rank as measured):")
        print(table(model, [("nodes", "nodes", "d"), ("bytes_per_rank_step", "bytes/rank/step", ",.0f"),
                            ("comm_s", "comm s", ".4f"), ("compute_s", "compute s", ".4f"),
                            ("comm_share", "comm share", ".2f"),
                            ("gloo_here_s", "comm s (gloo here)", ".3f"),
                            ("fast_share", f"share @ {a.fast_compute_ms:g} ms compute", ".2f")]))
        meta.update(sweep=sw, alltoall_latency_s=icpt, alltoall_bytes_per_s=bw,
                    model_check={"predicted_s": predicted, "measured_s": rrow["collective_ms"] / 1e3},
                    model=model)
    if a.workdir is None:
        shutil.rmtree(work, ignore_errors=True)
    path = save("distributed", records, meta, a.out)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
