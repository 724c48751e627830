"""The modules' training step over the engine: one forward and one backward+update call a step.

`EngineStep` is the autograd Function every tiered module runs: its forward asks the store for
the step's rows (`store.paths.step_forward`, `BagPaths`: device slots, or gathered weights for rows that are
not resident) and pools every feature of the collection in one engine call; its backward checks
the gradient and hands the store one engine update for the whole step (`step_backward`). On a
direct device cache that holds every id, the ids are the slots (`DirectSteps.forward`, a keyed batch,
`DirectSteps.update`): no dedup, lookup or staging. The
store's cascade, staging and write-behind stay below it. A read-only handle serves rows through
`ReadOnlyRows`, whose backward refuses to train.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch

import tierstore.validate as validate

from .bagpaths import Gathered
from .engine import Engine, Forward, Plan, StepBatch
from .errors import InvalidGradientError, ReadOnlyError
from .index import dedup


class EngineStep(torch.autograd.Function):
    """Pooled bags (or per-id rows) of a plan's features; backward updates the store's rows."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, psw: torch.Tensor | None, store: Any,
                engine: Engine, ids: list[torch.Tensor], lengths: torch.Tensor) -> torch.Tensor:
        plan = engine.plan
        of_table: list[list[int]] = [[] for _ in plan.tables]
        for f, feat in enumerate(plan.features):
            of_table[feat.table].append(f)
        sizes = [int(i.numel()) for i in ids]
        weights_w = None if psw is None else psw.detach()
        need_rows = psw is not None and bool(ctx.needs_input_grad[1])
        ctx.save_for_backward(psw)
        thread = threading.get_ident()  # autograd runs a CUDA step's backward on a thread of its own
        ctx.direct = None  # a direct step's rows and its input (`_by_table`)
        if not plan.packed and not need_rows:  # a direct device cache: ids are slots
            def pool_keyed(keys, counts, slab, made):  # `made`: the keyed batch made ahead
                batch, slots = made or engine.keyed_step(keys, counts, lengths, weights_w)
                return (*engine.forward(batch, slab, slots), batch, slots)

            # a step made ahead has no per-sample weights (`prepare_direct`)
            got = store.paths.direct.forward(direct_items(plan, ids), pool_keyed,
                                             engine if weights_w is None else None, lengths)
            if got is not None:
                (out, fwd, batch, slots), direct = got
                ctx.direct = (direct, (of_table, ids, sizes, lengths, weights_w))
                ctx.state = (store, engine, None, None, fwd, batch, slots, None, thread)
                return out
        items = _table_ids(plan, of_table, ids)

        def pool(gs, weights, slab):
            inverse: list[torch.Tensor] = [torch.empty(0)] * len(ids)
            for t, fs in enumerate(of_table):
                for f, part in zip(fs, torch.split(gs[t].inverse, [sizes[f] for f in fs])):
                    inverse[f] = part
            batch = plan.step(inverse, [g.unique.numel() for g in gs], lengths, weights_w)
            batch = batch.to(slab.device)
            slots = torch.cat([g.slots.to(slab.device, non_blocking=True) if w is None else
                               torch.zeros(g.unique.numel(), dtype=torch.int64, device=slab.device)
                               for g, w in zip(gs, weights)])
            out, fwd = engine.forward(batch, slab, slots, weights)
            rows = None
            if need_rows:  # each table's rows [u, dim], for the weights' gradient
                rows = [w if w is not None else
                        store.table_specs[tp.name].codec.gather(slab, g.slots, tp.dim)
                        for tp, g, w in zip(plan.tables, gs, weights)]
            return out, fwd, batch, slots, rows

        (out, fwd, batch, slots, rows), gs = store.paths.step_forward(items, pool)
        ctx.state = (store, engine, [n for n, _ in items], gs, fwd, batch, slots, rows, thread)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor):  # type: ignore[override]
        (psw,) = ctx.saved_tensors
        store, engine, names, gs, fwd, batch, slots, rows, thread = ctx.state
        ctx.state = None
        grad = grad_out.detach().to(device=slots.device, dtype=torch.float32).contiguous()
        if ctx.direct is not None:
            direct, layout = ctx.direct
            ctx.direct = None
            if psw is not None and psw.numel() and not validate.all_finite(psw.detach().float()):
                raise InvalidGradientError("per_sample_weights hold NaN/Inf; nothing was updated")
            finite = torch.isfinite(grad).all() if grad.numel() else None
            if store.paths.direct.update(direct, lambda table, ok: engine.backward(
                    batch, fwd, grad, table, slots, finite=ok), finite):
                return None, None, None, None, None, None
            # rows left the cache since the forward: the gathered way, by table
            if finite is not None and not bool(finite):
                raise InvalidGradientError("the output gradient holds NaN/Inf values; nothing was updated")
            names, gs, batch = _by_table(engine.plan, store, layout, slots.device)
        # a staged step on the sets cache checks on the device (no sync): `raise_deferred`
        deferred = bool(grad.numel()) and store.paths.defers_checks(gs)
        if grad.numel() and not deferred and not validate.all_finite(grad):
            raise InvalidGradientError("the output gradient holds NaN/Inf values; nothing was updated")
        if psw is not None and psw.numel() and not validate.all_finite(psw.detach().float()):
            raise InvalidGradientError("per_sample_weights hold NaN/Inf; nothing was updated")
        store.paths.step_backward(list(zip(names, gs)),
                                  lambda table, at, salts, finite=None: engine.backward(
                                      batch, fwd, grad, table, slots if at is None else at,
                                      salts=salts, finite=finite),
                                  finite=torch.isfinite(grad).all() if deferred else None, thread=thread)
        g_psw = None
        if rows is not None:
            g_psw = _weights_grad(engine.plan, batch, fwd, grad, rows).to(psw.device)
        return None, g_psw, None, None, None, None


def direct_items(plan: Plan, ids: list[torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """(table, ids) of each feature of a plan, in its order (a direct step's items)."""
    return [(plan.tables[feat.table].name, ids[f]) for f, feat in enumerate(plan.features)]


def prepare_direct(store: Any, engine: Engine, ids: list[torch.Tensor], lengths: torch.Tensor,
                   held_at: int | None = None) -> Any:
    """A direct step of `engine`'s collection made ahead (the prefetch pipeline's thread): its
    slots on the device and its keyed batch, or None (`DirectSteps.prepare`, `held_at` as
    there); the step takes it when its input is this one. Not for 16-bit tables (no keyed
    batch)."""
    if engine.plan.packed:
        return None
    return store.paths.direct.prepare(engine, direct_items(engine.plan, ids), lengths,
                                      lambda slots, sizes: engine.keyed_step(slots, sizes, lengths),
                                      held_at)


def _table_ids(plan: Plan, of_table: list[list[int]], ids: list[torch.Tensor]
               ) -> list[tuple[str, torch.Tensor]]:
    """(table, ids of its features one after another) per table of the plan."""
    return [(tp.name, torch.cat([ids[f] for f in of_table[t]]) if len(of_table[t]) > 1
             else ids[of_table[t][0]]) for t, tp in enumerate(plan.tables)]


def _by_table(plan: Plan, store: Any, layout: tuple, device: torch.device
              ) -> tuple[list[str], list[Gathered], StepBatch]:
    """A direct step's tables, their ids gathered by table (no rows: read again at the
    update) and its batch numbered by table, for `step_backward`'s gathered way."""
    of_table, ids, sizes, lengths, weights_w = layout
    items = _table_ids(plan, of_table, ids)
    gs, inverse = [], [torch.empty(0)] * len(sizes)
    for (name, ids), fs in zip(items, of_table):
        uniq, inv = dedup(store.check_ids(store.table_record(name), ids))
        gs.append(Gathered(uniq, inv, torch.empty(0)))
        for f, part in zip(fs, torch.split(inv, [sizes[f] for f in fs])):
            inverse[f] = part
    batch = plan.step(inverse, [g.unique.numel() for g in gs], lengths, weights_w).to(device)
    return [n for n, _ in items], gs, batch


def _weights_grad(plan: Plan, batch: Any, fwd: Forward, grad: torch.Tensor,
                  rows: list[torch.Tensor]) -> torch.Tensor:
    """d loss / d per-sample weight: each position's output gradient dotted with its row."""
    inv = batch.inverse
    pos = torch.arange(inv.numel(), device=inv.device)
    bag = torch.searchsorted(batch.offsets[1:], pos, right=True)
    feat = batch.bag_feat.index_select(0, bag)
    table = plan.feat_table.to(inv.device).index_select(0, feat)
    out = torch.zeros(inv.numel(), dtype=torch.float32, device=inv.device)
    for t, tp in enumerate(plan.tables):
        at = torch.nonzero(table == t).flatten()
        if not at.numel():
            continue
        r = rows[t].to(inv.device).index_select(0, inv.index_select(0, at) - batch.u_start[t])
        cols = plan.feat_col.to(inv.device).index_select(0, feat.index_select(0, at)).unsqueeze(1) \
            + torch.arange(tp.dim, device=inv.device)
        g = grad[batch.bag_out.index_select(0, bag.index_select(0, at)).unsqueeze(1), cols]
        out.index_copy_(0, at, (g * r[:, : tp.dim]).sum(1))
    return out


class ReadOnlyRows(torch.autograd.Function):
    """Rows of flat ids from a read-only handle (inference); backward raises ReadOnlyError."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, store: Any, table: str,
                ids: torch.Tensor) -> torch.Tensor:
        ctx.path = store.path
        return store.read(table, ids)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor):  # type: ignore[override]
        raise ReadOnlyError(f"store {ctx.path} is open read-only: training through it is not allowed")


def anchor() -> torch.Tensor:
    """A leaf that requires grad (when grad is on), so autograd runs a step's backward."""
    return torch.empty(0, requires_grad=torch.is_grad_enabled())


_ENGINES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def engine_for(store: Any, features: list[tuple[str, str, str]], pooled: bool = True) -> Engine:
    """The engine of a store's features (cached per store and layout)."""
    per = _ENGINES.setdefault(store, {})
    key = (tuple(features), pooled)
    eng = per.get(key)
    if eng is None:
        specs, seen = [], set()
        for _, table, _ in features:
            if table not in seen:
                seen.add(table)
                specs.append(store.table_specs[table])
        eng = Engine(Plan(specs, features, pooled), store.kernels)
        per[key] = eng
    return eng
