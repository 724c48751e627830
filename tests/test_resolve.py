"""The layout resolver: the fastest measured layout by default, explicit choices kept, exact bits."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import tierstore as ts
from tests.profiles import examples
from tierstore.prefetch import Prefetcher
from tierstore.resolve import CPU_POLICY, DEFAULT_POLICY, resolve_layout, staging_reserve

FEATS = {"f1": "a", "f2": "a", "f3": "b"}


@settings(max_examples=examples(0.5))
@given(dev=st.integers(0, 10**7), host=st.integers(0, 10**7), row=st.integers(4, 4096),
       rows=st.integers(1, 10**12))
def test_a_cpu_default_is_one_hlfu_tier_of_both_capacities_with_automatic_staging(dev, host, row,
                                                                                 rows):
    # (one LRU tier without slots when the caches hold every declared row)
    lay = resolve_layout("cpu", dev, host, None, None, row, rows)
    resident = dev + host >= rows  # nothing is ever evicted: LRU's bookkeeping, no slots
    assert (lay.device_rows, lay.host_rows) == (dev + host, 0)
    assert lay.policy == (DEFAULT_POLICY if resident else CPU_POLICY)
    assert lay.staging_auto == (bool(dev + host) and not resident) and lay.staging_rows == (
        staging_reserve(dev + host, row, rows) if lay.staging_auto else 0)
    assert lay.resident == resident and not any("clamped" in r for r in lay.reasons)
    # the reserve: at most 64 MiB of slots, four times the cache and the declared rows
    assert lay.staging_rows * (row + 56) <= 64 << 20
    assert lay.staging_rows <= min(4 * (dev + host), rows)
    assert any("one cache tier" in r for r in lay.reasons) == bool(host)


@settings(max_examples=examples(0.5))
@given(dev=st.integers(0, 10**6), host=st.integers(0, 10**6),
       policy=st.sampled_from(["lru", "hlfu", "lfu", "s3fifo"]),
       staging=st.one_of(st.none(), st.integers(0, 10**5)), device=st.sampled_from(["cpu", "cuda"]))
def test_an_explicit_choice_wins(dev, host, policy, staging, device):
    lay = resolve_layout(device, dev, host, policy, staging, 64, 10**9)
    assert (lay.device_rows, lay.host_rows, lay.policy) == (dev, host, policy)
    assert not lay.staging_auto and lay.staging_rows == (staging or 0)
    assert "named" in lay.reasons[0]


@pytest.mark.parametrize("staging", [None, 0, 500])
def test_named_staging_slots_on_a_cpu_default_fold_the_tiers_and_keep_their_number(staging):
    lay = resolve_layout("cpu", 100, 300, None, staging, 64, 10**9)
    assert (lay.device_rows, lay.host_rows, lay.policy) == (400, 0, CPU_POLICY)
    assert lay.staging_auto == (staging is None)
    assert lay.staging_rows == (1600 if staging is None else staging)


def test_on_cuda_the_tiers_stay_distinct_with_lru():
    lay = resolve_layout("cuda", 100, 300, None, None, 64, 10**9)
    assert (lay.device_rows, lay.host_rows, lay.policy, lay.staging_rows) == (100, 300, DEFAULT_POLICY, 0)
    assert any("stay distinct" in r for r in lay.reasons)


def test_an_unknown_policy_is_refused_before_any_file(tmp_path):
    with pytest.raises(ts.ConfigError, match="unknown policy"):
        ts.TierStore(tmp_path / "s", _specs(), policy="nope", device="cpu")
    assert not (tmp_path / "s").exists()


def test_stats_report_the_layout_and_memory_counts_only_active_staging_slots(tmp_path):
    with ts.TierStore(tmp_path / "s", _specs(), device_capacity=6, host_capacity=10,
                      device="cpu") as s:
        st = s.stats()
        assert st["layout"]["device_rows"] == 16 and st["layout"]["policy"] == CPU_POLICY
        assert st["device"]["capacity"] == 16 and st["host"]["capacity"] == 0
        assert st["device"]["staging"] == 64 and st["device"]["staging_active"] == 0
        base = s.memory()["budget_bytes"]
        assert s.device_tier.grow_staging(48) == 48
        assert s.memory()["budget_bytes"] == base + 48 * s.width * 4  # active slots' rows count
        assert s.device_tier.grow_staging(1000) == 64  # never past the reserve
        s.check()


def _specs():
    return [ts.TableSpec("a", 10**11, 3, optimizer=ts.Adagrad(0.2)),
            ts.TableSpec("b", 40, 5, optimizer=ts.RowWiseAdagrad(0.3))]


def _batches(n_steps, seed=3, batch=4):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n_steps):
        lengths = torch.randint(0, 5, (3 * batch,), generator=gen)
        vals = []
        for i, t in enumerate(FEATS.values()):
            n = int(lengths[i * batch : (i + 1) * batch].sum())
            vals.append(torch.randint(0, 40, (n,), generator=gen) * (1 if t == "b" else 7919))
        yield {"sparse": (list(FEATS), torch.cat(vals), lengths),
               "target": torch.randn(batch, 1, generator=gen)}


def _train(path, depth, steps=30, **store_kw):
    store = ts.TierStore(path, _specs(), device="cpu", **store_kw)
    ebc = ts.TieredEmbeddingBagCollection(store, FEATS)
    torch.manual_seed(0)
    dense = torch.nn.Linear(11, 1)
    dopt = torch.optim.SGD(dense.parameters(), lr=0.05)
    with Prefetcher(store, _batches(steps), depth=depth, features=FEATS,
                    extract=lambda b: b["sparse"]) as pf:
        for i, b in enumerate(pf):
            if i % 9 == 4:
                store.check()
            loss = (dense(ebc(*b["sparse"])) - b["target"]).pow(2).mean()
            dopt.zero_grad()
            loss.backward()
            dopt.step()
    store.check()
    stats = store.stats()
    result = {"a": store.read("a", torch.arange(40) * 7919), "b": store.read("b", torch.arange(40)),
              "dense": dense.weight.detach().clone()}
    store.close()
    with ts.TierStore(path, _specs(), device_capacity=2, host_capacity=2, policy="lru",
                      device="cpu") as again:  # and on disk after close
        result["stored"] = again.read("a", torch.arange(40) * 7919)
    return result, stats


_BASE: dict = {}


@settings(max_examples=examples(0.12))
@given(dev=st.integers(0, 24), host=st.integers(0, 24), depth=st.integers(1, 5))
def test_any_split_resolved_by_default_trains_the_all_resident_bits(tmp_path_factory, dev, host,
                                                                    depth):
    # whatever device/host split the user gives, the resolved layout (one hlfu tier, staging
    # slots activated from the window) gives an all-resident run's weights and state
    if "base" not in _BASE:
        _BASE["base"], _ = _train(tmp_path_factory.mktemp("base") / "s", 0,
                                  device_capacity=10**5, host_capacity=10**5, policy="lru")
    base = _BASE["base"]
    got, stats = _train(tmp_path_factory.mktemp("t") / "s", depth, device_capacity=dev,
                        host_capacity=host)
    assert stats["layout"]["device_rows"] == dev + host and stats["host"]["capacity"] == 0
    assert stats["device"]["staging_active"] <= stats["device"]["staging"] <= 4 * (dev + host)
    for k in ("a", "b", "dense"):
        assert torch.equal(got[k], base[k]), (k, dev, host, depth)
    assert torch.equal(got["stored"], base["a"])


def test_the_window_activates_staging_slots_and_stays_staged(tmp_path):
    # a 12-row cache with a reserve of 48: the window (more than the cache) is staged, not
    # warm-only, once the pipeline activated slots for it
    got, stats = _train(tmp_path / "s", 2, steps=30, device_capacity=4, host_capacity=8)
    pf = stats["prefetch"]
    assert pf["window_rows"] > 12
    assert 0 < stats["device"]["staging_active"] <= 48
    assert stats["device"]["staging_active"] >= min(48, pf["window_rows"] - 12) or pf["warm_only"]
    assert pf["warm_only"] < pf["batches"]


def test_tierstore_info_says_what_the_latest_open_resolved(tmp_path, capsys):
    from tierstore.cli import main as cli_main
    from tierstore.cli import store_info

    ts.TierStore(tmp_path / "s", _specs(), device_capacity=6, host_capacity=10, device="cpu").close()
    layout = store_info(str(tmp_path / "s"))["layout"]
    assert layout["device_rows"] == 16 and layout["policy"] == CPU_POLICY and layout["staging_auto"]
    assert cli_main(["info", str(tmp_path / "s")]) == 0
    out = capsys.readouterr().out
    assert "device tier 16 rows, host tier 0 rows, policy hlfu" in out and "one cache tier" in out
    ts.TierStore(tmp_path / "s", _specs(), device_capacity=6, host_capacity=10, policy="lru",
                 device="cpu").close()  # a later open with a named policy replaces the record
    assert store_info(str(tmp_path / "s"))["layout"]["host_rows"] == 10


@given(dev=st.integers(0, 10**6), host=st.integers(0, 10**6), rows=st.integers(1, 10**6),
       device=st.sampled_from(["cpu", "cuda"]), policy=st.sampled_from([None, "lru", "hlfu"]),
       defaults=st.tuples(st.booleans(), st.booleans()))
@example(dev=2, host=0, rows=1, device="cpu", policy=None, defaults=(False, True))  # found on a GPU run
def test_default_capacities_never_exceed_the_declared_rows(dev, host, rows, device, policy, defaults):
    """A slot past the declared rows could never hold a row: a default capacity is clamped to
    them (the device tier first), a named one is kept, and the caches are resident exactly
    when they held every row before the clamp."""
    lay = resolve_layout(device, dev, host, policy, None, 64, rows, defaults=defaults)
    d = min(dev, rows) if defaults[0] else dev
    h = min(host, max(0, rows - d)) if defaults[1] else host
    assert lay.resident == (dev + host >= rows) == (d + h >= rows)
    if device == "cuda" or policy is not None:  # the tiers as given, then clamped
        assert (lay.device_rows, lay.host_rows) == (d, h)
    else:  # one tier of both
        assert (lay.device_rows, lay.host_rows) == (d + h, 0)
    assert any("clamped" in r for r in lay.reasons) == ((d, h) != (dev, host))


def test_a_tiny_store_allocates_slots_for_its_rows_only(tmp_path):
    specs = [ts.TableSpec("a", 60, 8), ts.TableSpec("b", 40, 4)]
    # the sets cache (CUDA's default device tier) holds every row in whole sets of 32 lines
    sets = 128
    with ts.TierStore(tmp_path / "s", specs) as store:  # the default capacities: clamped
        held = store.device_tier.capacity + store.host_tier.capacity
        assert held == (sets if store.device_cache == "sets" else 100)
        assert store.stats()["layout"]["device_rows"] == 100
    with ts.TierStore(tmp_path / "s", specs, device_capacity=150, host_capacity=0) as store:
        assert store.device_tier.capacity == (sets if store.device_cache == "sets" else 150)  # named: kept
