"""libCacheSim's W-TinyLFU: literals from libCacheSim 0.3.5, its options, and a plain-Python model.

The literals come from the `libcachesim==0.3.5` wheel (its `WTinyLFU`, object size 1, each
request's `obj_id` the trace's key), run outside the project; the 19 counts of
`libcachesim_reference.json` are pinned in tests/test_sim.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.profiles import examples, needs
from tests.reference_wtinylfu import py_lcs_wtinylfu, xxh64_int
from tierstore.errors import ConfigError
from tierstore.sim.bench import main
from tierstore.sim.exact import dense_keys, simulate
from tierstore.sim.wtinylfu import lcs_wtinylfu, sketch_shape, xxh64_u64
from tierstore.traces import load_trace

DATA = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "traces"
CLOUD = DATA / "libcachesim_cloudPhysicsIO.txt"
WEB07 = DATA / "cache2k_web07.trace.xz"
needs_data = needs(CLOUD.exists() and WEB07.exists(), "shared trace data not present")


def _keyed(path: Path) -> tuple[np.ndarray, int, np.ndarray]:
    trace = load_trace(str(path))
    return (*trace.dense(), trace.rows)


@needs_data
@pytest.mark.parametrize(("capacity", "expected"), [(150, 98374), (1000, 94911), (20000, 59599)])
def test_cloudphysics_matches_libcachesim_at_three_more_sizes(capacity, expected):
    ids, n, keys = _keyed(CLOUD)
    assert simulate("wtinylfu", ids, n, capacity, keys) == expected


@needs_data
def test_the_keys_are_hashed_not_their_pattern():
    # same request pattern, other object ids: libCacheSim gives other counts (sketch collisions)
    ids, n, keys = _keyed(CLOUD)
    assert simulate("wtinylfu", ids, n, 490, keys) == 96549
    assert simulate("wtinylfu", ids, n, 490, ids) == 96492 == simulate("wtinylfu", ids, n, 490)


@needs_data
@pytest.mark.parametrize(("capacity", "window", "expected"),
                         [(300, 0.2, 41625), (2048, 0.05, 33344), (150, 0.0, 76118)])
def test_window_option_matches_libcachesim(capacity, window, expected):
    ids, n, keys = _keyed(WEB07)
    assert lcs_wtinylfu(ids, n, capacity, keys, window=window) == expected


@needs_data
def test_bench_exact_mode_passes_the_trace_keys(tmp_path):
    out = tmp_path / "r.json"
    assert main(["--trace", str(CLOUD), "--policy", "wtinylfu,lru", "--mode", "exact",
                 "--capacity", "0.1%,1%,10%", "--no-sizing", "--json", str(out),
                 "--no-progress"]) == 0
    got = {(r["policy"], r["capacity"]): r["misses"] for r in json.loads(out.read_text())}
    ref = json.loads((DATA / "libcachesim_reference.json").read_text())
    want = ref["libcachesim_cloudPhysicsIO"]["sizes"]
    assert got == {(ours, int(c)): by[lcs] for c, by in want.items()
                   for ours, lcs in (("wtinylfu", "WTinyLFU"), ("lru", "LRU"))}


def test_xxh64_known_values():
    keys = np.array([0, 1, 42932745, -5, 2**63 - 1], dtype=np.int64)
    seeds = [0, 0x12345678, 0x12344321, 0x12345678, 0]
    want = [0x34C96ACDCADB1BBB, 0x071B9484A2374097, 0x2DFF672421D1A7BD, 0x30B9F7D861CD95B2,
            0xFF70CC60366E770C]  # python-xxhash 3.x (libxxhash 0.8.4) on the 8 key bytes
    for k, s, w in zip(keys, seeds, want, strict=True):
        assert int(xxh64_u64(np.array([k]), s)[0]) == w == xxh64_int(int(k), s)


@given(keys=st.lists(st.integers(-(2**63), 2**63 - 1), min_size=1, max_size=50),
       seed=st.integers(0, 2**32 - 1))
def test_xxh64_vectorized_equals_plain(keys, seed):
    got = xxh64_u64(np.array(keys, dtype=np.int64), seed)
    assert [int(x) for x in got] == [xxh64_int(k, seed) for k in keys]


def test_sketch_shape_is_libcachesims():
    assert sketch_shape(203) == (2919, 10)  # 14.38 counters per entry, 10 positions
    assert sketch_shape(0) == (20, 10)  # too few counters: twice the positions
    assert sketch_shape(1000, 0.1) == (4793, 4)


def test_below_a_one_object_window_every_request_misses():
    ids, n = dense_keys(np.tile(np.arange(5), 40))
    assert lcs_wtinylfu(ids, n, 99) == ids.size  # window int(0.99) = 0
    assert lcs_wtinylfu(ids, n, 100) == 5
    assert lcs_wtinylfu(ids, n, 100, segments=(0, 1)) == ids.size  # no probation


def test_bad_options_are_config_errors():
    ids = np.zeros(3, dtype=np.int64)
    for kw in ({"window": 1.0}, {"window": -0.1}, {"segments": (1,)}, {"segments": (-1, 4)},
               {"error": 0.0}, {"decay": 0}):
        with pytest.raises(ConfigError):
            lcs_wtinylfu(ids, 1, 10, **kw)
    with pytest.raises(ConfigError):
        lcs_wtinylfu(ids, 1, 200, keys=np.zeros(2, dtype=np.int64))


@settings(max_examples=examples(), deadline=None)
@given(pattern=st.lists(st.integers(0, 260), min_size=1, max_size=700),
       key_space=st.lists(st.integers(-(2**63), 2**63 - 1), min_size=261, max_size=261,
                          unique=True),
       cap=st.integers(100, 240), window=st.sampled_from([0.01, 0.04, 0.3]),
       segments=st.sampled_from([(1, 4), (1, 1), (3, 1)]), error=st.sampled_from([0.001, 0.3]),
       decay=st.integers(1, 3), seeds=st.tuples(st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1)))
def test_kernel_equals_plain_python_model(pattern, key_space, cap, window, segments, error, decay,
                                          seeds):
    keys = [key_space[p] for p in pattern]
    arr = np.array(keys, dtype=np.int64)
    ids, n = dense_keys(arr)
    got = lcs_wtinylfu(ids, n, cap, arr, window=window, segments=segments, error=error,
                       decay=decay, seeds=seeds)
    assert got == py_lcs_wtinylfu(keys, cap, window, segments, error, decay, seeds)


@pytest.mark.parametrize("seed", range(4))
def test_kernel_equals_plain_python_model_on_skewed_traces(seed):
    # long enough for duels, demotions and halvings (decay=1: every `main` main-cache hits)
    rng = np.random.default_rng(seed)
    space = rng.integers(-(2**63), 2**63 - 1, size=600, dtype=np.int64)
    p = 1.0 / np.arange(1, 601) ** 0.9
    keys = space[rng.choice(600, size=4000, p=p / p.sum())]
    ids, n = dense_keys(keys)
    cap = int(rng.integers(100, 260))
    got = lcs_wtinylfu(ids, n, cap, keys, decay=1)
    assert n < got == py_lcs_wtinylfu(keys.tolist(), cap, decay=1)
    assert lcs_wtinylfu(ids, n, cap, keys) == py_lcs_wtinylfu(keys.tolist(), cap)
