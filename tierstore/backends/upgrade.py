"""In-place conversion of a closed store from on-disk format version 1 to version 2."""

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
from .lmdb_backend import DATA_NAME, META_DB, LmdbBackend, decode_keys, fsync_path
from .record import seal

_CHUNK = 16384


def upgrade_store(path: str | os.PathLike) -> dict:
    """Rewrite a version-1 store (rows without stamp or checksum) as version 2; returns a report.

    Each row gets a last-update stamp of 0 and its checksum. The new file is written beside the
    old one, synced, and renamed over it: a crash leaves the old store or the new one, whole.
    A store already at version 2 is left as it is.
    """
    path = Path(path)
    backend = LmdbBackend(path)  # the writer lock: nobody else has the store open
    try:
        store = backend.get_meta("store")
        if store is None:
            raise TierstoreError(f"{path} holds no tierstore store")
        version = store.get("format_version")
        if version == 2:
            return {"path": str(path), "upgraded": False, "rows": 0}
        if version != 1:
            raise ConfigMismatchError(f"store {path} has format version {version!r}; "
                                      "this tierstore converts version 1 only")
        specs = {f"t:{k[6:]}".encode(): TableSpec.from_config(backend.get_meta(k))
                 for k in backend.meta_keys() if k.startswith("table:")}
        tmp = path / f".upgrade-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        rows = 0
        txn = backend.snapshot()
        try:
            need = 2 * backend.used_bytes() + (64 << 20)
            env = lmdb.open(str(tmp), map_size=need, max_dbs=len(backend._snap_dbs) + 2, subdir=True,
                            lock=False, sync=False, metasync=False, readahead=False)
            try:
                for name, db in backend._snap_dbs.items():
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


def _upgraded_meta(key: bytes, value: bytes) -> bytes:
    if key != b"store":
        return value
    rec = json.loads(value)
    rec["format_version"] = 2
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
