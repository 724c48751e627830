"""Reopening stores: TierStore.open with the recorded specs and seed, table-name typos, add_tables."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tierstore as ts
from tierstore.cli import main as cli_main
from tierstore.cli import store_info

SMALL = dict(device_capacity=4, host_capacity=8, device="cpu")


def _specs():
    return [ts.TableSpec("users", 10**12, 8, optimizer=ts.RowWiseAdagrad(lr=0.05)),
            ts.TableSpec("items", 1000, 4, optimizer=ts.Adam(lr=0.01), init=ts.NormalInit(std=0.1),
                         dtype="bfloat16")]


def test_open_uses_recorded_specs_and_seed(tmp_path):
    ids = torch.tensor([0, 5, 999_999_999_999, 42])
    with ts.TierStore(tmp_path / "s", _specs(), seed=7, **SMALL) as s:
        s.apply("users", ids, torch.full((4, 8), 0.5))
        want_users = s.read("users", torch.arange(0, 100))  # 96 of them lazily initialized
        want_items = s.read("items", torch.arange(1000))
    with ts.TierStore.open(tmp_path / "s", device_capacity=2, host_capacity=3, device="cpu",
                           policy="fifo") as s:
        assert s.seed == 7
        assert s.table_specs == {t.name: t for t in _specs()}
        assert s.device_tier.capacity == 2 and s.host_tier.capacity == 3 and s.policy == "fifo"
        assert torch.equal(s.read("users", torch.arange(0, 100)), want_users)
        assert torch.equal(s.read("items", torch.arange(1000)), want_items)
        # training goes on exactly as with the full specs
        s.apply("users", ids, torch.ones(4, 8))
        after = s.read("users", ids)
    with ts.TierStore(tmp_path / "s", _specs(), seed=7, **SMALL) as s:
        assert torch.equal(s.read("users", ids), after)


def test_open_without_a_store_raises_and_creates_nothing(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(ts.StoreNotFoundError, match="no tierstore store") as info:
        ts.TierStore.open(missing)
    assert isinstance(info.value, ts.TierstoreError)
    assert not missing.exists()
    (tmp_path / "empty").mkdir()
    with pytest.raises(ts.StoreNotFoundError):
        ts.TierStore.open(tmp_path / "empty")
    assert list((tmp_path / "empty").iterdir()) == []


def test_table_typo_on_reopen_raises_and_stores_nothing(tmp_path):
    with ts.TierStore(tmp_path / "s", _specs(), **SMALL) as s:
        s.apply("items", torch.tensor([1]), torch.ones(1, 4))
    typo = ts.TableSpec("itmes", 1000, 4)
    with pytest.raises(ts.UnknownTableError) as info:
        ts.TierStore(tmp_path / "s", [typo], **SMALL)
    msg = str(info.value)
    assert "'itmes'" in msg and "items" in msg and "users" in msg and "add_tables=True" in msg
    # mixed with a real table: still refused, and nothing was recorded
    with pytest.raises(ts.UnknownTableError):
        ts.TierStore(tmp_path / "s", [_specs()[1], typo], **SMALL)
    assert sorted(t.name for t in ts.store.open_tables(tmp_path / "s")) == ["items", "users"]
    with ts.TierStore.open(tmp_path / "s", **SMALL) as s:
        assert sorted(s.table_specs) == ["items", "users"]


def test_add_tables_adds_a_new_table(tmp_path):
    with ts.TierStore(tmp_path / "s", _specs(), **SMALL) as s:
        s.apply("items", torch.tensor([1]), torch.ones(1, 4))
        want = s.read("items", torch.arange(10))
    new = ts.TableSpec("clicks", 50, 2)
    with ts.TierStore(tmp_path / "s", [_specs()[1], new], add_tables=True, **SMALL) as s:
        assert torch.equal(s.read("items", torch.arange(10)), want)
        s.apply("clicks", torch.tensor([3]), torch.ones(1, 2))
        clicks = s.read("clicks", torch.arange(50))
    with ts.TierStore.open(tmp_path / "s", **SMALL) as s:
        assert sorted(s.table_specs) == ["clicks", "items", "users"]
        assert torch.equal(s.read("clicks", torch.arange(50)), clicks)


def test_new_store_creates_its_tables_without_add_tables(tmp_path):
    with ts.TierStore(tmp_path / "s", _specs(), **SMALL) as s:
        assert sorted(s.table_specs) == ["items", "users"]
    # a subset of the stored tables reopens fine
    with ts.TierStore(tmp_path / "s", _specs()[:1], **SMALL) as s:
        assert list(s.table_specs) == ["users"]


_opt = st.sampled_from([ts.SGD(0.1), ts.Adagrad(lr=0.2), ts.RowWiseAdagrad(lr=0.3), ts.Adam(lr=0.01)])
_spec = st.builds(ts.TableSpec, name=st.sampled_from(["a", "b_1", "c.d", "E-2"]),
                  num_rows=st.integers(1, 2**63 - 1), dim=st.integers(1, 33), optimizer=_opt,
                  dtype=st.sampled_from(["float32", "float16", "bfloat16"]))


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(specs=st.lists(_spec, min_size=1, max_size=3, unique_by=lambda t: t.name),
       seed=st.integers(0, 2**31))
def test_open_round_trips_any_specs(tmp_path_factory, specs, seed):
    path = tmp_path_factory.mktemp("s") / "store"
    with ts.TierStore(path, specs, seed=seed, device_capacity=0, host_capacity=0, device="cpu") as s:
        probe = {t.name: s.read(t.name, torch.tensor([0, t.num_rows - 1])) for t in specs}
    with ts.TierStore.open(path, device_capacity=0, host_capacity=0, device="cpu") as s:
        assert s.seed == seed
        assert s.table_specs == {t.name: t for t in specs}
        for t in specs:
            assert torch.equal(s.read(t.name, torch.tensor([0, t.num_rows - 1])), probe[t.name])


def test_info_shows_last_open_hyperparameters_when_they_differ(tmp_path, capsys):
    spec = ts.TableSpec("t", 100, 4, optimizer=ts.SGD(0.1))
    with ts.TierStore(tmp_path / "s", [spec], **SMALL):
        pass
    assert store_info(str(tmp_path / "s"))["tables"][0]["last_open"] is None
    with ts.TierStore(tmp_path / "s", [ts.TableSpec("t", 100, 4, optimizer=ts.SGD(0.01))], **SMALL):
        pass
    t = store_info(str(tmp_path / "s"))["tables"][0]
    assert t["optimizer"]["lr"] == 0.1 and t["last_open"]["optimizer"]["lr"] == 0.01
    assert cli_main(["info", str(tmp_path / "s")]) == 0
    out = capsys.readouterr().out
    assert "lr=0.1" in out and "last opened with" in out and "lr=0.01" in out
    assert "TierStore.open" in out
    assert cli_main(["info", "--json", str(tmp_path / "s")]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["seed"] == 0 and report["tables"][0]["last_open"]["optimizer"]["lr"] == 0.01
    # TierStore.open uses the stored (creation) hyperparameters, as info says
    with ts.TierStore.open(tmp_path / "s", **SMALL) as s:
        assert s.table_specs["t"].optimizer.lr == 0.1
    t = store_info(str(tmp_path / "s"))["tables"][0]
    assert t["last_open"] is None  # the latest open used the stored ones again


def test_bad_policy_on_a_new_store_records_nothing(tmp_path):
    with pytest.raises(ts.ConfigError, match="policy"):
        ts.TierStore(tmp_path / "s", _specs(), policy="nope", device_capacity=2, host_capacity=2)
    assert not (tmp_path / "s").exists()
    with pytest.raises(ts.StoreNotFoundError):
        ts.TierStore.open(tmp_path / "s")


def test_open_while_open_in_this_process_raises_store_locked(tmp_path):
    """Issue 39 row 2: TierStore.open raises what TierStore(path, specs) raises there."""
    s = ts.TierStore(tmp_path / "s", _specs(), **SMALL)
    try:
        with pytest.raises(ts.StoreLockedError):
            ts.TierStore(tmp_path / "s", _specs(), **SMALL)
        with pytest.raises(ts.StoreLockedError, match="already open for writing"):
            ts.TierStore.open(tmp_path / "s", **SMALL)
        s.apply("items", torch.tensor([3]), torch.ones(1, 4))  # the first handle still works
    finally:
        s.close()
    with ts.TierStore.open(tmp_path / "s", **SMALL) as again:  # closed: opens
        assert again.table_specs["items"].dim == 4
