"""Shared helpers for the benchmarks: block timing, thread settings, JSON + PNG output, tables."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from pathlib import Path

import torch

OUT_DIR = Path(__file__).resolve().parent / "out"


def median_rate(fn: Callable[[], object], items: int, *, blocks: int, reps: int,
                before: Callable[[], object] | None = None) -> dict:
    """Time `blocks` blocks of `reps` calls; items/s of each block and their median."""
    rates = []
    for _ in range(blocks):
        if before is not None:
            before()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        dt = time.perf_counter() - t0
        rates.append(items * reps / dt)
    return {"rate": statistics.median(rates), "rates": rates, "blocks": blocks, "reps": reps}


def thread_settings(spec: str) -> list[int]:
    """Parse `--threads` such as `1,default` into torch thread counts."""
    default = torch.get_num_threads()
    out = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        n = default if part == "default" else int(part)
        if n not in out:
            out.append(n)
    return out


@contextmanager
def num_threads(n: int):
    """Run a block with `torch.set_num_threads(n)`, restoring the previous setting."""
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def machine() -> dict:
    """A short description of the machine the figures come from."""
    return {"python": platform.python_version(), "torch": torch.__version__,
            "cpus": os.cpu_count(), "default_threads": torch.get_num_threads(),
            "cuda": torch.cuda.is_available(), "when": time.strftime("%Y-%m-%d %H:%M:%S")}


def io_bytes(field: str) -> int:
    """This process's `read_bytes` or `write_bytes` from /proc/self/io (bytes it made the kernel
    read from, or send to, storage); 0 where the file is missing."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def save(name: str, records: list[dict], meta: dict, out_dir: Path | str | None = None) -> Path:
    """Write records and run metadata to `<out_dir>/<name>.json`; returns the path."""
    out = Path(out_dir) if out_dir is not None else OUT_DIR
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps({"meta": {**machine(), **meta}, "records": records}, indent=1))
    return path


def table(records: Iterable[dict], cols: list[tuple[str, str, str]]) -> str:
    """Format records as a fixed-width text table; cols are (key, header, format)."""
    rows = [[h for _, h, _ in cols]]
    for r in records:
        rows.append([("" if r.get(k) is None else format(r[k], f)) for k, _, f in cols])
    widths = [max(len(row[i]) for row in rows) for i in range(len(cols))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def bar_plot(path: Path, labels: list[str], groups: dict[str, list[float]], ylabel: str,
             title: str, target: float | None = None) -> None:
    """A grouped bar chart (one group per label, one bar per series) saved as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(labels) + 2), 4.5))
    n = max(1, len(groups))
    width = 0.8 / n
    for i, (series, vals) in enumerate(groups.items()):
        xs = [j + (i - (n - 1) / 2) * width for j in range(len(labels))]
        ax.bar(xs, vals, width, label=series)
    if target is not None:
        ax.axhline(target, color="black", ls="--", lw=1, label=f"target {target:g}")
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
