"""Moving between world sizes: export every shard into one export; import it under a new plan."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch
import zstandard

from ..errors import ConfigError, StoreCorruptError
from ..export import MANIFEST as EXPORT_MANIFEST
from ..export import _read_shard, export_store, read_export_manifest
from ..persistence import (
    DIGEST_KEY,
    check_apart,
    check_new_dir,
    os_error,
    publish_dir,
    seal,
    staging_dir,
    write_json_atomic,
)
from ..store import TierStore
from .plan import ShardingPlan, make_plan
from .store import MANIFEST, PLAN_FILE, read_json, read_sharded_manifest, shard_dir


def sharded_plan_of(src: str | os.PathLike) -> ShardingPlan | None:
    """The plan of a sharded store or sharded checkpoint directory; None for anything else."""
    src = Path(src)
    if (src / MANIFEST).is_file():
        return ShardingPlan.from_config(read_sharded_manifest(src)["plan"])
    if (src / PLAN_FILE).is_file():
        return ShardingPlan.from_config(read_json(src / PLAN_FILE, "sharding plan")["plan"])
    return None


def export_sharded(src: str | os.PathLike, dest: str | os.PathLike, *, level: int = 1,
                   shuffle: bool = True, shard_bytes: int | str = 32 << 20,
                   overwrite: bool = False) -> dict:
    """One export of every shard of a (closed) sharded store or a sharded checkpoint."""
    src, dest = Path(src), Path(dest)
    plan = sharded_plan_of(src)
    if plan is None:
        raise ConfigError(f"{src} is not a sharded store or sharded checkpoint")
    check_apart(dest, src, "export destination", "the source")
    if plan.kinds() & {"column", "data"}:
        raise ConfigError(f"{src} holds column-wise or data-parallel tables; export/import "
                          "re-partitions row- and table-wise plans only")
    check_new_dir(dest, overwrite, "export destination")
    t0 = time.perf_counter()
    try:
        staging = staging_dir(dest)
    except OSError as exc:
        raise os_error(exc, f"cannot create export {dest}") from exc
    try:
        parts = []
        for rank in range(plan.world_size):
            name = shard_dir(rank, plan.world_size)
            if not (src / name).is_dir():
                raise StoreCorruptError(f"sharded source {src} is missing shard {name}")
            parts.append((name, export_store(src / name, staging / name, level=level,
                                             shuffle=shuffle, shard_bytes=shard_bytes)))
        first = parts[0][1]
        tables = []
        for i, table in enumerate(first["tables"]):
            shards = [{**s, "file": f"{name}/{s['file']}"} for name, m in parts
                      for s in m["tables"][i]["shards"]]
            tables.append({"spec": table["spec"], "rows": sum(s["rows"] for s in shards),
                           "shards": shards})
        manifest = {k: v for k, v in first.items()
                    if k not in ("tables", "raw_bytes", "bytes", DIGEST_KEY)}
        manifest.update(tables=tables, raw_bytes=sum(m["raw_bytes"] for _, m in parts),
                        bytes=sum(m["bytes"] for _, m in parts), sharding=plan.to_config(),
                        seconds=time.perf_counter() - t0)
        write_json_atomic(staging / EXPORT_MANIFEST, seal(manifest))  # checksum of the merged one
        publish_dir(staging, dest)
    except OSError as exc:
        shutil.rmtree(staging, ignore_errors=True)
        raise os_error(exc, f"cannot write export {dest}") from exc
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return manifest


def import_sharded(src: str | os.PathLike, path: str | os.PathLike, world_size: int, *,
                   sharding: str | Mapping[str, str | int] | None = None,
                   map_limit: int | str | None = None, table_format: str | None = None) -> dict:
    """Build a sharded store for `world_size` ranks at `path` from an export, re-partitioned.

    `sharding` defaults to the export's own kinds (a table-wise table stays table-wise and is
    re-placed by the planner), or "row" for an export of a single store. `table_format`: the
    shard stores' tables (`StoreConfig.table_format`; None: its default, "chunks").
    """
    src, path = Path(src), Path(path)
    manifest = read_export_manifest(src)
    specs = manifest["specs"]
    if sharding is None:
        old = manifest.get("sharding")
        sharding = {t: "row:exact" if p.get("exact") else p["kind"]
                    for t, p in old["tables"].items()} if old else "row"
    plan = make_plan(specs, world_size, sharding)
    check_apart(path, src, "import destination", "the export")
    if plan.kinds() & {"column", "data"}:
        raise ConfigError("import re-partitions into row- and table-wise plans only")
    check_new_dir(path, False, "import destination")
    shuffle = bool(manifest["codec"].get("shuffle"))
    try:
        staging = staging_dir(path)
    except OSError as exc:
        raise os_error(exc, f"cannot create store {path}") from exc
    t0 = time.perf_counter()
    root = staging / "store"
    try:
        root.mkdir()
        stores = [TierStore(root / shard_dir(r, world_size), specs, device_capacity=0,
                            host_capacity=0, seed=int(manifest["seed"]), device="cpu",
                            map_limit=map_limit,
                            **({} if table_format is None else {"table_format": table_format}))
                  for r in range(world_size)]
        try:
            dctx = zstandard.ZstdDecompressor()
            for spec, table in zip(specs, manifest["tables"]):
                for shard in table["shards"]:
                    ids, payload = _read_shard(src, shard, spec, shuffle, dctx)
                    if not len(ids):
                        continue
                    own = plan.owners(spec.name, torch.from_numpy(ids)).numpy()
                    order = np.argsort(own, kind="stable")
                    bounds = np.searchsorted(own[order], np.arange(world_size + 1))
                    for r in range(world_size):
                        sel = order[bounds[r] : bounds[r + 1]]
                        if len(sel):
                            stores[r].backend.put({spec.name: (ids[sel], payload[sel])})
        finally:
            for s in stores:
                s.close()
        write_json_atomic(root / PLAN_FILE, {"plan": plan.to_config(), "seed": int(manifest["seed"])})
        publish_dir(root, path)
    except OSError as exc:
        raise os_error(exc, f"cannot import into {path}") from exc
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    manifest["import_seconds"] = time.perf_counter() - t0
    manifest["plan"] = plan.to_config()
    return manifest
