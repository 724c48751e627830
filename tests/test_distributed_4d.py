"""Column-wise, data-parallel and exact row-wise sharding, 16-bit comms: against one process."""

from __future__ import annotations

import pytest

from tests.test_distributed import (
    COMBOS,
    FEATURES,
    _check,
    _reference,
    _train,
    specs,
)
from tierstore.distributed import ShardedEmbeddingBagCollection, ShardedTierStore, make_plan
from tierstore.distributed.launch import run_local
from tierstore.errors import ConfigError


def _runs(rank, world, root, runs):
    """Each run: (name, opt, sharding, mode, steps, capacity, module kwargs)."""
    out = {}
    for name, opt, sharding, mode, steps, cap, kw in runs:
        store = ShardedTierStore(f"{root}/{name}", specs(opt), sharding=sharding,
                                 device_capacity=cap, host_capacity=cap, seed=3, timeout=20)
        ebc = ShardedEmbeddingBagCollection(store, FEATURES, mode=mode, **kw)
        out[name] = _train(ebc, store.read, rank, world, world - 1, steps)
        out[name + ":plan"] = store.plan.to_config()
        store.close()
    return out


def _spawn(world, root, runs):
    return run_local(world, _runs, root, runs, timeout_s=240, preload=[__name__])


def _compare(tmp_path, world, runs, exact=True):
    res = _spawn(world, str(tmp_path / "sharded"), runs)
    refs = {}
    for name, opt, _, mode, steps, _, _ in runs:
        key = (opt, mode, steps)
        if key not in refs:
            refs[key] = _reference(tmp_path / f"ref-{opt}-{mode}", world, opt, mode, steps,
                                   world - 1)
        _check({r: res[r][name] for r in range(world)}, world, refs[key], exact)
    return res


@pytest.mark.parametrize("world", [2, 3])
def test_column_wise_bit_identical_to_one_process(tmp_path, world):
    """SGD, Adagrad, row-wise Adagrad (exact across shards), Adam x sum, mean; tiny caches."""
    cols = {"users": "column", "items": "column"}
    combos = COMBOS if world == 2 else [("rowwise", "sum"), ("adam", "mean")]
    runs = [(f"{opt}-{mode}", opt, cols, mode, 3, 1000 if i % 2 else 3, {})
            for i, (opt, mode) in enumerate(combos)]
    res = _compare(tmp_path, world, runs)
    plan = res[0][runs[0][0] + ":plan"]["tables"]
    assert plan["users"]["kind"] == "column" and len(plan["users"]["shards"]) == min(world, 4)


def test_data_parallel_bit_identical_to_one_process(tmp_path):
    runs = [(f"{opt}-{mode}", opt, "data", mode, 3, 1000 if i % 2 else 3, {})
            for i, (opt, mode) in enumerate(COMBOS)]
    _compare(tmp_path, 2, runs)


def test_exact_row_wise_bit_identical_to_one_process(tmp_path):
    runs = [(f"{opt}-{mode}", opt, "row", mode, 3, 1000 if i % 2 else 3, {"exact": True})
            for i, (opt, mode) in enumerate(COMBOS)]
    _compare(tmp_path, 2, runs)


def test_mixed_kinds_three_ranks(tmp_path):
    """Every kind in one collection: column users, data items; then exact row + table."""
    runs = [("cd", "adam", {"users": "column", "items": "data"}, "mean", 3, 4, {}),
            ("rt", "adagrad", {"users": "row", "items": "table"}, "sum", 3, 4, {"exact": True}),
            ("cr", "rowwise", {"users": "column:2", "items": "row"}, "sum", 3, 4, {"exact": True})]
    _compare(tmp_path, 3, runs)


def test_plan_kinds_and_errors():
    import tierstore as ts

    tabs = [ts.TableSpec("a", 100, 8), ts.TableSpec("b", 100, 3), ts.TableSpec("c", 10, 2)]
    plan = make_plan(tabs, 4, {"a": "column", "b": "column:2", "c": "data"})
    assert len(plan.placement("a").shards) == 4 and len(set(plan.placement("a").shards)) == 4
    assert len(plan.placement("b").shards) == 2
    assert plan.placement("c").kind == "data"
    assert make_plan(tabs, 4, plan.__class__.from_config(plan.to_config())) == plan  # adopted
    for bad in ({"b": "column:4"}, {"a": "column:x"}, {"a": "columns"}):
        with pytest.raises(ConfigError):
            make_plan(tabs, 4, bad)
    half = [ts.TableSpec("h", 10, 4, dtype="float16")]
    with pytest.raises(ConfigError):
        make_plan(half, 2, "column")
