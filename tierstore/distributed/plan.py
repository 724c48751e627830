"""The sharding plan: which rank owns which rows of which table (row-wise hash or whole tables)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from ..config import TableSpec
from ..errors import ConfigError, ConfigMismatchError

KINDS = ("row", "table")
# a fixed 64-bit mix (the golden-ratio multiplier, as a signed int64) then a fold of the high bits
_MIX = -7046029254386353131


def row_owner(ids: torch.Tensor, world: int) -> torch.Tensor:
    """Owner rank of each row id under row-wise sharding: a fixed hash, so hot ids spread out."""
    h = ids.to(torch.int64) * _MIX  # wraps modulo 2**64: the same on every machine
    h = h ^ (h >> 31)
    return torch.remainder(h, world)


@dataclass(frozen=True)
class TablePlacement:
    """How one table is sharded: row-wise over every rank, or whole on `owner`."""

    kind: str
    owner: int = -1  # the owning rank of a table-wise table; -1 for row-wise

    def to_config(self) -> dict:
        """JSON-able form (stored beside the shards and in checkpoints)."""
        return {"kind": self.kind, "owner": self.owner}


@dataclass(frozen=True)
class ShardingPlan:
    """Where every table's rows live for a given world size."""

    world_size: int
    tables: tuple[tuple[str, TablePlacement], ...]

    def placement(self, table: str) -> TablePlacement:
        """The placement of one table."""
        return dict(self.tables)[table]

    def owners(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        """Owner rank of each id (int64 tensor like `ids`)."""
        p = self.placement(table)
        if p.kind == "row":
            return row_owner(ids, self.world_size)
        return torch.full_like(ids, p.owner, dtype=torch.int64)

    def to_config(self) -> dict:
        """JSON-able form."""
        return {"world_size": self.world_size, "tables": {t: p.to_config() for t, p in self.tables}}

    @classmethod
    def from_config(cls, cfg: dict) -> ShardingPlan:
        """Inverse of `to_config`."""
        return cls(int(cfg["world_size"]), tuple(
            (t, TablePlacement(str(p["kind"]), int(p["owner"]))) for t, p in cfg["tables"].items()))

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


def _cost(specs: Sequence[TableSpec], lookups: Mapping[str, float] | None) -> dict[str, float]:
    """Expected share of bytes plus share of lookups per table (the planner's load)."""
    nbytes = {s.name: float(s.num_rows) * s.payload_dim * 4 for s in specs}
    tot_b = sum(nbytes.values()) or 1.0
    cost = {t: b / tot_b for t, b in nbytes.items()}
    if lookups:
        tot_l = float(sum(lookups.get(s.name, 0.0) for s in specs)) or 1.0
        for s in specs:
            cost[s.name] += float(lookups.get(s.name, 0.0)) / tot_l
    return cost


def make_plan(specs: Sequence[TableSpec], world_size: int,
              sharding: str | Mapping[str, str | int] = "row",
              lookups: Mapping[str, float] | None = None) -> ShardingPlan:
    """Build the plan: "row", "table", or {table: "row" | "table" | owner rank} (others: "row").

    Table-wise tables without a given owner are placed greedily, the costliest first, on the
    least-loaded rank; the cost of a table is its share of expected bytes plus its share of
    `lookups` (expected lookups per step), when given.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world size must be a positive int, got {world_size!r}")
    names = [s.name for s in specs]
    if isinstance(sharding, str):
        if sharding not in KINDS:
            raise ConfigError(f"sharding must be one of {KINDS} or a dict, got {sharding!r}")
        wanted: dict[str, str | int] = {n: sharding for n in names}
    elif isinstance(sharding, Mapping):
        unknown = sorted(set(sharding) - set(names))
        if unknown:
            raise ConfigError(f"sharding names unknown tables {unknown}; tables are {names}")
        wanted = {n: sharding.get(n, "row") for n in names}
    else:
        raise ConfigError(f"sharding must be 'row', 'table' or a dict, got {sharding!r}")
    placed: dict[str, TablePlacement] = {}
    load = [0.0] * world_size
    cost = _cost(specs, lookups)
    for name, want in wanted.items():
        if isinstance(want, bool) or not (want in KINDS or isinstance(want, int)):
            raise ConfigError(f"sharding of table {name!r} must be 'row', 'table' or a rank, "
                              f"got {want!r}")
        if isinstance(want, int):
            if not 0 <= want < world_size:
                raise ConfigError(f"table {name!r} pinned to rank {want}, world size is {world_size}")
            placed[name] = TablePlacement("table", want)
            load[want] += cost[name]
        elif want == "row":
            placed[name] = TablePlacement("row")
    greedy = sorted((n for n, w in wanted.items() if w == "table"), key=lambda n: (-cost[n], n))
    for name in greedy:
        rank = min(range(world_size), key=lambda r: (load[r], r))
        placed[name] = TablePlacement("table", rank)
        load[rank] += cost[name]
    return ShardingPlan(world_size, tuple((n, placed[n]) for n in names))
