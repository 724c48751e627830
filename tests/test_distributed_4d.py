"""Column-wise, data-parallel and exact row-wise sharding, 16-bit comms: against one process."""

from __future__ import annotations

import pytest
import torch

from tests.test_distributed import (
    COMBOS,
    FEATURES,
    _check,
    _reference,
    _train,
    batch_sizes,
    coeffs,
    make_batch,
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


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_column_wise_bit_identical_to_one_process(tmp_path, world):
    """SGD, Adagrad, row-wise Adagrad (exact across shards), Adam x sum, mean; tiny caches."""
    cols = {"users": "column", "items": "column"}
    combos = COMBOS if world == 2 else [("rowwise", "sum"), ("adam", "mean")]
    runs = [(f"{opt}-{mode}", opt, cols, mode, 3, 1000 if i % 2 else 3, {})
            for i, (opt, mode) in enumerate(combos)]
    res = _compare(tmp_path, world, runs)
    plan = res[0][runs[0][0] + ":plan"]["tables"]
    assert plan["users"]["kind"] == "column" and len(plan["users"]["shards"]) == min(world, 4)


# every optimizer, sum and mean alternating (the other way round for exact row-wise)
HALF = [("adagrad", "sum"), ("adam", "mean"), ("rowwise", "sum"), ("sgd", "mean")]
OTHER_HALF = [(opt, "mean" if mode == "sum" else "sum") for opt, mode in HALF]


def test_data_parallel_bit_identical_to_one_process(tmp_path):
    runs = [(f"{opt}-{mode}", opt, "data", mode, 3, 1000 if i % 2 else 3, {})
            for i, (opt, mode) in enumerate(HALF)]
    _compare(tmp_path, 2, runs)


def test_exact_row_wise_bit_identical_to_one_process(tmp_path):
    runs = [(f"{opt}-{mode}", opt, "row", mode, 3, 1000 if i % 2 else 3, {"exact": True})
            for i, (opt, mode) in enumerate(OTHER_HALF)]
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


def _bytes_runs(rank, world, root):
    """Bytes per phase for fp32 / fp16 / bf16 comms and int64 / int32 ids."""
    out = {}
    for name, kw in (("f32", {"id_dtype": "int64"}), ("f16", {"comm_dtype": "float16"}),
                     ("bf16", {"comm_dtype": "bfloat16", "id_dtype": "int32"})):
        store = ShardedTierStore(f"{root}/{name}", specs("adagrad"), sharding="row", seed=3,
                                 timeout=20, device_capacity=100, host_capacity=100)
        ebc = ShardedEmbeddingBagCollection(store, FEATURES, **kw)
        _train(ebc, store.read, rank, world, -1, 2)
        out[name] = {k: v["bytes_sent"] for k, v in store.stats()["comm"].items()}
        store.close()
    return out


@pytest.mark.parametrize("dtype,tol", [("float16", 2e-3),
                                       pytest.param("bfloat16", 1.6e-2, marks=pytest.mark.slow)])
def test_16bit_comms_within_tolerance(tmp_path, dtype, tol):
    """16-bit pooled bags, partials, rows and gradients; float32 sums at the requester.

    Each value on the wire is rounded once (relative error <= 2**-11 for float16, 2**-8 for
    bfloat16): pooled outputs and rows stay within `tol` (absolute and relative) of one process.
    """
    runs = [(f"{kind}-{opt}", opt, sharding, "sum", 3, 1000, {"comm_dtype": dtype, **kw})
            for kind, sharding, kw in (("row", "row", {}), ("exact", "row", {"exact": True}),
                                       ("col", {"users": "column", "items": "data"}, {}))
            for opt in ("adagrad", "rowwise")]
    res = _spawn(2, str(tmp_path / "sharded"), runs)
    for name, opt, _, mode, steps, _, _ in runs:
        ref_outs, ref_rows = _reference(tmp_path / f"ref-{name}", 2, opt, mode, steps, 1)
        for step, want in enumerate(ref_outs):
            got = torch.cat([res[r][name][0][step] for r in range(2)])
            torch.testing.assert_close(got, want, rtol=tol, atol=tol)
            assert not torch.equal(got, want) or name.startswith("col")  # rounded on the wire
        for t, want in ref_rows.items():
            torch.testing.assert_close(res[0][name][1][t], want, rtol=tol, atol=tol)


def test_16bit_and_int32_halve_the_bytes(tmp_path):
    res = run_local(2, _bytes_runs, str(tmp_path), timeout_s=120, preload=[__name__])
    for r in range(2):
        f32, f16, bf16 = res[r]["f32"], res[r]["f16"], res[r]["bf16"]
        for phase in ("fwd:pooled", "bwd:grads"):
            assert f16[phase] * 2 == f32[phase] and bf16[phase] == f16[phase], phase
        assert f16["fwd:ids"] * 2 == f32["fwd:ids"] > 0  # int32 ids by default (< 2**31 rows)


LOOKS = {"users": (8, 4), "items": (16, 8, 4)}  # ids, bags (and unique ids) per rank per step


def _auto_runs(rank, world, root, configs, sharding="auto", opt="adam"):
    """(name, capacity, prefetch depth, exact) per run, each a fresh store with `sharding`."""
    from tierstore.prefetch import Prefetcher

    out = {}
    for name, cap, depth, exact in configs:
        store = ShardedTierStore(f"{root}/{name}", specs(opt), sharding=sharding, lookups=LOOKS,
                                 device_capacity=cap, host_capacity=cap, seed=3, timeout=20)
        ebc = ShardedEmbeddingBagCollection(store, FEATURES, exact=exact)
        batches = [make_batch(100 * s + rank, batch_sizes(world, s)[rank],
                              empty=("item", "item2") if rank == world - 1 else ())
                   for s in range(3)]
        outs = []
        for step, b in enumerate(Prefetcher(ebc, batches, depth)):
            sizes = batch_sizes(world, step)
            lo = sum(sizes[:rank])
            pooled = ebc(*b)
            c = coeffs(step, sum(sizes), pooled.shape[1])[lo : lo + sizes[rank]]
            (pooled * c.to(pooled.device)).sum().backward()
            outs.append(pooled.detach().cpu())  # compared on the CPU (a rank's store may be on CUDA)
        rows = {t: store.read(t, torch.arange(n)) for t, n in (("users", 60), ("items", 40))}
        out[name] = ((outs, rows), store.plan.to_config(), store.report)
        store.close()
    if sharding != "auto":
        return out
    # reopening with "auto" keeps the stored plan, whatever the planner's inputs now
    again = ShardedTierStore(f"{root}/{configs[0][0]}", specs("adam"), sharding="auto",
                             lookups={"users": 1, "items": 1000}, seed=3, timeout=20)
    out["reopened"] = again.plan.to_config()
    again.close()
    return out


def test_auto_plan_mixed_bit_identical_across_capacities_and_prefetch(tmp_path):
    configs = [("big-d0", 1000, 0, False), ("tiny-d2", 3, 2, False), ("none-d1", 0, 1, False),
               ("exact", 4, 2, True)]
    res = run_local(3, _auto_runs, str(tmp_path / "s"), configs, timeout_s=240,
                    preload=[__name__])
    plan = res[0]["big-d0"][1]
    kinds = {p["kind"] for p in plan["tables"].values()}
    assert len(kinds) == 2, plan  # a mixed plan: column-wise users, exact row-wise items
    assert plan["tables"]["items"].get("exact") is True
    assert res[0]["big-d0"][2]["step_seconds"] > 0 and len(res[0]["big-d0"][2]["ranks"]) == 3
    for r in range(3):
        assert res[r]["reopened"] == plan
        base = res[r]["big-d0"][0]
        for name in ("tiny-d2", "none-d1"):
            got = res[r][name][0]
            assert res[r][name][1] == plan
            for a, b in zip(got[0], base[0]):
                assert torch.equal(a, b), name
            for t in ("users", "items"):
                assert torch.equal(got[1][t], base[1][t]), name
    ref = _reference(tmp_path / "ref", 3, "adam", "sum", 3, 2)
    _check({r: res[r]["exact"][0] for r in range(3)}, 3, ref, exact=True)
    _check({r: res[r]["big-d0"][0] for r in range(3)}, 3, ref, exact=True)  # the plan is exact


def test_planner_fits_budgets_and_reports(tmp_path, capsys):
    import json

    import tierstore as ts
    from tierstore.cli import main
    from tierstore.distributed import CostModel, auto_plan
    from tierstore.distributed.planner import lookups_from_batches, table_cost

    tabs = [ts.TableSpec("huge", 10**6, 8, optimizer=ts.Adam()),
            ts.TableSpec("a", 1000, 8, optimizer=ts.RowWiseAdagrad()), ts.TableSpec("b", 1000, 8),
            ts.TableSpec("wide", 500, 64, optimizer=ts.Adagrad())]
    looks = {"huge": (100, 50), "a": (200, 10), "b": (200, 10), "wide": (50, 50)}
    model = CostModel(lookup_rate=1e9, bandwidth=1e7)
    plan, rep = auto_plan(tabs, 2, looks, "60MB", model)
    kinds = {p.kind for _, p in plan.tables}
    assert plan.placement("huge").kind in ("row", "column")  # 104 MB: does not fit one rank
    assert len(kinds) >= 2
    assert all(r.memory <= 60e6 for r in rep.ranks)
    # the report is the sum of the tables' modeled costs under the plan
    for r in range(2):
        secs = sum(table_cost(s, plan.placement(s.name), (*looks[s.name], looks[s.name][0]), 2,
                              model)[r].seconds
                   for s in tabs)
        assert abs(secs - rep.ranks[r].seconds) < 1e-12
    with pytest.raises(ConfigError):
        auto_plan(tabs, 2, looks, "40MB", model)  # huge needs 52 MB per rank even split in two
    got = lookups_from_batches([make_batch(s, 4) for s in range(3)], FEATURES)
    assert got["items"][1] == 8 and got["users"][1] == 4 and got["items"][2] <= got["items"][0]
    # exact row-wise where its rows cost at most EXACT_FACTOR x the partial sums' bytes
    one = [ts.TableSpec("short", 10**6, 16)]
    short, _ = auto_plan(one, 4, {"short": (100, 100, 90)}, model=CostModel(bandwidth=1e3))
    long_, _ = auto_plan(one, 4, {"short": (2000, 100, 1900)}, model=CostModel(bandwidth=1e3))
    assert short.placement("short").exact and not long_.placement("short").exact
    cfg = tmp_path / "tables.json"
    cfg.write_text(json.dumps({"tables": [s.to_config() for s in tabs],
                               "lookups": {k: list(v) for k, v in looks.items()}}))
    assert main(["plan", str(cfg), "--world-size", "2", "--budget", "60MB",
                 "--lookup-rate", "1e9", "--bandwidth", "1e7"]) == 0
    out = capsys.readouterr().out
    assert "modeled step" in out and "huge" in out and "column" in out or "row" in out
    assert main(["plan", str(cfg), "--world-size", "2", "--budget", "1MB"]) == 2


def test_data_and_column_rowwise_with_prefetch_and_tiny_caches(tmp_path):
    """Data-parallel users, column-wise row-wise Adagrad items: prefetch depths and capacities."""
    configs = [("big-d0", 1000, 0, False), ("tiny-d2", 3, 2, False), ("none-d1", 0, 1, False)]
    res = run_local(2, _auto_runs, str(tmp_path / "s"), configs,
                    {"users": "data", "items": "column"}, "rowwise", timeout_s=240,
                    preload=[__name__])
    ref = _reference(tmp_path / "ref", 2, "rowwise", "sum", 3, 1)
    for name, *_ in configs:
        _check({r: res[r][name][0] for r in range(2)}, 2, ref, exact=True)


def _plans_with_rank_lookups(rank, world, root):
    """Each rank measured other lookups: every rank must still train under rank 0's plan."""
    looks = {"users": 10.0 ** (rank * 3), "items": 10.0 ** (3 - 3 * rank)}
    out = []
    for name, sharding in (("t", "table"), ("a", "auto")):
        store = ShardedTierStore(f"{root}/{name}", specs("adagrad"), sharding=sharding,
                                 lookups=looks, timeout=20)
        ebc = ShardedEmbeddingBagCollection(store, FEATURES)
        _train(ebc, store.read, rank, world, -1, 1)
        out.append((store.plan.to_config(), store.report))
        store.close()
    return out


def test_ranks_with_different_lookups_agree_on_rank0s_plan(tmp_path):
    res = run_local(2, _plans_with_rank_lookups, str(tmp_path), timeout_s=120, preload=[__name__])
    assert res[0] == res[1]
