"""The sharding plan: which ranks hold which rows and columns of which table.

Four placements (Neo's "4D" sharding): row-wise (rows spread by a hash of the id), table-wise
(a whole table on one rank), column-wise (a table's columns split into shards, one per rank) and
data-parallel (every rank holds a replica).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..config import TableSpec
from ..errors import ConfigError, ConfigMismatchError

KINDS = ("row", "table", "column", "data")
# a fixed 64-bit mix (the golden-ratio multiplier, as a signed int64) then a fold of the high bits
_MIX = -7046029254386353131


def row_owner(ids: torch.Tensor, world: int) -> torch.Tensor:
    """Owner rank of each row id under row-wise sharding: a fixed hash, so hot ids spread out."""
    h = ids.to(torch.int64) * _MIX  # wraps modulo 2**64: the same on every machine
    h = h ^ (h >> 31)
    return torch.remainder(h, world)


def column_widths(dim: int, shards: int) -> list[int]:
    """Widths of `shards` column shards of a `dim`-wide table (the first ones one wider)."""
    return [dim // shards + (1 if i < dim % shards else 0) for i in range(shards)]


@dataclass(frozen=True)
class TablePlacement:
    """How one table is sharded: its kind, the owner of a table-wise table, the column shards' ranks."""

    kind: str
    owner: int = -1  # the owning rank of a table-wise table; -1 otherwise
    shards: tuple[int, ...] = ()  # column-wise: the rank of each column shard, in column order
    exact: bool = False  # row-wise: owners return rows, the requester pools (bit-identical)

    def to_config(self) -> dict:
        """JSON-able form (stored beside the shards and in checkpoints)."""
        cfg: dict = {"kind": self.kind, "owner": self.owner}
        if self.shards:
            cfg["shards"] = list(self.shards)
        if self.exact:
            cfg["exact"] = True
        return cfg

    @classmethod
    def from_config(cls, cfg: dict) -> TablePlacement:
        """Inverse of `to_config`."""
        return cls(str(cfg["kind"]), int(cfg["owner"]), tuple(int(r) for r in cfg.get("shards", ())),
                   bool(cfg.get("exact", False)))


@dataclass(frozen=True)
class ShardingPlan:
    """Where every table's rows live for a given world size."""

    world_size: int
    tables: tuple[tuple[str, TablePlacement], ...]

    def placement(self, table: str) -> TablePlacement:
        """The placement of one table."""
        return dict(self.tables)[table]

    def owners(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        """Owner rank of each id (row- and table-wise tables; int64 tensor like `ids`)."""
        p = self.placement(table)
        if p.kind == "row":
            return row_owner(ids, self.world_size)
        if p.kind != "table":
            raise ConfigError(f"table {table!r} is {p.kind}-wise: no single owner per row")
        return torch.full_like(ids, p.owner, dtype=torch.int64)

    def kinds(self) -> set[str]:
        """The placement kinds this plan uses."""
        return {p.kind for _, p in self.tables}

    def to_config(self) -> dict:
        """JSON-able form."""
        return {"world_size": self.world_size, "tables": {t: p.to_config() for t, p in self.tables}}

    @classmethod
    def from_config(cls, cfg: dict) -> ShardingPlan:
        """Inverse of `to_config`."""
        return cls(int(cfg["world_size"]), tuple(
            (t, TablePlacement.from_config(p)) for t, p in cfg["tables"].items()))

    def check_same(self, other: ShardingPlan, where: str) -> None:
        """Raise ConfigMismatchError when `other` (the stored plan) differs from this one."""
        if other.world_size != self.world_size:
            raise ConfigMismatchError(
                f"{where} was sharded for world size {other.world_size}, this job has "
                f"{self.world_size}; re-partition with `tierstore export` / "
                f"`tierstore import --world-size {self.world_size}`")
        if dict(other.tables) != dict(self.tables):
            raise ConfigMismatchError(f"{where} was sharded with plan {other.to_config()['tables']}, "
                                      f"given {self.to_config()['tables']}")


def _cost(specs: Sequence[TableSpec], lookups: Mapping[str, Any] | None) -> dict[str, float]:
    """Expected share of bytes plus share of lookups per table (the greedy placement's load)."""
    nbytes = {s.name: float(s.num_rows) * s.payload_dim * 4 for s in specs}
    tot_b = sum(nbytes.values()) or 1.0
    cost = {t: b / tot_b for t, b in nbytes.items()}
    if lookups:  # ids per step, or (ids, bags)
        ids = {s.name: lookups.get(s.name, 0.0) for s in specs}
        ids = {t: float(v if isinstance(v, (int, float)) else v[0]) for t, v in ids.items()}
        tot_l = sum(ids.values()) or 1.0
        for s in specs:
            cost[s.name] += ids[s.name] / tot_l
    return cost


def _column_shards(spec: TableSpec, want: str, world: int) -> int:
    """Number of column shards of "column" (one per rank, at most dim) or "column:K"."""
    k = min(world, spec.dim)
    if want != "column":
        try:
            k = int(want.split(":", 1)[1])
        except ValueError:
            raise ConfigError(f"column sharding of {spec.name!r} must be 'column' or 'column:K', "
                              f"got {want!r}") from None
        if not 1 <= k <= min(world, spec.dim):
            raise ConfigError(f"table {spec.name!r}: {k} column shards; between 1 and "
                              f"min(world size, dim) = {min(world, spec.dim)}")
    if spec.dtype != "float32":
        raise ConfigError(f"table {spec.name!r}: column-wise sharding needs float32 weights "
                          f"(16-bit weights round per row), got {spec.dtype}")
    if spec.admission is not None and spec.optimizer.kind == "rowwise_adagrad":
        raise ConfigError(f"table {spec.name!r}: column-wise row-wise Adagrad does not support "
                          "admission")
    return k


def check_plan(specs: Sequence[TableSpec], plan: ShardingPlan) -> ShardingPlan:
    """Check a given plan against the tables and return it (ConfigError when it cannot hold them)."""
    names = [s.name for s in specs]
    if sorted(dict(plan.tables)) != sorted(names):
        raise ConfigError(f"plan covers tables {sorted(dict(plan.tables))}, the store has {sorted(names)}")
    for s in specs:
        p = plan.placement(s.name)
        if p.kind not in KINDS:
            raise ConfigError(f"unknown placement kind {p.kind!r} for table {s.name!r}")
        ranks = list(p.shards) + ([p.owner] if p.kind == "table" else [])
        if any(not 0 <= r < plan.world_size for r in ranks) or len(set(p.shards)) != len(p.shards):
            raise ConfigError(f"placement of {s.name!r} names bad ranks: {p.to_config()}")
        if p.kind == "column":
            _column_shards(s, f"column:{len(p.shards)}", plan.world_size)
    return plan


def make_plan(specs: Sequence[TableSpec], world_size: int,
              sharding: str | Mapping[str, str | int] | ShardingPlan = "row",
              lookups: Mapping[str, Any] | None = None) -> ShardingPlan:
    """Build the plan: a kind for all, {table: kind | owner rank} (others: "row"), or a plan.

    Kinds: "row" ("row:exact": owners return rows, bit-identical), "table", "column" (one column
    shard per rank, at most dim; "column:K" for K shards) and "data" (replicated). Table-wise
    tables without a given owner are placed greedily, the costliest first, on the least-loaded
    rank; the cost of a table is its share of expected bytes plus its share of `lookups`
    (expected lookups per step), when given. Column shards start on the least-loaded ranks too.
    For "auto" see `tierstore.distributed.planner`.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world size must be a positive int, got {world_size!r}")
    if isinstance(sharding, ShardingPlan):
        if sharding.world_size != world_size:
            raise ConfigMismatchError(f"plan is for world size {sharding.world_size}, this job has "
                                      f"{world_size}")
        return check_plan(specs, sharding)
    names = [s.name for s in specs]
    by_name = {s.name: s for s in specs}
    if isinstance(sharding, str):
        wanted: dict[str, str | int] = {n: sharding for n in names}
    elif isinstance(sharding, Mapping):
        unknown = sorted(set(sharding) - set(names))
        if unknown:
            raise ConfigError(f"sharding names unknown tables {unknown}; tables are {names}")
        wanted = {n: sharding.get(n, "row") for n in names}
    else:
        raise ConfigError(f"sharding must be a kind {KINDS}, 'auto' or a dict, got {sharding!r}")
    placed: dict[str, TablePlacement] = {}
    load = [0.0] * world_size
    cost = _cost(specs, lookups)
    for name, want in wanted.items():
        ok = isinstance(want, int) and not isinstance(want, bool) or \
            isinstance(want, str) and (want in KINDS or want.startswith("column:") or
                                       want == "row:exact")
        if not ok:
            raise ConfigError(f"sharding of table {name!r} must be one of {KINDS}, 'column:K' or "
                              f"a rank, got {want!r}")
        if isinstance(want, int):
            if not 0 <= want < world_size:
                raise ConfigError(f"table {name!r} pinned to rank {want}, world size is {world_size}")
            placed[name] = TablePlacement("table", want)
            load[want] += cost[name]
        elif want in ("row", "data"):
            placed[name] = TablePlacement(want)
        elif want == "row:exact":
            placed[name] = TablePlacement("row", exact=True)
    greedy = sorted((n for n, w in wanted.items() if isinstance(w, str) and
                     (w == "table" or w.startswith("column"))), key=lambda n: (-cost[n], n))
    for name in greedy:
        want = str(wanted[name])
        if want == "table":
            rank = min(range(world_size), key=lambda r: (load[r], r))
            placed[name] = TablePlacement("table", rank)
            load[rank] += cost[name]
            continue
        k = _column_shards(by_name[name], want, world_size)
        ranks = sorted(range(world_size), key=lambda r: (load[r], r))[:k]
        for r in ranks:
            load[r] += cost[name] / k
        placed[name] = TablePlacement("column", -1, tuple(ranks))
    return ShardingPlan(world_size, tuple((n, placed[n]) for n in names))
