"""The Triton backend under the interpreter (TRITON_INTERPRET=1, CPU tensors) against numba,
bit for bit; and its step makes no call that would synchronize a CUDA device."""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") in (None, "", "0") and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton's first import: kernels on CPU tensors
triton = pytest.importorskip("triton")

from hypothesis import given, settings  # noqa: E402

from tests.engine_cases import Case, cases, engine_step  # noqa: E402
from tests.profiles import examples  # noqa: E402
from tests.syncs import SyncCounter  # noqa: E402
from tierstore.engine import Engine, Plan, interpreting  # noqa: E402

interpreted = pytest.mark.skipif(not interpreting(), reason="triton was imported without its interpreter")


@interpreted
@settings(max_examples=examples(0.4))
@given(case=cases(modes=("sum", "mean", "max"), dtypes=("float32", "float16", "bfloat16")))
def test_triton_equals_numba_bit_for_bit(case: Case):
    out, slab = engine_step(case, "numba")
    t_out, t_slab = engine_step(case, "triton")
    assert torch.equal(out, t_out)
    assert torch.equal(slab.view(torch.int32), t_slab.view(torch.int32))


@interpreted
def test_triton_step_makes_no_syncing_call():
    import tierstore as ts

    specs = [ts.TableSpec("a", 50, 8, optimizer=ts.RowWiseAdagrad(0.1)),
             ts.TableSpec("b", 40, 4, optimizer=ts.Adam(0.01))]
    plan = Plan(specs, [("x", "a", "sum"), ("y", "b", "mean"), ("z", "a", "max")])
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(0, 4, (12,), generator=g)
    ids = [torch.randint(0, 50, (int(lengths[:4].sum()),), generator=g),
           torch.randint(0, 40, (int(lengths[4:8].sum()),), generator=g),
           torch.randint(0, 50, (int(lengths[8:].sum()),), generator=g)]
    ua, ia = torch.unique(torch.cat([ids[0], ids[2]]), return_inverse=True)
    ub, ib = torch.unique(ids[1], return_inverse=True)
    k = ids[0].numel()
    batch = plan.step([ia[:k], ib, ia[k:]], [ua.numel(), ub.numel()], lengths)  # staged earlier
    slab = torch.randn(100, 20, generator=g).abs()
    slots = torch.cat([ua, 50 + ub])
    eng = Engine(plan, "triton")
    grad = torch.randn(4, 20, generator=g)
    with SyncCounter() as counter:
        out, fwd = eng.forward(batch, slab, slots)
        eng.backward(batch, fwd, grad, slab, slots)
    assert out.shape == (4, 20)
    assert counter.calls == []


@interpreted
@pytest.mark.parametrize("mode", ["sum", "max"])
def test_twenty_steps_with_triton_equal_numba(tmp_path, mode):
    import tierstore as ts

    specs = [ts.TableSpec("a", 60, 8, optimizer=ts.RowWiseAdagrad(0.1)),
             ts.TableSpec("b", 40, 6, optimizer=ts.Adam(0.01), dtype="bfloat16")]
    final = []
    for kernels in ("numba", "triton"):
        with ts.TierStore(tmp_path / kernels, specs, device="cpu", kernels=kernels) as store:
            assert store.kernels == kernels
            ebc = ts.TieredEmbeddingBagCollection(store, {"x": "a", "y": "b", "z": "a"}, mode=mode)
            g = torch.Generator().manual_seed(3)
            for _ in range(20):
                lengths = torch.randint(0, 4, (12,), generator=g)
                n = [int(lengths[i * 4:(i + 1) * 4].sum()) for i in range(3)]
                values = torch.cat([torch.randint(0, 60, (n[0],), generator=g),
                                    torch.randint(0, 40, (n[1],), generator=g),
                                    torch.randint(0, 60, (n[2],), generator=g)])
                out = ebc(["x", "y", "z"], values, lengths)
                (out * torch.randn(out.shape, generator=g)).sum().backward()
            final.append({t: store.read(t, torch.arange(r)) for t, r in (("a", 60), ("b", 40))})
    for t in ("a", "b"):
        assert torch.equal(final[0][t], final[1][t]), t


@interpreted
@pytest.mark.parametrize("opt", ["sgd", "adagrad"])
def test_twenty_prefetched_steps_over_small_caches_with_triton_equal_numba(tmp_path, opt):
    """Rows moving through caches of 16 rows, staged by the Prefetcher, with per-id weights:
    the Triton kernels (interpreter) leave every row and its state as numba does."""
    import tierstore as ts

    def make():
        return ts.SGD(0.1) if opt == "sgd" else ts.Adagrad(0.1)

    g = torch.Generator().manual_seed(11)
    batches = []
    for _ in range(20):
        lengths = torch.randint(0, 4, (8,), generator=g)
        n0, n1 = int(lengths[:4].sum()), int(lengths[4:].sum())
        values = torch.cat([torch.randint(0, 60, (n0,), generator=g),
                            torch.randint(0, 40, (n1,), generator=g)])
        batches.append((["x", "y"], values, lengths, torch.rand(values.shape, generator=g)))
    final = []
    for kernels in ("numba", "triton"):
        specs = [ts.TableSpec("a", 60, 8, optimizer=make()), ts.TableSpec("b", 40, 6, optimizer=make())]
        with ts.TierStore(tmp_path / kernels, specs, device="cpu", kernels=kernels,
                          device_capacity=16, host_capacity=16) as store:
            ebc = ts.TieredEmbeddingBagCollection(store, {"x": "a", "y": "b"})
            with ts.Prefetcher(store, iter(batches), depth=2, extract=lambda b: b[:3]) as pf:
                for keys, values, lengths, w in pf:
                    out = ebc(keys, values, lengths, per_sample_weights=w)
                    (out * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
            final.append({t: store.read(t, torch.arange(r)) for t, r in (("a", 60), ("b", 40))})
    for t in ("a", "b"):
        assert torch.equal(final[0][t], final[1][t]), t


@pytest.mark.skipif(not torch.cuda.is_available() or interpreting(), reason="needs a CUDA device")
@settings(max_examples=examples(0.4))
@given(case=cases(modes=("sum", "mean", "max"), dtypes=("float32", "float16", "bfloat16")))
def test_triton_on_cuda_equals_numba_on_the_cpu(case: Case):
    """Across devices: the compiled kernels make the numba kernels' float32 operations in the
    same order (no FMA, IEEE division and square root: `tests/test_triton_compile.py`), so the
    bits match. Adam's step size is float64 math without `pow` in both (its power by squaring:
    CUDA's `pow` and libm's may differ in the last bits, and this test held Adam to 2 float32
    ulps while the device computed it with `torch.pow`)."""
    out, slab = engine_step(case, "numba")
    c_out, c_slab = engine_step(case, "triton", "cuda")
    assert torch.equal(out, c_out)
    assert torch.equal(slab.view(torch.int32), c_slab.view(torch.int32))


@interpreted
@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_hot_rows_sum_in_position_order(mode):
    """A row many positions read (more than the backward loads at once, as Zipf's head rows
    are): its gradient is still added position by position, as numba does."""
    import tierstore as ts
    from tests.engine_cases import Case

    g = torch.Generator().manual_seed(7)
    specs = [ts.TableSpec("h", 3, 16, optimizer=ts.RowWiseAdagrad(0.1), clip=0.5),
             ts.TableSpec("a", 5, 8, optimizer=ts.Adam(0.01))]
    features = [("x", "h", mode), ("y", "a", mode), ("z", "h", mode)]
    batch = 7
    slab = torch.randn((12, max(s.row_dim for s in specs)), generator=g).abs()  # states >= 0
    slab[:, :16] -= 0.5
    slots = [torch.tensor([4, 0, 9]), torch.tensor([1, 2, 3, 5, 6])]
    a = specs[1]
    slab[slots[1], a.weight_cols + 2 * a.dim] = torch.tensor([0.0, 1.0, 2.0, 3.0, 4.0])  # Adam's steps
    lengths = torch.full((3 * batch,), 6, dtype=torch.int64)
    lengths[3] = 0
    ids = [torch.zeros(int(lengths[:batch].sum()), dtype=torch.int64),  # one row, 36 positions
           torch.randint(0, 5, (int(lengths[batch:2 * batch].sum()),), generator=g),
           torch.randint(0, 2, (int(lengths[2 * batch:].sum()),), generator=g)]
    n = int(lengths.sum())
    psw = torch.rand(n, generator=g) if mode == "sum" else None
    grad = torch.randn((batch, 16 + 8 + 16), generator=g)
    case = Case(specs, features, slab, slots, ids, lengths, psw, grad, batch)
    out, slab_n = engine_step(case, "numba")
    t_out, slab_t = engine_step(case, "triton")
    assert torch.equal(out, t_out)
    assert torch.equal(slab_n.view(torch.int32), slab_t.view(torch.int32))
    assert not torch.equal(slab_n, slab)  # the rows were updated
