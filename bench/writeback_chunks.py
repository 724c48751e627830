"""The page-chunk cases of `python -m bench.writeback` (format 4's steady state), and what its
other cases share with them: the records' width, rates, bytes written (`wchar`), CPU and wall
clocks summed by step (`Clock`), and the write-behind log: opened (`open_log`), filled as the
writer's sink fills it (`log_append`), read as a merge reads it (`newest_entries`) and emptied
(`drop_entries`).

- `chunks_*` (issue 36's format 4, `tierstore/backends/chunkmerge.py`, alone): a
  base of `--chunks-table` rows of page-sized chunks in ranges of `--chunks-range` rows
  (`chunks_base_write`); `--chunks-cycles` times, `--chunks-run` uniform random rows of the table
  appended to a log as the writer's sink does (`chunks_append`: `pack_log` and `MDB_APPEND`, no
  index), sorted for each id's newest entry (`chunks_sort`: the log's keys read in place, one
  sort), and merged into the base by a sequential rewrite of every range the batch touches, each
  record copied once from the log's map (`chunks_merge`, the log's chunks deleted after it;
  `copied/fed`: rows written a row fed, T / N).
  `chunks_steady` is the three on one core, per row fed, with the files' peak (base and log) and
  the base's own pages after the last merge (a closed store's, compacted) against the raw rows.
  `chunks_get`: sorted random reads (`--rows-per-case` draws) through the rewritten base
  (page-cached, every record verified). `chunks_in_place`: then batches of `--chunks-in-place`
  rows merged in place (the regime for T >> N: each chunk a row falls into read, merged and put
  back), with the pages their commits wrote a row fed. `--chunks-only` runs them with the
  B-tree's page-write floor of the same merge (`floor_<N>_into_<T>`) beside them.
"""

from __future__ import annotations

import argparse
import shutil
import time
from collections import deque
from pathlib import Path

import lmdb
import numpy as np

from tierstore.backends import runs, wal
from tierstore.backends.chunk_kernels import pack_log
from tierstore.backends.chunkmerge import RANGE_ROWS, ChunkLevel
from tierstore.backends.record import seal

DIM = 64
LOG_BATCH = 50_000  # rows a writer batch in the LSM and chunk cases' log (the steady cases' `--batch`)


def rate(n: int, seconds: float) -> float:
    """`n` a second over `seconds` (nan for none)."""
    return n / seconds if seconds > 0 else float("nan")


def wchar() -> int:
    """Bytes this process passed to write calls so far (/proc/self/io; 0 where absent)."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("wchar:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


class Clock:
    """Wall and process-CPU seconds summed by step name, and a case's record from its steps."""

    def __init__(self, names: tuple[str, ...]):
        self.cpu = dict.fromkeys(names, 0.0)
        self.wall = dict.fromkeys(names, 0.0)

    def timed(self, what: str, fn, *args):
        """`fn(*args)`, its seconds added to step `what`."""
        t0, c0 = time.perf_counter(), time.process_time()
        out = fn(*args)
        self.wall[what] += time.perf_counter() - t0
        self.cpu[what] += time.process_time() - c0
        return out

    def split(self, t0: float, cpu: dict[str, float], prefix: str = "") -> None:
        """Steps' CPU seconds (one thread) added, and the wall time since `t0` shared as they are."""
        for what in cpu:
            self.cpu[prefix + what] += cpu[what]
            self.wall[prefix + what] += (time.perf_counter() - t0) * cpu[what] / max(sum(cpu.values()), 1e-9)

    def rec(self, case: str, what: tuple[str, ...], rows: int, geo: dict, **extra) -> dict:
        """Case `case`'s record: `rows` over the seconds of steps `what`, then `geo` and `extra`."""
        c, t = sum(self.cpu[x] for x in what), sum(self.wall[x] for x in what)
        return {"case": case, "rows": rows, "rows_per_s": rate(rows, t),
                "cpu_us_per_row": c / max(rows, 1) * 1e6, "rows_per_cpu_s": rate(rows, c), **geo, **extra}


def open_log(path: Path, rows: int) -> tuple[lmdb.Environment, object]:
    """A log's environment at `path`, mapped for `rows` rows of entries (no syncs, no readahead),
    and its database."""
    env = lmdb.open(str(path), map_size=max(1 << 30, rows * 1200), max_dbs=2, sync=False,
                    metasync=False, readahead=False, meminit=False)
    return env, env.open_db(b"log")


def log_append(env: lmdb.Environment, db: object, ids: np.ndarray, tile: np.ndarray, seq: int) -> int:
    """Append rows to a log database as the writer's sink does (`pack_log`, one `MDB_APPEND`
    transaction a batch; no in-memory index): the entries a log merge then writes into a run."""
    w = tile.shape[1]
    ew = wal.HEADER // 4 + w + 1
    magic = int(np.frombuffer(b"TSLC", dtype=np.uint32)[0])
    for lo in range(0, len(ids), LOG_BATCH):
        part = ids[lo : lo + LOG_BATCH]
        n = len(part)
        out = np.empty(4 * (-(-n // runs.CHUNK_ROWS)) + n * ew, dtype=np.uint32)
        pack_log(np.zeros(n, dtype=np.uint32), part, tile[:n].view(np.uint32), w, runs.CHUNK_ROWS,
                 magic, out)
        raw, items = out.view(np.uint8), []
        for c in range(0, n, runs.CHUNK_ROWS):
            start = 4 * (4 * (c // runs.CHUNK_ROWS) + c * ew)
            count = min(runs.CHUNK_ROWS, n - c)
            items.append(((seq + c).to_bytes(8, "big"), memoryview(raw[start : start + 16 + 4 * count * ew])))
        with env.begin(write=True, db=db) as txn:
            txn.cursor().putmulti(items, append=True)
        seq += n
    return seq


def newest_entries(txn: lmdb.Transaction) -> tuple[list[bytes], list[np.ndarray], np.ndarray,
                                                   np.ndarray, np.ndarray]:
    """The log's chunks read in place (`txn`: a read transaction with buffers on the log's
    database) and each id's newest entry found by one sort (`newest_order`): (the chunks' keys,
    the chunks as uint32 [entries, entry words], the ids in order, the chunk of each id's entry
    and the entry's row in it)."""
    keys, chunks = [], []
    for key, val in txn.cursor().iternext():
        head = np.frombuffer(val[:16], dtype=np.uint32)
        chunks.append(np.frombuffer(val, dtype=np.uint32)[4:].reshape(int(head[2]), int(head[1]) // 4))
        keys.append(bytes(key))
    counts = np.array([len(c) for c in chunks], dtype=np.int64)
    rows = np.empty(int(counts.sum()), dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(counts)])
    for c, ch in enumerate(chunks):  # the entries' row ids (words 2-3 of each entry)
        rows[starts[c] : starts[c + 1]] = ch[:, 2:4].copy().view(np.int64).ravel()
    ids, pos = runs.newest_order(rows)
    of = np.repeat(np.arange(len(chunks), dtype=np.int64), counts)[pos]
    return keys, chunks, ids, of, pos - starts[of]


def drop_entries(env: lmdb.Environment, db: object, keys: list[bytes]) -> None:
    """Delete the log's merged chunks (`keys`) in one write transaction."""
    with env.begin(write=True, db=db) as txn:
        deque(map(txn.delete, keys), maxlen=0)


def _log_merge(log_env: lmdb.Environment, log_db: object, level: ChunkLevel, verify: bool,
               times: dict[str, float], in_place: bool = False) -> int:
    """The log's merge into the page-chunk base: its chunks read in place, each id's newest
    entry found by one sort (`newest_entries`, CPU seconds into times["sort"]), the records
    copied once from the log's map into the rewritten ranges (`merge_gather`), the log's chunks
    deleted after (both into times["merge"]); returns the rows the merge wrote."""
    c0 = time.process_time()
    with log_env.begin(db=log_db, buffers=True) as txn:  # the log's chunks stay put inside it
        keys, chunks, ids, of, at = newest_entries(txn)
        c1 = time.process_time()
        stats = level.merge_gather(ids, chunks, of, at, wal.HEADER // 4, verify=verify, in_place=in_place)
    drop_entries(log_env, log_db, keys)
    times["sort"] += c1 - c0
    times["merge"] += time.process_time() - c1
    return stats.rows_written


def chunks_cases(work: Path, table_rows: int, run_rows: int, cycles: int, seed: int,
                 writemap: bool = False, verify: bool = True, range_rows: int = RANGE_ROWS,
                 in_place_rows: int = 0, get_rows: int = 300_000) -> list[dict]:
    """Issue 36's steady state on format 4's page chunks (`backends/chunkmerge.py`, the level
    alone, outside a store): a base of `table_rows` rows written as page chunks in ranges
    (`chunks_base_write`);
    `cycles` times, `run_rows` uniform random rows of the table appended to a log as the writer's
    sink does (`chunks_append`), sorted for each id's newest entry (`chunks_sort`), merged into
    the base by rewriting every range they touch, each record copied once from the log's map
    (`chunks_merge`, the log's chunks deleted after it). `chunks_steady` is the three per row
    fed on one core, with the files' peak (base and log, the log full) and the base's own pages
    (what a closed, compacted store keeps) against the raw rows. `chunks_in_place`: then
    `cycles` batches of `in_place_rows` appended and merged in place (T >> N's regime), with the
    bytes their commits wrote (`wchar`) in 4 KiB pages a row fed. `chunks_get`: sorted random
    reads of `get_rows` ids through the level after the rewrites (page-cached, verified)."""
    rng = np.random.default_rng(seed)
    w = DIM + 2
    env = lmdb.open(str(work / "chunks"), map_size=max(1 << 30, (table_rows + 2 * range_rows) * 800),
                    max_dbs=256, sync=False, metasync=False, readahead=False, writemap=writemap)
    log_env, log_db = open_log(work / "chunks_log", run_rows)
    piece = 1 << 18
    tile = rng.standard_normal((piece, w), dtype=np.float32)  # payloads: their bits do not matter
    level = ChunkLevel(env, "t", w, "t", range_rows=range_rows)
    clock = Clock(("base", "append", "sort", "merge", "get", "ip_append", "ip_sort", "ip_merge"))
    written = 0

    def base_write() -> None:
        for lo in range(0, table_rows, 8 * piece):  # sorted batches appended past the last id
            ids = np.arange(lo, min(lo + 8 * piece, table_rows), dtype=np.int64)
            level.merge(ids, seal(ids, np.resize(tile, (len(ids), w))), verify=False)

    clock.timed("base", base_write)
    fed = seq = 0
    for _ in range(cycles):
        draw = rng.integers(0, table_rows, run_rows)
        seq = clock.timed("append", log_append, log_env, log_db, draw, tile, seq)
        fed += run_rows
        t0 = time.perf_counter()
        split = dict.fromkeys(("sort", "merge"), 0.0)
        written += _log_merge(log_env, log_db, level, verify, split)
        clock.split(t0, split)  # wall time split as the CPU time is (one thread)
    peak = sum((work / d / "data.mdb").stat().st_blocks * 512 for d in ("chunks", "chunks_log"))
    get_ids = np.unique(rng.integers(0, table_rows, get_rows))  # reads after the merges, verified
    _, found = clock.timed("get", level.get, get_ids)
    ip_fed, ip_bytes = 0, 0
    for _ in range(cycles if in_place_rows else 0):  # the in-place regime: small batches
        draw = rng.integers(0, table_rows, in_place_rows)
        seq = clock.timed("ip_append", log_append, log_env, log_db, draw, tile, seq)
        ip_fed += in_place_rows
        t0, b0 = time.perf_counter(), wchar()
        split = dict.fromkeys(("sort", "merge"), 0.0)
        _log_merge(log_env, log_db, level, verify, split, in_place=True)
        ip_bytes += wchar() - b0
        clock.split(t0, split, "ip_")
    used = 0
    with env.begin() as txn:
        for name in level.names:
            st = txn.stat(env.open_db(name, txn=txn, create=False))
            used += (st["leaf_pages"] + st["branch_pages"] + st["overflow_pages"]) * st["psize"]
    stored = level.rows()
    env.close()
    log_env.close()
    shutil.rmtree(work / "chunks", ignore_errors=True)
    shutil.rmtree(work / "chunks_log", ignore_errors=True)
    raw = stored * 4 * w
    geo = {"table_rows": table_rows, "run_rows": run_rows, "cycles": cycles}
    rec = clock.rec
    return [rec("chunks_base_write", ("base",), table_rows, geo),
            rec("chunks_append", ("append",), fed, geo),
            rec("chunks_sort", ("sort",), fed, geo),
            rec("chunks_merge", ("merge",), fed, geo, copied_per_fed=written / max(fed, 1)),
            rec("chunks_steady", ("append", "sort", "merge"), fed, geo, copied_per_fed=written / max(fed, 1),
                disk_peak_over_raw=peak / raw, disk_after_over_raw=used / raw),
            rec("chunks_get", ("get",), len(get_ids), geo, found=int(found.sum()))] + ([
            rec("chunks_in_place", ("ip_append", "ip_sort", "ip_merge"), ip_fed, geo,
                pages_per_row=ip_bytes / 4096 / max(ip_fed, 1), run_rows=in_place_rows)]
            if ip_fed else [])


def add_options(ap: argparse.ArgumentParser) -> None:
    """The page-chunk cases' options (`--chunks-*`)."""
    ap.add_argument("--chunks-table", type=int, default=8_000_000,
                    help="rows of the page-chunk base (format 4's merge; 0 skips those cases)")
    ap.add_argument("--chunks-run", type=int, default=2_000_000,
                    help="random rows appended to the log and merged into the base a cycle")
    ap.add_argument("--chunks-cycles", type=int, default=3, help="merges into the page-chunk base")
    ap.add_argument("--chunks-range", type=int, default=RANGE_ROWS, help="rows a range database")
    ap.add_argument("--chunks-in-place", type=int, default=250_000,
                    help="rows of the in-place batches merged after the rewrites (0 skips them)")
    ap.add_argument("--chunks-writemap", action="store_true",
                    help="the base's environment writes through a writable map (else heap pages "
                         "written with pwrite at commit, as the store's environments do)")
    ap.add_argument("--chunks-no-verify", action="store_true",
                    help="the merge copies records without checking them (reads still do)")
    ap.add_argument("--chunks-only", action="store_true",
                    help="run the page-chunk cases and the B-tree page-write floor of the same "
                         "merge alone")


def quick(args: argparse.Namespace) -> None:
    """`--quick`'s sizes of the page-chunk cases."""
    args.chunks_table, args.chunks_run, args.chunks_range = 80_000, 20_000, 30_000
    args.chunks_in_place = 2_000


def run(work: Path, args: argparse.Namespace) -> list[dict]:
    """The page-chunk cases under the options `add_options` added."""
    return chunks_cases(work, args.chunks_table, args.chunks_run, args.chunks_cycles, args.seed + 8,
                        writemap=args.chunks_writemap, verify=not args.chunks_no_verify,
                        range_rows=args.chunks_range, in_place_rows=args.chunks_in_place,
                        get_rows=args.rows_per_case)
