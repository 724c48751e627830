"""The cost-model planner behind `sharding="auto"`: table-, row-, column-wise or data-parallel.

For each rank r the modeled step time is

    T_r = C_r / lookup_rate + X_r / bandwidth

where C_r is the work of the lookups rank r serves (ids x columns / 64: one unit is a lookup
of a 64-wide row, forward and backward) and X_r the bytes rank r sends plus receives in the
step's all-to-alls. Per table t, with W ranks, L ids and B bags per rank per step, dim d, id
bytes i, float bytes f (on the wire), P bytes per stored row, N rows:

- table on rank o: C_o = W L d/64; X = (L+B) i + 2 B d f on the others, (W-1) times that on o;
  memory N P on o.
- row: C = L d/64 on every rank; X = 2 (W-1)/W L i + 2 (W-1) B i + 4 (W-1) q B d f, where
  q = 1 - (1 - 1/W)^(L/B) is the share of bags with an id on a given owner; memory N P / W.
  Exact row-wise replaces the forward's 2 (W-1) q B d f by 2 (W-1)/W U d f (U unique ids);
  the planner makes a row-wise table exact when that is at most EXACT_FACTOR (1.25) times it.
- column, k shards: C = W L d/(64 k) on a shard rank; X = k' (L+B) i + 2 B d f (1 - s/k) on
  every rank (k' shards other than itself, s = 1 on a shard rank), plus (W-1) ((L+B) i +
  2 B (d/k) f) on a shard rank (plus 2 (k-1) u d/k 4 for row-wise Adagrad, u = min(W L, N));
  memory N P / k on a shard rank.
- data: C = W L d/64 on every rank; X = 2 (W-1) ((L+B) i + B d f); memory N P on every rank.

The plan minimizes the largest T_r (then their sum): tables, costliest first, each take the
placement that does, among those that fit every rank's memory budget; then each table is
revisited once with all others placed. The report gives every rank's modeled C, X, T and memory.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..config import TableSpec, parse_size
from ..errors import ConfigError
from ..optimizers import SGD, optimizer_from_config
from .plan import ShardingPlan, TablePlacement

UNIT_DIM = 64.0  # a unit of compute is a lookup of a 64-wide row


@dataclass(frozen=True)
class CostModel:
    """The planner's constants: lookups/s of a 64-wide row (forward+backward), wire bytes/s."""

    lookup_rate: float = 4e6  # measured: ~3.7 M ids/s for the fused step on one core (DESIGN.md)
    bandwidth: float = 1e9  # bytes/s per rank through the collectives
    id_bytes: int = 4  # int32 ids when every table has < 2**31 rows
    float_bytes: int = 4  # 2 with comm_dtype float16 / bfloat16

    def to_config(self) -> dict:
        """JSON-able form."""
        return {"lookup_rate": self.lookup_rate, "bandwidth": self.bandwidth,
                "id_bytes": self.id_bytes, "float_bytes": self.float_bytes}


@dataclass
class RankCost:
    """One rank's modeled step: compute units, bytes moved, seconds, memory."""

    compute: float = 0.0
    bytes: float = 0.0
    memory: float = 0.0
    seconds: float = 0.0

    def as_dict(self) -> dict:
        """Plain dict for reports."""
        return {"compute_units": self.compute, "bytes": self.bytes, "memory_bytes": self.memory,
                "modeled_seconds": self.seconds}


@dataclass
class PlanReport:
    """The planner's output beside the plan: the inputs it used and each rank's modeled cost."""

    ranks: list[RankCost]
    lookups: dict[str, tuple[float, float, float]]
    model: CostModel
    budget: list[float | None] = field(default_factory=list)

    @property
    def step_seconds(self) -> float:
        """The modeled step: the slowest rank."""
        return max(r.seconds for r in self.ranks)

    def to_config(self) -> dict:
        """JSON-able form (stored in sharding.json beside the plan)."""
        return {"ranks": [r.as_dict() for r in self.ranks], "model": self.model.to_config(),
                "lookups": {t: list(v) for t, v in self.lookups.items()}, "budget": self.budget,
                "step_seconds": self.step_seconds}


def lookups_from_batches(batches: Iterable, features: Mapping[str, str]
                         ) -> dict[str, tuple[float, float, float]]:
    """Mean (ids, bags, unique ids) per step per table over one rank's sample batches.

    Batches are (keys, values, lengths), feature-major as the collections take them.
    """
    total: dict[str, list[float]] = {}
    n = 0
    for keys, values, lengths in batches:
        keys = list(keys)
        lengths = torch.as_tensor(lengths)
        values = torch.as_tensor(values)
        batch = lengths.numel() // max(len(keys), 1)
        starts = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        ids: dict[str, list[torch.Tensor]] = {}
        for i, k in enumerate(keys):
            if k not in features:
                continue
            lo, hi = int(starts[i * batch]), int(starts[(i + 1) * batch])
            acc = total.setdefault(features[k], [0.0, 0.0, 0.0])
            acc[0] += hi - lo
            acc[1] += batch
            ids.setdefault(features[k], []).append(values[lo:hi])
        for t, parts in ids.items():
            total[t][2] += torch.unique(torch.cat(parts)).numel()
        n += 1
    if n == 0:
        raise ConfigError("lookups_from_batches needs at least one sample batch")
    return {t: (v[0] / n, v[1] / n, v[2] / n) for t, v in total.items()}


def plan_tables(path: str) -> tuple[list[TableSpec], dict[str, object]]:
    """Table specs (and lookups) from a JSON file: a list of specs, or {"tables", "lookups"}."""
    try:
        cfg = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read table config {path}: {exc}") from exc
    items, lookups = (cfg, {}) if isinstance(cfg, list) else (cfg.get("tables"), cfg.get("lookups", {}))
    if not isinstance(items, list) or not items:
        raise ConfigError(f"{path}: expected a list of table specs or {{'tables': [...]}}")
    specs = []
    for t in items:
        try:
            opt = optimizer_from_config(t["optimizer"]) if "optimizer" in t else SGD()
            specs.append(TableSpec(t["name"], int(t["num_rows"]), int(t["dim"]), optimizer=opt,
                                   dtype=t.get("dtype", "float32")))
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"{path}: bad table spec {t!r}: {exc!r}") from exc
    return specs, dict(lookups)


def _lookups(specs: Sequence[TableSpec], lookups: Mapping[str, object] | None
             ) -> dict[str, tuple[float, float, float]]:
    """(ids, bags, unique ids) per rank per step of every table, from a number (all three
    equal), (ids, bags) (unique = ids) or (ids, bags, unique)."""
    out = {}
    for s in specs:
        v = (lookups or {}).get(s.name, 1.0)
        try:
            vals = [float(v)] * 3 if isinstance(v, (int, float)) else [float(x) for x in v]  # type: ignore[union-attr]
        except (TypeError, ValueError):
            vals = []
        if len(vals) == 2:
            vals.append(vals[0])
        if len(vals) != 3 or not (vals[0] >= 0 and vals[1] > 0 and 0 <= vals[2] <= max(vals[0], 1)):
            raise ConfigError(f"lookups of {s.name!r} must be ids >= 0, bags > 0 and unique ids "
                              f"<= ids, got {v!r}")
        out[s.name] = (vals[0], vals[1], vals[2])
    return out


def _budgets(budget: int | str | Sequence[int | str] | None, world: int) -> list[float | None]:
    if budget is None:
        return [None] * world
    if isinstance(budget, (int, str)):
        return [float(parse_size(budget))] * world
    vals = [float(parse_size(b)) for b in budget]
    if len(vals) != world:
        raise ConfigError(f"budget names {len(vals)} ranks, the world size is {world}")
    return vals


def row_forward_bytes(spec: TableSpec, looks: tuple[float, float, float], world: int,
                      m: CostModel) -> tuple[float, float]:
    """A rank's forward bytes (sent + received) of a row-wise table: (partial sums, exact rows)."""
    L, B, U = looks
    W, d, f = world, spec.dim, m.float_bytes
    q = 1.0 - (1.0 - 1.0 / W) ** (L / B) if W > 1 else 0.0
    return 2 * (W - 1) * q * B * d * f, 2 * (W - 1) / W * U * d * f


EXACT_FACTOR = 1.25  # the planner makes a row-wise table exact when its rows cost at most this
# many times the partial sums' forward bytes


def table_cost(spec: TableSpec, p: TablePlacement, looks: tuple[float, float, float], world: int,
               m: CostModel) -> list[RankCost]:
    """Each rank's modeled compute, bytes and memory for one table under placement `p`.

    `looks` is (ids, bags, unique ids) per rank per step.
    """
    d, W, i, f = spec.dim, world, m.id_bytes, m.float_bytes
    rows_b = float(spec.num_rows) * spec.row_dim * 4
    L, B = looks[0], looks[1]
    out = [RankCost() for _ in range(W)]
    if p.kind == "table":
        other = (L + B) * i + 2 * B * d * f
        for r in range(W):
            out[r].bytes = other if r != p.owner else (W - 1) * other
        out[p.owner].compute = W * L * d / UNIT_DIM
        out[p.owner].memory = rows_b
    elif p.kind == "row":
        partial, rows = row_forward_bytes(spec, looks, W, m)
        for r in range(W):
            out[r].compute = L * d / UNIT_DIM
            out[r].bytes = 2 * (W - 1) / W * L * i + 2 * (W - 1) * B * i + partial + \
                (rows if p.exact else partial)  # the backward's gradients are the partials'
            out[r].memory = rows_b / W
    elif p.kind == "column":
        k = len(p.shards)
        for r in range(W):
            mine = r in p.shards
            out[r].bytes = (k - mine) * (L + B) * i + 2 * B * d * f * (1 - mine / k)
            if mine:
                out[r].bytes += (W - 1) * ((L + B) * i + 2 * B * d / k * f)
                out[r].compute = W * L * d / k / UNIT_DIM
                out[r].memory = rows_b / k
                if spec.optimizer.kind == "rowwise_adagrad":  # bwd:colsq
                    out[r].bytes += 2 * (k - 1) * min(W * L, spec.num_rows) * d / k * 4
    else:  # data
        for r in range(W):
            out[r].compute = W * L * d / UNIT_DIM
            out[r].bytes = 2 * (W - 1) * ((L + B) * i + B * d * f)
            out[r].memory = rows_b
    for r in out:
        r.seconds = r.compute / m.lookup_rate + r.bytes / m.bandwidth
    return out


def _candidates(spec: TableSpec, world: int, looks: tuple[float, float, float],
                m: CostModel) -> list[TablePlacement]:
    out = [TablePlacement("table", r) for r in range(world)]
    if world > 1:
        partial, rows = row_forward_bytes(spec, looks, world, m)
        out.append(TablePlacement("row", exact=rows <= EXACT_FACTOR * partial))
        out.append(TablePlacement("data"))
        k = min(world, spec.dim)
        if k > 1 and spec.dtype == "float32" and spec.admission is None:
            for ranks in itertools.islice(itertools.combinations(range(world), k), 8):
                out.append(TablePlacement("column", -1, ranks))
    return out


def _total(costs: dict[str, list[RankCost]], world: int) -> list[RankCost]:
    tot = [RankCost() for _ in range(world)]
    for per in costs.values():
        for r, c in enumerate(per):
            tot[r].compute += c.compute
            tot[r].bytes += c.bytes
            tot[r].memory += c.memory
            tot[r].seconds += c.seconds
    return tot


def auto_plan(specs: Sequence[TableSpec], world: int, lookups: Mapping[str, object] | None = None,
              budget: int | str | Sequence[int | str] | None = None,
              model: CostModel | None = None) -> tuple[ShardingPlan, PlanReport]:
    """The plan minimizing the modeled step time within each rank's memory budget, and its report."""
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ConfigError(f"world size must be a positive int, got {world!r}")
    model = model or CostModel()
    looks = _lookups(specs, lookups)
    budgets = _budgets(budget, world)
    by_name = {s.name: s for s in specs}
    order = sorted(by_name, key=lambda t: (-(looks[t][0] * by_name[t].dim +
                                             by_name[t].num_rows * by_name[t].row_dim * 1e-3), t))
    chosen: dict[str, TablePlacement] = {}
    costs: dict[str, list[RankCost]] = {}

    def best(t: str) -> None:
        spec = by_name[t]
        costs.pop(t, None)
        base = _total(costs, world)
        pick = None
        for cand in _candidates(spec, world, looks[t], model):
            per = table_cost(spec, cand, looks[t], world, model)
            mem = [base[r].memory + per[r].memory for r in range(world)]
            if any(b is not None and mem[r] > b for r, b in enumerate(budgets)):
                continue
            secs = [base[r].seconds + per[r].seconds for r in range(world)]
            key = (max(secs), sum(secs), max(mem))
            if pick is None or key < pick[0]:
                pick = (key, cand, per)
        if pick is None:
            raise ConfigError(f"table {t!r} fits no placement within the per-rank memory budget "
                              f"{budgets}; raise the budget or add ranks")
        chosen[t], costs[t] = pick[1], pick[2]

    for t in order:
        best(t)
    for t in order:  # revisit each table with every other one placed
        best(t)
    report = PlanReport(_total(costs, world), looks, model, budgets)
    plan = ShardingPlan(world, tuple((s.name, chosen[s.name]) for s in specs))
    return plan, report


def format_report(plan: ShardingPlan, report: PlanReport) -> str:
    """The plan and each rank's modeled cost as a text table (`tierstore plan`)."""
    lines = [f"{'table':<20} {'kind':<9} {'ranks':<15} {'ids/step':>10} {'bags/step':>10}"]
    for t, p in plan.tables:
        ranks = ",".join(map(str, p.shards)) if p.kind == "column" else \
            str(p.owner) if p.kind == "table" else "all"
        ids, bags = report.lookups.get(t, (0.0, 0.0, 0.0))[:2]
        kind = "row:exact" if p.exact else p.kind
        lines.append(f"{t:<20} {kind:<9} {ranks:<15} {ids:>10.0f} {bags:>10.0f}")
    lines.append("")
    lines.append(f"{'rank':>4} {'compute units':>14} {'MB moved':>10} {'memory MB':>10} "
                 f"{'modeled ms':>11}")
    for r, c in enumerate(report.ranks):
        lines.append(f"{r:>4} {c.compute:>14.0f} {c.bytes / 1e6:>10.3f} {c.memory / 1e6:>10.1f} "
                     f"{c.seconds * 1e3:>11.3f}")
    lines.append(f"modeled step: {report.step_seconds * 1e3:.3f} ms (the slowest rank); "
                 f"lookup_rate {report.model.lookup_rate:g}/s, bandwidth {report.model.bandwidth:g} B/s")
    return "\n".join(lines)
