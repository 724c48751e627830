"""TieredEmbeddingBag(Collection) against plain PyTorch and against itself across placements."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

import tierstore as ts
from tests.profiles import examples

N, DIM = 60, 4


def _bags(gen: torch.Generator, n_bags: int, max_len: int, n_rows: int = N):
    lengths = torch.randint(0, max_len + 1, (n_bags,), generator=gen)
    ids = torch.randint(0, n_rows, (int(lengths.sum()),), generator=gen)
    offsets = torch.zeros(n_bags, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lengths, 0)[:-1]
    return ids, offsets


def _rowwise_adagrad_ref(weight, acc, grad, lr, eps):
    """Hand-written row-wise Adagrad on the rows with a nonzero gradient."""
    touched = grad.abs().sum(1) > 0
    g = grad[touched]
    acc[touched] += g.pow(2).mean(1)
    weight[touched] -= lr * g / (acc[touched].sqrt() + eps).unsqueeze(1)


def _adam_ref(weight, m, v, t, grad, lr, b1, b2, eps):
    """SparseAdam semantics with a per-row step count, on the rows with a nonzero gradient."""
    touched = grad.abs().sum(1) > 0
    g = grad[touched]
    t[touched] += 1
    m[touched] = m[touched] + (g - m[touched]) * (1 - b1)
    v[touched] = v[touched] + (g * g - v[touched]) * (1 - b2)
    tt = t[touched].double()
    step = (lr * (1 - b2**tt).sqrt() / (1 - b1**tt)).float().unsqueeze(1)
    weight[touched] -= step * m[touched] / (v[touched].sqrt() + eps)


@pytest.mark.parametrize("opt_name", ["sgd", "adagrad", "rowwise", "adam"])
@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_matches_plain_pytorch_after_50_steps(tmp_path, opt_name, mode):
    opt = {"sgd": ts.SGD(0.1), "adagrad": ts.Adagrad(0.1), "rowwise": ts.RowWiseAdagrad(0.1),
           "adam": ts.Adam(0.01)}[opt_name]
    spec = ts.TableSpec("t", N, DIM, optimizer=opt)
    gen = torch.Generator().manual_seed(7)
    with ts.TierStore(tmp_path / "s", [spec], device_capacity=8, host_capacity=16,
                      device="cpu") as store:
        bag = ts.TieredEmbeddingBag(store, "t", mode=mode)
        ref = torch.nn.EmbeddingBag(N, DIM, mode=mode)
        with torch.no_grad():
            ref.weight.copy_(store.read("t", torch.arange(N)))
        torch_opt = {"sgd": lambda: torch.optim.SGD(ref.parameters(), lr=0.1),
                     "adagrad": lambda: torch.optim.Adagrad(ref.parameters(), lr=0.1)}
        topt = torch_opt[opt_name]() if opt_name in torch_opt else None
        acc = torch.zeros(N)
        m, v, t = torch.zeros(N, DIM), torch.zeros(N, DIM), torch.zeros(N)
        for _ in range(50):
            ids, offsets = _bags(gen, 6, 5)
            target = torch.randn(6, DIM, generator=gen)
            loss = ((bag(ids, offsets) - target) ** 2).sum()
            loss.backward()
            ref.zero_grad()
            ((ref(ids, offsets) - target) ** 2).sum().backward()
            with torch.no_grad():
                if topt is not None:
                    topt.step()
                elif opt_name == "rowwise":
                    _rowwise_adagrad_ref(ref.weight, acc, ref.weight.grad, 0.1, 1e-10)
                else:
                    _adam_ref(ref.weight, m, v, t, ref.weight.grad, 0.01, 0.9, 0.999, 1e-8)
        got = store.read("t", torch.arange(N))
        torch.testing.assert_close(got, ref.weight.detach(), rtol=1e-6, atol=1e-6)


def _train(path, caps, policy, steps, opt, reopen_at=None, mode="sum"):
    """Train a collection of two features sharing one table plus one more; return payloads."""
    specs = [ts.TableSpec("a", 10**11, 3, optimizer=opt),
             ts.TableSpec("b", 40, 5, optimizer=ts.RowWiseAdagrad(0.3))]
    gen = torch.Generator().manual_seed(3)

    def open_():
        return ts.TierStore(path, specs, device_capacity=caps[0], host_capacity=caps[1],
                            policy=policy, device="cpu")

    store = open_()
    feats = {"f1": "a", "f2": "a", "f3": "b"}
    ebc = ts.TieredEmbeddingBagCollection(store, feats, mode=mode)
    dense = torch.nn.Linear(11, 1)
    torch.manual_seed(0)
    dense.reset_parameters()
    dopt = torch.optim.SGD(dense.parameters(), lr=0.05)
    for step in range(steps):
        if step == reopen_at:
            store.close()
            store = open_()
            ebc = ts.TieredEmbeddingBagCollection(store, feats, mode=mode)
        lengths = torch.randint(0, 4, (3 * 4,), generator=gen)
        vals = []
        for i, t in enumerate(feats.values()):
            n = int(lengths[i * 4 : (i + 1) * 4].sum())
            hi = 40 if t == "b" else 30
            vals.append(torch.randint(0, hi, (n,), generator=gen) * (1 if t == "b" else 7919))
        out = ebc(list(feats), torch.cat(vals), lengths)
        loss = dense(out).pow(2).mean()
        dopt.zero_grad()
        loss.backward()
        dopt.step()
    ids_a = torch.arange(30) * 7919
    result = {"a": store.cascade.access(store.tables["a"], ids_a, None).clone(),
              "b": store.cascade.access(store.tables["b"], torch.arange(40), None).clone(),
              "dense": dense.weight.detach().clone()}
    store.close()
    return result


@pytest.mark.parametrize("opt", [ts.Adagrad(0.2), ts.Adam(0.05)])
def test_bit_identical_for_every_placement(tmp_path, opt):
    base = _train(tmp_path / "base", (10**6, 10**6), "lru", 25, opt)
    cases = [((1, 0), "lru", None), ((0, 0), "lfu", None), ((2, 3), "lfu", 10),
             ((5, 7), "lru", 13), ((1, 1), "lru", 5)]
    for i, (caps, policy, reopen) in enumerate(cases):
        got = _train(tmp_path / f"c{i}", caps, policy, 25, opt, reopen_at=reopen)
        for k in base:
            assert torch.equal(got[k], base[k]), (caps, policy, reopen, k)


@settings(max_examples=examples(0.5))
@given(n_bags=st.integers(0, 6), max_len=st.integers(0, 6), mode=st.sampled_from(["sum", "mean"]),
       weighted=st.booleans(), two_d=st.booleans(), seed=st.integers(0, 1000),
       caps=st.tuples(st.integers(0, 4), st.integers(0, 4)))
def test_forward_backward_match_embedding_bag(tmp_path_factory, n_bags, max_len, mode, weighted,
                                              two_d, seed, caps):
    if weighted and mode == "mean":
        mode = "sum"
    gen = torch.Generator().manual_seed(seed)
    path = tmp_path_factory.mktemp("s")
    spec = ts.TableSpec("t", N, DIM, optimizer=ts.SGD(0.5))
    with ts.TierStore(path, [spec], device_capacity=caps[0], host_capacity=caps[1],
                      device="cpu") as store:
        before = store.read("t", torch.arange(N))
        ref = torch.nn.EmbeddingBag(N, DIM, mode=mode)
        with torch.no_grad():
            ref.weight.copy_(before)
        if two_d:
            ids = torch.randint(0, N, (n_bags, max_len), generator=gen)
            offsets = None
        else:
            ids, offsets = _bags(gen, n_bags, max_len)
        psw = torch.rand(ids.shape, generator=gen) if weighted else None
        bag = ts.TieredEmbeddingBag(store, "t", mode=mode)
        out = bag(ids, offsets, per_sample_weights=psw)
        if two_d:  # torch's own 2-D path rejects empty shapes: feed it the 1-D form
            flat_off = torch.arange(n_bags, dtype=torch.int64) * max_len
            flat_psw = None if psw is None else psw.reshape(-1)
            want = ref(ids.reshape(-1), flat_off, per_sample_weights=flat_psw)
        else:
            want = ref(ids, offsets, per_sample_weights=psw)
        torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
        target = torch.randn(out.shape, generator=gen)
        ((out - target) ** 2).sum().backward()
        ((want - target) ** 2).sum().backward()
        with torch.no_grad():
            ref.weight -= 0.5 * ref.weight.grad
        torch.testing.assert_close(store.read("t", torch.arange(N)), ref.weight.detach(),
                                   rtol=1e-6, atol=1e-6)


def test_per_sample_weight_gradient(tmp_path):
    spec = ts.TableSpec("t", N, DIM)
    with ts.TierStore(tmp_path / "s", [spec], device_capacity=4, host_capacity=4) as store:
        ref = torch.nn.EmbeddingBag(N, DIM, mode="sum")
        with torch.no_grad():
            ref.weight.copy_(store.read("t", torch.arange(N)))
        ids, offsets = torch.tensor([1, 2, 2, 5, 9]), torch.tensor([0, 2])
        w1 = torch.rand(5, requires_grad=True)
        w2 = w1.detach().clone().requires_grad_(True)
        ts.TieredEmbeddingBag(store, "t")(ids, offsets, per_sample_weights=w1).sum().backward()
        ref(ids, offsets, per_sample_weights=w2).sum().backward()
        torch.testing.assert_close(w1.grad, w2.grad)


def test_collection_takes_weights_by_either_name(tmp_path):
    """`weights=` and `per_sample_weights=` (nn.EmbeddingBag's name) give the same pooling; both
    at once is a ShapeError that changes nothing."""
    spec = ts.TableSpec("t", N, DIM)
    with ts.TierStore(tmp_path / "s", [spec]) as store:
        ebc = ts.TieredEmbeddingBagCollection(store, {"f": "t"})
        values, lengths = torch.tensor([1, 2, 2, 5, 9]), torch.tensor([2, 3])
        w = torch.rand(5)
        with torch.no_grad():
            a = ebc(["f"], values, lengths, weights=w)
            b = ebc(["f"], values, lengths, per_sample_weights=w)
            before = store.read("t", torch.arange(N))
            with pytest.raises(ts.ShapeError):
                ebc(["f"], values, lengths, weights=w, per_sample_weights=w)
        assert torch.equal(a, b)
        assert not torch.equal(a, ebc(["f"], values, lengths).detach())
        assert torch.equal(store.read("t", torch.arange(N)), before)


class FakeKJT:
    """Duck-typed stand-in for torchrec's KeyedJaggedTensor."""

    def __init__(self, keys, values, lengths):
        self._k, self._v, self._l = keys, values, lengths

    def keys(self):
        return self._k

    def values(self):
        return self._v

    def lengths(self):
        return self._l

    def weights_or_none(self):
        return None


def test_collection_layouts_and_kjt(tmp_path):
    specs = [ts.TableSpec("a", 100, 3), ts.TableSpec("b", 100, 2)]
    with ts.TierStore(tmp_path / "s", specs, device_capacity=10, host_capacity=10) as store:
        ebc = ts.TieredEmbeddingBagCollection(store, {"x": "a", "y": "b", "z": "a"})
        keys = ["y", "x", "z"]  # input order may differ from the collection's feature order
        lengths = torch.tensor([1, 2, 0, 1, 3, 1])
        values = torch.tensor([5, 6, 7, 8, 9, 10, 11, 12])
        with torch.no_grad():
            out = ebc(keys, values, lengths)
            as_dict = ebc(FakeKJT(keys, values, lengths), as_dict=True)
            offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
            by_offsets = ebc(keys, values, offsets=offsets)
        # the store's device may be CUDA (its default where there is one): compare on the CPU
        out, by_offsets = out.cpu(), by_offsets.cpu()
        as_dict = {k: v.cpu() for k, v in as_dict.items()}
        assert out.shape == (2, 3 + 2 + 3)
        assert torch.equal(out, torch.cat([as_dict["x"], as_dict["y"], as_dict["z"]], 1))
        assert torch.equal(out, by_offsets)
        a = store.read("a", torch.arange(100)).cpu()
        b = store.read("b", torch.arange(100)).cpu()
        # y: [5] | [6, 7]; x: [] | [8]; z: [9, 10, 11] | [12]
        assert torch.equal(as_dict["y"][1], b[6] + b[7])
        assert torch.equal(as_dict["x"][0], torch.zeros(3))
        assert torch.equal(as_dict["x"][1], a[8])
        assert torch.equal(as_dict["z"][0], a[9] + a[10] + a[11])
        assert torch.equal(as_dict["z"][1], a[12])
        with pytest.raises(ts.ShapeError):
            ebc(["x"], values, lengths)


def test_module_errors(tmp_path):
    with ts.TierStore(tmp_path / "s", [ts.TableSpec("a", 10, 2)], device_capacity=2,
                      host_capacity=2) as store:
        with pytest.raises(ts.UnknownTableError):
            ts.TieredEmbeddingBag(store, "nope")
        with pytest.raises(ts.ConfigError):
            ts.TieredEmbeddingBag(store, "a", mode="median")
        bag = ts.TieredEmbeddingBag(store, "a")
        with pytest.raises(ts.ShapeError):
            bag(torch.tensor([1, 2]))
        with pytest.raises(ts.InvalidIdsError):
            bag(torch.tensor([1, 20]), torch.tensor([0]))
        with pytest.raises(ts.ShapeError):
            bag(torch.tensor([1, 2]), torch.tensor([1]))


@pytest.mark.parametrize("opt", [ts.SGD(0.3, weight_decay=0.01), ts.Adagrad(0.2),
                                 ts.RowWiseAdagrad(0.2, weight_decay=0.01), ts.Adam(0.05)])
@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_fused_kernels_match_the_torch_path(tmp_path, opt, mode):
    """The numba kernels and the pure-torch update agree within float32 rounding."""
    results = []
    for fused in (True, False):
        spec = ts.TableSpec("t", N, DIM, optimizer=opt)
        gen = torch.Generator().manual_seed(11)
        with ts.TierStore(tmp_path / f"s{fused}", [spec], device_capacity=7, host_capacity=9,
                          device="cpu") as store:
            store.fused = fused
            bag = ts.TieredEmbeddingBag(store, "t", mode=mode)
            for _ in range(30):
                ids, offsets = _bags(gen, 6, 5)
                psw = torch.rand(ids.shape, generator=gen) if mode == "sum" else None
                target = torch.randn(6, DIM, generator=gen)
                ((bag(ids, offsets, per_sample_weights=psw) - target) ** 2).sum().backward()
                store.apply("t", ids, torch.randn(ids.numel(), DIM, generator=gen) * 0.1)
            results.append(store.cascade.access(store.tables["t"], torch.arange(N), None).clone())
    torch.testing.assert_close(results[0], results[1], rtol=1e-5, atol=1e-6)


def test_torch_update_path_is_also_placement_invariant(tmp_path, monkeypatch):
    monkeypatch.setattr("tierstore.store.HAVE_NUMBA", False)
    base = _train(tmp_path / "base", (10**6, 10**6), "lru", 15, ts.Adagrad(0.2))
    got = _train(tmp_path / "tiny", (1, 2), "lfu", 15, ts.Adagrad(0.2), reopen_at=7)
    for k in base:
        assert torch.equal(got[k], base[k]), k


def test_rows_moved_between_forward_and_backward(tmp_path):
    """Backward must find rows that other traffic moved after the forward gathered them."""
    spec = ts.TableSpec("t", N, DIM, optimizer=ts.Adagrad(0.3))
    results = []
    for interleave in (False, True):
        with ts.TierStore(tmp_path / f"s{interleave}", [spec], device_capacity=6, host_capacity=6,
                          device="cpu") as store:
            bag = ts.TieredEmbeddingBag(store, "t")
            gen = torch.Generator().manual_seed(5)
            for _ in range(20):
                ids, offsets = _bags(gen, 3, 2)
                out = bag(ids, offsets)
                if interleave:  # evict everything the forward saw
                    store.read("t", torch.arange(N))
                out.sum().backward()
            results.append(store.read("t", torch.arange(N)))
    assert torch.equal(results[0], results[1])
