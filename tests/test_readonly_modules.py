"""The bag modules over `TierStore.open(path, readonly=True)` (issue 39 row 1): inference pools the
writer's flushed rows; a backward through them raises ReadOnlyError."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tierstore as ts

SPECS = [ts.TableSpec("a", 10**9, 8, optimizer=ts.RowWiseAdagrad(lr=0.1)),
         ts.TableSpec("b", 500, 4, optimizer=ts.SGD(lr=0.1))]


def _batch(rng: torch.Generator, batch: int):
    lengths = torch.randint(0, 4, (2 * batch,), generator=rng)
    n = int(lengths.sum())
    values = torch.cat([torch.randint(0, 500, (int(lengths[:batch].sum()),), generator=rng),
                        torch.randint(0, 500, (int(lengths[batch:].sum()),), generator=rng)])
    assert values.numel() == n
    return values, lengths


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A store whose rows were trained a few steps and flushed (so the reader sees them)."""
    path = tmp_path_factory.mktemp("ro") / "s"
    store = ts.TierStore(path, SPECS, device_capacity=64, host_capacity=128, device="cpu")
    coll = ts.TieredEmbeddingBagCollection(store, ["a", "b"])
    rng = torch.Generator().manual_seed(0)
    for _ in range(3):
        values, lengths = _batch(rng, 16)
        coll(["a", "b"], values, lengths).sum().backward()
    store.flush()
    yield path, store
    store.close()


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**31 - 1), batch=st.integers(1, 12), mode=st.sampled_from(["sum", "mean"]))
def test_collection_over_readonly_store_matches_the_writer(trained, seed, batch, mode):
    path, writer = trained
    ro = ts.TierStore.open(path, readonly=True)
    try:
        values, lengths = _batch(torch.Generator().manual_seed(seed), batch)
        with torch.no_grad():
            got = ts.TieredEmbeddingBagCollection(ro, ["a", "b"], mode=mode)(["a", "b"], values, lengths)
            want = ts.TieredEmbeddingBagCollection(writer, ["a", "b"], mode=mode)(["a", "b"], values,
                                                                                  lengths)
        assert got.shape == (batch, 12)
        assert torch.equal(got.cpu(), want)  # the read-only handle's default device: CUDA where there is one
    finally:
        ro.close()


def test_bag_over_readonly_store_and_backward_refused(trained):
    path, writer = trained
    ro = ts.TierStore.open(path, readonly=True)
    try:
        ids, offsets = torch.tensor([1, 2, 3, 7]), torch.tensor([0, 1, 4])
        with torch.no_grad():
            got = ts.TieredEmbeddingBag(ro, "a")(ids, offsets)
        rows = writer.read("a", ids)
        got = got.cpu()  # the read-only handle's default device: CUDA where there is one
        assert torch.equal(got[0], rows[0]) and torch.equal(got[1], rows[1:].sum(0))
        assert torch.equal(got[2], torch.zeros(8))  # an empty bag
        out = ts.TieredEmbeddingBag(ro, "a")(ids, offsets)  # grad enabled: the backward refuses
        with pytest.raises(ts.ReadOnlyError):
            out.sum().backward()
    finally:
        ro.close()
