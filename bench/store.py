"""`python -m bench.store`: rows/s of TierStore.read/apply per tier beside raw ceilings from the same run.

Cases (one table, dim 64, row-wise Adagrad, batches of unique random ids over a 10**9-row table):
- device_hit: every row hits the device tier; ceiling `torch.index_select` on a tensor shaped like
  the device slab (same row count and width), at random rows.
- host_hit: every row hits the host tier (the device tier holds only the previous batch, so each
  call also moves a batch down to the host tier); same ceiling on a host-slab-shaped tensor.
- lmdb_cached: every row misses both caches and is read from LMDB with the data in the page cache;
  apply also writes back one dirty evicted row per row. Ceiling: raw py-lmdb on the same
  environment (a `txn.get` loop over sorted keys; for apply, plus `putmulti` of the same payloads),
  so this case's store keeps B-tree tables (`table_format="btree"`: a B-tree against py-lmdb).
- lmdb_cold: as lmdb_cached, but the store is flushed, closed, its data.mdb dropped from the page
  cache (`posix_fadvise(DONTNEED)`) and reopened before each timed call; caches are refilled from
  another id range first. The raw ceiling runs under the same protocol.
Every case names `device_cache="slab"`: the cases count on one LRU order over the whole device
tier (the sets cache, CUDA's default, evicts within a set, so some rows would stay cached).

Timing: store and ceiling blocks alternate (one round = one block of each); a figure's `ratio` is
the median over rounds of store rate / ceiling rate, so a load spike on the shared machine weighs
on both sides of the ratio alike. `rows_per_s` and `ceiling_rows_per_s` are medians over rounds.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import lmdb
import numpy as np
import torch

from tierstore import RowWiseAdagrad, TableSpec, TierStore
from tierstore.backends.record import seal

from .common import OUT_DIR, bar_plot, num_threads, save, table, thread_settings

TABLE = "t"
NUM_ROWS = 10**9
TARGETS = {"device_hit": 0.3, "host_hit": None, "lmdb_cached": 0.5, "lmdb_cold": 0.5}


def drop_page_cache(path: Path) -> None:
    """Ask the kernel to drop a file's cached pages (the file must not be mapped)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _spec(dim: int) -> TableSpec:
    return TableSpec(TABLE, NUM_ROWS, dim, optimizer=RowWiseAdagrad(lr=0.01))


def _grads(n: int, dim: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, dim, generator=g) * 0.01


class RawLmdb:
    """The py-lmdb ceiling: sorted-key `txn.get` loop reads and `putmulti` writes, no tierstore.

    `width` is the stored row's float32 columns (`TableSpec.row_dim`); records carry one more
    word, the checksum, which `write` computes (any store of record must) and `read` returns.
    """

    def __init__(self, env: lmdb.Environment, db: object, width: int) -> None:
        self.env, self.db, self.width = env, db, width

    def read(self, ids: np.ndarray) -> np.ndarray:
        """Records of existing rows [n, width + 1] (row, then the check word), in sorted id order."""
        keys = np.sort(ids).astype(">u8").tobytes()
        with self.env.begin(db=self.db) as txn:
            get = txn.get
            vals = [get(keys[i : i + 8]) for i in range(0, len(keys), 8)]
        return np.frombuffer(b"".join(vals), dtype=np.float32).reshape(-1, self.width + 1)

    def write(self, ids: np.ndarray, payload: np.ndarray) -> None:
        """Write rows (sorted by id) in one transaction, sealed with their checksums."""
        order = np.argsort(ids)
        srt = ids[order]
        keys = srt.astype(">u8").tobytes()
        raw = seal(srt, np.ascontiguousarray(payload[order][:, : self.width], dtype=np.float32))
        w = raw.shape[1]
        raw = raw.tobytes()
        items = [(keys[8 * i : 8 * i + 8], raw[w * i : w * (i + 1)]) for i in range(len(order))]
        with self.env.begin(write=True, db=self.db) as txn:
            txn.cursor().putmulti(items)

    def read_write(self, ids: np.ndarray) -> None:
        """A miss that also writes back a row: read the rows, write the same payloads back."""
        data = self.read(ids)
        self.write(np.sort(ids), data)


def _populate(store: TierStore, ids: np.ndarray, dim: int, chunk: int = 65536) -> None:
    """Write rows straight to the LMDB tier (random weights, positive accumulators)."""
    width = store.table_specs[TABLE].row_dim
    rng = np.random.default_rng(7)
    for lo in range(0, len(ids), chunk):
        part = ids[lo : lo + chunk]
        pay = rng.standard_normal((len(part), width), dtype=np.float32) * 0.05
        pay[:, dim:] = np.abs(pay[:, dim:])
        pay[:, -1] = 0.0  # the last-update stamp column
        store.backend.put({TABLE: (part, pay)})
    store.backend.sync()


def _profile(fn, reps: int, label: str, sink: list[str]) -> None:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(reps):
        fn()
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(18)
    sink.append(f"==== {label} ({reps} calls) ====\n{buf.getvalue()}")


def paired_rates(fns: dict[str, Callable[[], object]], items: int, blocks: int,
                 reps: int) -> dict[str, list[float]]:
    """items/s of each function per round (one block of `reps` calls of each, in turn)."""
    # interleaved rounds: a load spike on the shared machine hits the store and its ceiling alike
    out: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(blocks):
        for key, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            out[key].append(items * reps / (time.perf_counter() - t0))
    return out


def _record(case: str, op: str, batch: int, threads: int, rates: list[float], ceiling: str,
            ceil_rates: list[float], extra: dict | None = None) -> dict:
    """One result row; `ratio` is the median over rounds of store rate / ceiling rate."""
    ratio = statistics.median(r / c for r, c in zip(rates, ceil_rates))
    rate, ceil = statistics.median(rates), statistics.median(ceil_rates)
    target = TARGETS[case]
    return {"case": case, "op": op, "batch": batch, "threads": threads,
            "rows_per_s": rate, "rates": rates,
            "ceiling": ceiling, "ceiling_rows_per_s": ceil, "ceiling_rates": ceil_rates,
            "ratio": ratio, "ratio_of_medians": rate / ceil,
            "target": target, "meets_target": None if target is None else ratio >= target,
            **(extra or {})}


def bench_cache_hits(work: Path, batch: int, dim: int, cap: int, threads: int, blocks: int,
                     reps: int, prof: list[str] | None) -> list[dict]:
    """device_hit and host_hit cases for one batch size."""
    spec = _spec(dim)
    width = spec.payload_dim
    rng = np.random.default_rng(batch)
    ids_all = torch.from_numpy(rng.choice(NUM_ROWS, size=4 * batch, replace=False).astype(np.int64))
    grads = _grads(batch, dim, 1)
    # ceilings: random rows of a slab-shaped tensor; plain-torch gather + row-wise Adagrad + scatter
    base = torch.rand(cap, width)
    slots = torch.randperm(cap)[:batch]

    def ceil_select():
        base.index_select(0, slots)

    def ceil_update():
        rows = base.index_select(0, slots)
        w, acc = rows[:, :dim], rows[:, dim:]
        acc.add_(grads.mul(grads).mean(1, keepdim=True))
        w.addcdiv_(grads, acc.sqrt().add_(1e-10), value=-0.01)
        base.index_copy_(0, slots, rows)

    out = []
    # device hits: the batch stays resident in a device tier of `cap` rows
    ids = ids_all[:batch]
    with TierStore(work / f"dev{batch}", spec, device_capacity=cap, host_capacity=0,
                   policy="lru", device_cache="slab") as st:  # named: the tiers as given
        st.read(TABLE, ids)
        st.apply(TABLE, ids, grads)  # loads the numba kernels before timing
        res = paired_rates({"sel": ceil_select, "upd": ceil_update,
                            "read": lambda: st.read(TABLE, ids),
                            "apply": lambda: st.apply(TABLE, ids, grads)}, batch, blocks, reps)
        assert st.stats()["device"]["misses"] == batch, "device_hit case missed the device tier"
        if prof is not None:
            _profile(lambda: st.read(TABLE, ids), reps, f"device_hit read b={batch} t={threads}", prof)
            _profile(lambda: st.apply(TABLE, ids, grads), reps,
                     f"device_hit apply b={batch} t={threads}", prof)
    upd = {"torch_update_rows_per_s": statistics.median(res["upd"])}
    out.append(_record("device_hit", "read", batch, threads, res["read"], "index_select", res["sel"]))
    out.append(_record("device_hit", "apply", batch, threads, res["apply"], "index_select", res["sel"],
                       {**upd, "ratio_vs_torch_update":
                        statistics.median(a / u for a, u in zip(res["apply"], res["upd"]))}))
    # host hits: the device tier holds one batch; four batches rotate through it
    parts = ids_all.view(4, batch)
    with TierStore(work / f"host{batch}", spec, device_capacity=batch, host_capacity=cap,
                   policy="lru", device_cache="slab") as st:
        for p in parts:
            st.read(TABLE, p)
        it = {"i": 0}

        def nxt():
            it["i"] = (it["i"] + 1) % 4
            return parts[it["i"]]

        res = paired_rates({"sel": ceil_select, "upd": ceil_update,
                            "read": lambda: st.read(TABLE, nxt()),
                            "apply": lambda: st.apply(TABLE, nxt(), grads)}, batch, blocks, reps)
        s = st.stats()
        assert s["ssd"]["lookups"] == 4 * batch, "host_hit case reached LMDB"
        if prof is not None:
            _profile(lambda: st.read(TABLE, nxt()), reps, f"host_hit read b={batch} t={threads}", prof)
            _profile(lambda: st.apply(TABLE, nxt(), grads), reps,
                     f"host_hit apply b={batch} t={threads}", prof)
    upd = {"torch_update_rows_per_s": statistics.median(res["upd"])}
    out.append(_record("host_hit", "read", batch, threads, res["read"], "index_select", res["sel"]))
    out.append(_record("host_hit", "apply", batch, threads, res["apply"], "index_select", res["sel"],
                       {**upd, "ratio_vs_torch_update":
                        statistics.median(a / u for a, u in zip(res["apply"], res["upd"]))}))
    return out


class LmdbCase:
    """A populated store for the LMDB-miss cases: rotating hot batches, warm-up and cold batches."""

    ROT = 8

    def __init__(self, work: Path, batch: int, dim: int, cold_blocks: int) -> None:
        self.path = work / f"lmdb{batch}"
        self.batch, self.dim, self.spec = batch, dim, _spec(dim)
        self.width = self.spec.row_dim
        n = (self.ROT + 2 + cold_blocks) * batch
        rng = np.random.default_rng(batch + 1)
        ids = rng.choice(NUM_ROWS, size=n, replace=False).astype(np.int64)
        self.hot = ids[: self.ROT * batch].reshape(self.ROT, batch)
        self.warm = ids[self.ROT * batch : (self.ROT + 2) * batch].reshape(2, batch)
        self.cold_ids = ids[(self.ROT + 2) * batch :].reshape(cold_blocks, batch)
        self.grads = _grads(batch, dim, 2)
        self.store = self._open()
        _populate(self.store, ids, dim)

    def _open(self) -> TierStore:
        # named: two tiers the misses rotate through; B-tree tables, which the py-lmdb ceiling
        # reads (a `txn.get` loop over the table's database)
        return TierStore(self.path, self.spec, device_capacity=self.batch, host_capacity=self.batch,
                         policy="lru", device_cache="slab", table_format="btree")

    def _raw(self) -> RawLmdb:
        return RawLmdb(self.store.backend.env, self.store.backend.table_db(TABLE), self.width)

    def cached(self, threads: int, blocks: int, reps: int, prof: list[str] | None) -> list[dict]:
        """Rows miss both caches and come from page-cached LMDB."""
        st, b = self.store, self.batch
        for p in self.hot:  # warm the page cache and fill both caches
            st.read(TABLE, torch.from_numpy(p))
        it = {"i": 0, "c": 0}

        def nxt():  # the store's rotation: every batch was evicted since its last use
            it["i"] = (it["i"] + 1) % self.ROT
            return self.hot[it["i"]]

        def nxt_raw():  # the ceiling's own rotation, so it does not shift the store's
            it["c"] = (it["c"] + 1) % self.ROT
            return self.hot[it["c"]]

        raw = self._raw()
        out = []
        for op in ("read", "apply"):
            if op == "read":
                def run():
                    st.read(TABLE, torch.from_numpy(nxt()))

                def ceil():
                    raw.read(nxt_raw())
            else:
                def run():
                    st.apply(TABLE, torch.from_numpy(nxt()), self.grads)

                def ceil():
                    raw.read_write(nxt_raw())
            before = st.stats()["ssd"]["lookups"]
            res = paired_rates({"store": run, "ceil": ceil}, b, blocks, reps)
            assert st.stats()["ssd"]["lookups"] - before == b * blocks * reps, "a row hit a cache"
            if prof is not None:
                _profile(run, reps, f"lmdb_cached {op} b={b} t={threads}", prof)
            ceiling = "lmdb get loop" if op == "read" else "lmdb get loop + putmulti"
            out.append(_record("lmdb_cached", op, b, threads, res["store"], ceiling, res["ceil"]))
        return out

    def _reopen_cold(self) -> None:
        self.store.close()
        drop_page_cache(self.path / "data.mdb")
        self.store = self._open()

    def cold(self, threads: int, prof: list[str] | None) -> list[dict]:
        """Each timed call reads rows whose pages were dropped from the page cache."""
        b, out = self.batch, []
        for op in ("read", "apply"):
            rates, crates = [], []
            for ids in self.cold_ids:
                self._reopen_cold()
                st = self.store
                for w in self.warm:  # refill the caches (and the B-tree's upper pages)
                    if op == "read":
                        st.read(TABLE, torch.from_numpy(w))
                    else:
                        st.apply(TABLE, torch.from_numpy(w), self.grads)
                t0 = time.perf_counter()
                if op == "read":
                    st.read(TABLE, torch.from_numpy(ids))
                else:
                    st.apply(TABLE, torch.from_numpy(ids), self.grads)
                rates.append(b / (time.perf_counter() - t0))
                # the raw ceiling under the same protocol, on the store's own environment
                self._reopen_cold()
                raw = self._raw()
                for w in self.warm:
                    raw.read(w)
                t0 = time.perf_counter()
                if op == "read":
                    raw.read(ids)
                else:
                    raw.read_write(ids)
                crates.append(b / (time.perf_counter() - t0))
            ceiling = "lmdb get loop" if op == "read" else "lmdb get loop + putmulti"
            out.append(_record("lmdb_cold", op, b, threads, rates, ceiling, crates))
        return out

    def close(self) -> None:
        """Close the store."""
        self.store.close()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(prog="python -m bench.store", description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="4096,65536", help="batch sizes (unique ids per call)")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--threads", default="1,default", help="torch thread counts, e.g. 1,default")
    p.add_argument("--blocks", type=int, default=5, help="timed blocks per figure (median)")
    p.add_argument("--rows-per-block", type=int, default=262144, help="rows per timed block")
    p.add_argument("--cap", type=int, default=1 << 20, help="cache tier capacity in rows (hits)")
    p.add_argument("--cold-blocks", type=int, default=3, help="cold calls per figure; 0 skips cold")
    p.add_argument("--workdir", default=None, help="where the stores go (default: a temp dir on disk)")
    p.add_argument("--out", default=str(OUT_DIR))
    p.add_argument("--profile", action="store_true", help="also cProfile each store case")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--quick", action="store_true", help="a short run with small sizes")
    args = p.parse_args(argv)
    if args.quick:
        args.batches, args.blocks, args.rows_per_block = "1024,8192", 3, 16384
        args.cap, args.cold_blocks = min(args.cap, 65536), min(args.cold_blocks, 1)
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the store benchmark, print a table, write JSON (+ PNG) under --out."""
    args = parse_args(argv)
    batches = [int(b) for b in args.batches.split(",") if b]
    threads = thread_settings(args.threads)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench_store_", dir=args.workdir or out_dir))
    prof: list[str] | None = [] if args.profile else None
    records: list[dict] = []
    try:
        for b in batches:
            reps = max(1, args.rows_per_block // b)
            cap = max(args.cap, 4 * b)
            case = LmdbCase(work, b, args.dim, args.cold_blocks)
            try:
                for n in threads:
                    with num_threads(n):
                        records += bench_cache_hits(work, b, args.dim, cap, n, args.blocks, reps, prof)
                        records += case.cached(n, args.blocks, reps, prof)
                        print(f"batch {b}, {n} thread(s): done", file=sys.stderr, flush=True)
                if args.cold_blocks:
                    with num_threads(threads[0]):
                        records += case.cold(threads[0], prof)
            finally:
                case.close()
                shutil.rmtree(case.path, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(table(records, [("case", "case", "s"), ("op", "op", "s"), ("batch", "batch", "d"),
                          ("threads", "thr", "d"), ("rows_per_s", "rows/s", ",.0f"),
                          ("ceiling", "ceiling", "s"), ("ceiling_rows_per_s", "ceiling rows/s", ",.0f"),
                          ("ratio", "ratio", ".3f"), ("target", "target", ".1f"),
                          ("meets_target", "ok", "")]))
    meta = {"bench": "store", "argv": sys.argv[1:] if argv is None else argv, "dim": args.dim,
            "optimizer": "rowwise_adagrad", "cap": args.cap, "threads": threads, "quick": args.quick}
    path = save("store", records, meta, out_dir)
    print(f"wrote {path}")
    if prof is not None:
        ppath = out_dir / "store_profile.txt"
        ppath.write_text("\n".join(prof))
        print(f"wrote {ppath}")
    if not args.no_plot:
        labels = [f"{r['case']} {r['op']}\nb={r['batch']} t={r['threads']}" for r in records]
        bar_plot(out_dir / "store.png", labels, {"store / ceiling": [r["ratio"] for r in records]},
                 "ratio to ceiling (same run)", "bench.store: tierstore vs ceilings")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
