"""Smoke tests: each benchmark main runs at tiny sizes and writes sane JSON records (not timed)."""

from __future__ import annotations

import json
import math

import pytest

from bench import store as bench_store
from bench import training as bench_training


def _load(path):
    data = json.loads(path.read_text())
    assert data["meta"]["torch"]
    return data["records"]


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_bench_store_smoke(tmp_path):
    rc = bench_store.main(["--batches", "128", "--threads", "1", "--blocks", "1",
                           "--rows-per-block", "128", "--cap", "512", "--cold-blocks", "1",
                           "--out", str(tmp_path), "--no-plot"])
    assert rc == 0
    recs = _load(tmp_path / "store.json")
    cases = {(r["case"], r["op"]) for r in recs}
    for case in ("device_hit", "host_hit", "lmdb_cached", "lmdb_cold"):
        assert {(case, "read"), (case, "apply")} <= cases
    for r in recs:
        assert r["batch"] == 128 and r["threads"] == 1
        assert _positive(r["rows_per_s"]) and _positive(r["ceiling_rows_per_s"])
        pairs = sorted(a / c for a, c in zip(r["rates"], r["ceiling_rates"]))
        assert len(pairs) == len(r["rates"]) and math.isclose(r["ratio"], pairs[len(pairs) // 2])
        assert math.isclose(r["ratio_of_medians"], r["rows_per_s"] / r["ceiling_rows_per_s"])
        assert r["ceiling"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("bench_store_")]  # work dir gone


def test_bench_training_smoke(tmp_path):
    configs = "tierstore_resident,tierstore_cache1,torch_embeddingbag,fbgemm_cpu"
    rc = bench_training.main(["--tables", "2", "--rows", "2000", "--batch", "32", "--pool", "2",
                              "--warmup", "1", "--blocks", "1", "--steps", "2", "--threads", "1",
                              "--configs", configs, "--out", str(tmp_path), "--no-plot"])
    assert rc == 0
    data = json.loads((tmp_path / "training.json").read_text())
    recs = data["records"]
    got = {r["config"] for r in recs}
    expected = set(configs.split(",")) - set(data["meta"]["skipped"])
    assert got == expected
    for r in recs:
        assert _positive(r["samples_per_s"]) and _positive(r["ids_per_s"]) and _positive(r["ms_per_step"])
        assert r["ids_per_s"] > r["samples_per_s"]  # at least one id per bag
        assert r["vs_resident"] is not None
    res = next(r for r in recs if r["config"] == "tierstore_resident")
    assert res["vs_resident"] == 1.0
    cache = next(r for r in recs if r["config"] == "tierstore_cache1")
    assert cache["capacity"]["device"] + cache["capacity"]["host"] <= 2 * 2000 * 0.01 + 2
    assert cache["stats"]["ssd"]["lookups"] > 0
    # per-thread CPU by role, per step: every role named, none negative (10 ms ticks: may be 0)
    for r in (res, cache):
        assert _positive(r["ms_per_step_mean"])
        cpu = {k: v for k, v in r["per_step"].items() if k.startswith("cpu_")}
        assert set(cpu) == {f"cpu_{role}_ms" for role in bench_training.CPU_ROLES}
        assert all(v >= 0 for v in cpu.values())


def test_bench_prefetch_smoke(tmp_path):
    from bench import prefetch as bench_prefetch

    rc = bench_prefetch.main(["--tables", "2", "--rows", "4000", "--batch", "32", "--pool", "2",
                              "--depths", "0,2", "--blocks", "1", "--steps", "2", "--warmup", "1",
                              "--out", str(tmp_path)])
    assert rc == 0
    recs = _load(tmp_path / "prefetch.json")
    assert recs[0]["config"] == "all_resident" and recs[0]["ratio"] == 1.0
    got = {(r["lmdb"], r["depth"]) for r in recs[1:]}
    assert got == {(state, d) for state in ("page-cached", "cold") for d in (0, 2)}
    for r in recs:
        assert _positive(r["samples_per_s"]) and r["stall_ms_per_step"] >= 0
    assert (tmp_path / "prefetch.png").stat().st_size > 0


def test_bench_writeback_smoke(tmp_path):
    from bench import writeback as bench_writeback

    rc = bench_writeback.main(["--quick", "--out", str(tmp_path), "--no-plot"])
    assert rc == 0
    recs = _load(tmp_path / "writeback.json")
    cases = {r["case"]: r for r in recs}
    floors = {c for c in cases if c.startswith("floor_")}  # the page-write floor of a merge
    assert floors == {"floor_5000_into_50000", "floor_20000_into_50000", "floor_100000_into_100000"}
    assert set(cases) - floors == {"raw_append", "raw_update", "log_append", "steady_uniform",
                                   "steady_zipf", "get_pylmdb", "get_pages", "get2_pylmdb",
                                   "get2_pages", "merge_5000", "merge_20000"} | {
        f"lsm_put_{m}_{c}" for m in ("pwrite", "writemap") for c in ("fresh", "reused")} | {
        f"lsm_{c}_k{k}" for k in (2, 4) for c in ("base_write", "append", "runs", "merges", "steady",
                                                  "one_process", "get", "end_to_end")} | {
        f"chunks_{c}" for c in ("base_write", "append", "sort", "merge", "steady", "in_place", "get")}
    assert cases["chunks_get"]["found"] == cases["chunks_get"]["rows"]  # every id of the table
    steady = cases["chunks_steady"]  # every range rewritten each merge: T / N rows a row fed
    assert steady["copied_per_fed"] == pytest.approx(80_000 / 20_000, rel=0.01)
    assert 1.0 < steady["disk_after_over_raw"] < 1.3 <= steady["disk_peak_over_raw"] < 3
    assert 0 < cases["chunks_in_place"]["pages_per_row"] <= 1.2
    for case in floors:  # a merge rewrites at least one page a leaf it touches, at most one a row
        r = cases[case]
        assert 0 < r["pages_per_row"] <= 1.2 and r["pages_written"] >= 0.9 * r["model_pages"]
    for case in ("merge_5000", "merge_20000"):  # every appended row is distinct: all merged
        assert cases[case]["merged"] == int(case.split("_")[1])
    for r in recs:
        assert _positive(r["rows_per_s"]) and r["rows"] > 0
    for case in ("get_pylmdb", "get_pages", "get2_pylmdb", "get2_pages"):
        assert cases[case]["found"] == cases[case]["rows"]
    assert cases["log_append"]["appended"] == cases["log_append"]["rows"]
    # the LSM cases: 2 cycles of k runs of 10,000 draws into a 60,000-row base, dense at the end
    for k in (2, 4):
        assert cases[f"lsm_steady_k{k}"]["rows"] == 20_000 * k
        assert cases[f"lsm_merges_k{k}"]["base_chunks"] == 15
        assert 1.0 < cases[f"lsm_steady_k{k}"]["disk_after_over_raw"] < 1.1  # full chunks and pages
        assert cases[f"lsm_end_to_end_k{k}"]["rows_per_s"] < min(
            cases["log_append"]["rows_per_s"], cases[f"lsm_steady_k{k}"]["rows_per_s"])
        assert cases[f"lsm_one_process_k{k}"]["cpu_us_per_row"] > cases[f"lsm_runs_k{k}"]["cpu_us_per_row"]


def test_bench_steady_smoke(tmp_path):
    from bench import steady

    rc = steady.main(["--config", "tierstore_cache10", "--rows", "4000", "--tables", "2",
                      "--batch", "64", "--steps", "4", "--warmup", "3", "--out", str(tmp_path)])
    assert rc == 0
    (rec,) = _load(tmp_path / "steady_tierstore_cache10.json")
    meta = json.loads((tmp_path / "steady_tierstore_cache10.json").read_text())["meta"]
    assert meta["pool"] == 7  # no batch repeats: warm-up plus timed steps
    assert rec["counters_per_step"]["rows_merged"] >= 0 and rec["merges"] >= 0
    assert rec["config"] == "tierstore_cache10" and rec["steps"] == 4
    assert _positive(rec["ms_per_step"]) and rec["disk_mb_per_step"] >= 0
    # CPU per thread in 10 ms ticks: 4 tiny steps may stay below one tick in every thread
    # (seen on a loaded machine), so only the accounting's shape is checked
    cpu = rec["cpu_ms_per_step"]  # the threads that used a tick, named and positive
    assert all(isinstance(k, str) and _positive(v) for k, v in cpu.items())
    assert rec["counters_per_step"]["rows_read"] > 0  # 10% caches: the steps miss
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("bench_steady_")]
    # the resolved layout: one hlfu tier of both capacities, a reserve of 4x the cache
    assert rec["capacity"] == {"device": 400, "host": 400, "staging": 3200} and rec["policy"] == "hlfu"


def test_bench_steady_with_staging_slots(tmp_path):
    from bench import steady

    rc = steady.main(["--config", "tierstore_cache1", "--rows", "4000", "--tables", "2",
                      "--batch", "64", "--steps", "4", "--warmup", "3", "--policy", "hlfu",
                      "--split", "device", "--staging", "0.1", "--out", str(tmp_path)])
    assert rc == 0
    (rec,) = _load(tmp_path / "steady_tierstore_cache1.json")
    assert rec["capacity"] == {"device": 80, "host": 0, "staging": 800}
    assert rec["counters_per_step"]["rows_read"] > 0


def test_bench_steady_times_the_miss_path_per_method_and_unwraps_after(tmp_path):
    from bench import steady
    from tierstore.backends.slab import SlabTier
    from tierstore.policies.lru import LRU

    originals = (SlabTier.insert, LRU.on_hit)
    rc = steady.main(["--config", "tierstore_cache10", "--rows", "4000", "--tables", "2",
                      "--batch", "64", "--steps", "3", "--warmup", "2", "--calls", "--policy", "lru",
                      "--out", str(tmp_path)])
    assert rc == 0
    (rec,) = _load(tmp_path / "steady_tierstore_cache10.json")
    calls = {(c["thread"], c["method"]): c for c in rec["calls"]}
    # the training thread's misses go through the cascade; staging runs on the prefetch thread
    assert calls[("MainThread", "Cascade.access")]["calls_per_step"] > 0
    assert any(t != "MainThread" and m == "Prefetcher.prepare_batch" for t, m in calls)
    inserts = {m for _, m in calls if m.startswith("SlabTier.insert[")}
    assert inserts <= {"SlabTier.insert[device]", "SlabTier.insert[host]"} and inserts
    for c in rec["calls"]:
        assert c["cpu_ms_per_step"] >= 0 and c["calls_per_step"] > 0
    # inclusive: a caller's time holds its callees'
    place = sum(c["cpu_ms_per_step"] for (t, m), c in calls.items() if m == "Cascade.place")
    inner = sum(c["cpu_ms_per_step"] for (t, m), c in calls.items() if m == "SlabTier.insert[device]")
    assert place >= inner
    # the writer thread appends to the log; it is named after the store
    assert any(t.startswith("tierstore-writer") and m == "WriteLog.append" for t, m in calls)
    assert (SlabTier.insert, LRU.on_hit) == originals  # the wrappers are gone


def test_bench_steady_puts_the_whole_cache_in_the_device_tier_when_told(tmp_path):
    from bench import steady

    rc = steady.main(["--config", "tierstore_cache10", "--rows", "4000", "--tables", "2",
                      "--batch", "64", "--steps", "2", "--warmup", "1", "--split", "device",
                      "--policy", "s3fifo", "--out", str(tmp_path)])
    assert rc == 0
    (rec,) = _load(tmp_path / "steady_tierstore_cache10.json")
    assert rec["capacity"] == {"device": 800, "host": 0, "staging": 0} and rec["policy"] == "s3fifo"
    assert rec["counters_per_step"]["rows_read"] > 0


def test_bench_scale_writes_where_told(tmp_path):
    from bench import scale

    out = tmp_path / "out"
    rc = scale.main(["--rows", "1e4", "--steps", "2", "--batch", "32", "--hot", "500",
                     "--eval-batches", "1", "--work", str(tmp_path / "runs"), "--out", str(out)])
    assert rc == 0
    record = json.loads((out / "scale.json").read_text())
    (result,) = record["results"]
    assert result["rows_per_table"] == 10_000 and result["throughput_vs_first"] == 1.0
    assert (out / "scale.png").stat().st_size > 0 and (out / "scale_10000.json").exists()


def test_bench_staging_floor_counts_every_staged_key(tmp_path):
    from bench import staging_floor

    rc = staging_floor.main(["--tables", "2", "--rows", "5000", "--batch", "64", "--pool", "6",
                             "--warmup", "4", "--steps", "6", "--out", str(tmp_path)])
    assert rc == 0
    recs = _load(tmp_path / "staging_floor.json")
    assert {(r["policy"], r["tiers"], r["copies"]) for r in recs} == {
        (p, t, c) for p in ("lru", "hlfu") for t in (1, 2) for c in (True, False)}
    unique = json.loads((tmp_path / "staging_floor.json").read_text())["meta"]["unique_keys"]
    for r in recs:  # every key is a device hit, a host hit, from below, refused or left out (6
        # timed steps cycle the 6 pooled batches once: the per-step mean is the pool's)
        total = r["device_hits"] + r["host_hits"] + r["from_below"] + r["pinned_out"] + r["refused"]
        assert total == pytest.approx(unique, rel=1e-9) and total > 0
        assert r["staging_cpu_ms"] >= 0
        if r["tiers"] == 1:
            assert r["host_hits"] == 0
        if r["policy"] == "lru" or r["tiers"] == 2:  # admission: hlfu with one tier only
            assert r["refused"] == 0
    by = {(r["policy"], r["tiers"], r["copies"]): r for r in recs}
    keys = ("device_hits", "host_hits", "from_below", "refused", "ring_rows")
    for p in ("lru", "hlfu"):
        for tiers in (1, 2):  # copies change the cost, never a decision
            a, b = by[(p, tiers, True)], by[(p, tiers, False)]
            assert [a[k] for k in keys] == [b[k] for k in keys]


def test_bench_kernels_smoke(tmp_path):
    from bench import kernels as bench_kernels

    rc = bench_kernels.main(["--tables", "2", "--rows", "500", "--batch", "16",
                             "--reps", "2", "--warmup", "0", "--device", "cpu", "--out", str(tmp_path)])
    assert rc == 0
    recs = _load(tmp_path / "kernels.json")
    assert {r["phase"] for r in recs} == {"plan", "forward", "backward", "keyed", "keyed_forward",
                                          "keyed_backward", "torch_bag"}
    assert all(_positive(r["ms"]) and r["ms_min"] <= r["ms"] for r in recs)


def test_bench_pagechunks_smoke(tmp_path):
    from bench import pagechunks as bench_pagechunks

    rc = bench_pagechunks.main(["--rows", "3000", "--row-dims", "5", "--batch", "500", "--reads", "200",
                                "--work", str(tmp_path / "w"), "--out", str(tmp_path)])
    assert rc == 0
    recs = _load(tmp_path / "pagechunks.json")
    assert [r["layout"] for r in recs] == ["btree", "btree_dense", "chunks"]
    assert all(r["found"] == recs[0]["found"] > 0 for r in recs)  # every layout finds the same rows
    assert all(_positive(r["disk_x_raw"]) and _positive(r["warm_us_row"]) for r in recs)
    assert (tmp_path / "pagechunks.png").is_file()


def test_bench_persistence_smoke(tmp_path):
    from bench import persistence as bench_persistence

    out = tmp_path / "persistence.json"
    rc = bench_persistence.main(["--rows", "20000", "--device-capacity", "512", "--host-capacity",
                                 "2048", "--batch", "1024", "--workdir", str(tmp_path / "w"),
                                 "--out", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["dirty_rows"] > 0 and res["pause_s"] >= 0 and _positive(res["restore_s"])
    assert all(_positive(c["ratio"]) for c in res["codecs"])
