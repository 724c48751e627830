"""The cold regime's tools: drop a store's files from the page cache, and the disk's 4 KiB
random-read IOPS measured in the same run (fio-style, `os.preadv` from threads).

`bench.training --cold` drops `data.mdb` and the write-behind log's file before each timed block
(`posix_fadvise(DONTNEED)`, after `fdatasync` so dirty pages can go), and measures the disk's
IOPS at queue depth 1 and 32 on the store's own `data.mdb` before and after the blocks. Reads use
`O_DIRECT` where the file system allows it (no page cache at all); elsewhere the file is dropped
from the page cache first and reads are buffered (`direct` says which).
"""

from __future__ import annotations

import argparse
import mmap
import os
import threading
import time
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from .common import table

PAGE = 4096


def store_files(path: Path) -> list[Path]:
    """A store's LMDB files: the tables' `data.mdb` and the write-behind log's, where present."""
    return [p for p in (path / "data.mdb", path / "wlog" / "data.mdb") if p.exists()]


def drop_cache(paths: Iterable[Path]) -> int:
    """Write back and drop these files' pages from the page cache; returns the bytes advised."""
    total = 0
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            size = os.fstat(fd).st_size
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            total += size
        finally:
            os.close(fd)
    return total


def _open_direct(path: Path) -> tuple[int, bool]:
    flag = getattr(os, "O_DIRECT", 0)
    if flag:
        try:
            fd = os.open(path, os.O_RDONLY | flag)
            buf = mmap.mmap(-1, PAGE)  # page-aligned, as O_DIRECT needs
            try:
                os.preadv(fd, [buf], 0)
                return fd, True
            except OSError:
                os.close(fd)
            finally:
                buf.close()
        except OSError:
            pass
    drop_cache([path])
    return os.open(path, os.O_RDONLY), False


def random_read_iops(path: Path, depth: int, seconds: float = 2.0, seed: int = 0) -> dict:
    """4 KiB reads at random page offsets of `path` from `depth` threads (queue depth) for
    `seconds`: {"iops", "depth", "reads", "direct"}."""
    size = os.path.getsize(path) // PAGE
    fd, direct = _open_direct(path)
    counts = [0] * depth
    stop = time.perf_counter() + seconds

    def worker(i: int) -> None:
        buf = mmap.mmap(-1, PAGE)
        rng = np.random.default_rng(seed * 1000 + i)
        offsets = rng.integers(0, max(1, size), 1 << 16) * PAGE
        n = 0
        try:
            while time.perf_counter() < stop:
                os.preadv(fd, [buf], int(offsets[n & 0xFFFF]))
                n += 1
        finally:
            buf.close()
        counts[i] = n

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(depth)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    os.close(fd)
    reads = sum(counts)
    return {"iops": reads / elapsed if elapsed > 0 else float("nan"), "depth": depth,
            "reads": reads, "direct": direct, "file_bytes": size * PAGE}


def disk_iops(path: Path, seconds: float = 2.0) -> dict[str, dict]:
    """The disk's random-read IOPS at queue depth 1 and 32 on `path` (a store's data.mdb)."""
    return {f"qd{d}": random_read_iops(path, d, seconds) for d in (1, 32)}


def print_cold(records: list[dict], iops: dict[str, list[dict]]) -> None:
    """The cold regime: rows read below the caches per second against the disk's 4 KiB random
    read IOPS (queue depth 1 and 32, before and after the blocks), and the step's disk floor."""
    rows = []
    for r in records:
        if r["config"] not in iops or "per_step" not in r:
            continue
        qd1 = min(m["qd1"]["iops"] for m in iops[r["config"]])
        qd32 = min(m["qd32"]["iops"] for m in iops[r["config"]])
        read = r["per_step"]["rows_read"]
        floor_ms = 1000 * read / qd32  # one random page a row: the step's reads at QD32
        r["cold"] = {"rows_read_per_s": read / (r["ms_per_step"] / 1000), "iops_qd1": qd1,
                     "iops_qd32": qd32, "disk_floor_ms": floor_ms,
                     "direct": all(m["qd32"]["direct"] for m in iops[r["config"]])}
        r["cold"]["vs_qd32"] = r["cold"]["rows_read_per_s"] / qd32
        r["cold"]["vs_floor"] = r["ms_per_step"] / floor_ms if floor_ms else None
        r["cold"]["reads_ahead_peak"] = r.get("stats", {}).get("prefetch", {}).get("reads_ahead_peak")
        rows.append({"config": r["config"], "threads": r["threads"], "ms": r["ms_per_step"],
                     "train_ms": r["per_step"].get("cpu_training_ms", 0.0), **r["cold"]})
    print("cold regime: files dropped from the page cache before each block; rows read/s against "
          "the disk's 4 KiB random-read IOPS (same run; the lower of before/after)")
    print(table(rows, [("config", "config", "s"), ("threads", "thr", "d"), ("ms", "ms/step", ".1f"),
                       ("train_ms", "train cpu ms", ".1f"), ("rows_read_per_s", "rows read/s", ",.0f"),
                       ("iops_qd1", "IOPS qd1", ",.0f"), ("iops_qd32", "IOPS qd32", ",.0f"),
                       ("vs_qd32", "vs qd32", ".2f"), ("disk_floor_ms", "floor ms", ".1f"),
                       ("vs_floor", "step/floor", ".2f"), ("reads_ahead_peak", "ahead", ""),
                       ("direct", "O_DIRECT", "")]))


def add_cold_options(p: argparse.ArgumentParser) -> None:
    """bench.training's options of the cold regime and of the pipeline's reads."""
    p.add_argument("--cold", action="store_true",
                   help="the cold regime: drop the stores' files from the page cache before each "
                        "timed block, and measure the disk's 4 KiB random-read IOPS (QD1, QD32)")
    p.add_argument("--iops-seconds", type=float, default=2.0, help="--cold: seconds per IOPS case")
    p.add_argument("--reads-ahead", type=int, default=None,
                   help="Prefetcher(reads_ahead=...): batches read ahead at most while reads are "
                        "cold (default: the pipeline's)")
    p.add_argument("--ask-ahead", choices=("on", "off"), default="on",
                   help="Prefetcher(ask_ahead=...): cold reads ask the disk for all their pages first")
    p.add_argument("--readers", type=int, default=None,
                   help="Prefetcher(readers=...): reader threads (default: the pipeline's)")


def pipeline_options(args: argparse.Namespace) -> dict:
    """The Prefetcher keyword arguments the options above name."""
    out: dict = {"ask_ahead": args.ask_ahead == "on"}
    if args.reads_ahead is not None:
        out["reads_ahead"] = args.reads_ahead
    if args.readers is not None:
        out["readers"] = args.readers
    return out
