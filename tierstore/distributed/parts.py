"""A sharded collection's tables as parts: who receives a table's ids, what comes back, where.

A part is one piece of a table served by its owner ranks: a table-wise table (one owner), a
row-wise table (every rank owns the rows that hash to it; "row" returns partial sums, "exact"
returns the rows), one column shard ("column", or "colrow" for row-wise Adagrad) or a
data-parallel replica ("data": every rank pools the global batch, keeps its own bags, and gets
every rank's gradients). Also the wire formats: 16-bit floats and 32-bit ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .._kernels import HAVE_NUMBA
from ..config import TableSpec
from ..errors import ConfigError
from ..fused import pool as fused_pool
from .plan import ShardingPlan, column_widths, row_owner

COMM_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
ID_DTYPES = {"int64": torch.int64, "int32": torch.int32}
INT32_ROWS = 2**31  # ids travel as int32 when every table has fewer rows


@dataclass(frozen=True)
class Part:
    """One served piece of a table: its kind, the ranks that receive its ids, its output columns."""

    table: str
    kind: str  # table | row | exact | column | colrow | data
    owners: tuple[int, ...]
    dim: int  # output columns of this part
    col: int  # its first column in the table's output
    shard: int = 0  # column shard index

    @property
    def whole_bags(self) -> bool:
        """Owners see whole bags (table-wise, column-wise, data-parallel)."""
        return self.kind in ("table", "column", "colrow", "data")


def make_parts(plan: ShardingPlan, specs: dict[str, TableSpec], tables: list[str],
               exact: bool) -> list[Part]:
    """The parts of `tables` in order (a column table gives one part per shard)."""
    world = plan.world_size
    out: list[Part] = []
    for t in tables:
        p, d = plan.placement(t), specs[t].dim
        if p.kind == "table":
            out.append(Part(t, "table", (p.owner,), d, 0))
        elif p.kind == "row":
            out.append(Part(t, "exact" if exact or p.exact else "row", tuple(range(world)), d, 0))
        elif p.kind == "data":
            out.append(Part(t, "data", tuple(range(world)), d, 0))
        else:
            kind = "colrow" if specs[t].optimizer.kind == "rowwise_adagrad" else "column"
            lo = 0
            for i, (r, w) in enumerate(zip(p.shards, column_widths(d, len(p.shards)))):
                out.append(Part(t, kind, (r,), w, lo, i))
                lo += w
    return out


@dataclass
class Request:
    """What this rank sent for one part, and what it expects back from each owner."""

    part: Part
    bags: int  # this rank's bags of the table (features x batch)
    send: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]  # owner: counts, ids, w
    fwd_rows: dict[int, int]  # owner: rows it returns (bags, partial bags or unique rows)
    bwd_mask: dict[int, torch.Tensor]  # owner: the bags whose gradient goes to it
    fwd_mask: dict[int, torch.Tensor] = field(default_factory=dict)  # row: owner's partial bags
    exact_index: torch.Tensor | None = None  # exact: each id's row in the owners' returned rows
    offsets: torch.Tensor | None = None  # exact: the bags' offsets, for pooling here
    weights: torch.Tensor | None = None  # exact: the user's per-id weights


def build_request(part: Part, rank: int, ids: torch.Tensor, lens: torch.Tensor,
                  w: torch.Tensor | None, mean: bool) -> Request:
    """Bucket one table's ids for `part`'s owners (stable: each owner's ids keep their order)."""
    nb = lens.numel()
    allbags = torch.ones(nb, dtype=torch.bool)
    if part.kind not in ("row", "exact"):
        if part.kind == "data":
            return Request(part, nb, {o: (lens, ids, w) for o in part.owners},
                           {o: nb if o == rank else 0 for o in part.owners},
                           {o: allbags for o in part.owners})
        o = part.owners[0]
        return Request(part, nb, {o: (lens, ids, w)}, {o: nb}, {o: allbags})
    world = len(part.owners)
    bag_of = torch.repeat_interleave(torch.arange(nb), lens)
    own = row_owner(ids, world)
    order = torch.argsort(own, stable=True)
    per_owner = torch.bincount(own, minlength=world).tolist()
    counts = torch.bincount(own * nb + bag_of, minlength=world * nb).view(world, nb)
    if mean:  # owners pool sums scaled by the full bag length (requester-side mean)
        scale = (1.0 / lens.clamp(min=1).to(torch.float32)).index_select(0, bag_of)
        w_own = scale
    else:
        w_own = w
    ids_s = ids.index_select(0, order).split(per_owner)
    w_s = w_own.index_select(0, order).split(per_owner) if w_own is not None else [None] * world
    req = Request(part, nb, {}, {}, {})
    for o in range(world):
        req.send[o] = (counts[o], ids_s[o], w_s[o])
        req.bwd_mask[o] = counts[o] > 0
    if part.kind == "row":
        for o in range(world):
            req.fwd_mask[o] = req.bwd_mask[o]
            req.fwd_rows[o] = int(req.bwd_mask[o].sum())
        return req
    # exact: owners return the unique rows of the ids they got; pool them here
    base, index_parts = 0, []
    for o in range(world):
        uniq, inv = torch.unique(ids_s[o], sorted=True, return_inverse=True)
        req.fwd_rows[o] = uniq.numel()
        index_parts.append(inv + base)
        base += uniq.numel()
    index = torch.empty_like(ids)
    index[order] = torch.cat(index_parts) if index_parts else torch.empty(0, dtype=torch.int64)
    req.exact_index = index
    req.offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)[:-1]])
    req.weights = w
    return req


def pool_rows(rows: torch.Tensor, index: torch.Tensor, offsets: torch.Tensor,
              weights: torch.Tensor | None, mode: str) -> torch.Tensor:
    """Bags pooled from `rows[index]` as the single-process module pools them (same kernel)."""
    dim = rows.shape[1]
    rows = rows.contiguous()
    if HAVE_NUMBA:
        return fused_pool(rows, torch.arange(rows.shape[0]), index, offsets, dim, weights,
                          mode == "mean")
    return F.embedding_bag(index, rows, offsets, mode=mode, per_sample_weights=weights)


def comm_dtype_of(name: str) -> torch.dtype:
    """The torch dtype of a `comm_dtype` name (ConfigError for others)."""
    if name not in COMM_DTYPES:
        raise ConfigError(f"comm_dtype must be one of {sorted(COMM_DTYPES)}, got {name!r}")
    return COMM_DTYPES[name]


def id_dtype_of(name: str | None, specs: dict[str, TableSpec]) -> torch.dtype:
    """int32 ids on the wire when every table has < 2**31 rows (None: automatic), else int64."""
    fits = all(s.num_rows < INT32_ROWS for s in specs.values())
    if name is None:
        return torch.int32 if fits else torch.int64
    if name not in ID_DTYPES:
        raise ConfigError(f"id_dtype must be one of {sorted(ID_DTYPES)} or None, got {name!r}")
    if name == "int32" and not fits:
        raise ConfigError("id_dtype='int32' needs every table under 2**31 rows")
    return ID_DTYPES[name]
