"""StoreConfig: the store's options as one frozen dataclass, and the keyword form that builds it."""

import dataclasses

import pytest
import torch

from tierstore import ConfigError, StoreConfig, TableSpec, TierStore


def spec(name="t"):
    return TableSpec(name, 1000, 8)


def test_keywords_and_config_build_the_same_store(tmp_path):
    cfg = StoreConfig(device_capacity=16, host_capacity=32, policy="lfu", seed=3)
    # (under TIERSTORE_TEST_TABLE_FORMAT, `build` also sets the table format: tests/as_format.py)
    cfg = StoreConfig.build(cfg)
    with TierStore(tmp_path / "a", [spec()], config=cfg) as a:
        assert a.config == cfg
        ra = a.read("t", torch.arange(10))
    with TierStore(tmp_path / "b", [spec()], device_capacity=16, host_capacity=32, policy="lfu",
                   seed=3) as b:
        assert b.config == cfg
        assert torch.equal(ra, b.read("t", torch.arange(10)))


def test_options_replace_config_fields(tmp_path):
    cfg = StoreConfig.build(StoreConfig(device_capacity=16, policy="lfu"))  # (as_format.py)
    with TierStore(tmp_path / "s", [spec()], config=cfg, policy="lru") as s:
        assert s.config == dataclasses.replace(cfg, policy="lru")
        assert s.policy == "lru"


def test_new_stores_keep_page_chunks_by_default():
    """The default table format is page chunks (format 4); "btree" and "chunks" are the values."""
    assert StoreConfig().table_format == "chunks"
    assert StoreConfig(table_format="btree").table_format == "btree"
    with pytest.raises(ConfigError, match="table_format"):
        StoreConfig(table_format="auto")


def test_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        StoreConfig().policy = "lfu"


@pytest.mark.parametrize("bad", [{"seed": -1}, {"seed": True}, {"kernels": "cuda"},
                                 {"policy": 3}, {"add_tables": "yes"}])
def test_bad_fields_are_config_errors(bad):
    with pytest.raises(ConfigError):
        StoreConfig(**bad)


def test_unknown_option_is_refused_before_anything_is_created(tmp_path):
    with pytest.raises(ConfigError, match="unknown store option"):
        TierStore(tmp_path / "s", [spec()], device_capcity=16)
    assert not (tmp_path / "s").exists()
    with pytest.raises(ConfigError, match="StoreConfig"):
        TierStore(tmp_path / "s", [spec()], config={"policy": "lru"})


def test_open_takes_config_and_keeps_the_stored_seed(tmp_path):
    with TierStore(tmp_path / "s", [spec()], seed=7) as s:
        want = s.read("t", torch.arange(5))
    with TierStore.open(tmp_path / "s", config=StoreConfig(device_capacity=4), seed=1) as s:
        assert s.seed == 7
        assert s.config.device_capacity == 4
        assert torch.equal(s.read("t", torch.arange(5)), want)
