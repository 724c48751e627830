"""SSD-tier throughput of the write-behind path and of reads, with py-lmdb floors measured in the
same run: `python -m bench.writeback`.

One store of `--tables` x `--rows` populated rows (dim 64 + row-wise Adagrad: 66-word records,
272 bytes with the checksum). Measured, each as rows/s over `--rows-per-case` rows:

- `raw_append`: py-lmdb alone, `MDB_APPEND` of sequential keys into a fresh database (the floor
  of a sequential log);
- `raw_update`: py-lmdb alone, one key-sorted `putmulti` of random stored keys (the floor of the
  merge: a random B-tree update per row);
- `log_append`: the store's writer sink (`_write_rows`) while the write-behind log has room: the
  rate at which write-backs become durable-on-commit;
- `steady_uniform` / `steady_zipf`: the same sink for long enough that the log merges into the
  tables again and again (uniform keys: no row is rewritten while in the log; Zipf(1.05): hot
  rows are);
- `merge_<n>`: one merge of `n` distinct random rows appended to the log (the merger stopped):
  rows/s and CPU microseconds a row. The merge sorts all `n` by key, so a larger log puts more
  rows into each leaf page it rewrites (`n` rows into `--tables` x `--rows` stored rows);
- `get_pylmdb` / `get_pages`: sorted random reads of stored rows through py-lmdb's `txn.get`
  and through the compiled page reader (`backends/pages.py`), both verifying checksums;
- `get2_pylmdb` / `get2_pages`: the same reads split over two reader threads (what the prefetch
  pipeline does): py-lmdb's per-row Python work holds the GIL, the page reader's loop does not;
- `floor_<N>_into_<T>`: the page-write floor of a merge. py-lmdb alone (heap pages written with
  `pwrite` at commit, as the store's environment does), one key-sorted transaction of `N`
  distinct random rows into a table of `T` rows: the bytes its commit wrote (`wchar` of
  /proc/self/io) in 4 KiB pages, pages per row, rows/s, and the model `L (1 - exp(-N / L))` for a
  table of `L` leaves. `--floor-tables` sets the `T`s, `--merge-sizes` the `N`s; the steady cases
  print, beside their rate, the floor of the store's own merge (half its log into its tables);
- `lsm_*_k<k>` (issue 36's LSM of sorted-chunk runs, `tierstore/backends/runs.py`, which the
  store does not use yet), one LSM per `--lsm-k` value: a base of `--lsm-table` rows written as
  sorted chunks (`lsm_base_write`); `--lsm-cycles` times, `k` batches of `--lsm-run` random rows
  appended to a log as the writer's sink does (`lsm_append`: `pack_log` and `MDB_APPEND`,
  without the sink's in-memory index), each merged into a run (`lsm_runs`: the log's chunks
  read in place, one sort for each id's newest entry, records gathered and verified into the
  run's chunks, the log's chunks deleted), then the `k` runs merged with the base into a new
  base that frees each chunk it consumed (`lsm_merges`, the compiled k-way merge). All figures
  are per row fed; CPU is process CPU. `lsm_steady` is runs plus merges (the file's peak and the
  final base's pages against the raw rows beside it), `lsm_one_process` adds `lsm_append`,
  `lsm_end_to_end` projects the writer's whole cost on one core: the store's `log_append` (its
  index included) and `lsm_steady` one after the other. `lsm_get` reads random rows through the
  runs newest first and the base. `lsm_put_<pwrite|writemap>_<fresh|reused>`: LMDB's own cost
  of a run write, whole chunks put with `MDB_APPEND` (commits `pwrite` heap pages, or a
  writable map), into a fresh file and into pages freed before. `--lsm-only` runs these and
  `log_append` alone.
- `chunks_*` (issue 36's format 4's steady state: a page-chunk base that a log merges into by
  range rewrites, then in place), in `bench/writeback_chunks.py`, whose docstring says what each
  case measures. `--chunks-only` runs them with the B-tree's page-write floor of the same merge
  (`floor_<N>_into_<T>`) beside them.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import lmdb
import numpy as np
import torch

from tierstore import RowWiseAdagrad, TableSpec, TierStore
from tierstore.backends import runs, wal
from tierstore.backends.lmdb_backend import encode_keys
from tierstore.backends.record import seal

from . import writeback_chunks
from .common import OUT_DIR, bar_plot, save, table
from .writeback_chunks import DIM, Clock, drop_entries, log_append, newest_entries, open_log, rate, wchar

LEAF_ROWS = 14  # 272-byte records and 8-byte keys in a 4 KiB LMDB leaf page


def _store(work: Path, tables: int, rows: int, seed: int, table_format: str = "chunks",
           write_log: int | None = None) -> TierStore:
    specs = [TableSpec(f"t{i}", rows, DIM, optimizer=RowWiseAdagrad(0.01)) for i in range(tables)]
    store = TierStore(work / "store", specs, device_capacity=0, host_capacity=0,
                      table_format=table_format, write_log=write_log)
    rng = np.random.default_rng(seed)
    w = specs[0].row_dim
    for s in specs:
        for lo in range(0, rows, 1 << 20):
            ids = np.arange(lo, min(lo + (1 << 20), rows), dtype=np.int64)
            store.backend.put({s.name: (ids, rng.standard_normal((len(ids), w), dtype=np.float32))})
    store.backend.sync()
    return store


def raw_cases(work: Path, rows: int, n: int, seed: int) -> list[dict]:
    """py-lmdb alone on a populated table of format-v2 records: append and random-update floors."""
    rng = np.random.default_rng(seed)
    w = DIM + 2
    env = lmdb.open(str(work / "raw"), map_size=64 << 30, max_dbs=4, sync=False, metasync=False,
                    readahead=False, writemap=True)
    table = env.open_db(b"t")
    for lo in range(0, rows, 1 << 18):
        ids = np.arange(lo, min(lo + (1 << 18), rows), dtype=np.int64)
        vals = seal(ids, rng.standard_normal((len(ids), w), dtype=np.float32))
        with env.begin(write=True, db=table) as txn:
            txn.cursor().putmulti(zip(encode_keys(ids), vals.view(f"V{vals.shape[1]}").ravel().tolist()),
                                  append=True)
    ids = np.sort(rng.choice(rows, n, replace=False))
    vals = seal(ids, rng.standard_normal((n, w), dtype=np.float32))
    vals = vals.view(f"V{vals.shape[1]}").ravel().tolist()
    log = env.open_db(b"log")
    keys = encode_keys(np.arange(n))
    t0 = time.perf_counter()
    with env.begin(write=True, db=log) as txn:
        txn.cursor().putmulti(zip(keys, vals), append=True)
    t1 = time.perf_counter()
    with env.begin(write=True, db=table) as txn:
        txn.cursor().putmulti(zip(encode_keys(ids), vals))
    t2 = time.perf_counter()
    env.close()
    return [{"case": "raw_append", "rows": n, "rows_per_s": rate(n, t1 - t0)},
            {"case": "raw_update", "rows": n, "rows_per_s": rate(n, t2 - t1)}]


def floor_cases(work: Path, table_rows: list[int], sizes: list[int], seed: int) -> list[dict]:
    """Leaf pages a merge of `n` sorted rows rewrites into a `t`-row table, measured by the bytes
    its commit writes (no writable map: LMDB `pwrite`s each dirty page once)."""
    rng = np.random.default_rng(seed)
    w = DIM + 2
    out = []
    for t in table_rows:
        env = lmdb.open(str(work / f"floor_{t}"), map_size=max(1 << 30, t * 1200), max_dbs=2,
                        sync=False, metasync=False, readahead=False)
        table = env.open_db(b"t")
        for lo in range(0, t, 1 << 18):
            ids = np.arange(lo, min(lo + (1 << 18), t), dtype=np.int64)
            vals = seal(ids, rng.standard_normal((len(ids), w), dtype=np.float32))
            with env.begin(write=True, db=table) as txn:
                txn.cursor().putmulti(zip(encode_keys(ids), vals.view(f"V{vals.shape[1]}").ravel().tolist()),
                                      append=True)
        with env.begin(db=table) as txn:
            leaves = txn.stat(table)["leaf_pages"]
        for n in sizes:
            if n > t:
                continue
            ids = np.sort(rng.choice(t, n, replace=False))
            vals = seal(ids, rng.standard_normal((n, w), dtype=np.float32))
            items = list(zip(encode_keys(ids), vals.view(f"V{vals.shape[1]}").ravel().tolist()))
            b0, t0 = wchar(), time.perf_counter()
            with env.begin(write=True, db=table) as txn:
                txn.cursor().putmulti(items)
            sec, pages = time.perf_counter() - t0, (wchar() - b0) / 4096
            model = leaves * (1 - np.exp(-n / leaves))
            out.append({"case": f"floor_{n}_into_{t}", "rows": n, "rows_per_s": rate(n, sec),
                        "table_rows": t, "leaf_pages": leaves, "pages_written": pages,
                        "pages_per_row": pages / n, "model_pages": model,
                        "rows_per_leaf": n / leaves})
        env.close()
        shutil.rmtree(work / f"floor_{t}", ignore_errors=True)
    return out


def writer_case(store: TierStore, name: str, n: int, batch: int, alpha: float | None,
                seed: int, settle: bool = False) -> dict:
    """Feed `n` rows through the writer's sink in ring-sized batches of distinct keys.

    The batches' keys are drawn first and the payloads are one random tile (their bits do not
    matter), so the timed loop is the sink and whatever the merger does beside it: process CPU
    (every thread) over the whole loop. With `settle`, the rows still in the log at the end are
    merged too and counted (`e2e_*`: every row fed appended and merged once, the steady state's
    cost without a tail left unpaid). The log's own counters split the CPU: `merge_cpu_us` is
    the merging threads' CPU a row fed (`WriteLog.merge_cpu`), `sink_us` the rest. The disk
    (tables' file plus the log's) is sampled after every batch: `disk_peak_over_raw` against
    the stored rows' payload bytes."""
    rng = np.random.default_rng(seed)
    tables, rows = len(store.tables), next(iter(store.tables.values())).spec.num_rows
    batches, done = [], 0
    while done < n:
        tabs = rng.integers(0, tables, batch)
        ids = (rng.zipf(alpha, batch) - 1) % rows if alpha else rng.integers(0, rows, batch)
        _, first = np.unique(tabs * rows + ids, return_index=True)
        batches.append((tabs[first], ids[first]))
        done += len(first)
    tile = rng.standard_normal((batch, store.width), dtype=np.float32)
    log, be = store.log, store.backend
    appended0, merged0, merges0, mcpu0 = log.rows_appended, log.rows_merged, log.merges, log.merge_cpu
    peak = 0
    t0, c0 = time.perf_counter(), time.process_time()  # every thread: the sink and the merger
    for tabs, ids in batches:
        store._write_rows(tabs, ids, tile[: len(ids)])
        peak = max(peak, be.data_bytes() + be.log_bytes())
    t, cpu = time.perf_counter() - t0, time.process_time() - c0
    rec = {"case": name, "rows": done, "rows_per_s": rate(done, t),
           "cpu_us_per_row": cpu / max(done, 1) * 1e6, "rows_per_cpu_s": rate(done, cpu)}
    if settle:
        store.writeback.drain()
        t1, c1 = time.perf_counter(), time.process_time()
        with log.merging:  # the background merger's own merge first, if one is running
            log.merge()
        t, cpu = t + time.perf_counter() - t1, cpu + time.process_time() - c1
        peak = max(peak, be.data_bytes() + be.log_bytes())
        stored = sum(be.count(s) for s in store.tables)
        merges = log.merges - merges0
        raw = max(stored * 4 * store.width, 1)
        rec.update({"e2e_cpu_us_per_row": cpu / max(done, 1) * 1e6,
                    "e2e_rows_per_cpu_s": rate(done, cpu), "e2e_rows_per_s": rate(done, t),
                    "merges": merges,
                    "merge_cpu_us": (log.merge_cpu - mcpu0) / max(done, 1) * 1e6,
                    "sink_us": (cpu - (log.merge_cpu - mcpu0)) / max(done, 1) * 1e6,
                    "stored_over_merge": stored * merges / max(log.rows_merged - merged0, 1),
                    "disk_peak_over_raw": peak / raw,  # the files never shrink: their peaks
                    "data_over_raw": be.data_bytes() / raw, "log_over_raw": be.log_bytes() / raw,
                    "log_bound": log.full_at(), "merge_start": log.merge_at()})
    rec.update({"appended": log.rows_appended - appended0, "merged": log.rows_merged - merged0})
    return rec


def merge_cases(store: TierStore, sizes: list[int], seed: int) -> list[dict]:
    """One merge of `n` appended distinct random rows per size: rows/s and CPU us a row."""
    rng = np.random.default_rng(seed)
    tables, rows = len(store.tables), next(iter(store.tables.values())).spec.num_rows
    log = store.log
    store.writeback.drain()
    log.stop_merger()
    log.merge()
    out = []
    for n in sizes:
        if n > log.capacity:
            continue
        keys = rng.choice(tables * rows, n, replace=False)
        for lo in range(0, n, 1 << 16):
            k = keys[lo : lo + (1 << 16)]
            log.append(k // rows, k % rows, rng.standard_normal((len(k), store.width), dtype=np.float32))
        merged0 = log.rows_merged
        t0, c0 = time.perf_counter(), time.process_time()
        log.merge()
        t, c = time.perf_counter() - t0, time.process_time() - c0
        m = log.rows_merged - merged0
        out.append({"case": f"merge_{n}", "rows": m, "rows_per_s": rate(m, t), "merged": m,
                    "cpu_us_per_row": c / max(m, 1) * 1e6,
                    "rows_per_leaf": n / (tables * rows / LEAF_ROWS)})
    return out


def read_cases(store: TierStore, n: int, seed: int) -> list[dict]:
    """Sorted random reads of stored rows through py-lmdb and through the page reader."""
    rng = np.random.default_rng(seed)
    spec = next(iter(store.tables.values())).spec
    be = store.backend
    ids = rng.choice(spec.num_rows, n, replace=False)
    out = []
    pages = be._pages
    every = np.arange(spec.num_rows)
    for case, reader in (("get_pylmdb", None), ("get_pages", pages)):
        be._pages = reader
        for lo in range(0, len(every), 1 << 18):  # every page mapped: the steady state of a long run
            be.get(spec.name, every[lo : lo + (1 << 18)], spec.row_dim)
        t0 = time.perf_counter()
        _, found = be.get(spec.name, ids, spec.row_dim)
        out.append({"case": case, "rows": n, "rows_per_s": rate(n, time.perf_counter() - t0),
                    "found": int(found.sum())})
    with ThreadPoolExecutor(2) as pool:
        for case, reader in (("get2_pylmdb", None), ("get2_pages", pages)):
            be._pages = reader
            halves = np.array_split(rng.choice(spec.num_rows, n, replace=False), 2)
            t0 = time.perf_counter()
            found = sum(int(f.sum()) for _, f in pool.map(
                lambda q: be.get(spec.name, np.sort(q), spec.row_dim), halves))
            out.append({"case": case, "rows": n, "rows_per_s": rate(n, time.perf_counter() - t0),
                        "found": found})
    be._pages = pages
    return out


def _log_to_run(log_env: lmdb.Environment, log_db: object, writer: runs.RunWriter) -> int:
    """The log's merge into a run: its chunks read in place, each id's newest entry found by one
    sort (`newest_entries`), the records gathered straight into the run's chunks (verified), the
    log's chunks deleted; returns the run's rows."""
    with log_env.begin(db=log_db, buffers=True) as txn:
        keys, chunks, ids, of, at = newest_entries(txn)
        writer.gather(ids, chunks, of, at, wal.HEADER // 4, "t")
    n = writer.finish()
    drop_entries(log_env, log_db, keys)
    return n


def chunk_put_cases(work: Path, rows: int, seed: int) -> list[dict]:
    """LMDB's own cost of writing a run: whole chunks of 4,096 records put with `MDB_APPEND`
    (a commit every 64), heap pages written with `pwrite` at commit against a writable map, into
    a fresh file and then again into the pages the first pass freed (a merge's steady state);
    CPU microseconds a row for the puts and commits alone."""
    rng = np.random.default_rng(seed)
    w = DIM + 2
    rb = 4 * w + 4
    k = runs.CHUNK_ROWS
    one = np.frombuffer(rng.bytes(runs.HEADER + k * (8 + rb)), dtype=np.uint8)
    chunks = -(-rows // k)
    out = []
    for mode, writemap in (("pwrite", False), ("writemap", True)):
        env = lmdb.open(str(work / mode), map_size=max(1 << 30, rows * 600), max_dbs=2, sync=False,
                        metasync=False, readahead=False, writemap=writemap)
        for case in ("fresh", "reused"):
            db = env.open_db(case.encode())
            c0, t0 = time.process_time(), time.perf_counter()
            for lo in range(0, chunks, runs.TXN_CHUNKS):
                with env.begin(write=True, db=db) as txn:
                    for c in range(lo, min(lo + runs.TXN_CHUNKS, chunks)):
                        txn.put(c.to_bytes(8, "big"), one, append=True)
            cpu, sec = time.process_time() - c0, time.perf_counter() - t0
            out.append({"case": f"lsm_put_{mode}_{case}", "rows": chunks * k,
                        "rows_per_s": rate(chunks * k, sec), "cpu_us_per_row": cpu / (chunks * k) * 1e6,
                        "rows_per_cpu_s": rate(chunks * k, cpu)})
            with env.begin(write=True) as txn:  # its pages go to the free list for the next pass
                txn.drop(db, delete=True)
        env.close()
        shutil.rmtree(work / mode, ignore_errors=True)
    return out


def lsm_cases(work: Path, table_rows: int, run_rows: int, k: int, cycles: int, get_rows: int,
              seed: int, writemap: bool = False, readahead: bool = False) -> list[dict]:
    """The merge side of issue 36's LSM, on `backends/runs.py` (not yet the store's format): a
    base of `table_rows` rows as sorted chunks; each cycle appends `k` batches of `run_rows`
    random rows to a log (`lsm_append`: the writer's sink without its index), merges each into a
    run (`lsm_runs`: chunks read in place, one sort, records gathered into the run's chunks),
    then merges the runs with the base into a new base that frees what it consumed
    (`lsm_merges`, compiled). Reads go through the `k` runs, then the base. Cases are suffixed
    `_k<k>`; CPU microseconds are process CPU a row fed (robust to other processes)."""
    rng = np.random.default_rng(seed)
    w = DIM + 2
    rb = 4 * w + 4
    env = lmdb.open(str(work / "lsm"), map_size=max(1 << 30, (table_rows + k * run_rows) * 1200),
                    max_dbs=64, sync=False, metasync=False, readahead=readahead, writemap=writemap)
    log_env, log_db = open_log(work / "lsm_log", run_rows)
    piece = 1 << 18
    tile = rng.standard_normal((piece, w), dtype=np.float32)  # payloads: their bits do not matter
    names = iter(range(1 << 30))

    def fresh():
        return env.open_db(f"r{next(names)}".encode())

    clock = Clock(("base", "append", "runs", "merges", "get"))
    timed = clock.timed

    def base_write(ids: np.ndarray) -> object:
        db = fresh()
        writer = runs.RunWriter(env, db, rb)
        for lo in range(0, len(ids), piece):
            part = ids[lo : lo + piece]
            writer.add(part, seal(part, tile[: len(part)]))
        writer.finish()
        return db

    base = timed("base", base_write, np.arange(table_rows, dtype=np.int64))
    fed = got = seq = 0
    for c in range(cycles):
        levels = []
        for _ in range(k):
            draw = rng.integers(0, table_rows, run_rows)
            seq = timed("append", log_append, log_env, log_db, draw, tile, seq)
            db = fresh()
            timed("runs", _log_to_run, log_env, log_db, runs.RunWriter(env, db, rb))
            fed += run_rows
            levels.insert(0, db)
        sources = [runs.SortedRun(env, db, "t", w) for db in levels + [base]]
        if c == cycles - 1 and get_rows:  # reads through k runs, newest first, then the base
            ids = np.sort(rng.choice(table_rows, get_rows, replace=False))
            t0, c0 = time.perf_counter(), time.process_time()
            found = np.zeros(len(ids), dtype=bool)
            for src in sources:
                todo = np.flatnonzero(~found)
                _, hit = src.get(ids[todo])
                found[todo[hit]] = True
            clock.wall["get"], got = time.perf_counter() - t0, len(ids)
            clock.cpu["get"] = time.process_time() - c0

        def merge(sources=sources):
            out = fresh()
            runs.merge_runs(sources, runs.RunWriter(env, out, rb), free=True)
            with env.begin(write=True) as txn:  # the emptied sources' databases go
                for src in sources:
                    txn.drop(src.db, delete=True)
            return out

        base = timed("merges", merge)
    with env.begin(db=base) as txn:
        st = txn.stat(base)
    chunks = st["entries"]
    peak = (work / "lsm" / "data.mdb").stat().st_blocks * 512  # the file never shrinks: its peak
    # what the base's own pages hold (a compaction's file: the rest of the file is free pages)
    used = (st["leaf_pages"] + st["branch_pages"] + st["overflow_pages"]) * st["psize"]
    env.close()
    log_env.close()
    shutil.rmtree(work / "lsm", ignore_errors=True)
    shutil.rmtree(work / "lsm_log", ignore_errors=True)
    raw = table_rows * 4 * w
    geo = {"table_rows": table_rows, "run_rows": run_rows, "k": k, "cycles": cycles}

    def rec(case: str, what: tuple[str, ...], rows: int, **extra) -> dict:
        return clock.rec(f"{case}_k{k}", what, rows, geo, **extra)

    return [rec("lsm_base_write", ("base",), table_rows),
            rec("lsm_append", ("append",), fed),
            rec("lsm_runs", ("runs",), fed),
            rec("lsm_merges", ("merges",), fed, base_chunks=chunks),
            rec("lsm_steady", ("runs", "merges"), fed, disk_peak_over_raw=peak / raw,
                disk_after_over_raw=used / raw),
            rec("lsm_one_process", ("append", "runs", "merges"), fed),
            rec("lsm_get", ("get",), got)]


def chunks_main(work: Path, args: argparse.Namespace) -> list[dict]:
    """The page-chunk steady state, and with `--chunks-only` the B-tree's page-write floor of
    the same merge (`run` rows into `table` rows) beside it."""
    out = writeback_chunks.run(work, args)
    if args.chunks_only:
        out += floor_cases(work, [args.chunks_table], [min(args.chunks_run, args.chunks_table)],
                           args.seed + 9)
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.writeback", description=__doc__.splitlines()[0])
    ap.add_argument("--tables", type=int, default=8)
    ap.add_argument("--rows", type=int, default=1_000_000, help="stored rows per table")
    ap.add_argument("--rows-per-case", type=int, default=300_000)
    ap.add_argument("--steady", type=int, default=3_000_000, help="rows fed in each steady case")
    ap.add_argument("--batch", type=int, default=50_000, help="rows per writer batch")
    ap.add_argument("--merge-sizes", default="131072,524288,2000000",
                    help="rows per merge case (at most the log's capacity)")
    ap.add_argument("--floor-tables", default="1000000,8000000",
                    help="table sizes (rows) of the page-write floor cases; '' skips them")
    ap.add_argument("--lsm-table", type=int, default=8_000_000,
                    help="rows of the LSM cases' base (0 skips them)")
    ap.add_argument("--lsm-run", type=int, default=1_500_000, help="random rows a run")
    ap.add_argument("--lsm-k", default="2,4,8", help="runs merged into the base at a time (one LSM "
                    "per value)")
    ap.add_argument("--torch-threads", type=int, default=None,
                    help="torch's intra-op threads (default: torch's own); 1 keeps the sink's "
                         "small torch ops (its index) from spinning a second core")
    ap.add_argument("--lsm-writemap", action="store_true",
                    help="the LSM's environment writes through a writable map (else heap pages "
                         "written with pwrite at commit, as the store's environments do)")
    ap.add_argument("--lsm-put-rows", type=int, default=2_000_000,
                    help="rows of the chunk-put cases (LMDB's cost of a run write; 0 skips them)")
    ap.add_argument("--lsm-cycles", type=int, default=3, help="merges into the base")
    ap.add_argument("--lsm-only", action="store_true", help="run the LSM cases (and log_append) alone")
    writeback_chunks.add_options(ap)
    ap.add_argument("--table-format", choices=("chunks", "btree"), default="chunks",
                    help="TierStore(table_format=...) of the store's cases: page-chunk levels "
                         "(format 4, the default) or B-tree tables (format 3)")
    ap.add_argument("--write-log", type=int, default=None,
                    help="the store's write-behind log capacity in rows (default: the store's own)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--quick", action="store_true", help="a short run: 2 x 50k rows")
    args = ap.parse_args(argv)
    if args.quick:
        args.tables, args.rows, args.rows_per_case, args.steady, args.batch = 2, 50_000, 20_000, 60_000, 5_000
        args.merge_sizes, args.floor_tables = "5000,20000", "50000"
        args.lsm_table, args.lsm_run, args.lsm_k, args.lsm_cycles = 60_000, 10_000, "2,4", 2
        args.lsm_put_rows = 20_000
        writeback_chunks.quick(args)
    return args


def store_cases(work: Path, args: argparse.Namespace, full: bool) -> tuple[list[dict], str | None, int]:
    """The store's cases (its sink, steady states, reads, merges, floors) and the LSM's; returns
    (records, the floor case of the steady states, the log's capacity)."""
    recs = raw_cases(work, args.rows, args.rows_per_case, args.seed) if full else []
    sizes = [int(v) for v in args.merge_sizes.split(",") if v]
    store_rows = args.tables * args.rows
    floors = floor_cases(work, [int(v) for v in args.floor_tables.split(",") if v], sizes,
                         args.seed + 4) if full else []
    store = _store(work, args.tables, args.rows, args.seed, args.table_format, args.write_log)
    try:
        store.writeback.drain()
        room = store.log.capacity * 3 // 4 - store.log.size - args.batch
        recs.append(writer_case(store, "log_append", max(args.batch, min(args.rows_per_case, room)),
                                args.batch, None, args.seed))
        if full:
            recs.append(writer_case(store, "steady_uniform", args.steady, args.batch, None,
                                    args.seed + 1, settle=True))
            recs.append(writer_case(store, "steady_zipf", args.steady, args.batch, 1.05, args.seed + 2,
                                    settle=True))
            recs += read_cases(store, args.rows_per_case, args.seed)
            recs += merge_cases(store, sizes, args.seed + 3)
        log_capacity = store.log.capacity
    finally:
        store.close()
    if full:  # the floor beside the steady state: the store's own merge (half its log into its tables)
        recs += floors + floor_cases(work, [store_rows], [min(log_capacity // 2, store_rows)],
                                     args.seed + 5)
    own = recs[-1]["case"] if full else None
    if args.lsm_table:
        append = next(r for r in recs if r["case"] == "log_append")
        for k in [int(v) for v in str(args.lsm_k).split(",") if v]:
            lsm = lsm_cases(work, args.lsm_table, args.lsm_run, k, args.lsm_cycles,
                            args.rows_per_case, args.seed + 6, writemap=args.lsm_writemap)
            steady = next(r for r in lsm if r["case"] == f"lsm_steady_k{k}")
            # the store's log append (its index too) and the merge side, one after the other
            cpu = append["cpu_us_per_row"] + steady["cpu_us_per_row"]
            lsm.append({"case": f"lsm_end_to_end_k{k}", "rows": steady["rows"], "k": k,
                        "rows_per_s": 1 / (1 / append["rows_per_s"] + 1 / steady["rows_per_s"]),
                        "projected": True, "cpu_us_per_row": cpu, "rows_per_cpu_s": 1e6 / cpu})
            recs += lsm
    if args.lsm_put_rows:
        recs += chunk_put_cases(work, args.lsm_put_rows, args.seed + 7)
    return recs, own, log_capacity


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    work = Path(tempfile.mkdtemp(prefix="bench_writeback_", dir=args.workdir))
    full = not args.lsm_only and not args.chunks_only
    log_capacity = None
    try:
        if args.chunks_only:
            recs, own = chunks_main(work, args), None
        else:
            recs, own, log_capacity = store_cases(work, args, full)
            if args.chunks_table:
                recs += chunks_main(work, args)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    base = {r["case"]: r["rows_per_s"] for r in recs}
    for r in recs:
        if r["case"].startswith(("floor", "lsm", "chunks")) or r["case"] in ("raw_append", "raw_update") or \
                (r["case"].startswith("steady") and own is None):
            r["vs_floor"] = r["floor"] = None
            continue
        floor = "raw_append" if r["case"] in ("log_append",) else own if r["case"].startswith(
            "steady") else "raw_update" if r["case"].startswith("merge") else "get_pylmdb"
        if floor not in base:
            r["vs_floor"] = r["floor"] = None
            continue
        r["vs_floor"] = r["rows_per_s"] / base[floor]
        r["floor"] = floor
    print(table(recs, [("case", "case", ""), ("k", "k", ""), ("rows", "rows", ",d"),
                       ("rows_per_s", "rows/s", ",.0f"),
                       ("floor", "floor", ""), ("vs_floor", "vs floor", ".2f"),
                       ("merged", "merged", ",d"), ("rows_per_leaf", "rows/leaf", ".2f"),
                       ("cpu_us_per_row", "cpu us/row", ".2f"), ("pages_per_row", "pages/row", ".3f"),
                       ("model_pages", "model pages", ",.0f"), ("pages_written", "pages", ",.0f"),
                       ("rows_per_cpu_s", "rows/cpu-s", ",.0f"),
                       ("copied_per_fed", "copied/fed", ".2f"),
                       ("merges", "merges", "d"), ("stored_over_merge", "T/N", ".2f"),
                       ("sink_us", "sink us", ".2f"), ("merge_cpu_us", "merge us", ".2f"),
                       ("e2e_cpu_us_per_row", "e2e cpu us", ".2f"),
                       ("e2e_rows_per_cpu_s", "e2e rows/cpu-s", ",.0f"),
                       ("disk_peak_over_raw", "disk peak x raw", ".2f"),
                       ("data_over_raw", "tables x raw", ".2f"), ("log_over_raw", "log x raw", ".2f"),
                       ("disk_after_over_raw", "base x raw", ".2f")]))
    meta = {"bench": "writeback", "argv": sys.argv[1:] if argv is None else argv, "tables": args.tables,
            "table_format": args.table_format,
            "torch_threads": torch.get_num_threads(),
            "rows": args.rows, "record_bytes": (DIM + 2) * 4 + 4, "log_capacity": log_capacity}
    path = save("writeback", recs, meta, args.out)
    print(f"wrote {path}")
    if not args.no_plot:
        png = Path(args.out or OUT_DIR) / "writeback.png"
        bar_plot(png, [r["case"] for r in recs], {"M rows/s": [r["rows_per_s"] / 1e6 for r in recs]},
                 "M rows/s", "SSD tier throughput (write-behind sink, reads) and py-lmdb floors",
                 target=1.0)
        print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
