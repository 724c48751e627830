"""The pipeline's look-ahead while reads wait on the disk (Prefetcher reads_ahead /
read_ahead_bytes): the same bits for any setting, its memory bound, and errors for bad values."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tierstore as ts
from tests.profiles import examples
from tests.test_resolve import FEATS, _batches, _specs
from tierstore.errors import ConfigError, TierstoreError
from tierstore.prefetch import Prefetcher, reads

_BASE: dict = {}


@pytest.fixture
def always_cold(monkeypatch):
    """Every batch's reads count as waiting on the disk (so pages are asked ahead too)."""
    monkeypatch.setattr(reads, "COLD_ROW_S", 0.0)
    monkeypatch.setattr(reads, "COLD_STAY_ROW_S", 0.0)
    monkeypatch.setattr(reads, "COLD_CPU_SHARE", 10.0)
    monkeypatch.setattr(reads, "COLD_STAY_CPU_SHARE", 10.0)
    monkeypatch.setattr(reads, "COLD_FAULTS_A_ROW", 0.0)  # page-cached test rows fault nothing


def _train(path, steps=30, depth=2, **pf_kw):
    store = ts.TierStore(path, _specs(), device_capacity=4, host_capacity=8, device="cpu")
    ebc = ts.TieredEmbeddingBagCollection(store, FEATS)
    torch.manual_seed(0)
    dense = torch.nn.Linear(11, 1)
    dopt = torch.optim.SGD(dense.parameters(), lr=0.05)
    with Prefetcher(store, _batches(steps), depth=depth, features=FEATS,
                    extract=lambda b: b["sparse"], **pf_kw) as pf:
        for b in pf:
            loss = (dense(ebc(*b["sparse"])) - b["target"]).pow(2).mean()
            dopt.zero_grad()
            loss.backward()
            dopt.step()
    store.check()
    stats = store.stats()["prefetch"]
    out = {"a": store.read("a", torch.arange(40) * 7919), "b": store.read("b", torch.arange(40)),
           "dense": dense.weight.detach().clone()}
    store.close()
    return out, stats


@settings(max_examples=examples(0.15), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ahead=st.integers(1, 12), readers=st.integers(1, 4), depth=st.integers(1, 4),
       budget=st.sampled_from([0, 1 << 10, 1 << 20]), ask=st.booleans())
def test_any_look_ahead_trains_the_same_bits(tmp_path_factory, always_cold, ahead, readers, depth,
                                              budget, ask):
    if "base" not in _BASE:  # the pipeline off: the reference
        _BASE["base"], _ = _train(tmp_path_factory.mktemp("base") / "s", depth=0)
    got, stats = _train(tmp_path_factory.mktemp("t") / "s", depth=depth, reads_ahead=ahead,
                        readers=readers, read_ahead_bytes=budget, ask_ahead=ask)
    assert stats["cold_read_batches"] > 0
    assert 1 <= stats["reads_ahead_peak"] <= ahead
    for k, v in _BASE["base"].items():
        assert torch.equal(got[k], v), k


def test_the_look_ahead_stays_within_its_memory_budget(tmp_path, always_cold):
    # room for every batch: it reads as far ahead as allowed
    _, wide = _train(tmp_path / "wide", steps=40, reads_ahead=6, read_ahead_bytes=1 << 30)
    assert wide["reads_ahead_peak"] == 6
    # a budget below two batches: one read ahead beyond the oldest, never more
    _, tight = _train(tmp_path / "tight", steps=40, reads_ahead=6, read_ahead_bytes=1)
    assert tight["reads_ahead_peak"] == 1
    # a budget of some batches: the batches read ahead hold at most it plus one batch
    batch_max = tight["read_ahead_bytes_peak"]  # two batches' bytes at most
    for budget in (batch_max // 2, batch_max, batch_max * 3):
        _, mid = _train(tmp_path / f"mid{budget}", steps=40, reads_ahead=12, read_ahead_bytes=budget)
        assert 1 <= mid["reads_ahead_peak"] <= 12
        assert mid["read_ahead_bytes_peak"] <= budget + batch_max


def test_warm_reads_look_one_batch_ahead(tmp_path, monkeypatch):
    monkeypatch.setattr(reads, "COLD_ROW_S", 1.0)  # no read counts as cold (the test's rows are
    monkeypatch.setattr(reads, "COLD_STAY_ROW_S", 1.0)  # few: a task's overhead, on a loaded
    _, stats = _train(tmp_path / "s", steps=20, reads_ahead=8)  # machine, may look like a disk)
    assert stats["cold_read_batches"] == 0 and stats["reads_ahead_peak"] == 1


@pytest.mark.parametrize("kw", [{"reads_ahead": 0}, {"reads_ahead": True}, {"reads_ahead": 2.0},
                                {"read_ahead_bytes": -1}, {"read_ahead_bytes": "1M"},
                                {"readers": 0}, {"ask_ahead": 1}, {"ask_ahead": None}])
def test_bad_look_ahead_settings_are_refused(tmp_path, kw):
    with ts.TierStore(tmp_path / "s", _specs(), device_capacity=4, host_capacity=8,
                      device="cpu") as store:
        with pytest.raises(ConfigError):
            Prefetcher(store, _batches(3), features=FEATS, extract=lambda b: b["sparse"], **kw)
        assert not store.prefetchers  # nothing was started


def test_a_source_error_comes_after_the_batches_read_before_it(tmp_path, always_cold):
    def source():
        yield from _batches(6)
        raise ValueError("source broke")

    with ts.TierStore(tmp_path / "s", _specs(), device_capacity=4, host_capacity=8,
                      device="cpu") as store:
        seen = 0
        with pytest.raises(TierstoreError, match="source broke"):
            with Prefetcher(store, source(), features=FEATS, extract=lambda b: b["sparse"],
                            reads_ahead=4) as pf:
                for _ in pf:
                    seen += 1
        assert seen == 6
