"""TieredEmbedding(Collection) against nn.Embedding + torch optimizers, and across placements."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings
from test_module import _adam_ref, _rowwise_adagrad_ref

import tierstore as ts
from tierstore.prefetch import Prefetcher

N, DIM = 50, 4
OPTS = {"sgd": lambda: ts.SGD(0.1), "adagrad": lambda: ts.Adagrad(0.1),
        "rowwise": lambda: ts.RowWiseAdagrad(0.1), "adam": lambda: ts.Adam(0.01)}


@pytest.mark.parametrize("opt_name", list(OPTS))
@pytest.mark.parametrize("padding_idx", [None, 3])
def test_matches_nn_embedding_after_40_steps(tmp_path, opt_name, padding_idx):
    """The engine's update (one path for every placement) agrees with nn.Embedding + the torch
    optimizer (or the row-wise / Adam reference) to 1e-6 after 40 steps."""
    spec = ts.TableSpec("t", N, DIM, optimizer=OPTS[opt_name]())
    gen = torch.Generator().manual_seed(3)
    with ts.TierStore(tmp_path / "s", [spec], device_capacity=8, host_capacity=16,
                      device="cpu") as store:
        emb = ts.TieredEmbedding(store, "t", padding_idx=padding_idx)
        ref = torch.nn.Embedding(N, DIM, padding_idx=padding_idx)
        with torch.no_grad():
            ref.weight.copy_(store.read("t", torch.arange(N)))
            if padding_idx is not None:
                ref.weight[padding_idx] = 0
        topt = {"sgd": lambda: torch.optim.SGD(ref.parameters(), lr=0.1),
                "adagrad": lambda: torch.optim.Adagrad(ref.parameters(), lr=0.1)}
        topt = topt[opt_name]() if opt_name in topt else None
        acc = torch.zeros(N)
        m, v, t = torch.zeros(N, DIM), torch.zeros(N, DIM), torch.zeros(N)
        pad_before = store.read("t", torch.tensor([3]))
        for _ in range(40):
            ids = torch.randint(0, N, (3, 5), generator=gen)  # 2-D ids, repeats included
            target = torch.randn(3, 5, DIM, generator=gen)
            out = emb(ids)
            assert out.shape == (3, 5, DIM)
            if padding_idx is not None:
                assert bool((out[ids == padding_idx] == 0).all())
            ((out - target) ** 2).sum().backward()
            ref.zero_grad()
            ((ref(ids) - target) ** 2).sum().backward()
            with torch.no_grad():
                if topt is not None:
                    topt.step()
                elif opt_name == "rowwise":
                    _rowwise_adagrad_ref(ref.weight, acc, ref.weight.grad, 0.1, 1e-10)
                else:
                    _adam_ref(ref.weight, m, v, t, ref.weight.grad, 0.01, 0.9, 0.999, 1e-8)
        got = store.read("t", torch.arange(N))
        keep = torch.arange(N) != (padding_idx if padding_idx is not None else -1)
        torch.testing.assert_close(got[keep], ref.weight.detach()[keep], rtol=1e-6, atol=1e-6)
        if padding_idx is not None:  # the padding row was never updated
            assert torch.equal(store.read("t", torch.tensor([3])), pad_before)


def _train_collection(path, caps, policy, steps, opt, prefetch=False):
    """Two sequence features sharing table `a`, one on `b`; returns every payload after training."""
    specs = [ts.TableSpec("a", 40, 3, optimizer=opt), ts.TableSpec("b", 30, 5, optimizer=opt)]
    gen = torch.Generator().manual_seed(11)
    batches = []
    for _ in range(steps):
        lengths = torch.randint(0, 4, (3 * 4,), generator=gen)
        n = lengths.view(3, 4).sum(1)
        values = torch.cat([torch.randint(0, 40, (int(n[0]),), generator=gen),
                            torch.randint(0, 40, (int(n[1]),), generator=gen),
                            torch.randint(0, 30, (int(n[2]),), generator=gen)])
        batches.append((["f1", "f2", "g"], values, lengths))
    with ts.TierStore(path, specs, device_capacity=caps[0], host_capacity=caps[1],
                      policy=policy, device="cpu") as store:
        ec = ts.TieredEmbeddingCollection(store, {"f1": "a", "f2": "a", "g": "b"})
        it = Prefetcher(ec, batches, depth=2) if prefetch else batches
        for keys, values, lengths in it:
            out = ec(keys, values, lengths)
            assert out["g"].values().shape == (int(lengths[8:].sum()), 5)
            assert torch.equal(out["f2"].lengths(), lengths[4:8])
            loss = sum((j.values() * torch.arange(1, j.values().shape[1] + 1)).sin().sum()
                       for j in out.values())
            loss.backward()
        store.flush()
        pa = store.cascade.access(store.table_record("a"), torch.arange(40), None, count=False)
        pb = store.cascade.access(store.table_record("b"), torch.arange(30), None, count=False)
        return pa[:, : specs[0].payload_dim].clone(), pb[:, : specs[1].payload_dim].clone()


@settings(deadline=None, max_examples=6)
@given(opt=st.sampled_from(list(OPTS)), dcap=st.integers(0, 12), hcap=st.integers(0, 40),
       policy=st.sampled_from(["lru", "lfu", "clock"]), prefetch=st.booleans())
def test_collection_bit_identical_for_every_placement(tmp_path_factory, opt, dcap, hcap, policy,
                                                      prefetch):
    base = tmp_path_factory.mktemp("seq")
    ref = _train_collection(base / "ref", (200, 0), "lru", 6, OPTS[opt]())
    got = _train_collection(base / "got", (dcap, hcap), policy, 6, OPTS[opt](), prefetch)
    assert torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1])


def test_collection_equals_separate_embeddings(tmp_path):
    """A collection's values are the rows of its ids, and features sharing a table share updates."""
    spec = ts.TableSpec("a", 20, 2, optimizer=ts.SGD(0.5))
    with ts.TierStore(tmp_path / "s", [spec], device_capacity=4, host_capacity=4,
                      device="cpu") as store:
        ec = ts.TieredEmbeddingCollection(store, {"x": "a", "y": "a"})
        values = torch.tensor([1, 2, 2, 5, 1])
        lengths = torch.tensor([2, 1, 0, 2])  # x: [1, 2], [2]; y: [], [5, 1]
        before = store.read("a", values)
        out = ec(["x", "y"], values, lengths)
        assert torch.equal(out["x"].values(), before[:3])
        assert torch.equal(out["y"].values(), before[3:])
        assert torch.equal(out["x"].offsets(), torch.tensor([0, 2, 3]))
        (out["x"].values().sum() + out["y"].values().sum()).backward()
        after = store.read("a", torch.tensor([1, 2, 5]))
        # row 1 appears twice (x and y), row 2 twice, row 5 once: SGD by 0.5 per use
        expect = store.read("a", torch.tensor([1, 2, 5]))
        torch.testing.assert_close(after, expect)
        torch.testing.assert_close(after, before[[0, 1, 3]] - torch.tensor([[1.0], [1.0], [0.5]]))


def test_keyed_jagged_tensor_input(tmp_path):
    torchrec = pytest.importorskip("torchrec")
    spec = ts.TableSpec("a", 20, 2)
    with ts.TierStore(tmp_path / "s", [spec], device="cpu", device_capacity=8,
                      host_capacity=8) as store:
        ec = ts.TieredEmbeddingCollection(store, {"x": "a"})
        kjt = torchrec.KeyedJaggedTensor(keys=["x"], values=torch.tensor([3, 4, 7]),
                                         lengths=torch.tensor([1, 2]))
        out = ec(kjt)
        assert torch.equal(out["x"].values(), store.read("a", torch.tensor([3, 4, 7])))
        assert torch.equal(out["x"].lengths(), torch.tensor([1, 2]))


def test_kjt_like_object_input(tmp_path):
    """Any object with keys()/values()/lengths() methods is taken as a KeyedJaggedTensor."""

    class KJT:
        def keys(self):
            return ["x"]

        def values(self):
            return torch.tensor([3, 4, 7])

        def lengths(self):
            return torch.tensor([2, 1])

    with ts.TierStore(tmp_path / "s", [ts.TableSpec("a", 20, 2)], device="cpu",
                      device_capacity=8, host_capacity=8) as store:
        out = ts.TieredEmbeddingCollection(store, {"x": "a"})(KJT())
        values, lengths = out["x"]
        assert torch.equal(values, store.read("a", torch.tensor([3, 4, 7])))
        assert [s.shape[0] for s in out["x"].split()] == [2, 1]


def test_bad_input_is_a_clear_error_and_changes_nothing(tmp_path):
    with ts.TierStore(tmp_path / "s", [ts.TableSpec("a", 20, 2)], device="cpu",
                      device_capacity=8, host_capacity=8) as store:
        emb = ts.TieredEmbedding(store, "a")
        before = store.read("a", torch.arange(20))
        with pytest.raises(ts.InvalidIdsError):
            emb(torch.tensor([1, 20]))
        with pytest.raises(ts.InvalidIdsError):
            emb(torch.tensor([0.5]))
        with pytest.raises(ts.ConfigError):
            ts.TieredEmbedding(store, "a", padding_idx=20)
        with pytest.raises(ts.UnknownTableError):
            ts.TieredEmbedding(store, "nope")
        with pytest.raises(ts.ShapeError):
            ts.TieredEmbeddingCollection(store, {"x": "a"})(["x"], torch.tensor([1]),
                                                           torch.tensor([2]))
        assert torch.equal(store.read("a", torch.arange(20)), before)


def test_non_finite_gradient_is_refused_and_changes_nothing(tmp_path):
    spec = ts.TableSpec("t", N, DIM, optimizer=ts.Adagrad(0.1))
    with ts.TierStore(tmp_path / "s", [spec], device_capacity=8, host_capacity=16,
                      device="cpu") as store:
        emb = ts.TieredEmbedding(store, "t")
        before = store.read("t", torch.arange(N))
        out = emb(torch.tensor([[1, 2], [2, 9]]))
        with pytest.raises(ts.InvalidGradientError):
            (out * torch.tensor(float("nan"))).sum().backward()
        assert torch.equal(store.read("t", torch.arange(N)), before)


def test_last_row_padding_idx_and_empty_input(tmp_path):
    with ts.TierStore(tmp_path / "s", [ts.TableSpec("a", 20, 2)], device="cpu",
                      device_capacity=8, host_capacity=8) as store:
        with pytest.raises(ts.ConfigError):  # issue 38: a negative index names a real row
            ts.TieredEmbedding(store, "a", padding_idx=-1)
        emb = ts.TieredEmbedding(store, "a", padding_idx=19)
        assert emb.padding_idx == 19
        out = emb(torch.tensor([[19, 2]]))
        assert torch.equal(out[0, 0], torch.zeros(2))
        assert torch.equal(out[0, 1], store.read("a", torch.tensor([2]))[0])
        assert emb(torch.empty(0, 3, dtype=torch.int64)).shape == (0, 3, 2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("opt_name", list(OPTS))
def test_cuda_store_matches_cpu_store(tmp_path, opt_name):
    """The torch (non-numba) update path on a CUDA store gives the CPU store's rows."""
    out = {}
    for dev in ("cpu", "cuda"):
        spec = ts.TableSpec("t", N, DIM, optimizer=OPTS[opt_name]())
        gen = torch.Generator().manual_seed(9)
        with ts.TierStore(tmp_path / dev, [spec], device_capacity=8, host_capacity=16,
                          device=dev) as store:
            emb = ts.TieredEmbedding(store, "t", padding_idx=0)
            for _ in range(10):
                ids = torch.randint(0, N, (4, 6), generator=gen)
                target = torch.randn(4, 6, DIM, generator=gen).to(dev)
                ((emb(ids.to(dev)) - target) ** 2).sum().backward()
            out[dev] = store.read("t", torch.arange(N)).cpu()
    torch.testing.assert_close(out["cuda"], out["cpu"], rtol=1e-5, atol=1e-6)


def test_adam_matches_torch_sparse_adam_when_every_row_is_used(tmp_path):
    """With every row touched each step, per-row step counts equal SparseAdam's global one."""
    spec = ts.TableSpec("t", 12, 3, optimizer=ts.Adam(0.01))
    gen = torch.Generator().manual_seed(5)
    with ts.TierStore(tmp_path / "s", [spec], device_capacity=4, host_capacity=4,
                      device="cpu") as store:
        emb = ts.TieredEmbedding(store, "t")
        ref = torch.nn.Embedding(12, 3, sparse=True)
        with torch.no_grad():
            ref.weight.copy_(store.read("t", torch.arange(12)))
        opt = torch.optim.SparseAdam(ref.parameters(), lr=0.01)
        for _ in range(15):
            ids = torch.cat([torch.randperm(12, generator=gen),
                             torch.randint(0, 12, (6,), generator=gen)]).view(3, 6)
            target = torch.randn(3, 6, 3, generator=gen)
            ((emb(ids) - target) ** 2).sum().backward()
            opt.zero_grad()
            ((ref(ids) - target) ** 2).sum().backward()
            opt.step()
        torch.testing.assert_close(store.read("t", torch.arange(12)), ref.weight.detach(),
                                   rtol=1e-5, atol=1e-6)


def test_prefetcher_stages_a_tiered_embedding(tmp_path):
    """Prefetcher(module, batches) takes a TieredEmbedding (its .store and .features) like bags."""
    gen = torch.Generator().manual_seed(2)
    batches = [{"t": torch.randint(0, N, (4, 5), generator=gen)} for _ in range(8)]
    out = {}
    for depth in (0, 2):
        spec = ts.TableSpec("t", N, DIM, optimizer=ts.Adagrad(0.1))
        with ts.TierStore(tmp_path / f"d{depth}", [spec], device_capacity=30, host_capacity=30,
                          device="cpu") as store:
            emb = ts.TieredEmbedding(store, "t")
            with Prefetcher(emb, batches, depth=depth) as pf:
                for b in pf:
                    emb(b["t"]).pow(2).sum().backward()
            if depth:
                assert store.prefetch_stats.rows_used > 0
            out[depth] = store.read("t", torch.arange(N))
    assert torch.equal(out[0], out[2])
