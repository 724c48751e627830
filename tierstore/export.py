"""Portable export/import: tables as zstd-compressed shards of rows under a versioned manifest.

Layout: `manifest.json` (written last) and `<table>/<k>.zst`. A shard decompresses to the row ids
of a contiguous id range (sorted, delta-encoded little-endian int64) followed by their payloads
(little-endian float32 [n, row_dim]: weights, optimizer state, then the last-update stamp as
int32 bits; a float16/bfloat16 table's weights are packed two per column, see
tierstore/precision.py), optionally byte-shuffled
(all first bytes of the floats, then all second bytes, ...). Export and import stream one shard
at a time, so memory is bounded by the shard size, not by the table.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import zstandard

from ._version import __version__
from .backends.format import FORMAT_VERSION, ROW_FORMATS
from .backends.lmdb_backend import LmdbBackend, lmdb_errors
from .backends.wal import replay_stored
from .config import TableSpec, parse_size
from .errors import ConfigError, ConfigMismatchError, StoreCorruptError, TierstoreError
from .persistence import (
    MANIFEST as CHECKPOINT_MANIFEST,
)
from .persistence import (
    check_apart,
    check_new_dir,
    check_seal,
    end_staging,
    is_staging,
    load_manifest,
    os_error,
    publish_dir,
    seal,
    staging_dir,
    verify_checkpoint,
    write_json_atomic,
)

if TYPE_CHECKING:
    from .store import TierStore

EXPORT_FORMAT = "tierstore-export"
EXPORT_VERSION = 2  # 2: shards hold row_dim columns (payload + last-update stamp)
MANIFEST = "manifest.json"
DEFAULT_SHARD_BYTES = 32 << 20


# codec -------------------------------------------------------------------------------------------
def encode_shard(ids: np.ndarray, payload: np.ndarray, shuffle: bool) -> bytes:
    """Raw (uncompressed) shard bytes: delta-encoded ids then (shuffled) float32 payloads."""
    ids = np.ascontiguousarray(ids, dtype="<i8")
    deltas = np.diff(ids, prepend=np.zeros(1, "<i8")).astype("<i8")
    pay = np.ascontiguousarray(payload, dtype="<f4").view(np.uint8)
    if shuffle:
        pay = pay.reshape(-1, 4).T
    return deltas.tobytes() + np.ascontiguousarray(pay).tobytes()


def decode_shard(raw: bytes, n: int, width: int, shuffle: bool) -> tuple[np.ndarray, np.ndarray]:
    """Inverse of `encode_shard`: (ids int64 [n], payload float32 [n, width])."""
    if len(raw) != n * (8 + 4 * width):
        raise StoreCorruptError(f"shard holds {len(raw)} bytes, expected {n * (8 + 4 * width)}")
    ids = np.cumsum(np.frombuffer(raw, "<i8", count=n)).astype(np.int64)
    pay = np.frombuffer(raw, np.uint8, offset=8 * n)
    if shuffle:
        pay = pay.reshape(4, -1).T
    return ids, np.ascontiguousarray(pay).view("<f4").reshape(n, width).astype(np.float32)


# export ------------------------------------------------------------------------------------------
@contextmanager
def _source(src: TierStore | str | os.PathLike) -> Iterator[tuple[LmdbBackend, Any]]:
    """(backend, read snapshot) of an open store, a store directory or a checkpoint directory."""
    from .store import TierStore

    backend, owned = None, False
    if isinstance(src, TierStore):
        src.flush()
        backend = src.backend
    else:
        path = Path(src)
        if path.exists() and not path.is_dir():
            raise ConfigError(f"export source {path} is not a directory")
        if not (path / "data.mdb").is_file():
            raise StoreCorruptError(f"{path} holds no tierstore store or checkpoint")
        if (path / CHECKPOINT_MANIFEST).exists():
            verify_checkpoint(path)  # immutable: read without a lock
            backend = LmdbBackend(path, readonly=True)
        else:
            backend = LmdbBackend(path)  # takes the writer lock: nobody changes it meanwhile
            try:  # a write-behind log left by a crash holds the newest versions of its rows
                replay_stored(backend)
            except BaseException:
                backend.close()
                raise
        owned = True
    try:
        txn = backend.snapshot()
        try:
            yield backend, txn
        finally:
            txn.abort()
    finally:
        if owned:
            backend.close()


def export_store(src: TierStore | str | os.PathLike, dest: str | os.PathLike, *, level: int = 1,
                 shuffle: bool = True, shard_bytes: int | str = DEFAULT_SHARD_BYTES,
                 overwrite: bool = False, progress: Callable[[int], None] | None = None) -> dict:
    """Dump every table of a store (or checkpoint) to `dest` as compressed shards; the manifest.

    `progress` gets the rows read after each chunk (the `tierstore export` progress bar).
    """

    dest = Path(dest)
    shard_bytes = parse_size(shard_bytes)
    if isinstance(level, bool) or not isinstance(level, int) or not 1 <= level <= 22:
        raise ConfigError(f"zstd level must be an int in [1, 22], got {level!r}")
    if shard_bytes < 1:
        raise ConfigError(f"shard size must be positive, got {shard_bytes}")
    check_apart(dest, src.path if hasattr(src, "path") else Path(src), "export destination",
                "the source")
    check_new_dir(dest, overwrite, "export destination")
    t0 = time.perf_counter()
    with lmdb_errors(src.path if hasattr(src, "path") else src), _source(src) as (backend, txn):
        meta = backend.snapshot_meta(txn)
        store_meta = meta.get("store") or {}
        if store_meta.get("format_version") not in ROW_FORMATS:
            raise ConfigMismatchError(
                f"store format version {store_meta.get('format_version')!r}; this tierstore "
                f"exports version {FORMAT_VERSION}")
        specs = [TableSpec.from_config(v) for k, v in sorted(meta.items())
                 if k.startswith("table:")]
        cutoffs = meta.get("expiry") or {}  # rows stamped below read as missing: not exported
        try:
            staging = staging_dir(dest)
        except OSError as exc:
            raise os_error(exc, f"cannot create export {dest}") from exc
        try:
            cctx = zstandard.ZstdCompressor(level=level)
            tables, raw_total, out_total = [], 0, 0
            for spec in specs:
                (staging / spec.name).mkdir()
                chunk = max(1, shard_bytes // (8 + 4 * spec.row_dim))
                shards = []
                for ids, payload in backend.iter_rows(spec.name, spec.row_dim, txn, chunk):
                    if progress is not None:
                        progress(len(ids))
                    if spec.name in cutoffs:  # expired, not yet deleted by the ttl deleter
                        live = payload[:, spec.stamp_col].view(np.int32) >= cutoffs[spec.name]
                        ids, payload = ids[live], payload[live]
                        if len(ids) == 0:
                            continue
                    raw = encode_shard(ids, payload, shuffle)
                    blob = cctx.compress(raw)
                    rel = f"{spec.name}/{len(shards):05d}.zst"
                    with open(staging / rel, "wb") as f:
                        f.write(blob)
                        f.flush()
                        os.fsync(f.fileno())
                    shards.append({"file": rel, "rows": len(ids), "first_id": int(ids[0]),
                                   "last_id": int(ids[-1]), "raw_bytes": len(raw),
                                   "bytes": len(blob), "sha256": hashlib.sha256(blob).hexdigest()})
                    raw_total += len(raw)
                    out_total += len(blob)
                tables.append({"spec": spec.to_config(), "rows": sum(s["rows"] for s in shards),
                               "shards": shards})
            manifest = {"format": EXPORT_FORMAT, "version": EXPORT_VERSION,
                        "tierstore_version": __version__, "created_unix": time.time(),
                        "seed": int(store_meta.get("seed", 0)),
                        "codec": {"name": "zstd", "level": level, "shuffle": bool(shuffle),
                                  "ids": "delta<i8", "payload": "<f4"},
                        "raw_bytes": raw_total, "bytes": out_total, "tables": tables}
            manifest["seconds"] = time.perf_counter() - t0
            write_json_atomic(staging / MANIFEST, seal(manifest))
            publish_dir(staging, dest)
        except OSError as exc:
            raise os_error(exc, f"cannot write export {dest}") from exc
        finally:
            end_staging(staging)
    return manifest


# import ------------------------------------------------------------------------------------------
def read_export_manifest(src: str | os.PathLike) -> dict:
    """The manifest of an export directory; raises on a missing, foreign or malformed one."""
    src = Path(src)
    if is_staging(src):
        raise StoreCorruptError(f"{src} is the staging directory of an export that did not finish")
    manifest = load_manifest(src, MANIFEST, "export", EXPORT_FORMAT, EXPORT_VERSION)
    codec = manifest.get("codec") or {}
    if not isinstance(codec, dict) or codec.get("name") != "zstd" or \
            codec.get("ids") != "delta<i8" or codec.get("payload") != "<f4":
        raise ConfigMismatchError(f"export {src} uses an unknown codec {codec!r}")
    check_seal(manifest, src / MANIFEST, "export")
    try:
        if not isinstance(codec.get("shuffle"), bool):
            raise ValueError(f"codec.shuffle must be true or false, got {codec.get('shuffle')!r}")
        manifest["specs"] = [TableSpec.from_config(t["spec"]) for t in manifest["tables"]]
        for t in manifest["tables"]:
            last = -1
            for s in t["shards"]:
                int(s["bytes"]), int(s["raw_bytes"]), str(s["sha256"])
                rows, first, end = int(s["rows"]), int(s["first_id"]), int(s["last_id"])
                if rows < 1 or first <= last or end < first or end - first + 1 < rows:
                    raise ValueError(f"shard {s['file']!r} lists {rows} rows in [{first}, {end}] "
                                     f"after id {last}")
                last = end
                if not isinstance(s["file"], str) or ".." in Path(s["file"]).parts or \
                        Path(s["file"]).is_absolute():
                    raise ValueError(f"bad shard path {s['file']!r}")
            if int(t["rows"]) != sum(int(s["rows"]) for s in t["shards"]):
                raise ValueError(f"table {t['spec']['name']!r} lists {t['rows']} rows, its "
                                 f"shards {sum(int(s['rows']) for s in t['shards'])}")
        int(manifest["seed"])
    except (KeyError, TypeError, ValueError, TierstoreError) as exc:
        raise StoreCorruptError(f"export manifest {src / MANIFEST} is malformed: {exc!r}") from exc
    return manifest


def _read_shard(src: Path, shard: dict, spec: TableSpec, shuffle: bool,
                dctx: zstandard.ZstdDecompressor) -> tuple[np.ndarray, np.ndarray]:
    """Read, check and decode one shard."""
    path = src / shard["file"]
    try:
        blob = path.read_bytes()
    except OSError as exc:
        raise StoreCorruptError(f"export shard {path} is unreadable: {exc}") from exc
    if len(blob) != shard["bytes"] or hashlib.sha256(blob).hexdigest() != shard["sha256"]:
        raise StoreCorruptError(f"export shard {path} is corrupt or truncated")
    try:
        raw = dctx.decompress(blob, max_output_size=int(shard["raw_bytes"]))
    except zstandard.ZstdError as exc:
        raise StoreCorruptError(f"export shard {path} does not decompress: {exc}") from exc
    ids, payload = decode_shard(raw, int(shard["rows"]), spec.row_dim, shuffle)
    if len(ids) and (ids[0] < 0 or ids[-1] >= spec.num_rows or
                     (len(ids) > 1 and not bool((ids[1:] > ids[:-1]).all()))):
        raise StoreCorruptError(f"export shard {path} holds row ids that are out of order or range")
    if len(ids) and (int(ids[0]) != int(shard["first_id"]) or int(ids[-1]) != int(shard["last_id"])):
        raise StoreCorruptError(f"export shard {path} holds ids [{ids[0]}, {ids[-1]}], its manifest "
                                f"entry says [{shard['first_id']}, {shard['last_id']}]")
    return ids, payload


def import_store(src: str | os.PathLike, path: str | os.PathLike, *,
                 map_limit: int | str | None = None,
                 progress: Callable[[int], None] | None = None,
                 table_format: str | None = None) -> dict:
    """Build a new store at `path` from the export `src`; returns the export's manifest.

    `progress` gets the rows written after each shard (the `tierstore import` progress bar).
    `table_format`: the new store's tables, "chunks" or "btree" (`StoreConfig.table_format`;
    None: its default, "chunks"): an export and an import convert a store from one to the other.

    The store is assembled beside `path` and renamed into place only once every shard has been
    verified and written, so a bad export or a full disk leaves `path` as it was.
    """
    from .store import TierStore

    src, path = Path(src), Path(path)
    manifest = read_export_manifest(src)
    check_apart(path, src, "import destination", "the export")
    check_new_dir(path, False, "import destination",
                  "an import builds a new store: choose a new path or remove this one")
    shuffle = bool(manifest["codec"].get("shuffle"))
    try:
        staging = staging_dir(path)
    except OSError as exc:
        raise os_error(exc, f"cannot create store {path}") from exc
    t0 = time.perf_counter()
    try:
        store = TierStore(staging / "store", manifest["specs"], device_capacity=0, host_capacity=0,
                          seed=int(manifest["seed"]), device="cpu", map_limit=map_limit,
                          **({} if table_format is None else {"table_format": table_format}))
        try:
            dctx = zstandard.ZstdDecompressor()
            for spec, table in zip(manifest["specs"], manifest["tables"]):
                for shard in table["shards"]:
                    ids, payload = _read_shard(src, shard, spec, shuffle, dctx)
                    if len(ids):
                        store.backend.put({spec.name: (ids, payload)})
                    if progress is not None:
                        progress(len(ids))
        finally:
            store.close()
        publish_dir(staging / "store", path)
    except OSError as exc:
        raise os_error(exc, f"cannot import into {path}") from exc
    finally:
        end_staging(staging)
    manifest["import_seconds"] = time.perf_counter() - t0
    return manifest
