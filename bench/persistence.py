"""`python -m bench.persistence`: checkpoint pause and copy rate, restore, export/import, codecs.

Builds a store of `--rows` rows (written straight to LMDB in large batches), dirties a cache's
worth of rows by training, then times: the checkpoint pause (dirty rows to the log, merges
held), the background work (the log merged up to the pause, the snapshot copied) while training
continues, restore, export and import. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import zstandard

import tierstore as ts
from tierstore import persistence
from tierstore.export import encode_shard, export_store, import_store

MIB = 2**20


def _rows(rng: np.random.Generator, n: int, dim: int, row_dim: int) -> np.ndarray:
    """Stored rows that look trained: uniform init plus small steps, row-wise Adagrad state,
    then the row's other columns (its last-update stamp) zero: `row_dim` words a row."""
    w = rng.uniform(-0.05, 0.05, (n, dim)).astype(np.float32)
    w += (rng.standard_normal((n, dim)) * 1e-3).astype(np.float32)
    acc = (rng.gamma(2.0, 1e-3, (n, 1))).astype(np.float32)
    return np.concatenate([w, acc, np.zeros((n, row_dim - dim - 1), np.float32)], 1)


def build(path: Path, rows: int, dim: int, caps: tuple[int, int], seed: int = 0) -> ts.TierStore:
    """A store holding `rows` written rows of one table (ids spread over 10**11)."""
    spec = ts.TableSpec("t", 10**11, dim, optimizer=ts.RowWiseAdagrad(0.05))
    store = ts.TierStore(path, spec, device_capacity=caps[0], host_capacity=caps[1], seed=seed,
                         device="cpu")
    rng = np.random.default_rng(seed)
    chunk = 1 << 18
    for lo in range(0, rows, chunk):
        ids = np.arange(lo, min(rows, lo + chunk), dtype=np.int64) * 9973
        store.backend.put({"t": (ids, _rows(rng, len(ids), dim, spec.row_dim))})
    store.backend.sync()
    return store


def train(store: ts.TierStore, steps: int, rows: int, batch: int, start: int = 0) -> float:
    """Run `steps` apply() calls on random written rows; returns seconds per step."""
    dim = store.tables["t"].spec.dim
    t0 = time.perf_counter()
    for s in range(start, start + steps):
        g = torch.Generator().manual_seed(s)
        ids = torch.randint(0, rows, (batch,), generator=g) * 9973
        store.apply("t", ids, torch.randn(batch, dim, generator=g) * 1e-3)
    return (time.perf_counter() - t0) / max(steps, 1)


def codecs(sample: np.ndarray) -> list[dict]:
    """zstd ratio and speed on a block of rows: float32 with/without byte shuffle, and bf16."""
    out = []
    ids = np.arange(len(sample), dtype=np.int64) * 9973
    for shuffle in (False, True):
        raw = encode_shard(ids, sample, shuffle)
        for level in (1, 3, 9):
            c = zstandard.ZstdCompressor(level=level)
            t0 = time.perf_counter()
            blob = c.compress(raw)
            t1 = time.perf_counter()
            zstandard.ZstdDecompressor().decompress(blob)
            t2 = time.perf_counter()
            out.append({"payload": "float32", "shuffle": shuffle, "level": level,
                        "ratio": len(raw) / len(blob), "compress_MBps": len(raw) / (t1 - t0) / 1e6,
                        "decompress_MBps": len(raw) / (t2 - t1) / 1e6})
    bf = torch.from_numpy(sample).to(torch.bfloat16).view(torch.int16).numpy()
    for shuffle in (False, True):
        b = bf.view(np.uint8).reshape(-1, 2).T if shuffle else bf.view(np.uint8)
        raw = np.ascontiguousarray(b).tobytes()
        blob = zstandard.ZstdCompressor(level=1).compress(raw)
        out.append({"payload": "bfloat16 (reference)", "shuffle": shuffle, "level": 1,
                    "ratio": len(raw) / len(blob), "compress_MBps": None,
                    "decompress_MBps": None})
    return out


def main(argv: list[str] | None = None) -> int:
    """Run the persistence benchmark."""
    ap = argparse.ArgumentParser(prog="python -m bench.persistence", description=__doc__)
    ap.add_argument("--rows", type=int, default=10_000_000)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--device-capacity", type=int, default=65_536)
    ap.add_argument("--host-capacity", type=int, default=262_144)
    ap.add_argument("--batch", type=int, default=16_384)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--workdir", default=None, help="scratch directory (default: a temp dir)")
    ap.add_argument("--out", default="bench/out/persistence.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="tierstore-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    res: dict = {"rows": args.rows, "dim": args.dim, "optimizer": "RowWiseAdagrad",
                 "payload_floats": args.dim + 1, "threads": args.threads,
                 "caps": [args.device_capacity, args.host_capacity]}
    try:
        t0 = time.perf_counter()
        store = build(work / "store", args.rows, args.dim,
                      (args.device_capacity, args.host_capacity))
        res["build_s"] = time.perf_counter() - t0
        res["store_bytes"] = store.backend.disk_bytes()
        res["step_s_idle"] = train(store, 20, args.rows, args.batch)  # fills the caches
        dirty = int(store.device_tier.dirty.sum()) + int(store.host_tier.dirty.sum())
        res["dirty_rows"] = dirty

        # checkpoint: pause (dirty rows to the log), then merge + snapshot + copy while training goes on
        pending = persistence.start_checkpoint(store, work / "ckpt", step=20)
        res["pause_s"] = pending.pause_s
        steps, t1 = 0, time.perf_counter()
        while not pending.done():
            train(store, 1, args.rows, args.batch, start=100 + steps)
            steps += 1
        manifest = pending.wait()
        res["steps_during_copy"] = steps
        res["step_s_during_copy"] = (time.perf_counter() - t1) / max(steps, 1)
        res["copy_s"] = manifest["copy_s"]
        res["ckpt_bytes"] = manifest["files"]["data.mdb"]["bytes"]
        res["copy_MBps"] = res["ckpt_bytes"] / manifest["copy_s"] / 1e6
        t1 = time.perf_counter()
        store.checkpoint(work / "ckpt2")  # blocking, for comparison (fewer dirty rows now)
        res["blocking_checkpoint_s"] = time.perf_counter() - t1
        train(store, 1, args.rows, args.batch, start=10_000)  # one step's worth of dirty rows
        res["dirty_rows_1step"] = (int(store.device_tier.dirty.sum())
                                   + int(store.host_tier.dirty.sum()))
        pending = persistence.start_checkpoint(store, work / "ckpt3")
        res["pause_1step_s"] = pending.pause_s
        pending.wait()
        shutil.rmtree(work / "ckpt3")
        store.close()

        t1 = time.perf_counter()
        back = ts.TierStore.restore(work / "ckpt", work / "restored", device_capacity=1024,
                                    host_capacity=1024, device="cpu")
        res["restore_s"] = time.perf_counter() - t1
        res["restore_MBps"] = res["ckpt_bytes"] / res["restore_s"] / 1e6
        back.close()
        shutil.rmtree(work / "restored")
        shutil.rmtree(work / "ckpt2")

        t1 = time.perf_counter()
        m = export_store(work / "ckpt", work / "export")
        res["export_s"] = time.perf_counter() - t1
        res["export_raw_bytes"], res["export_bytes"] = m["raw_bytes"], m["bytes"]
        res["export_ratio"] = m["raw_bytes"] / m["bytes"]
        res["export_MBps"] = m["raw_bytes"] / res["export_s"] / 1e6
        res["export_shards"] = sum(len(t["shards"]) for t in m["tables"])
        t1 = time.perf_counter()
        import_store(work / "export", work / "imported")
        res["import_s"] = time.perf_counter() - t1
        res["import_MBps"] = m["raw_bytes"] / res["import_s"] / 1e6

        sample = _rows(np.random.default_rng(1), 1 << 17, args.dim, args.dim + 1)  # payloads
        res["codecs"] = codecs(sample)
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=2)
    print(report(res))
    return 0


def report(r: dict) -> str:
    """A markdown table of the results."""
    lines = [
        f"store: {r['rows']:,} rows, dim {r['dim']} + {r['payload_floats'] - r['dim']} optimizer "
        f"float(s) ({r['optimizer']}), {r['store_bytes'] / MIB:.0f} MiB on disk; caches "
        f"{r['caps'][0]:,} + {r['caps'][1]:,} rows; torch threads {r['threads']}",
        "",
        "| what | figure |", "| --- | --- |",
        f"| checkpoint pause ({r['dirty_rows']:,} dirty rows to the log, merges held) | "
        f"{r['pause_s'] * 1e3:.0f} ms |",
        f"| checkpoint pause after one more step ({r['dirty_rows_1step']:,} dirty rows) | "
        f"{r['pause_1step_s'] * 1e3:.0f} ms |",
        f"| log merge + snapshot copy + fsync + sha256 ({r['ckpt_bytes'] / MIB:.0f} MiB) | "
        f"{r['copy_s']:.1f} s = {r['copy_MBps']:.0f} MB/s |",
        f"| training steps run during the copy | {r['steps_during_copy']} "
        f"({r['step_s_during_copy'] * 1e3:.0f} ms/step vs {r['step_s_idle'] * 1e3:.0f} idle) |",
        f"| blocking checkpoint right after | {r['blocking_checkpoint_s']:.1f} s |",
        f"| restore (verified copy) | {r['restore_s']:.1f} s = {r['restore_MBps']:.0f} MB/s |",
        f"| export (zstd 1, byte shuffle, {r['export_shards']} shards) | {r['export_s']:.1f} s = "
        f"{r['export_MBps']:.0f} MB/s raw, ratio {r['export_ratio']:.2f}x |",
        f"| import | {r['import_s']:.1f} s = {r['import_MBps']:.0f} MB/s raw |",
        "", "| payload | shuffle | zstd level | ratio | compress MB/s | decompress MB/s |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for c in r["codecs"]:
        cm = "-" if c["compress_MBps"] is None else f"{c['compress_MBps']:.0f}"
        dm = "-" if c["decompress_MBps"] is None else f"{c['decompress_MBps']:.0f}"
        lines.append(f"| {c['payload']} | {c['shuffle']} | {c['level']} | {c['ratio']:.3f} | "
                     f"{cm} | {dm} |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
