"""LMDB tier read/write-back throughput, write-transaction layouts A/B in one run: `python -m bench.lmdb_io`.

The workload is what a store with 1%-row caches sends to LMDB: per step and table, a `get` of a
batch of sorted unique ids (half stored, half never written) and a `put` of as many evicted dirty
rows (half rewrites of stored rows, half new rows), all ids random over 10^11. Each layout runs
on its own store grown the same way; blocks of steps alternate between layouts so machine noise
hits both alike: each run is its own process (so its mapped file pages are its own), layouts
alternate over `--rounds`. Reports rows/s per layout (median), the ratio to the first, the
file size after growing and the peak of mapped file pages while timing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from tierstore.backends import lmdb_backend
from tierstore.backends.lmdb_backend import LmdbBackend, _file_resident

OUT = Path("bench/out")
WIDTH = 17  # dim 16 + row-wise Adagrad
LAYOUTS = {
    # the library before this change: one pwrite-committed transaction per put, mapping never trimmed
    "one_txn": dict(txn_rows=1 << 62, map_resident=None, writemap=False),
    # key-range transactions of TXN_ROWS rows committed with pwrite, untrimmed
    "key_range_pwrite": dict(txn_rows=lmdb_backend.TXN_ROWS, map_resident=None, writemap=False),
    # the library's default: key-range, pwrite commits, mapping trimmed past MAP_RESIDENT
    "default": dict(txn_rows=lmdb_backend.TXN_ROWS, map_resident=256 << 20, writemap=False),
    # the library with TIERSTORE_MAP_RESIDENT=none: key-range, writable map, never trimmed
    "untrimmed": dict(txn_rows=lmdb_backend.TXN_ROWS, map_resident=None, writemap=True),
    # for completeness: a writable map that is trimmed (every write after a trim faults)
    "writemap_trimmed": dict(txn_rows=lmdb_backend.TXN_ROWS, map_resident=256 << 20, writemap=True),
}


class Run:
    """One layout: its store, its id stream and its timings."""

    def __init__(self, name: str, path: Path, args: argparse.Namespace) -> None:
        self.name, self.cfg = name, LAYOUTS[name]
        old = lmdb_backend.WRITEMAP, lmdb_backend.MAP_RESIDENT
        lmdb_backend.WRITEMAP, lmdb_backend.MAP_RESIDENT = self.cfg["writemap"], self.cfg["map_resident"]
        try:
            self.backend = LmdbBackend(path)
        finally:
            lmdb_backend.WRITEMAP, lmdb_backend.MAP_RESIDENT = old
        self.backend.compact_on_close = None
        self.args = args
        self.rng = np.random.default_rng(args.seed)
        self.stored = [np.empty(0, np.int64) for _ in range(args.tables)]
        self.get_s = self.put_s = 0.0
        self.rows = 0
        self.peak_file = 0

    def _with_layout(self, fn, *a):
        old = self.backend.txn_rows
        self.backend.txn_rows = self.cfg["txn_rows"]
        try:
            return fn(*a)
        finally:
            self.backend.txn_rows = old

    def grow(self, rows_per_table: int) -> None:
        """Fill each table with random rows in puts of `batch` rows (as evictions would)."""
        b = self.args.batch
        for t in range(self.args.tables):
            ids = self.rng.choice(10**11, rows_per_table, replace=False)
            for i in range(0, rows_per_table, b):
                part = ids[i:i + b]
                self._with_layout(self.backend.put, {f"t{t}": (part, self._payload(len(part)))})
            self.stored[t] = ids

    def _payload(self, n: int) -> np.ndarray:
        return self.rng.standard_normal((n, WIDTH), dtype=np.float32)

    def step(self) -> None:
        """One step over every table: get a batch, then write it back."""
        half = self.args.batch // 2
        puts = {}
        for t in range(self.args.tables):
            old = self.stored[t][self.rng.integers(0, len(self.stored[t]), half)]
            new = self.rng.integers(0, 10**11, half)
            ids = np.unique(np.concatenate([old, new]))
            t0 = time.perf_counter()
            data, _ = self.backend.get(f"t{t}", ids, WIDTH)
            self.get_s += time.perf_counter() - t0
            puts[f"t{t}"] = (ids, data + 1)
            self.rows += len(ids)
        t0 = time.perf_counter()
        self._with_layout(self.backend.put, puts)
        self.put_s += time.perf_counter() - t0
        self.peak_file = max(self.peak_file, _file_resident())


def run_layout(name: str, args: argparse.Namespace) -> dict:
    """Grow a store with one layout and time it (in this process, so its mapped pages are its own)."""
    work = Path(tempfile.mkdtemp(prefix="bench_lmdb_io_", dir=args.workdir))
    base0 = _file_resident()
    r = Run(name, work / name, args)
    try:
        t0 = time.perf_counter()
        r.grow(args.rows)
        grow_s = time.perf_counter() - t0
        grown = r.backend.disk_bytes()
        raw = args.tables * args.rows * WIDTH * 4
        r.peak_file = 0
        blocks = []
        for _ in range(args.blocks):
            rows0, s0 = r.rows, r.get_s + r.put_s
            for _ in range(args.steps):
                r.step()
            blocks.append((r.rows - rows0) / (r.get_s + r.put_s - s0))
        return {"layout": name, "rows_per_s": statistics.median(blocks), "blocks": blocks,
                "get_rows_per_s": r.rows / r.get_s, "put_rows_per_s": r.rows / r.put_s,
                "grow_rows_per_s": args.tables * args.rows / grow_s, "grown_file_over_raw": grown / raw,
                "file_bytes": r.backend.disk_bytes(), "peak_file_resident": r.peak_file,
                "base_file_resident": base0}
    finally:
        r.backend.close()
        shutil.rmtree(work, ignore_errors=True)


def interleaved(names: list[str], args: argparse.Namespace) -> int:
    """All layouts in this process: grow each, then alternate timed blocks between them."""
    work = Path(tempfile.mkdtemp(prefix="bench_lmdb_io_", dir=args.workdir))
    runs = [Run(n, work / n, args) for n in names]
    try:
        for r in runs:
            r.grow(args.rows)
        blocks: dict[str, list[float]] = {n: [] for n in names}
        for _ in range(args.blocks * args.rounds):
            for r in runs:
                rows0, s0 = r.rows, r.get_s + r.put_s
                for _ in range(args.steps):
                    r.step()
                blocks[r.name].append((r.rows - rows0) / (r.get_s + r.put_s - s0))
        base = statistics.median(blocks[names[0]])
        print(f"\n{'layout':>20} {'rows/s':>10} {'vs first':>8} {'get rows/s':>11} {'put rows/s':>11} "
              f"{'file/raw':>8}  (interleaved, one process)")
        results = []
        for r in runs:
            med = statistics.median(blocks[r.name])
            raw = args.tables * args.rows * WIDTH * 4
            res = {"layout": r.name, "rows_per_s": med, "vs_first": med / base,
                   "get_rows_per_s": r.rows / r.get_s, "put_rows_per_s": r.rows / r.put_s,
                   "file_over_initial_raw": r.backend.disk_bytes() / raw, "blocks": blocks[r.name]}
            results.append(res)
            print(f"{r.name:>20} {med:>10,.0f} {med / base:>8.2f} {res['get_rows_per_s']:>11,.0f} "
                  f"{res['put_rows_per_s']:>11,.0f} {res['file_over_initial_raw']:>8.2f}")
    finally:
        for r in runs:
            r.backend.close()
        shutil.rmtree(work, ignore_errors=True)
    OUT.mkdir(parents=True, exist_ok=True)
    record = {"bench": "lmdb_io", "mode": "interleaved", "args": vars(args), "results": results}
    (OUT / "lmdb_io_interleaved.json").write_text(json.dumps(record, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the A/B benchmark; prints a table and writes bench/out/lmdb_io.json."""
    ap = argparse.ArgumentParser(prog="python -m bench.lmdb_io", description=__doc__)
    ap.add_argument("--tables", type=int, default=8)
    ap.add_argument("--rows", type=int, default=300_000, help="rows per table before timing")
    ap.add_argument("--batch", type=int, default=8192, help="unique ids per table and step")
    ap.add_argument("--blocks", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4, help="steps per block")
    ap.add_argument("--rounds", type=int, default=3, help="alternating runs of every layout")
    ap.add_argument("--layouts", default="one_txn,default,untrimmed")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--interleaved", action="store_true",
                    help="all layouts in one process, blocks alternating (for untrimmed layouts only: "
                         "a trimmed layout would react to the others' mapped pages)")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # child: run one layout, print JSON
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(run_layout(args.one, args)))
        return 0
    names = args.layouts.split(",")
    if args.interleaved:
        return interleaved(names, args)
    rounds: dict[str, list[dict]] = {n: [] for n in names}
    passthrough = [a for a in (argv if argv is not None else sys.argv[1:])]
    for i in range(args.rounds):
        for n in names:
            out = subprocess.run([sys.executable, "-m", "bench.lmdb_io", *passthrough, "--one", n],
                                 check=True, capture_output=True, text=True).stdout
            rounds[n].append(json.loads(out.strip().splitlines()[-1]))
            print(f"round {i + 1} {n}: {rounds[n][-1]['rows_per_s']:,.0f} rows/s", file=sys.stderr)
    results = []
    base = statistics.median(r["rows_per_s"] for r in rounds[names[0]])
    print(f"\n{'layout':>10} {'rows/s':>10} {'vs first':>8} {'get rows/s':>11} {'put rows/s':>11} "
          f"{'grow rows/s':>11} {'grown file/raw':>14} {'peak mapped MiB':>15}")
    for n in names:
        rs = rounds[n]
        res = {k: statistics.median(r[k] for r in rs) for k in
               ("rows_per_s", "get_rows_per_s", "put_rows_per_s", "grow_rows_per_s",
                "grown_file_over_raw", "peak_file_resident", "base_file_resident")}
        res.update(layout=n, vs_first=res["rows_per_s"] / base, rounds=rs)
        results.append(res)
        mapped = (res["peak_file_resident"] - res["base_file_resident"]) / 2**20
        print(f"{n:>10} {res['rows_per_s']:>10,.0f} {res['vs_first']:>8.2f} {res['get_rows_per_s']:>11,.0f} "
              f"{res['put_rows_per_s']:>11,.0f} {res['grow_rows_per_s']:>11,.0f} "
              f"{res['grown_file_over_raw']:>14.2f} {mapped:>15.0f}")
    OUT.mkdir(parents=True, exist_ok=True)
    record = {"bench": "lmdb_io", "args": vars(args), "cpus": os.cpu_count(), "results": results}
    (OUT / "lmdb_io.json").write_text(json.dumps(record, indent=2))
    print(f"wrote {OUT / 'lmdb_io.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
