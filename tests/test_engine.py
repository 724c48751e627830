"""The step engine's numba backend: bit for bit today's per-table fused path, the independent
reference's math, and nn.EmbeddingBag's max/mean/sum conventions."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings

import tierstore as ts
from tests.engine_cases import Case, cases, engine_step, fused_step, table_inputs
from tests.profiles import examples
from tests.reference import reference_step
from tierstore.engine import Engine, Plan, check_kernels


@settings(max_examples=examples())
@given(case=cases(dtypes=("float32", "float16", "bfloat16")))
def test_engine_equals_the_fused_path_bit_for_bit(case: Case):
    out, slab = engine_step(case)
    ref_out, ref_slab = fused_step(case)
    assert torch.equal(out, ref_out)
    assert torch.equal(slab.view(torch.int32), ref_slab.view(torch.int32))


@settings(max_examples=examples())
@given(case=cases(clip=False))
def test_engine_update_follows_the_reference_math(case: Case):
    _, slab = engine_step(case)
    name_of = {s.name: s for s in case.specs}
    cols, c = [], 0
    for _, t, _ in case.features:
        cols.append(c)
        c += name_of[t].dim
    pstart = np.cumsum([0] + [x.numel() for x in case.ids])
    b = case.batch
    for t, (fidx, _ids, uniq, _inv) in enumerate(table_inputs(case)):
        s = case.specs[t]
        if not uniq.numel():
            continue
        gsum = np.zeros((uniq.numel(), s.dim))
        for i in fidx:  # float64 per-position gradients summed per row
            ln = case.lengths[i * b:(i + 1) * b]
            bag = torch.repeat_interleave(torch.arange(b), ln)
            g = case.grad[:, cols[i]:cols[i] + s.dim].double()[bag]
            if case.features[0][2] == "mean":
                g = g / ln.clamp(min=1).double()[bag].unsqueeze(1)
            if case.psw is not None:
                g = g * case.psw[pstart[i]:pstart[i + 1]].double().unsqueeze(1)
            local = torch.searchsorted(uniq, case.ids[i])
            np.add.at(gsum, local.numpy(), g.numpy())
        before = case.slab[case.slots[t][uniq]][:, : s.payload_dim].double().numpy()
        want = reference_step(s.optimizer.to_config(), before, gsum, s.dim)
        got = slab[case.slots[t][uniq]][:, : s.payload_dim].double().numpy()
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-5)


@settings(max_examples=examples())
@given(case=cases(modes=("max", "mean", "sum"), clip=False, weighted=False))
def test_pooling_and_sgd_match_embedding_bag(case: Case):
    """Each feature against F.embedding_bag (max: the gradient goes to the arg-max row)."""
    case.specs = [ts.TableSpec(s.name, s.num_rows, s.dim, optimizer=ts.SGD(0.5)) for s in case.specs]
    out, slab = engine_step(case)
    name_of = {s.name: (k, s) for k, s in enumerate(case.specs)}
    b, c = case.batch, 0
    weights = {s.name: case.slab[case.slots[k]][:, : s.dim].clone().requires_grad_()
               for k, s in enumerate(case.specs)}
    loss = 0
    for i, (_, t, mode) in enumerate(case.features):
        k, s = name_of[t]
        ln = case.lengths[i * b:(i + 1) * b]
        offs = torch.zeros(b, dtype=torch.int64)
        torch.cumsum(ln[:-1], 0, out=offs[1:])
        want = torch.nn.functional.embedding_bag(case.ids[i], weights[t], offs, mode=mode)
        torch.testing.assert_close(out[:, c:c + s.dim], want.detach(), rtol=1e-6, atol=1e-6)
        loss = loss + (want * case.grad[:, c:c + s.dim]).sum()
        c += s.dim
    if isinstance(loss, torch.Tensor):
        loss.backward()
    for k, s in enumerate(case.specs):
        w = weights[s.name]
        g = w.grad if w.grad is not None else torch.zeros_like(w)
        torch.testing.assert_close(slab[case.slots[k]][:, : s.dim], (w - 0.5 * g).detach(),
                                   rtol=1e-5, atol=1e-5)


def test_unpooled_plan_returns_each_ids_row():
    specs = [ts.TableSpec("a", 10, 3), ts.TableSpec("b", 7, 5)]
    plan = Plan(specs, [("x", "a", "sum"), ("y", "b", "sum")], pooled=False)
    slab = torch.randn(20, 6)
    ids_a, ids_b = torch.tensor([3, 1, 3]), torch.tensor([6, 0])
    ua, ia = torch.unique(ids_a, return_inverse=True)
    ub, ib = torch.unique(ids_b, return_inverse=True)
    batch = plan.step([ia, ib], [ua.numel(), ub.numel()], torch.empty(0))
    slots = torch.cat([ua, 10 + ub])
    out, _ = Engine(plan).forward(batch, slab, slots)
    assert out.shape == (5, 5)
    assert torch.equal(out[:3, :3], slab[ids_a, :3]) and torch.equal(out[3:, :5], slab[10 + ids_b, :5])
    assert bool((out[:3, 3:] == 0).all())


def test_kernel_names_are_checked(monkeypatch):
    cpu = torch.device("cpu")
    assert check_kernels("auto", cpu) == "numba"
    assert check_kernels("numba", cpu) == "numba"
    with pytest.raises(ts.ConfigError, match="kernels must be one of"):
        check_kernels("cuda", cpu)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ts.ConfigError, match="TRITON_INTERPRET|triton package"):
        check_kernels("triton", cpu)
