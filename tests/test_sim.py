"""Exact simulators pinned to libCacheSim's miss counts; tier mode; the benchmark's main."""

from __future__ import annotations

import json
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.profiles import examples, needs
from tierstore.errors import ConfigError
from tierstore.sim.bench import main, parse_capacities, size_for_hit_rate
from tierstore.sim.exact import EXACT, dense_keys, simulate
from tierstore.sim.tier import simulate_tier
from tierstore.sim.wtinylfu import tier_wtinylfu
from tierstore.traces import load_trace

DATA = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "traces"
REF_PATH = DATA / "libcachesim_reference.json"
FILES = {
    "cache2k_orm_busy": "cache2k_orm-busy.trace.xz",
    "cache2k_web07": "cache2k_web07.trace.xz",
    "cache2k_web12": "cache2k_web12.trace.xz",
    "lirs_sprite": "lirs_sprite.trace.gz",
    "lirs_multi2": "lirs_multi2.trace.gz",
    "lirs_2_pools": "lirs_2_pools.trace.gz",
    "libcachesim_cloudPhysicsIO": "libcachesim_cloudPhysicsIO.txt",
}
NAMES = {"LRU": "lru", "FIFO": "fifo", "LFU": "lfu", "Belady": "belady", "Clock": "clock",
         "Sieve": "sieve", "S3FIFO": "s3fifo", "ARC": "arc", "WTinyLFU": "wtinylfu"}
needs_data = needs(REF_PATH.exists(), "shared trace data not present")
_cache: dict[str, tuple[np.ndarray, int, np.ndarray]] = {}


def _trace(name: str) -> tuple[np.ndarray, int]:
    return _keyed_trace(name)[:2]


def _keyed_trace(name: str) -> tuple[np.ndarray, int, np.ndarray]:
    """Dense ids, distinct keys, and the original keys (what libCacheSim's W-TinyLFU hashes)."""
    if name not in _cache:
        trace = load_trace(str(DATA / FILES[name]))
        _cache[name] = (*trace.dense(), trace.rows)
    return _cache[name]


def _ref_cases(slow: bool) -> list:
    if not REF_PATH.exists():
        return []
    ref = json.loads(REF_PATH.read_text())
    out = []
    for trace, entry in ref.items():
        if (trace == "cache2k_orm_busy") != slow:
            continue
        for cap, by_policy in entry["sizes"].items():
            for lcs_name, ours in NAMES.items():
                out.append(pytest.param(trace, int(cap), ours, by_policy[lcs_name],
                                        id=f"{trace}-{cap}-{ours}"))
    return out


@needs_data
@pytest.mark.parametrize(("trace", "capacity", "policy", "expected"), _ref_cases(slow=False))
def test_exact_matches_libcachesim(trace, capacity, policy, expected):
    ids, n, keys = _keyed_trace(trace)
    assert simulate(policy, ids, n, capacity, keys) == expected


@needs_data
@pytest.mark.slow
@pytest.mark.parametrize(("trace", "capacity", "policy", "expected"), _ref_cases(slow=True))
def test_exact_matches_libcachesim_large(trace, capacity, policy, expected):
    ids, n, keys = _keyed_trace(trace)
    assert simulate(policy, ids, n, capacity, keys) == expected


@needs_data
def test_reference_trace_shapes():
    ref = json.loads(REF_PATH.read_text())
    for name in ("cache2k_web07", "lirs_sprite", "libcachesim_cloudPhysicsIO"):
        ids, n = _trace(name)
        assert (ids.size, n) == (ref[name]["requests"], ref[name]["distinct"])
    # what docs/policies.md says the reference holds: 7 traces, 19 sizes, 9 policies, 171 counts
    assert len(ref) == 7 and sum(len(e["sizes"]) for e in ref.values()) == 19
    assert sorted(len(e["sizes"]) for e in ref.values()) == [2, 2, 3, 3, 3, 3, 3]
    assert len(_ref_cases(False)) + len(_ref_cases(True)) == 171


# reference models in plain Python -------------------------------------------------------------
def _py_lru(keys, cap):
    od: OrderedDict = OrderedDict()
    misses = 0
    for k in keys:
        if k in od:
            od.move_to_end(k)
            continue
        misses += 1
        if len(od) >= cap:
            od.popitem(last=False)
        od[k] = None
    return misses


def _py_lfu(keys, cap):
    freq: dict = {}
    last: dict = {}
    misses = 0
    for t, k in enumerate(keys):
        if k in freq:
            freq[k] += 1
        else:
            misses += 1
            if len(freq) >= cap:
                v = min(freq, key=lambda x: (freq[x], last[x]))
                del freq[v], last[v]
            freq[k] = 1
        last[k] = t
    return misses


def _py_belady(keys, cap):
    cache: set = set()
    misses = 0
    for t, k in enumerate(keys):
        if k in cache:
            continue
        misses += 1
        if len(cache) >= cap:
            def nxt(x, t=t):
                for j in range(t + 1, len(keys)):
                    if keys[j] == x:
                        return j
                return len(keys) + 1
            cache.remove(max(cache, key=nxt))
        cache.add(k)
    return misses


@settings(max_examples=examples())
@given(keys=st.lists(st.integers(0, 12), max_size=60), cap=st.integers(0, 8))
def test_exact_against_python_models(keys, cap):
    ids, n = dense_keys(np.array(keys, dtype=np.int64))
    assert simulate("lru", ids, n, cap) == (_py_lru(keys, cap) if cap else len(keys))
    assert simulate("lfu", ids, n, cap) == (_py_lfu(keys, cap) if cap else len(keys))
    assert simulate("belady", ids, n, cap) == (_py_belady(keys, cap) if cap else len(keys))
    for pol in EXACT:  # every policy: compulsory misses <= misses <= requests, and MIN is optimal
        m = simulate(pol, ids, n, cap)
        assert len(set(keys)) <= m <= len(keys), pol
        assert simulate("belady", ids, n, cap) <= m, pol


def test_dense_keys_large_range():
    keys = np.array([5, -(2**62), 2**62, 5, 7], dtype=np.int64)
    ids, n = dense_keys(keys)
    assert n == 4 and ids[0] == ids[3] and len(set(ids.tolist())) == 4


def test_simulate_rejects_bad_input():
    with pytest.raises(ConfigError):
        simulate("nope", np.zeros(3, dtype=np.int64), 1, 1)
    with pytest.raises(ConfigError):
        simulate("lru", np.zeros(3, dtype=np.int64), 1, -1)
    with pytest.raises(ConfigError):
        dense_keys(np.zeros(3, dtype=np.float32))


# tier mode ---------------------------------------------------------------------------------
@needs_data
@pytest.mark.parametrize("policy", ["lru", "fifo", "clock", "lfu", "sieve", "belady", "s3fifo",
                                    "wtinylfu", "arc"])
def test_tier_mode_batch1_equals_exact(policy):  # ARC too, on this trace prefix
    ids, n = _trace("lirs_multi2")
    ids = dense_keys(ids[:3000])[0]
    n = int(ids.max()) + 1
    assert simulate_tier(ids, n, policy, 57, 1) == _one_by_one(policy, ids, n, 57)


def _one_by_one(policy: str, ids: np.ndarray, n: int, cap: int) -> int:
    """The request-by-request misses a tier policy must give at batch 1: the exact simulator,
    except for W-TinyLFU, whose exact simulator is libCacheSim's and whose tier policy is
    tierstore's own (docs/policies.md): there, the tier policy's kernels one request at a time."""
    return tier_wtinylfu(ids, n, cap) if policy == "wtinylfu" else simulate(policy, ids, n, cap)


@pytest.mark.parametrize("policy", ["lru", "fifo", "clock", "lfu", "sieve", "s3fifo",
                                    "wtinylfu"])
def test_tier_mode_batch1_equals_exact_on_zipf(policy):
    # the tier's queue policies, one request a batch, are the textbook policies
    ids, n = load_trace("zipf:alpha=0.9,keys=3000,requests=12000,seed=5").dense()
    for cap in (40, 300):
        assert simulate_tier(ids, n, policy, cap, 1) == _one_by_one(policy, ids, n, cap)


def test_tier_arc_close_to_textbook_arc():
    # the tier picks victims before it sees the incoming keys, so a ghost hit adapts p one
    # eviction late and REPLACE loses its "x in B2" tie rule (docs/policies.md)
    ids, n = load_trace("zipf:alpha=0.9,keys=3000,requests=12000,seed=5").dense()
    for cap in (40, 300):
        tier = simulate_tier(ids, n, "arc", cap, 1) / ids.size
        exact = simulate("arc", ids, n, cap) / ids.size
        assert abs(tier - exact) < 0.005
        assert tier < simulate("lru", ids, n, cap) / ids.size


def test_wtinylfu_beats_lru_on_zipf():
    trace = load_trace("zipf:alpha=1.0,keys=20000,requests=100000,seed=2")
    ids, n = trace.dense()
    for cap in (200, 1000, 4000):
        lru = simulate("lru", ids, n, cap)
        assert simulate("wtinylfu", ids, n, cap, trace.rows) < lru  # libCacheSim's
        assert tier_wtinylfu(ids, n, cap) < lru  # the tier policy's


def _py_arc(keys, c):
    """Megiddo & Modha's ARC pseudocode over Python lists (LRU end first)."""
    t1, t2, b1, b2 = [], [], [], []
    p, misses = 0.0, 0

    def replace(in_b2):
        if t1 and (len(t1) > p or (in_b2 and len(t1) == p)):
            b1.append(t1.pop(0))
        else:
            b2.append(t2.pop(0))

    for x in keys:
        if x in t1 or x in t2:
            (t1 if x in t1 else t2).remove(x)
            t2.append(x)
            continue
        misses += 1
        if x in b1:
            p = min(c, p + max(len(b2) / len(b1), 1))
            replace(False)
            b1.remove(x)
            t2.append(x)
        elif x in b2:
            p = max(0, p - max(len(b1) / len(b2), 1))
            replace(True)
            b2.remove(x)
            t2.append(x)
        else:
            if len(t1) + len(b1) == c:
                if len(t1) < c:
                    b1.pop(0)
                    replace(False)
                else:
                    t1.pop(0)
            elif len(t1) + len(t2) + len(b1) + len(b2) >= c:
                if len(t1) + len(t2) + len(b1) + len(b2) == 2 * c:
                    b2.pop(0)
                replace(False)
            t1.append(x)
    return misses


@settings(max_examples=60, deadline=None)
@given(keys=st.lists(st.integers(0, 15), max_size=80), cap=st.integers(1, 8))
def test_arc_against_python_model(keys, cap):
    ids, n = dense_keys(np.array(keys, dtype=np.int64))
    assert simulate("arc", ids, n, cap) == _py_arc(list(ids), cap)


def test_tier_mode_batches_and_lookahead():
    trace = load_trace("zipf:alpha=1.0,keys=5000,requests=40000,seed=3")
    ids, n = trace.dense()
    lru = simulate_tier(ids, n, "lru", 500, 256)
    bel = simulate_tier(ids, n, "belady", 500, 256)
    wide = simulate_tier(ids, n, "lookahead", 500, 256, window=64)
    assert bel <= wide <= lru
    assert simulate_tier(ids, n, "belady", 500, 256) == bel  # deterministic


# the benchmark -----------------------------------------------------------------------------
def test_parse_capacities():
    assert parse_capacities("10,1%,0.01%", 1000) == [1, 10]
    with pytest.raises(ConfigError):
        parse_capacities("x", 10)
    with pytest.raises(ConfigError):
        parse_capacities("-3", 10)


def test_size_for_hit_rate():
    ids, n = dense_keys(np.tile(np.arange(100), 50))
    need = size_for_hit_rate("lru", ids, n, 0.9)
    assert need == 100
    assert size_for_hit_rate("lru", ids, n, 0.999) is None


def test_bench_main_writes_json_and_plot(tmp_path, capsys):
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    rc = main(["--trace", "zipf:alpha=1.0,keys=2000,requests=20000,seed=1",
               "--capacity", "1%,10%", "--policy", "lru,sieve,lookahead,belady",
               "--batch-size", "128", "--json", str(out), "--plot", str(png), "--no-progress"])
    assert rc == 0
    recs = json.loads(out.read_text())
    runs = [r for r in recs if r["mode"] in ("exact", "tier")]
    assert {r["mode"] for r in runs} == {"exact", "tier"}
    for r in runs:
        assert {"policy", "mode", "capacity", "requests", "misses", "miss_ratio",
                "seconds"} <= r.keys()
    assert not any(r["policy"] == "lookahead" and r["mode"] == "exact" for r in runs)
    assert png.stat().st_size > 1000
    assert "hit rate" in capsys.readouterr().out


def test_bench_main_bad_flags(capsys):
    assert main(["--policy", "nope", "--no-progress"]) == 2
    assert main(["--mode", "fast", "--no-progress"]) == 2
    assert "error" in capsys.readouterr().err
