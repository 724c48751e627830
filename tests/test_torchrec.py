"""TorchRec interop: real KeyedJaggedTensor batches into the collection and the Prefetcher.

Optional: `pip install --no-deps torchrec==1.8.0 fbgemm-gpu-cpu==1.8.0` plus
`pip install tensordict iopath pyre-extensions torchmetrics` (see docs/usability.md).
"""

from __future__ import annotations

import pytest
import torch

import tierstore as ts
from tierstore.prefetch import Prefetcher

try:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor
except Exception as exc:  # ImportError, or a torchrec/fbgemm build that does not load
    pytest.skip(f"torchrec is not importable ({type(exc).__name__}: {exc}); install it with "
                "`pip install --no-deps torchrec==1.8.0 fbgemm-gpu-cpu==1.8.0` (docs/usability.md)",
                allow_module_level=True)

FEATS = {"user": "users", "item": "items", "item_hist": "items"}
BATCH = 6


def _specs():
    return [ts.TableSpec("users", 10**10, 8, optimizer=ts.RowWiseAdagrad(lr=0.1)),
            ts.TableSpec("items", 500, 4, optimizer=ts.SGD(0.2))]


def _kjt(seed: int, weighted: bool = False) -> KeyedJaggedTensor:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (len(FEATS) * BATCH,), generator=gen)
    vals = []
    for i, table in enumerate(FEATS.values()):
        n = int(lengths[i * BATCH:(i + 1) * BATCH].sum())
        hi = 60 if table == "items" else 30
        vals.append(torch.randint(0, hi, (n,), generator=gen) * (1 if table == "items" else 7919**2))
    values = torch.cat(vals)
    weights = torch.rand(values.numel(), generator=gen) if weighted else None
    return KeyedJaggedTensor.from_lengths_sync(keys=list(FEATS), values=values, lengths=lengths,
                                               weights=weights)


def _store(path, caps=(10**4, 10**4)):
    return ts.TierStore(path, _specs(), device_capacity=caps[0], host_capacity=caps[1], device="cpu")


def _expected(store, kjt: KeyedJaggedTensor) -> dict[str, torch.Tensor]:
    """Pooled sums computed from the rows read back, one feature at a time."""
    out = {}
    for f, jt in kjt.to_dict().items():
        rows = store.read(FEATS[f], jt.values())
        w = jt.weights_or_none()
        if w is not None:
            rows = rows * w[:, None]
        bag = torch.repeat_interleave(torch.arange(BATCH), jt.lengths())
        out[f] = torch.zeros(BATCH, rows.shape[1]).index_add_(0, bag, rows)
    return out


@pytest.mark.parametrize("weighted", [False, True])
def test_kjt_into_the_collection(tmp_path, weighted):
    with _store(tmp_path / "s") as store:
        ebc = ts.TieredEmbeddingBagCollection(store, FEATS)
        kjt = _kjt(1, weighted)
        want = _expected(store, kjt)
        with torch.no_grad():
            got = ebc(kjt, as_dict=True)
            flat = ebc(kjt)
        assert list(got) == list(FEATS)
        for f in FEATS:
            torch.testing.assert_close(got[f], want[f], rtol=1e-6, atol=1e-6)
        # a KeyedTensor, as TorchRec's EmbeddingBagCollection returns, from the flat output
        kt = KeyedTensor(keys=ebc.feature_names, length_per_key=ebc.dims, values=flat)
        for f, t in kt.to_dict().items():
            assert torch.equal(t, got[f])


def test_kjt_training_matches_the_plain_jagged_layout(tmp_path):
    results = []
    for name, as_kjt in (("kjt", True), ("plain", False)):
        with _store(tmp_path / name, caps=(5, 9)) as store:
            ebc = ts.TieredEmbeddingBagCollection(store, FEATS)
            for step in range(6):
                kjt = _kjt(10 + step)
                out = ebc(kjt) if as_kjt else ebc(kjt.keys(), kjt.values(), kjt.lengths())
                out.pow(2).sum().backward()
            results.append({t: store.read(t, torch.arange(60) * (1 if t == "items" else 7919**2))
                            for t in ("users", "items")})
    for t in ("users", "items"):
        assert torch.equal(results[0][t], results[1][t])
    assert not torch.equal(results[0]["items"], _fresh_items(tmp_path))  # training changed rows


def _fresh_items(tmp_path):
    with _store(tmp_path / "fresh") as store:
        return store.read("items", torch.arange(60))


@pytest.mark.parametrize("depth", [1, 3])
def test_kjt_batches_through_the_prefetcher_are_bit_identical(tmp_path, depth):
    batches = [_kjt(100 + i) for i in range(8)]
    outs = {}
    for name, d in (("base", 0), ("pf", depth)):
        with _store(tmp_path / name, caps=(64, 128)) as store:
            ebc = ts.TieredEmbeddingBagCollection(store, FEATS)
            it = Prefetcher(ebc, iter(batches), depth=d) if d else iter(batches)
            losses = []
            for kjt in it:
                assert isinstance(kjt, KeyedJaggedTensor)
                loss = ebc(kjt).pow(2).sum()
                loss.backward()
                losses.append(float(loss.detach()))
            if d:
                it.close()
                assert store.prefetch_stats.rows_staged > 0
            outs[name] = (losses, store.read("items", torch.arange(60)),
                          store.read("users", torch.arange(30) * 7919**2))
    assert outs["base"][0] == outs["pf"][0]
    assert torch.equal(outs["base"][1], outs["pf"][1]) and torch.equal(outs["base"][2], outs["pf"][2])


def test_keyed_tensor_output_and_torchrec_configs(tmp_path):
    """Issue 39 row 5: real EmbeddingBagConfigs build the collection; output='keyed' is a KeyedTensor."""
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType

    tables = [EmbeddingBagConfig(num_embeddings=10**10, embedding_dim=8, name="users",
                                 feature_names=["user"]),
              EmbeddingBagConfig(num_embeddings=500, embedding_dim=4, name="items",
                                 feature_names=["item", "item_hist"], pooling=PoolingType.SUM)]
    ebc = ts.TieredEmbeddingBagCollection.from_configs(
        tmp_path / "s", tables, optimizer=ts.SGD(0.2), output="keyed", device="cpu",
        device_capacity=10**4, host_capacity=10**4)
    same = ts.TieredEmbeddingBagCollection(ebc.store, tables=tables, output="keyed_tensor")
    assert same.output == "keyed" and same.features == ebc.features
    try:
        assert ebc.store.table_specs["items"].num_rows == 500
        assert ebc.store.table_specs["users"].optimizer == ts.SGD(0.2)
        kjt = _kjt(3)
        kt = ebc(kjt)
        assert isinstance(kt, KeyedTensor)
        assert kt.keys() == list(FEATS) and kt.length_per_key() == [8, 4, 4]
        want = _expected(ebc.store, kjt)
        for f in FEATS:
            torch.testing.assert_close(kt[f], want[f], rtol=1e-6, atol=1e-6)
        kt.values().sum().backward()  # trains through the KeyedTensor's values
    finally:
        ebc.store.close()
    with pytest.raises(ts.ConfigError, match="different poolings"):
        ts.TieredEmbeddingBagCollection.from_configs(
            tmp_path / "t", [EmbeddingBagConfig(num_embeddings=10, embedding_dim=4, name="a",
                                                feature_names=["x"], pooling=PoolingType.MEAN),
                             EmbeddingBagConfig(num_embeddings=10, embedding_dim=4, name="b",
                                                feature_names=["y"])], device="cpu")
