"""What a run measures besides its loss: held-out AUC, resident memory and bytes on disk."""

from __future__ import annotations

import resource
from pathlib import Path

import psutil
import torch


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


def dir_bytes(path: Path) -> int:
    """Total size of the files under a directory (0 when it does not exist)."""
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
