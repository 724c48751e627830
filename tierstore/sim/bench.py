"""The policy benchmark: miss ratios of every policy on a trace, exact and tier mode, and sizing."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

from ..errors import ConfigError, TierstoreError
from ..policies import POLICIES, make_policy
from ..traces import TRACE_FORMATS, Trace, load_trace
from .admission import admit_trace
from .exact import EXACT, simulate
from .tier import simulate_tier

DEFAULT_TRACE = "zipf:alpha=1.0,keys=1000000,requests=2000000,seed=1"
DEFAULT_POLICIES = "lru,lfu,fifo,clock,sieve,s3fifo,lookahead,belady"
TIER_RATE = 4_000  # tier-mode batches per second on 2 cores (measured 2-8k: one SlabTier round each)
SLOW_SECONDS = 60  # warn before a tier-mode replay expected to take longer than this
MARKERS = "osD^vP*Xph<>"


def row_bytes(args: argparse.Namespace) -> int | None:
    """Bytes one cached row takes: `--row-bytes`, or the payload of `--dim/--dtype/--optimizer`."""
    if args.row_bytes is not None:
        if args.row_bytes < 1:
            raise ConfigError("--row-bytes must be >= 1")
        return args.row_bytes
    if args.dim is None:
        return None
    from ..config import TableSpec
    from ..optimizers import OPTIMIZERS

    if args.optimizer not in OPTIMIZERS:
        raise ConfigError(f"unknown --optimizer {args.optimizer!r}; known: {sorted(OPTIMIZERS)}")
    spec = TableSpec("sizing", 1, args.dim, optimizer=OPTIMIZERS[args.optimizer](), dtype=args.dtype)
    return spec.payload_dim * 4


def format_bytes(n: float) -> str:
    """A byte count with a binary unit, e.g. `1.5 GiB`."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def tier_warning(n_requests: int, batch_size: int, jobs: int) -> str | None:
    """An up-front warning when tier mode will replay too many batches to finish quickly."""
    batches = jobs * -(-n_requests // batch_size)
    secs = batches / TIER_RATE
    if secs <= SLOW_SECONDS:
        return None
    return (f"warning: tier mode replays {batches:,} batches through a real SlabTier at about "
            f"{TIER_RATE:,} batches/s: expect ~{secs / 60:.0f} min. For request-by-request miss "
            f"ratios use --mode exact (same counts for the exact policies, millions of requests/s), "
            f"or raise --batch-size (now {batch_size}).")


def object_keys(trace: Trace, ids: np.ndarray, n_keys: int) -> np.ndarray:
    """Per dense id, the key a cache simulator like libCacheSim sees as the object id.

    A one-table trace's keys are its row ids; with several tables, (table, row) pairs have no
    single integer id, so the dense id stands for the object.
    """
    out = np.arange(n_keys, dtype=np.int64)
    if len(trace.table_names) <= 1 or not trace.tables.any():
        out[ids] = trace.rows
    return out


def parse_capacities(text: str, n_keys: int) -> list[int]:
    """Capacities from `1000,1%,0.5%`: rows, or percentages of the distinct keys (at least 1)."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        try:
            val = float(part[:-1]) * n_keys / 100 if part.endswith("%") else float(part)
        except ValueError:
            raise ConfigError(f"bad capacity {part!r}; use rows or a percentage") from None
        if not math.isfinite(val) or val < 0:
            raise ConfigError(f"capacity must be >= 0, got {part!r}")
        out.append(max(1, round(val)))
    if not out:
        raise ConfigError("no capacity given")
    return sorted(set(out))


def size_for_hit_rate(policy: str, ids: np.ndarray, n_keys: int, target: float,
                      rel: float = 0.01, keys: np.ndarray | None = None) -> int | None:
    """Smallest capacity (within `rel`) whose exact hit rate reaches `target`; None if none does."""
    n = ids.size
    if n == 0 or 1 - n_keys / n < target:  # compulsory misses alone exceed the budget
        return None
    allowed = (1 - target) * n
    lo, hi = 0, n_keys
    while hi - lo > max(1, int(lo * rel)):
        mid = (lo + hi) // 2
        if simulate(policy, ids, n_keys, mid, keys) <= allowed:
            hi = mid
        else:
            lo = mid
    return hi


def _plot(records: list[dict], path: str, title: str, floor: float | None = None) -> None:
    import matplotlib.pyplot as plt

    fig = plot_figure(records, title, floor)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_figure(records: list[dict], title: str, floor: float | None = None):
    """The miss-ratio plot: a line per (policy, mode), a marker per policy, the compulsory floor."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    keys = sorted({(r["policy"], r["mode"]) for r in records})
    cmap = plt.get_cmap("tab10")
    pols = sorted({k[0] for k in keys})
    colors = {p: cmap(i % 10) for i, p in enumerate(pols)}
    markers = {p: MARKERS[i % len(MARKERS)] for i, p in enumerate(pols)}
    for pol, mode in keys:
        pts = sorted((r["capacity"], r["miss_ratio"]) for r in records
                     if r["policy"] == pol and r["mode"] == mode)
        style = "-" if mode == "exact" else "--"
        lw = 2.5 if pol == "belady" else 1.5
        # distinct markers (open, so equal curves stay visible on top of each other)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker=markers[pol], ms=6,
                mfc="none", lw=lw, color="black" if pol == "belady" else colors[pol],
                label=f"{pol} ({mode})")
    if floor is not None:
        ax.axhline(floor, color="gray", ls=":", lw=1.2,
                   label=f"compulsory misses ({floor:.3f})")
    ax.set_xscale("log")
    ax.set_xlabel("cache capacity (rows)")
    ax.set_ylabel("miss ratio")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    return fig


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Show defaults and keep the epilog's layout."""


def build_parser(prog: str = "tierstore bench-policies") -> argparse.ArgumentParser:
    """The benchmark's command-line flags."""
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, epilog=TRACE_FORMATS,
                                 formatter_class=_HelpFormatter)
    ap.add_argument("--trace", default=DEFAULT_TRACE,
                    help="synthetic spec (zipf:..., shift:...) or a trace file; formats below")
    ap.add_argument("--trace-dtype", default=None, help="raw key dtype, e.g. '>i4' or '>i8'")
    ap.add_argument("--limit", type=int, default=None, help="use only the first N requests")
    ap.add_argument("--capacity", default="0.1%,1%,10%",
                    help="comma-separated rows or %% of distinct keys")
    ap.add_argument("--policy", default=DEFAULT_POLICIES,
                    help=f"comma-separated policy names (known: {', '.join(sorted(POLICIES))}; "
                         "lookahead:NAME picks the fallback)")
    ap.add_argument("--mode", default="exact,tier",
                    help="exact (request by request, numba), tier (a real SlabTier, in batches) "
                         "or both, comma-separated")
    ap.add_argument("--batch-size", type=int, default=4096,
                    help="tier mode batch size (1 = request by request: slow, see --mode exact)")
    ap.add_argument("--window", type=int, default=4, help="look-ahead window in batches")
    ap.add_argument("--target-hit-rate", type=float, default=0.9,
                    help="hit rate the sizing answer aims at")
    ap.add_argument("--no-sizing", action="store_true", help="skip the capacity search")
    ap.add_argument("--row-bytes", type=int, default=None,
                    help="bytes per cached row, to give sizing answers in bytes too")
    ap.add_argument("--dim", type=int, default=None,
                    help="embedding dim: row bytes from --dim/--dtype/--optimizer (if no --row-bytes)")
    ap.add_argument("--dtype", default="float32", help="stored embedding dtype (with --dim)")
    ap.add_argument("--optimizer", default="sgd", help="optimizer kind, for its state (with --dim)")
    ap.add_argument("--device", default="cpu", help="tier mode device (cpu or cuda)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads")
    ap.add_argument("--json", default=None, help="write the records as a JSON list here")
    ap.add_argument("--plot", default=None, help="write a miss-ratio plot (PNG) here")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    ap.add_argument("--admission", default=None,
                    help="feature admission before the caches, e.g. 'count:2' (docs/admission.md)")
    return ap


def main(argv: list[str] | None = None, prog: str = "tierstore bench-policies") -> int:
    """Run the benchmark; returns a process exit code."""
    args = build_parser(prog).parse_args(argv)
    try:
        return _run(args)
    except TierstoreError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    if args.threads:
        torch.set_num_threads(args.threads)
    modes = [m.strip() for m in args.mode.split(",") if m.strip()]
    for m in modes:
        if m not in ("exact", "tier"):
            raise ConfigError(f"unknown mode {m!r}; use exact and/or tier")
    policies = [p.strip().lower() for p in args.policy.split(",") if p.strip()]
    for p in policies:
        make_policy(p, 1)  # raises ConfigError for unknown names
    if args.batch_size < 1:
        raise ConfigError("--batch-size must be >= 1")
    if not 0 < args.target_hit_rate < 1:
        raise ConfigError("--target-hit-rate must be in (0, 1)")
    rbytes = row_bytes(args)
    t0 = time.perf_counter()
    trace = load_trace(args.trace, args.trace_dtype, args.limit)
    ids, n_keys = trace.dense()
    obj = object_keys(trace, ids, n_keys)
    adm = admit_trace(args.admission, ids, args.batch_size)
    if adm is not None:  # the caches see only admitted requests; the rest need no row
        ids = adm.ids
        print(f"admission {adm.spec}: {ids.size} of {adm.requests} requests admitted, rows "
              f"stored {adm.rows_stored} instead of {adm.distinct}")
    keys = obj[ids]  # each request's object id, for the simulators that hash it
    n = ids.size
    print(f"trace {trace.name}: {n} requests, {n_keys} distinct keys, "
          f"{len(trace.table_names)} table(s); loaded in {time.perf_counter() - t0:.1f}s")
    caps = parse_capacities(args.capacity, n_keys)
    records: list[dict] = []
    jobs = [(m, p, c) for m in modes for p in policies for c in caps
            if not (m == "exact" and p not in EXACT)]
    skipped = sorted({p for p in policies if p not in EXACT}) if "exact" in modes else []
    small = sorted({c for m, _, c in jobs if m == "tier" and c < args.batch_size})
    if small:  # a tier that cannot hold one batch: every policy keeps the same (last) rows
        print(f"warning: tier mode with capacities {small} below the batch size "
              f"{args.batch_size}: a tier cannot hold one batch's distinct keys, so the policies "
              f"barely differ there (repeats inside a batch are free); use a --batch-size below "
              f"the capacity, or --mode exact", file=sys.stderr, flush=True)
    warn = tier_warning(n, args.batch_size, sum(1 for j in jobs if j[0] == "tier"))
    if warn:
        print(warn, file=sys.stderr, flush=True)
    bar = tqdm(total=len(jobs) * n, unit="req", unit_scale=True, disable=args.no_progress,
               file=sys.stderr)
    for mode, pol, cap in jobs:
        bar.set_description(f"{mode} {pol} {cap}")
        start = time.perf_counter()
        if mode == "exact":
            misses = simulate(pol, ids, n_keys, cap, keys)
            bar.update(n)
        else:
            misses = simulate_tier(ids, n_keys, pol, cap, args.batch_size, args.window,
                                   args.device, progress=bar)
        secs = time.perf_counter() - start
        rec = {"trace": trace.name, "policy": pol, "mode": mode, "capacity": cap,
               "capacity_bytes": cap * rbytes if rbytes else None,
               "requests": n, "distinct": n_keys, "misses": int(misses),
               "miss_ratio": misses / n if n else 0.0, "seconds": secs,
               "requests_per_s": n / secs if secs > 0 else float("inf")}
        if adm is not None:
            rec.update(adm.fields(int(misses)))
        if mode == "tier":
            rec["batch_size"] = args.batch_size
            rec["capacity_below_batch"] = cap < args.batch_size
            if POLICIES[pol.partition(":")[0]].name == "lookahead":
                rec["window"] = args.window
        records.append(rec)
    bar.close()
    if skipped:
        print(f"(no exact simulator for {', '.join(skipped)}: tier mode only)")
    print(f"\n{'policy':<18}{'mode':<7}{'capacity':>11}{'miss ratio':>12}{'seconds':>9}"
          f"{'Mreq/s':>8}")
    for r in records:
        print(f"{r['policy']:<18}{r['mode']:<7}{r['capacity']:>11}{r['miss_ratio']:>12.4f}"
              f"{r['seconds']:>9.2f}{r['requests_per_s'] / 1e6:>8.2f}")
    if not args.no_sizing:
        target = args.target_hit_rate
        print(f"\ncapacity needed for a {target:.0%} hit rate (exact mode, within 1%):")
        for pol in [p for p in policies if p in EXACT]:
            need = size_for_hit_rate(pol, ids, n_keys, target, keys=keys)
            if need is None:
                print(f"  {pol:<10} unreachable: compulsory misses alone are "
                      f"{n_keys / max(n, 1):.1%} of requests")
            else:
                size = f", {format_bytes(need * rbytes)} at {rbytes} B/row" if rbytes else ""
                print(f"  {pol:<10} {need} rows ({need / n_keys:.2%} of distinct keys{size})")
            records.append({"trace": trace.name, "policy": pol, "mode": "sizing",
                            "target_hit_rate": target, "capacity": need,
                            "capacity_bytes": need * rbytes if need is not None and rbytes else None,
                            "row_bytes": rbytes, "requests": n, "distinct": n_keys})
        if not rbytes:
            print("  (rows only: give --row-bytes, or --dim/--dtype/--optimizer, for bytes)")
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=1))
    if args.plot:
        _plot([r for r in records if r["mode"] != "sizing"], args.plot,
              f"{trace.name}: {n} requests, {n_keys} keys", floor=n_keys / n if n else None)
        print(f"plot written to {args.plot}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
