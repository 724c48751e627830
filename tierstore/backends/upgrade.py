"""In-place conversion of a closed store of an older on-disk format (1 or 2) to the current one (3)."""

from __future__ import annotations

import json
import os
import uuid
from itertools import islice
from pathlib import Path

import lmdb
import numpy as np

from ..config import TableSpec
from ..errors import ConfigMismatchError, TierstoreError
from .format import CHUNK_FORMAT, FORMAT_VERSION
from .lmdb_backend import DATA_NAME, META_DB, LmdbBackend, decode_keys, fsync_path
from .record import seal
from .wal import replay_stored

_CHUNK = 16384


def upgrade_store(path: str | os.PathLike) -> dict:
    """Convert a closed store of format 1 or 2 to format 3 in place; returns a report.

    Format 1 (rows without stamp or checksum): each row gets a last-update stamp of 0 and its
    checksum; the new file is written beside the old one, synced, and renamed over it, so a
    crash leaves the old store or the new one, whole. Format 2 (the write-behind log inside the
    tables' file): its log is merged into the tables and dropped, then the version is bumped
    (a writable `TierStore` open does the same). A store already at format 3 or 4 is left as it is.
    """
    path = Path(path)
    backend = LmdbBackend(path)  # the writer lock: nobody else has the store open
    try:
        store = backend.get_meta("store")
        if store is None:
            raise TierstoreError(f"{path} holds no tierstore store")
        version = store.get("format_version")
        if version in (FORMAT_VERSION, CHUNK_FORMAT):
            return {"path": str(path), "upgraded": False, "rows": 0}
        if version == 2:
            return {"path": str(path), "upgraded": True, "rows": replay_and_convert(backend)}
        if version != 1:
            raise ConfigMismatchError(f"store {path} has format version {version!r}; "
                                      "this tierstore converts versions 1 and 2")
        specs = {f"t:{k[6:]}".encode(): TableSpec.from_config(backend.get_meta(k))
                 for k in backend.meta_keys() if k.startswith("table:")}
        tmp = path / f".upgrade-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        rows = 0
        txn = backend.snapshot()
        try:
            need = 2 * backend.used_bytes() + (64 << 20)
            env = lmdb.open(str(tmp), map_size=need, max_dbs=len(backend.snap_dbs) + 2, subdir=True,
                            lock=False, sync=False, metasync=False, readahead=False)
            try:
                for name, db in backend.snap_dbs.items():
                    out = env.open_db(name, create=True)
                    it = txn.cursor(db=db).iternext(keys=True, values=True)
                    while items := list(islice(it, _CHUNK)):
                        if name == META_DB:
                            items = [(k, _upgraded_meta(k, v)) for k, v in items]
                        elif name in specs:
                            items = _upgraded_rows(specs[name], items)
                            rows += len(items)
                        with env.begin(write=True, db=out) as w:
                            w.cursor().putmulti(items, append=True)
                env.sync(True)
            finally:
                env.close()
        finally:
            txn.abort()
        fsync_path(tmp / DATA_NAME)
        backend.env.close()
        backend.env = None
        os.replace(tmp / DATA_NAME, path / DATA_NAME)
        (path / "lock.mdb").unlink(missing_ok=True)
        fsync_path(path)
        for leftover in tmp.iterdir():
            leftover.unlink()
        tmp.rmdir()
        return {"path": str(path), "upgraded": True, "rows": rows}
    finally:
        backend.close()


def replay_and_convert(backend: LmdbBackend) -> int:
    """Fold a write-behind log left by a crash into the tables (`wal.replay_stored`); a store of
    format 2 (its log inside the tables' file, now merged and dropped) is then recorded as the
    current format. Returns the rows the replay wrote."""
    rows = replay_stored(backend)
    store = backend.get_meta("store")
    if store is not None and store.get("format_version") == 2:
        backend.put_meta({"store": {**store, "format_version": FORMAT_VERSION}})
        backend.sync()
    return rows


def _upgraded_meta(key: bytes, value: bytes) -> bytes:
    if key != b"store":
        return value
    rec = json.loads(value)
    rec["format_version"] = FORMAT_VERSION
    return json.dumps(rec, sort_keys=True).encode()


def _upgraded_rows(spec: TableSpec, items: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """Version-1 records (payload only) -> version-2 records (payload, stamp 0, checksum)."""
    ids = decode_keys([k for k, _ in items])
    old = np.frombuffer(b"".join(v for _, v in items), dtype=np.float32)
    if old.size != len(items) * spec.payload_dim:
        raise ConfigMismatchError(f"table {spec.name!r}: version-1 rows have the wrong size")
    rows = np.zeros((len(items), spec.row_dim), dtype=np.float32)
    rows[:, : spec.payload_dim] = old.reshape(len(items), spec.payload_dim)
    rec = seal(ids, rows)
    return list(zip((k for k, _ in items), rec.view(f"V{rec.shape[1]}").ravel().tolist()))
