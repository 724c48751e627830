"""ShardedTierStore: one local TierStore per rank holding its shard, collective read/checkpoint."""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

import tierstore.distributed.colwise as colwise
import tierstore.validate as validate

from ..config import TableSpec
from ..errors import ConfigError, ConfigMismatchError, StoreCorruptError, UnknownTableError
from ..fsops import write_json_atomic
from ..initializers import ColumnSlice
from ..persistence import check_apart
from ..resolve import DEFAULT_POLICY
from ..store import TierStore
from .comm import Comm, guarded, timeout_seconds
from .plan import ShardingPlan, column_widths, make_plan
from .planner import CostModel, auto_plan

PLAN_FILE = "sharding.json"
MANIFEST = "SHARDED_MANIFEST.json"
SHARDED_FORMAT = "tierstore-sharded-checkpoint"
SHARDED_VERSION = 1


def shard_dir(rank: int, world: int) -> str:
    """Directory name of one rank's shard: rank-00001-of-00004."""
    return f"rank-{rank:05d}-of-{world:05d}"


def local_specs(specs: Sequence[TableSpec], plan: ShardingPlan, rank: int) -> list[TableSpec]:
    """The tables of one rank's local store: whole tables, or this rank's column shard.

    A column shard keeps the table's name (so lazy initialization draws the same values) and
    its columns of the initializer; a row-wise Adagrad shard adds the row's accumulator as one
    more weight column of an SGD(lr=1) table (see `colwise.py`).
    """
    out = []
    for s in specs:
        p = plan.placement(s.name)
        if p.kind != "column":
            out.append(s)
            continue
        if rank not in p.shards:
            continue
        i = p.shards.index(rank)
        widths = column_widths(s.dim, len(p.shards))
        lo = sum(widths[:i])
        if s.optimizer.kind == "rowwise_adagrad":
            out.append(dataclasses.replace(s, dim=widths[i] + 1, optimizer=colwise.LOCAL_OPTIMIZER,
                                           init=ColumnSlice(s.init, s.dim, lo, 1), clip=None))
        else:
            out.append(dataclasses.replace(s, dim=widths[i], init=ColumnSlice(s.init, s.dim, lo)))
    if not out:  # a rank that holds no table at all still opens a (tiny) store
        out.append(TableSpec(EMPTY_TABLE, 1, 1))
    return out


EMPTY_TABLE = "tierstore.no-tables"


def read_json(path: Path, what: str) -> dict:
    """Read a JSON file; a damaged one is a StoreCorruptError."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise StoreCorruptError(f"{what} {path} is unreadable: {exc}") from exc


class ShardedTierStore:
    """Tables sharded over the ranks of torch.distributed; each rank keeps its shard in a TierStore.

    Open it on every rank (collective). `sharding` is "row" (rows spread by a hash of the id),
    "table" (whole tables placed by a greedy planner), "column" (columns split over the ranks),
    "data" (replicated), "auto" (the cost-model planner, `planner.auto_plan`; a store that
    already has a plan keeps it), {table: kind | "column:K" | rank}, or a ShardingPlan;
    None adopts the plan stored at `path` (e.g. by `tierstore import --world-size N`).
    `lookups` ({table: ids per rank per step, or (ids, bags)}, e.g. from
    `planner.lookups_from_batches`) weighs the planners; `budget` (bytes per rank, one for all
    or one each) bounds what "auto" places on a rank; `cost_model` its constants; `timeout`
    (seconds, default 300) bounds every collective, so a dead rank raises RankFailureError;
    `backend` is the process-group backend of the store's collectives ("gloo" or "nccl"); the
    other keyword arguments go to each rank's TierStore (capacities are per rank).
    """

    def __init__(self, path: str | os.PathLike, tables: Sequence[TableSpec] | TableSpec, *,
                 sharding: str | Mapping[str, str | int] | None = "row",
                 lookups: Mapping[str, Any] | None = None,
                 budget: int | str | Sequence[int | str] | None = None,
                 cost_model: CostModel | None = None,
                 timeout: float | datetime.timedelta | None = None, backend: str = "gloo",
                 **store_kwargs: Any) -> None:
        tables = [tables] if isinstance(tables, TableSpec) else list(tables)
        if not tables or not all(isinstance(t, TableSpec) for t in tables):
            raise ConfigError("tables must be a non-empty sequence of TableSpec")
        self.timeout_s = timeout_seconds(timeout)
        self.comm = Comm(self.timeout_s, backend, "step")
        self.prefetch_comm = Comm(self.timeout_s, backend, "prefetch")
        self.rank, self.world_size = self.comm.rank, self.comm.world
        self.path = Path(path)
        self.specs = {t.name: t for t in tables}
        self.report: dict | None = None  # the planner's modeled cost per rank ("auto")
        if sharding is None:  # the stored plan (an imported store), else row-wise
            sharding = stored_plan(self.path) or "row"
        if isinstance(sharding, str) and sharding == "auto":
            self.plan = guarded(self.comm, "plan",
                                lambda: self._auto(tables, lookups, budget, cost_model))
        else:
            self.plan = guarded(self.comm, "plan",
                                lambda: make_plan(tables, self.world_size, sharding, lookups))
        # every rank plans; rank 0's plan (and report) is the job's: ranks may measure other lookups
        self.plan, self.report = self.comm.broadcast_object("plan:agree", (self.plan, self.report))
        self.local: TierStore = guarded(self.comm, "open", lambda: self._open(tables, store_kwargs))
        self.step_seconds = 0.0
        self._closed = False

    def _auto(self, tables: list[TableSpec], lookups: Mapping[str, Any] | None,
              budget: Any, cost_model: CostModel | None) -> ShardingPlan:
        """The stored plan when there is one (with its report), else the cost-model planner's."""
        stored = stored_plan(self.path)
        if stored is not None:
            self.report = read_json(self.path / PLAN_FILE, "sharding plan").get("model")
            return make_plan(tables, self.world_size, stored)
        plan, report = auto_plan(tables, self.world_size, lookups, budget, cost_model)
        self.report = report.to_config()
        return plan

    def _open(self, tables: list[TableSpec], store_kwargs: dict) -> TierStore:
        """Check or record the plan, then open this rank's shard store."""
        self.path.mkdir(parents=True, exist_ok=True)
        plan_path = self.path / PLAN_FILE
        want = {"plan": self.plan.to_config(), "seed": store_kwargs.get("seed", 0)}
        if self.report is not None:
            want["model"] = self.report
        if plan_path.exists():
            stored = read_json(plan_path, "sharding plan")
            try:
                before = ShardingPlan.from_config(stored["plan"])
            except (KeyError, TypeError, ValueError) as exc:
                raise StoreCorruptError(f"sharding plan {plan_path} is malformed: {exc!r}") from exc
            self.plan.check_same(before, f"sharded store {self.path}")
        else:
            write_json_atomic(plan_path, want)
        # the sharded pipeline stages by its own rule and unpins by lookup: it keeps the layout
        # as given (LRU unless named) rather than the resolved one-tier layout (tierstore.resolve)
        cfg = store_kwargs.get("config")
        if "policy" not in store_kwargs and getattr(cfg, "policy", None) is None:
            store_kwargs = {**store_kwargs, "policy": DEFAULT_POLICY}
        return TierStore(self.path / shard_dir(self.rank, self.world_size),
                         local_specs(tables, self.plan, self.rank), **store_kwargs)

    # public API -----------------------------------------------------------------------------
    @property
    def table_specs(self) -> dict[str, TableSpec]:
        """The specs of every table."""
        return dict(self.specs)

    def owners(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        """Owner rank of each id of `table`."""
        return self.plan.owners(table, ids)

    def read(self, table: str, ids: Any) -> torch.Tensor:
        """Collective: every rank calls; each gets the current rows [n, dim] of its own ids."""
        def prepare():
            if table not in self.specs:
                raise UnknownTableError(f"unknown table {table!r}; this store has "
                                        f"{sorted(self.specs)}")
            return validate.row_ids(self.specs[table], ids)

        ids = guarded(self.comm, "read:validate", prepare)
        placement = self.plan.placement(table)
        dim = self.specs[table].dim
        if placement.kind == "data":  # every rank holds the whole table
            return self.local.read(table, ids).cpu()
        uniq, inv = torch.unique(ids, sorted=True, return_inverse=True)
        if placement.kind == "column":  # every shard rank returns its columns of every row
            return self._read_columns(table, placement.shards, uniq).index_select(0, inv)
        own = self.owners(table, uniq)
        order = torch.argsort(own, stable=True)
        send_ids = uniq.index_select(0, order)
        counts = torch.bincount(own, minlength=self.world_size)
        recv_counts = self.comm.exchange_sizes("read:counts", counts.view(-1, 1))[:, 0]
        asked = self.comm.exchange("read:ids", send_ids, counts.tolist(), recv_counts.tolist())
        rows = self.local.read(table, asked).cpu() if asked.numel() else torch.empty(0, dim)
        back = self.comm.exchange("read:rows", rows.reshape(-1).contiguous(),
                                  (recv_counts * dim).tolist(), (counts * dim).tolist())
        got = torch.empty(uniq.numel(), dim)
        got.index_copy_(0, order, back.view(-1, dim))
        return got.index_select(0, inv)

    def _read_columns(self, table: str, shards: tuple[int, ...], uniq: torch.Tensor) -> torch.Tensor:
        """[u, dim] rows of a column-wise table: each shard rank returns its columns."""
        world = self.world_size
        widths = column_widths(self.specs[table].dim, len(shards))
        n = uniq.numel()
        counts = torch.zeros(world, dtype=torch.int64)
        counts[list(shards)] = n
        recv_counts = self.comm.exchange_sizes("read:counts", counts.view(-1, 1))[:, 0]
        send = torch.cat([uniq] * len(shards)) if shards else uniq[:0]
        asked = self.comm.exchange("read:ids", send, counts.tolist(), recv_counts.tolist())
        mine = shards.index(self.rank) if self.rank in shards else -1
        width = widths[mine] if mine >= 0 else 0
        rows = self.local.read(table, asked).cpu()[:, :width] if asked.numel() \
            else torch.empty(0, width)
        back_counts = torch.zeros(world, dtype=torch.int64)
        for r, w in zip(shards, widths):
            back_counts[r] = n * w
        back = self.comm.exchange("read:rows", rows.reshape(-1).contiguous(),
                                  (recv_counts * width).tolist(), back_counts.tolist())
        cols = back.split(back_counts.tolist())
        return torch.cat([cols[r].view(n, w) for r, w in zip(shards, widths)], dim=1)

    def flush(self) -> None:
        """Collective: flush every rank's shard to disk."""
        guarded(self.comm, "flush", self.local.flush)

    def stats(self) -> dict:
        """This rank's shard stats plus the bytes and seconds of its collectives."""
        out = self.local.stats()
        out["comm"] = {k: v.as_dict() for k, v in self.comm.stats.items()}
        out["prefetch_comm"] = {k: v.as_dict() for k, v in self.prefetch_comm.stats.items()}
        return out

    def checkpoint(self, dest: str | os.PathLike, *, step: int | None = None,
                   extra: dict | None = None, overwrite: bool = False) -> dict:
        """Collective: every rank checkpoints its shard, then rank 0 writes the global manifest.

        The checkpoint is complete only once the global manifest exists, which is written
        after every shard has reported success.
        """
        dest = Path(dest)

        def shard() -> dict:
            check_apart(dest, self.local.path, "checkpoint destination")
            if (dest / MANIFEST).exists() and not overwrite:
                raise ConfigError(f"checkpoint {dest} exists; pass overwrite=True to replace it")
            dest.mkdir(parents=True, exist_ok=True)
            if overwrite:
                (dest / MANIFEST).unlink(missing_ok=True)
            return self.local.checkpoint(dest / shard_dir(self.rank, self.world_size), step=step,
                                         extra=extra, overwrite=overwrite)

        guarded(self.comm, "checkpoint:shards", shard)
        manifest = {"format": SHARDED_FORMAT, "version": SHARDED_VERSION, "step": step,
                    "extra": extra, "world_size": self.world_size, "plan": self.plan.to_config(),
                    "seed": self.local.seed, "created_unix": time.time(),
                    "tables": [s.to_config() for s in self.specs.values()],
                    "shards": [shard_dir(r, self.world_size) for r in range(self.world_size)]}

        def publish() -> None:
            if self.rank == 0:
                write_json_atomic(dest / MANIFEST, manifest)

        guarded(self.comm, "checkpoint:manifest", publish)
        return manifest

    @classmethod
    def restore(cls, dest: str | os.PathLike, path: str | os.PathLike,
                **open_kwargs: Any) -> ShardedTierStore:
        """Collective: replace every rank's shard at `path` with checkpoint `dest` and open it.

        The world size must match the checkpoint's; to change it, go through
        `tierstore export` and `tierstore import --world-size N`.
        """
        import torch.distributed as dist

        dest, path = Path(dest), Path(path)
        manifest = read_sharded_manifest(dest)
        if not dist.is_initialized():
            raise ConfigError("ShardedTierStore.restore needs torch.distributed initialized")
        world, rank = dist.get_world_size(), dist.get_rank()
        if manifest["world_size"] != world:
            raise ConfigMismatchError(
                f"checkpoint {dest} holds {manifest['world_size']} shards, this job has {world} "
                f"ranks; re-partition with `tierstore export` / `tierstore import --world-size {world}`")
        tables = [TableSpec.from_config(t) for t in manifest["tables"]]
        plan = ShardingPlan.from_config(manifest["plan"])
        seed = open_kwargs.pop("seed", manifest["seed"])
        open_kwargs.pop("tables", None)
        store_keys = {k: open_kwargs.pop(k) for k in ("timeout", "backend", "lookups", "budget",
                                                      "cost_model")
                      if k in open_kwargs}
        path.mkdir(parents=True, exist_ok=True)
        name = shard_dir(rank, world)
        TierStore.restore(dest / name, path / name, seed=seed, **open_kwargs).close()
        write_json_atomic(path / PLAN_FILE, {"plan": plan.to_config(), "seed": seed})
        return cls(path, tables, sharding=None, seed=seed, **store_keys, **open_kwargs)

    def close(self) -> None:
        """Flush and close this rank's shard (local; call on every rank)."""
        if self._closed:
            return
        self._closed = True
        self.local.close()
        self.comm.destroy()
        self.prefetch_comm.destroy()

    def __enter__(self) -> ShardedTierStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def stored_plan(path: Path) -> ShardingPlan | None:
    """The plan stored at `path` (a sharded store or an imported one), if any."""
    if not (path / PLAN_FILE).is_file():
        return None
    return ShardingPlan.from_config(read_json(path / PLAN_FILE, "sharding plan")["plan"])


def read_sharded_manifest(dest: str | os.PathLike) -> dict:
    """The global manifest of a sharded checkpoint; a checkpoint without one is incomplete."""
    dest = Path(dest)
    if not (dest / MANIFEST).is_file():
        raise StoreCorruptError(f"{dest} is not a complete sharded checkpoint (no {MANIFEST}); "
                                "a checkpoint is complete only once every shard is")
    m = read_json(dest / MANIFEST, "sharded checkpoint manifest")
    if m.get("format") != SHARDED_FORMAT or m.get("version") != SHARDED_VERSION:
        raise ConfigMismatchError(f"{dest / MANIFEST} is not a {SHARDED_FORMAT} v{SHARDED_VERSION}")
    for name in m.get("shards", []):
        if not (dest / name).is_dir():
            raise StoreCorruptError(f"sharded checkpoint {dest} is missing shard {name}")
    return m
