"""`tierstore verify PATH`: a full structural and checksum scan of a closed store or checkpoint.

First every B-tree page of `data.mdb` (and of a crash-left write-behind log, `wlog/data.mdb`) is
walked from the file, before LMDB opens it (`backends/pagecheck.py`: page numbers, flags, bounds,
nodes, key order, page and entry counts against each database's record); then every row is read
back in id order and its checksum verified. Nothing is written: a crash-left log is checked, not
replayed. Damage is a `StoreCorruptError` naming the page or the row.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from .backends.lmdb_backend import LmdbBackend
from .backends.lmdb_common import DATA_NAME
from .backends.lmdb_meta import LOG_DIR, read_meta
from .backends.pagecheck import check_file
from .config import TableSpec
from .errors import StoreCorruptError, StoreLockedError
from .serving import writer_alive


def verify_store(path: str | os.PathLike, pages: Callable[[int], None] | None = None,
                 rows: Callable[[int], None] | None = None) -> dict:
    """Check a closed store's (or a checkpoint's) pages and row checksums; returns counts.

    `pages(n)` / `rows(n)` are told of progress (n pages / rows more checked). Returns
    {"path", "pages", "rows": {table: rows}, "log_pages"}.
    """
    path = Path(path)
    if not (path / DATA_NAME).is_file():
        raise StoreCorruptError(f"{path} holds no tierstore store or checkpoint (no {DATA_NAME})")
    if writer_alive(path):
        raise StoreLockedError(f"store {path} is open for writing: verify a closed store or a "
                               "checkpoint of it")
    walked = check_file(path / DATA_NAME, f"store {path}", pages)
    log = path / LOG_DIR / DATA_NAME
    log_pages = check_file(log, f"write-behind log of {path}", pages)["pages"] if log.exists() else 0
    meta = read_meta(path)["meta"]
    specs = [TableSpec.from_config(v) for k, v in sorted(meta.items()) if k.startswith("table:")]
    counts = {}
    backend = LmdbBackend(path, readonly=True)
    try:
        txn = backend.snapshot()  # (opens the tables' handles first)
        try:
            for spec in specs:
                n = 0
                for ids, _ in backend.iter_rows(spec.name, spec.row_dim, txn):  # checksums
                    n += len(ids)
                    if rows is not None:
                        rows(len(ids))
                counts[spec.name] = n
        finally:
            txn.abort()
    finally:
        backend.close()
    return {"path": str(path), "pages": walked["pages"], "rows": counts, "log_pages": log_pages}


def expected_work(path: str | os.PathLike) -> tuple[int, int]:
    """(pages, rows) a verify of `path` walks: for its progress bars."""
    path = Path(path)
    size = sum((p / DATA_NAME).stat().st_size for p in (path, path / LOG_DIR)
               if (p / DATA_NAME).exists())
    try:
        stored = sum(read_meta(path)["rows"].values())
    except Exception:  # reported by the verify itself
        stored = 0
    return size // 4096, stored
