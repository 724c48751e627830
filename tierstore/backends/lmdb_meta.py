"""A store's metadata read with py-lmdb alone: no torch, no numba (what `tierstore info` needs).

`read_meta` opens the tables' environment read-only, without LMDB's lock file (as a read-only
`LmdbBackend` does), and returns every metadata record, the rows stored per table and the bytes
on disk. It writes nothing and takes no writer lock, so it works beside a live store.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import lmdb

from ..errors import StoreCorruptError, TierstoreError
from .format import CHUNK_FORMAT

META_DB = b"__tierstore_meta__"
DATA_NAME = "data.mdb"
LOG_DIR = "wlog"  # the write-behind log's environment, inside the store's directory
LAST_OPEN = "last_open"  # metadata record: the table specs of the latest open, per table
LAST_LAYOUT = "last_layout"  # metadata record: the cache layout the latest open resolved, and why


def _allocated(path: Path) -> int:
    return path.stat().st_blocks * 512 if path.exists() else 0


def check_file_size(env: lmdb.Environment, data: Path, store: Path) -> int:
    """Raise StoreCorruptError when `data`, the file of `env`, is shorter than the pages its
    newest meta page says it holds (reading past the file's end through the map is SIGBUS);
    returns the bytes those pages take."""
    used = (env.info()["last_pgno"] + 1) * env.stat()["psize"]
    have = data.stat().st_size if data.exists() else 0
    if have < used:
        name = data.name if data.parent == store else data.relative_to(store)
        raise StoreCorruptError(f"store {store}: {name} is truncated ({have} bytes, LMDB needs {used})")
    return used


def read_meta(path: str | os.PathLike) -> dict:
    """{"meta": {key: record}, "rows": {table: rows stored}, "table_formats": {table: "chunks" or
    "btree"}, "disk_bytes", "map_used_bytes"}."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise TierstoreError(f"store path {path} exists and is not a directory")
    if not (path / DATA_NAME).exists():
        raise StoreCorruptError(f"{path} holds no tierstore data (no data.mdb)")
    try:
        env = lmdb.open(str(path), readonly=True, lock=False, subdir=True, max_dbs=4096,
                        readahead=False)
    except lmdb.Error as exc:
        raise StoreCorruptError(f"cannot open LMDB store at {path}: {exc}") from exc
    try:
        used = check_file_size(env, path / DATA_NAME, path)
        with env.begin() as txn:
            try:
                meta_db = env.open_db(META_DB, txn=txn, create=False)
            except lmdb.NotFoundError:
                raise StoreCorruptError(f"store at {path} has no tierstore metadata") from None
            meta = {k.decode(): json.loads(v) for k, v in txn.cursor(db=meta_db)}
            rows, formats = {}, {}
            chunked = (meta.get("store") or {}).get("format_version") == CHUNK_FORMAT
            for key in meta:
                if key.startswith("table:"):
                    table = key[len("table:"):]
                    # format 4: the manifest's counts, but for a table kept as a B-tree (its
                    # rows too wide for a chunk: it has a `t:` database)
                    btree = not chunked or txn.get(f"t:{table}".encode()) is not None
                    formats[table] = "btree" if btree else "chunks"
                    if not btree:
                        chunks = meta.get(f"chunks:{table}")
                        rows[table] = sum(int(c) for c in (chunks or {}).get("counts", []))
                        continue
                    try:
                        db = env.open_db(f"t:{table}".encode(), txn=txn, create=False)
                    except lmdb.NotFoundError:
                        rows[table] = 0
                        continue
                    rows[table] = int(txn.stat(db)["entries"])
    except lmdb.Error as exc:
        raise StoreCorruptError(f"cannot read the metadata of store {path}: {exc}") from exc
    except ValueError as exc:
        raise StoreCorruptError(f"store {path}: metadata is not valid JSON") from exc
    finally:
        env.close()
    disk = _allocated(path / DATA_NAME) + _allocated(path / LOG_DIR / DATA_NAME)
    return {"meta": meta, "rows": rows, "table_formats": formats, "disk_bytes": disk,
            "map_used_bytes": used}
