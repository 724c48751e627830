"""Format 4's page-sized chunks against today's B-tree of rows: `python -m bench.pagechunks`.

One table of `--rows` random ids (a sparse id space, as lazily created rows are), each stored
three ways in its own LMDB file: a B-tree of one entry a row grown by sorted batches of random
inserts (how the store's merges grow a table today), the same rows appended in id order (a
dense B-tree, as a compaction writes it), and page-sized chunks (`backends/pagechunks.py`).
Per layout: bytes on disk a row against the raw row, the CPU time to write the rows, a warm
read (page-cached) in microseconds a row through the compiled page walk, and a cold read (the
file dropped from the page cache): the bytes the kernel read from the disk a row, in 4 KiB
pages (`/proc/self/io`), and microseconds a row.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

import lmdb
import numpy as np

from tierstore.backends import pagechunks
from tierstore.backends.lmdb_common import encode_keys
from tierstore.backends.pages import PageReader
from tierstore.backends.record import open_records, seal

from .common import bar_plot, io_bytes, save, table


def _read_bytes() -> int:
    """Bytes this process made the kernel read from storage so far."""
    return io_bytes("read_bytes")


def _build(path: Path, layout: str, ids: np.ndarray, recs: np.ndarray, batch: int) -> float:
    """Write the rows in `layout`; returns CPU seconds."""
    env = lmdb.open(str(path), map_size=1 << 36, max_dbs=2, sync=False, writemap=False)
    db = env.open_db(b"t")
    c0 = time.process_time()
    if layout == "chunks":
        pagechunks.write(env, db, ids, recs)
    elif layout == "btree_dense":
        keys = encode_keys(ids)
        for lo in range(0, len(ids), 1 << 16):
            with env.begin(write=True, db=db) as txn:
                txn.cursor().putmulti(zip(keys[lo : lo + (1 << 16)], recs[lo : lo + (1 << 16)]),
                                      append=True)
    else:  # sorted batches of random rows, as merges insert them
        order = np.random.default_rng(1).permutation(len(ids))
        for lo in range(0, len(ids), batch):
            part = np.sort(order[lo : lo + batch])
            keys = encode_keys(ids[part])
            with env.begin(write=True, db=db) as txn:
                txn.cursor().putmulti(zip(keys, recs[part]))
    env.sync()
    cpu = time.process_time() - c0
    env.close()
    return cpu


def _read(path: Path, layout: str, q: np.ndarray, row_dim: int, cold: bool) -> tuple[float, float, int]:
    """(us a row, pages read from the disk a row, rows found) for sorted ids `q`."""
    data = path / "data.mdb"
    if cold:
        fd = os.open(data, os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    env = lmdb.open(str(path), readonly=True, lock=False, max_dbs=2, readahead=False)
    env.open_db(b"t", create=False)
    reader = PageReader(data, env.stat()["psize"])
    rb = 4 * row_dim + 4
    b0, t0 = _read_bytes(), time.perf_counter()
    with env.begin() as txn:
        if layout == "chunks":
            got = pagechunks.lookup(reader, txn, b"t", "t", q, row_dim)
            found = got[1]
        else:
            vals, found = reader.lookup(txn.get(b"t"), q.astype(np.uint64), rb)
            open_records("t", q[found], vals[found], row_dim)
    dt = time.perf_counter() - t0
    pages = (_read_bytes() - b0) / 4096
    env.close()
    return 1e6 * dt / len(q), pages / len(q), int(found.sum())


def main(argv: list[str] | None = None) -> int:
    """Run the comparison; prints a table and writes bench/out/pagechunks.json and .png."""
    ap = argparse.ArgumentParser(prog="python -m bench.pagechunks", description=__doc__)
    ap.add_argument("--rows", type=float, default=2e6)
    ap.add_argument("--row-dims", default="17,65", help="float32 words a row (payload + stamp)")
    ap.add_argument("--batch", type=int, default=200_000, help="rows a merge inserts (btree)")
    ap.add_argument("--reads", type=int, default=4000, help="ids a read (half stored)")
    ap.add_argument("--work", default=None, help="where the stores go (default: a temp dir)")
    ap.add_argument("--out", default=None, help="where the JSON and PNG go (default: bench/out)")
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    n = int(args.rows)
    ids = np.unique(rng.integers(0, 50 * n, int(n * 1.02)))[:n]
    work = Path(args.work or tempfile.mkdtemp(prefix="tierstore-pagechunks-"))
    results = []
    for row_dim in [int(x) for x in args.row_dims.split(",")]:
        recs = seal(ids, rng.standard_normal((n, row_dim)).astype(np.float32))
        raw = 4 * row_dim
        q = np.unique(np.concatenate([rng.choice(ids, args.reads // 2),  # the same ids each layout
                                      rng.integers(0, 50 * n, args.reads // 2)]))
        for layout in ("btree", "btree_dense", "chunks"):
            path = work / f"{layout}_{row_dim}"
            shutil.rmtree(path, ignore_errors=True)
            path.mkdir(parents=True)
            cpu = _build(path, layout, ids, recs, args.batch)
            size = (path / "data.mdb").stat().st_size
            _read(path, layout, q, row_dim, cold=False)  # the mapping and code warmed
            warm_us, _, found = _read(path, layout, q, row_dim, cold=False)
            cold_us, cold_pages, _ = _read(path, layout, q, row_dim, cold=True)
            r = {"row_dim": row_dim, "layout": layout, "rows": n, "disk_x_raw": size / (n * raw),
                 "write_us_row": 1e6 * cpu / n, "warm_us_row": warm_us, "cold_us_row": cold_us,
                 "cold_pages_row": cold_pages, "reads": len(q), "found": found}
            results.append(r)
            shutil.rmtree(path, ignore_errors=True)
    print()
    print(table(results, [("row_dim", "row words", ""), ("layout", "layout", ""),
                          ("disk_x_raw", "disk x raw", ".2f"), ("write_us_row", "write us/row", ".2f"),
                          ("warm_us_row", "warm us/row", ".2f"), ("cold_us_row", "cold us/row", ".1f"),
                          ("cold_pages_row", "cold pages/row", ".2f")]))
    path = save("pagechunks", results, {"args": vars(args)}, args.out)
    print(f"wrote {path}")
    if not args.no_plot:
        dims = sorted({r["row_dim"] for r in results})
        groups = {lay: [next(r["disk_x_raw"] for r in results if r["row_dim"] == d and r["layout"] == lay)
                        for d in dims] for lay in ("btree", "btree_dense", "chunks")}
        png = path.with_suffix(".png")
        bar_plot(png, [f"{d} words a row" for d in dims], groups, "disk / raw row bytes",
                 "format 4's page-sized chunks vs B-trees: bytes on disk", target=2.0)
        print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
