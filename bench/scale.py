"""The DLRM trainer at 10**6, 10**9 and 10**11 rows per table, same skew: `python -m bench.scale`."""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from .common import bar_plot

OUT = Path("bench/out")
GIB = 2**30


def run_one(rows: int, args: argparse.Namespace, admission: str = "none") -> dict:
    """Train once in a fresh process (so peak RSS is this run's) and return its summary."""
    tag = "" if admission == "none" else "_" + admission.replace(":", "_")
    run_dir = Path(args.work) / f"scale_{rows}{tag}"
    out = Path(args.out) / f"scale_{rows}{tag}.json"
    cmd = [sys.executable, "-m", "integration.train", "--tables", f"uniform:{rows}",
           "--steps", str(args.steps), "--batch", str(args.batch), "--hot", str(args.hot),
           "--alpha", str(args.alpha), "--device-capacity", args.device_capacity,
           "--host-capacity", args.host_capacity, "--policy", args.policy,
           "--prefetch", str(args.prefetch), "--threads", str(args.threads),
           "--table-format", args.table_format,
           "--checkpoint-interval", str(args.steps),
           "--eval-batches", str(args.eval_batches), "--run-dir", str(run_dir), "--json", str(out),
           "--no-progress"] + ([] if admission == "none" else ["--admission", admission])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(),
                                                                       os.environ.get("PYTHONPATH")]))}
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    s = json.loads(out.read_text())
    return {"rows_per_table": rows, "total_rows": s["total_rows"], "samples_per_s": s["samples_per_s"],
            "ids_per_s": s["ids_per_s"], "peak_rss_bytes": s["peak_rss_bytes"],
            "peak_anon_bytes": s["peak_anon_bytes"],
            "cache_bytes": s["cache_bytes"], "rows_stored": s["rows_stored"],
            "disk_bytes": s["disk_bytes"], "raw_bytes": s["raw_row_bytes"],
            "peak_disk_bytes": s["peak_disk_bytes"], "closed_disk_bytes": s["disk_bytes_closed"],
            "peak_data_bytes": s["peak_data_bytes"], "peak_log_bytes": s["peak_log_bytes"],
            "leaf_fill": s["leaf_fill"],
            "disk_per_row": s["disk_per_row"], "checkpoint_bytes": s["last_checkpoint_store_bytes"],
            "payload_bytes_per_row": s["payload_bytes_per_row"],
            "hit_rate_device": s["tiers"]["device"]["hit_rate"],
            "hit_rate_host": s["tiers"]["host"]["hit_rate"], "stall_s": s["stall_s"],
            "auc": s["final_auc"], "train_s": s["train_s"], "command": " ".join(cmd[1:]),
            "admission": admission}


def main(argv: list[str] | None = None) -> int:
    """Run the scale benchmark; prints a table and writes bench/out/scale.json."""
    ap = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__)
    ap.add_argument("--rows", default="1e6,1e9,1e11", help="rows per table, comma-separated")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--hot", type=int, default=1_000_000, help="distinct ids per feature (<= smallest table)")
    ap.add_argument("--alpha", type=float, default=1.1)
    ap.add_argument("--device-capacity", default="32MiB")
    ap.add_argument("--host-capacity", default="128MiB")
    ap.add_argument("--policy", default="lru")
    ap.add_argument("--prefetch", type=int, default=0)
    ap.add_argument("--table-format", choices=("chunks", "btree"), default="chunks",
                    help="the store's tables on disk (TierStore(table_format=...))")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--work", default="runs/bench_scale", help="where the run directories go")
    ap.add_argument("--admission", default="none",
                    help="comma-separated admission settings to run each size with, e.g. none,count:2")
    ap.add_argument("--eval-batches", type=int, default=2)
    ap.add_argument("--out", default=str(OUT), help="where the JSON and PNG files go")
    args = ap.parse_args(argv)
    out_dir = Path(args.out)
    rows = [int(float(x)) for x in args.rows.split(",")]
    out_dir.mkdir(parents=True, exist_ok=True)
    results = []
    for n in rows:
        for adm in args.admission.split(","):
            t0 = time.perf_counter()
            results.append(run_one(n, args, adm))
            print(f"  {n:.0e} rows/table ({adm}) done in {time.perf_counter() - t0:.0f} s",
                  file=sys.stderr)
    base = results[0]["samples_per_s"]
    print(f"\n{'rows/table':>10} {'total rows':>11} {'samples/s':>10} {'vs first':>8} {'dev hit':>8} "
          f"{'host hit':>8} {'peak RSS':>9} {'anon':>8} {'caches':>8} {'rows on disk':>13} "
          f"{'disk B/row':>10} "
          f"{'x raw':>6} {'peak x raw':>10} {'tables':>6} {'log':>5} {'leaf fill':>9} "
          f"{'closed x raw':>12} {'ckpt x raw':>10} {'AUC':>6}")
    for r in results:
        r["throughput_vs_first"] = r["samples_per_s"] / base if base else 0.0
        r["rss_over_caches_gib"] = (r["peak_rss_bytes"] - r["cache_bytes"]) / GIB
        r["anon_over_caches_gib"] = (r["peak_anon_bytes"] - r["cache_bytes"]) / GIB
        raw = r["raw_bytes"] or 1
        r["disk_over_raw"] = r["disk_bytes"] / raw  # end of training, before close
        r["peak_disk_over_raw"] = r["peak_disk_bytes"] / raw  # sampled every 10 steps
        r["peak_data_over_raw"] = r["peak_data_bytes"] / raw  # the tables' file at its peak
        r["peak_log_over_raw"] = r["peak_log_bytes"] / raw  # the log's file at its peak
        r["closed_disk_over_raw"] = r["closed_disk_bytes"] / raw  # after close (compacts)
        r["checkpoint_over_raw"] = r["checkpoint_bytes"] / r["raw_bytes"] if r["raw_bytes"] else 0.0
        print(f"{r['rows_per_table']:>10.0e} {r['total_rows']:>11.2e} {r['samples_per_s']:>10,.0f} "
              f"{r['throughput_vs_first']:>8.2f} {r['hit_rate_device']:>8.3f} {r['hit_rate_host']:>8.3f} "
              f"{r['peak_rss_bytes'] / 2**20:>7,.0f}Mi {r['peak_anon_bytes'] / 2**20:>6,.0f}Mi "
              f"{r['cache_bytes'] / 2**20:>6,.0f}Mi "
              f"{r['rows_stored']:>13,} {r['disk_per_row']:>10.1f} {r['disk_over_raw']:>6.2f} "
              f"{r['peak_disk_over_raw']:>10.2f} {r['peak_data_over_raw']:>6.2f} "
              f"{r['peak_log_over_raw']:>5.2f} {r['leaf_fill']:>9.2f} {r['closed_disk_over_raw']:>12.2f} "
              f"{r['checkpoint_over_raw']:>10.2f} {r['auc']:>6.3f}"
              + ("" if r["admission"] == "none" else f"  admission {r['admission']}"))
    last = results[-1]
    print(f"\ntargets: largest keeps {last['throughput_vs_first']:.2f}x of the first's throughput "
          f"(>= 0.5); peak RSS - caches = {max(r['rss_over_caches_gib'] for r in results):.2f} GiB "
          f"(anonymous only: {max(r['anon_over_caches_gib'] for r in results):.2f}; <= 1); "
          f"disk / raw = {max(r['disk_over_raw'] for r in results):.2f} live store at the end "
          f"(peak {max(r['peak_disk_over_raw'] for r in results):.2f}: tables "
          f"{max(r['peak_data_over_raw'] for r in results):.2f}, log "
          f"{max(r['peak_log_over_raw'] for r in results):.2f}; goal <= 2), "
          f"{max(r['closed_disk_over_raw'] for r in results):.2f} after close), "
          f"{max(r['checkpoint_over_raw'] for r in results):.2f} compacted checkpoint (< 1.5)")
    record = {"bench": "scale", "machine": platform.platform(), "cpus": os.cpu_count(),
              "args": vars(args), "results": results}
    (out_dir / "scale.json").write_text(json.dumps(record, indent=2))
    print(f"wrote {out_dir / 'scale.json'}")
    labels = [f"{r['rows_per_table']:.0e} rows/table" for r in results]
    bar_plot(out_dir / "scale.png", labels,
             {"throughput vs first": [r["throughput_vs_first"] for r in results],
              "anon GiB over caches": [r["anon_over_caches_gib"] for r in results],
              "disk / raw bytes": [r["disk_over_raw"] for r in results]},
             "ratio", "DLRM trainer at growing table sizes (same skew)")
    print(f"wrote {out_dir / 'scale.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
