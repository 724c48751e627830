"""The bag modules on the engine against nn.EmbeddingBag: mode "max" (the gradient goes to the
arg-max row), padding_idx and include_last_offset, trained with SGD side by side."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

import tierstore as ts
from tests.profiles import examples


def _store(path, n, dim, **kw):
    return ts.TierStore(path, [ts.TableSpec("t", n, dim, optimizer=ts.SGD(0.5))], device="cpu", **kw)


@settings(max_examples=examples(0.3))
@given(mode=st.sampled_from(["sum", "mean", "max"]), padding=st.sampled_from([None, 0, 3, -1]),
       last=st.booleans(), weighted=st.booleans(), small=st.booleans(),
       seed=st.integers(0, 2**31 - 1))
def test_bag_module_trains_like_embedding_bag(tmp_path_factory, mode, padding, last, weighted,
                                             small, seed):
    n, dim = 12, 5
    weighted = weighted and mode == "sum"
    path = tmp_path_factory.mktemp("s")
    caps = {"device_capacity": 3, "host_capacity": 4} if small else {}
    with _store(path, n, dim, **caps) as store:
        bag = ts.TieredEmbeddingBag(store, "t", mode=mode, padding_idx=padding, include_last_offset=last)
        ref = torch.nn.EmbeddingBag(n, dim, mode=mode, padding_idx=padding, include_last_offset=last)
        with torch.no_grad():
            ref.weight.copy_(store.read("t", torch.arange(n)))
        opt = torch.optim.SGD(ref.parameters(), lr=0.5)
        g = torch.Generator().manual_seed(seed)
        for _ in range(4):
            lengths = torch.randint(0, 5, (4,), generator=g)
            ids = torch.randint(0, n, (int(lengths.sum()),), generator=g)
            offsets = torch.zeros(5, dtype=torch.int64)
            offsets[1:] = torch.cumsum(lengths, 0)
            offsets = offsets if last else offsets[:-1]
            psw = torch.rand(ids.numel(), generator=g) if weighted else None
            target = torch.randn(4, dim, generator=g)
            out = bag(ids, offsets, per_sample_weights=psw)
            want = ref(ids, offsets, per_sample_weights=psw)
            torch.testing.assert_close(out, want.detach(), rtol=1e-5, atol=1e-5)
            ((out - target) ** 2).sum().backward()
            opt.zero_grad()
            ((want - target) ** 2).sum().backward()
            opt.step()
        torch.testing.assert_close(store.read("t", torch.arange(n)), ref.weight.detach(),
                                   rtol=1e-5, atol=1e-5)


def test_max_mode_collection_and_weights_gradient(tmp_path):
    """A collection in max mode pools each feature like F.embedding_bag; the per-sample weights'
    gradient of a sum collection is torch's."""
    specs = [ts.TableSpec("a", 20, 4, optimizer=ts.SGD(0.1)), ts.TableSpec("b", 30, 6)]
    with ts.TierStore(tmp_path / "s", specs, device="cpu") as store:
        wa, wb = store.read("a", torch.arange(20)), store.read("b", torch.arange(30))
        ebc = ts.TieredEmbeddingBagCollection(store, {"x": "a", "y": "b"}, mode="max")
        values = torch.tensor([1, 5, 5, 2, 7, 3, 9, 9])
        lengths = torch.tensor([2, 1, 0, 3, 2, 0])  # x: 2, 1, 0; y: 3, 2, 0
        out = ebc(["x", "y"], values, lengths)
        ox = torch.nn.functional.embedding_bag(values[:3], wa, torch.tensor([0, 2, 3]), mode="max")
        oy = torch.nn.functional.embedding_bag(values[3:], wb, torch.tensor([0, 3, 5]), mode="max")
        assert torch.equal(out, torch.cat([ox, oy], 1))
        ebc_w = ts.TieredEmbeddingBagCollection(store, {"x": "a", "y": "b"})
        w = torch.rand(8, requires_grad=True)
        ref_w = w.detach().clone().requires_grad_()
        out = ebc_w(["x", "y"], values, lengths, weights=w)
        ox = torch.nn.functional.embedding_bag(values[:3], wa, torch.tensor([0, 2, 3]),
                                               mode="sum", per_sample_weights=ref_w[:3])
        oy = torch.nn.functional.embedding_bag(values[3:], wb, torch.tensor([0, 3, 5]),
                                               mode="sum", per_sample_weights=ref_w[3:])
        grad = torch.randn(3, 10)
        out.backward(grad)
        torch.cat([ox, oy], 1).backward(grad)
        torch.testing.assert_close(w.grad, ref_w.grad)


def test_bag_module_refuses_bad_conventions(tmp_path):
    with _store(tmp_path / "s", 10, 2) as store:
        with pytest.raises(ts.ConfigError):
            ts.TieredEmbeddingBag(store, "t", padding_idx=10)
        bag = ts.TieredEmbeddingBag(store, "t", mode="max")
        with pytest.raises(ts.ConfigError):
            bag(torch.tensor([1, 2]), torch.tensor([0]), per_sample_weights=torch.ones(2))
        last = ts.TieredEmbeddingBag(store, "t", include_last_offset=True)
        with pytest.raises(ts.ShapeError):
            last(torch.tensor([1, 2]), torch.tensor([], dtype=torch.int64))
        assert last(torch.tensor([1, 2, 3]), torch.tensor([0, 2, 3])).shape == (2, 2)
