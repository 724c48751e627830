"""Row-wise int8/int4 quantized export for inference, readable by `ReadOnlyStore`.

Each row of weights (no optimizer state) is stored as `[scale f32 | bias f32 | codes]`, with
`bias` the row's minimum, `scale` = (max - min) / (2**bits - 1) and codes = round((w - bias) /
scale) (int4: two codes per byte, low nibble first), padded to whole float32 columns. A value
reads back as `bias + scale * code`: at most scale / 2 from the original. The export is an LMDB
environment (`data.mdb`, the same key layout as a store) with a `quantized` metadata record and a
`manifest.json` (written last), so `ReadOnlyStore(dir)` serves it directly. Rows the source
never stored are not exported; they read as their deterministic init, as in the store.
"""

from __future__ import annotations

import os
import shutil
import time
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING

import lmdb
import numpy as np
import torch

from .backends.format import FORMAT_VERSION, ROW_FORMATS
from .backends.lmdb_backend import META_DB, encode_keys, fsync_path
from .backends.record import CHECK_BYTES, seal
from .config import TableSpec
from .errors import ConfigMismatchError
from .persistence import check_apart, check_new_dir, os_error, publish_dir, staging_dir, write_json_atomic
from .qcodec import BITS as BITS  # re-exported
from .qcodec import _check_dtype, quantize, stored_width
from .qcodec import dequantize as dequantize  # re-exported

if TYPE_CHECKING:
    from .store import TierStore

QUANT_FORMAT = "tierstore-quantized"
QUANT_VERSION = 1
_CHUNK = 65536


def export_quantized(src: TierStore | str | os.PathLike, dest: str | os.PathLike, dtype: str, *,
                     overwrite: bool = False) -> dict:
    """Write every table's weights row-wise quantized to `dest`; returns the manifest."""
    import json

    from .export import MANIFEST, _source

    _check_dtype(dtype)
    dest = Path(dest)
    check_apart(dest, src.path if hasattr(src, "path") else Path(src), "export destination",
                "the source")
    check_new_dir(dest, overwrite, "export destination")
    t0 = time.perf_counter()
    with _source(src) as (backend, txn):
        meta = backend.snapshot_meta(txn)
        store_meta = meta.get("store") or {}
        if store_meta.get("format_version") not in ROW_FORMATS:
            raise ConfigMismatchError(
                f"store format version {store_meta.get('format_version')!r}; this tierstore "
                f"exports version {FORMAT_VERSION}")
        specs = [TableSpec.from_config(v) for k, v in sorted(meta.items())
                 if k.startswith("table:")]
        need = 1 << 24
        for spec in specs:
            need += backend.snapshot_count(txn, spec.name) * \
                (24 + CHECK_BYTES + 4 * stored_width(spec.dim, dtype))
        try:
            staging = staging_dir(dest)
        except OSError as exc:
            raise os_error(exc, f"cannot create export {dest}") from exc
        try:
            env = lmdb.open(str(staging), map_size=2 * need, max_dbs=len(specs) + 2, subdir=True,
                            lock=False, sync=False, metasync=False, readahead=False)
            tables = []
            try:
                widths = {s.name: stored_width(s.dim, dtype) for s in specs}
                # its tables are B-trees whatever the source's: the record says format 3 (a
                # chunked source's format 4 would tell readers to look for chunk manifests)
                records = {"store": {**store_meta, "format_version": FORMAT_VERSION},
                           "quantized": {"dtype": dtype, "widths": widths}}
                records.update({f"table:{s.name}": s.to_config() for s in specs})
                mdb = env.open_db(META_DB, create=True)
                with env.begin(write=True, db=mdb) as w:
                    for k, v in records.items():
                        w.put(k.encode(), json.dumps(v, sort_keys=True).encode())
                for spec in specs:
                    db = env.open_db(f"t:{spec.name}".encode(), create=True)
                    rows = 0
                    for ids, payload in backend.iter_rows(spec.name, spec.row_dim, txn, _CHUNK):
                        cols = torch.from_numpy(np.array(payload[:, : spec.weight_cols]))  # own, writable
                        weights = spec.codec.decode(cols, spec.dim).numpy()
                        blob = seal(ids, quantize(weights, dtype))  # checksummed, as a store's rows
                        vals = blob.view(f"V{blob.shape[1]}").ravel().tolist()
                        it = zip(encode_keys(ids), vals)
                        while items := list(islice(it, 8192)):
                            with env.begin(write=True, db=db) as w:
                                w.cursor().putmulti(items, append=True)
                        rows += len(ids)
                    per_row = 4 * widths[spec.name] + CHECK_BYTES  # with the checksum
                    tables.append({"name": spec.name, "rows": rows, "dim": spec.dim,
                                   "bytes_per_row": per_row,
                                   "float32_bytes_per_row": 4 * spec.dim + CHECK_BYTES})
                env.sync(True)
            finally:
                env.close()
            fsync_path(staging / "data.mdb")
            manifest = {"format": QUANT_FORMAT, "version": QUANT_VERSION, "dtype": dtype,
                        "seed": int(store_meta.get("seed", 0)), "created_unix": time.time(),
                        "tables": tables, "bytes": (staging / "data.mdb").stat().st_size,
                        "seconds": time.perf_counter() - t0}
            write_json_atomic(staging / MANIFEST, manifest)
            publish_dir(staging, dest)
        except OSError as exc:
            shutil.rmtree(staging, ignore_errors=True)
            raise os_error(exc, f"cannot write export {dest}") from exc
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    return manifest
