"""Random collections and steps for the engine tests, and today's per-table fused path as the
yardstick (`tierstore.fused`: `pool` and `BatchUpdate`, one table at a time)."""

from __future__ import annotations

from dataclasses import dataclass

import hypothesis.strategies as st
import numpy as np
import torch

import tierstore as ts
from tierstore.engine import Plan
from tierstore.fused import BatchUpdate, bag_positions
from tierstore.fused import pool as fused_pool

OPTS = {"sgd": lambda: ts.SGD(0.1, weight_decay=0.01), "adagrad": lambda: ts.Adagrad(0.2),
        "rowwise_adagrad": lambda: ts.RowWiseAdagrad(0.3, weight_decay=0.02),
        "adam": lambda: ts.Adam(0.05, weight_decay=0.01)}


@dataclass
class Case:
    specs: list[ts.TableSpec]
    features: list[tuple[str, str, str]]
    slab: torch.Tensor  # [slots, width]: every table's rows, at `slots[t]`
    slots: list[torch.Tensor]  # per table: slot of each of its rows (row id -> slot)
    ids: list[torch.Tensor]  # per feature: flat ids
    lengths: torch.Tensor  # [features * batch]
    psw: torch.Tensor | None
    grad: torch.Tensor  # [batch, out_width] (pooled)
    batch: int


@st.composite
def cases(draw, modes=("sum", "mean"), max_tables=3, dtypes=("float32",), weighted=True,
          clip=True):
    """A collection (1-3 tables, features sharing tables) with one step's input and gradient."""
    nt = draw(st.integers(1, max_tables))
    specs = []
    for t in range(nt):
        opt = draw(st.sampled_from(sorted(OPTS)))
        specs.append(ts.TableSpec(f"t{t}", draw(st.integers(1, 30)), draw(st.integers(1, 20)),
                                  optimizer=OPTS[opt](), dtype=draw(st.sampled_from(dtypes)),
                                  clip=draw(st.sampled_from([None, 0.5])) if clip else None))
    nf = draw(st.integers(1, 4))
    mode = draw(st.sampled_from(modes))
    features = [(f"f{i}", f"t{draw(st.integers(0, nt - 1))}", mode) for i in range(nf)]
    batch = draw(st.integers(1, 6))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    width = max(s.row_dim for s in specs)
    total = sum(s.num_rows for s in specs)
    slab = torch.randn((total + 5, width), generator=g)
    perm = torch.randperm(total + 5, generator=g)
    slots, at = [], 0
    for s in specs:
        slots.append(perm[at : at + s.num_rows])
        at += s.num_rows
        # keep optimizer state valid (accumulators >= 0, Adam's step a small count)
        sd = s.optimizer.state_dim(s.dim)
        rows = slab[slots[-1]]
        rows[:, s.weight_cols : s.weight_cols + sd] = rows[:, s.weight_cols : s.weight_cols + sd].abs()
        if s.optimizer.kind == "adam":
            rows[:, s.weight_cols + 2 * s.dim] = torch.randint(0, 5, (s.num_rows,), generator=g).float()
        if s.codec.packed:
            rows[:, : s.weight_cols] = s.codec.encode(torch.randn((s.num_rows, s.dim), generator=g))
        slab[slots[-1]] = rows
    lengths = torch.randint(0, 5, (nf * batch,), generator=g)
    name_of = {s.name: s for s in specs}
    ids = [torch.randint(0, name_of[t].num_rows, (int(lengths[i * batch:(i + 1) * batch].sum()),),
                         generator=g) for i, (_, t, _) in enumerate(features)]
    n = int(lengths.sum())
    psw = torch.rand(n, generator=g) * 2 - 0.5 if weighted and mode == "sum" and draw(st.booleans()) \
        else None
    out_width = sum(name_of[t].dim for _, t, _ in features)
    grad = torch.randn((batch, out_width), generator=g)
    return Case(specs, features, slab, slots, ids, lengths, psw, grad, batch)


def table_inputs(case: Case):
    """Per table: its features' ids concatenated (feature order), their unique rows (first
    occurrence) and inverse, and for each feature its slice of that table's positions."""
    out = []
    for s in case.specs:
        fidx = [i for i, (_, t, _) in enumerate(case.features) if t == s.name]
        ids = torch.cat([case.ids[i] for i in fidx]) if fidx else torch.empty(0, dtype=torch.int64)
        uniq, inv = torch.unique(ids, return_inverse=True)
        out.append((fidx, ids, uniq, inv))
    return out


def engine_step(case: Case, kernels: str = "numba", device: str = "cpu"):
    """(pooled output, updated slab) through the engine: one forward, one backward (on
    `device`; the results come back on the CPU)."""
    from tierstore.engine import Engine

    plan = Plan(case.specs, case.features)
    per = table_inputs(case)
    inverse, n_unique, slots = [None] * len(case.features), [], []
    for t, (fidx, _, uniq, inv) in enumerate(per):
        at = 0
        for i in fidx:
            k = case.ids[i].numel()
            inverse[i] = inv[at : at + k]
            at += k
        n_unique.append(uniq.numel())
        slots.append(case.slots[t][uniq])
    dev = torch.device(device)
    batch = plan.step(inverse, n_unique, case.lengths, case.psw).to(dev)
    slot_t = torch.cat(slots).to(dev)
    eng = Engine(plan, kernels)
    src = case.slab.clone().to(dev)
    out, fwd = eng.forward(batch, src, slot_t)
    salts = [(uniq, 3 + t) for t, (_, _, uniq, _) in enumerate(per)]  # 16-bit rounding's bits
    eng.backward(batch, fwd, case.grad.to(dev), src, slot_t, salts=salts)
    return out.cpu(), src.cpu()


def keyed_engine_step(case: Case, kernels: str = "numba", device: str = "cpu"):
    """`engine_step` over a keyed batch (`Plan.keyed_step`: each id given as its slot)."""
    from tierstore.engine import Engine

    plan = Plan(case.specs, case.features)
    pos = {s.name: t for t, s in enumerate(case.specs)}
    dev = torch.device(device)
    keys = [case.slots[pos[t]][i].to(dev) for (_, t, _), i in zip(case.features, case.ids)]
    eng = Engine(plan, kernels)
    batch, slots = eng.keyed_step(torch.cat(keys), [k.numel() for k in keys], case.lengths, case.psw)
    src = case.slab.clone().to(dev)
    out, fwd = eng.forward(batch, src, slots)
    eng.backward(batch, fwd, case.grad.to(dev), src, slots)
    return out.cpu(), src.cpu()


def fused_step(case: Case):
    """The same step through today's per-table fused path (sum/mean only)."""
    name_of = {s.name: s for s in case.specs}
    b = case.batch
    out = torch.zeros((b, case.grad.shape[1]))
    cols, c = [], 0
    for _, t, _ in case.features:
        cols.append(c)
        c += name_of[t].dim
    slab = case.slab.clone()
    pstart = np.cumsum([0] + [x.numel() for x in case.ids])
    for t, (fidx, _ids, uniq, inv) in enumerate(table_inputs(case)):
        s = case.specs[t]
        if not fidx:
            continue
        ln = torch.cat([case.lengths[i * b:(i + 1) * b] for i in fidx])
        offs = torch.zeros(ln.numel(), dtype=torch.int64)
        torch.cumsum(ln[:-1], 0, out=offs[1:])
        psw = None if case.psw is None else torch.cat(
            [case.psw[pstart[i]:pstart[i + 1]] for i in fidx])
        mean = case.features[0][2] == "mean"
        dslots = case.slots[t][uniq]
        weights = s.codec.gather(case.slab, dslots, s.dim).contiguous()
        pooled = fused_pool(weights, torch.arange(uniq.numel()), inv, offs, s.dim, psw, mean)
        grad = torch.cat([case.grad[:, cols[i]:cols[i] + s.dim] for i in fidx])
        if s.clip is not None:
            grad = grad.clamp(-s.clip, s.clip)
        for j, i in enumerate(fidx):
            out[:, cols[i]:cols[i] + s.dim] = pooled[j * b:(j + 1) * b]
        bag_of, lengths = bag_positions(offs, inv.numel())
        scale = None
        if mean:
            scale = (1.0 / lengths.clamp(min=1).to(torch.float32)).index_select(0, bag_of)
        if psw is not None:
            scale = psw if scale is None else scale * psw
        if uniq.numel():
            BatchUpdate(s.optimizer, s.dim, uniq.numel(), inv, grad.contiguous(), bag_of, scale,
                        True, s.dtype, 3 + t, uniq).apply(slab, dslots)
    return out, slab
