"""The end-of-run summary: the figures a run reports (a dict, also written as JSON) and their table."""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING

from tierstore.stats import tier_table

from .data import SPARSE_NAMES
from .metrics import dir_bytes, peak_rss, rss_parts

if TYPE_CHECKING:
    from .trainer import Trainer


def build_summary(t: Trainer, train_s: float, start_step: int, final: dict) -> dict:
    """The summary of a finished run: throughput, time split, tiers, memory, disk and held-out metrics."""
    st = t.store.stats()
    steps = t.step - start_step
    rows_stored = st["ssd"]["rows_stored"]
    latest = t.latest() if t.checkpoints else None
    mem = rss_parts()
    payload_bytes = 4 * t.specs[0].payload_dim
    return {
        "config": asdict(t.cfg),
        "total_rows": int(sum(t.cards)),
        "steps": steps,
        "samples": steps * t.cfg.batch,
        "train_s": train_s,
        "samples_per_s": steps * t.cfg.batch / train_s if train_s else 0.0,
        "ids_per_s": steps * t.cfg.batch * len(SPARSE_NAMES) / train_s if train_s else 0.0,
        "times": dict(t.times),
        "stall_s": t.times["data"] + t.times["lookup"],
        "tiers": {k: getattr(t, "train_stats", st)[k] for k in ("device", "host", "ssd")},
        "prefetch": st.get("prefetch", {}),
        "admission": st.get("admission", {}),
        "expiry": st.get("expiry", {}),
        "rows_stored": rows_stored,
        "disk_bytes": st["ssd"]["disk_bytes"],
        "peak_disk_bytes": max(t.peak_disk, st["ssd"]["disk_bytes"]),
        "peak_data_bytes": max(t.peak_data, st["ssd"]["data_bytes"]),
        "peak_log_bytes": max(t.peak_log, st["ssd"]["log_bytes"]),
        # the tables' leaves: rows a leaf against a full leaf (B-tree splits leave ~2/3)
        "leaf_fill": st["ssd"]["dense_leaf_pages"] / max(st["ssd"]["leaf_pages"], 1),
        "raw_row_bytes": rows_stored * payload_bytes,
        "disk_per_row": st["ssd"]["disk_bytes"] / rows_stored if rows_stored else 0.0,
        "payload_bytes_per_row": payload_bytes,
        "checkpoint_bytes": dir_bytes(t.ckpt_dir),
        "last_checkpoint_store_bytes": dir_bytes(latest / "store") if latest else 0,
        "checkpoints": list(t.checkpoints),
        "rss_bytes": mem["rss"],
        "rss_anon_bytes": mem["anon"],
        "rss_file_bytes": mem["file"],
        "peak_rss_bytes": peak_rss(),
        "peak_anon_bytes": max(t.peak_anon, mem["anon"]),
        "cache_bytes": (st["device"]["capacity"] + st["host"]["capacity"]) * 4 * t.store.width,
        "evals": list(t.evals),
        "final_auc": final["auc"],
        "final_logloss": final["logloss"],
        "eval_ctr": final["ctr"],
    }


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
        f"{'kernel compilation':<22} {s['times'].get('compile', 0.0):.1f} s "
        + ("(first use: numba caches the kernels for later runs; not counted as stall)"
           if s["times"].get("compile", 0.0) > 0 else "(none: kernels came from numba's cache)"),
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
