"""Sorted-chunk runs (backends/runs.py) on real LMDB files: reads, merges and damage against a dict."""

from __future__ import annotations

import lmdb
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierstore.backends import runs
from tierstore.backends.record import seal
from tierstore.errors import StoreCorruptError, TierstoreError

W = 5  # row words (a record: 5 words + its checksum)
RB = 4 * W + 4


def _env(path):
    return lmdb.open(str(path), map_size=1 << 28, max_dbs=64, sync=False, metasync=False)


def _rows(ids: np.ndarray, salt: int) -> np.ndarray:
    """Distinct, reproducible row values for (id, salt)."""
    return (ids[:, None] * 10 + np.arange(W) + salt * 1000).astype(np.float32)


def _write(env, name: bytes, ids: np.ndarray, salt: int, add_sizes=(3, 11, 40)) -> runs.SortedRun:
    db = env.open_db(name)
    w = runs.RunWriter(env, db, RB, txn_chunks=2)
    ids = np.sort(ids)
    lo, k = 0, 0
    while lo < len(ids):  # added in uneven pieces: chunks cut across adds
        hi = lo + add_sizes[k % len(add_sizes)]
        w.add(ids[lo:hi], seal(ids[lo:hi], _rows(ids[lo:hi], salt)))
        lo, k = hi, k + 1
    assert w.finish() == len(ids)
    assert w.chunks == -(-len(ids) // runs.CHUNK_ROWS)
    return runs.SortedRun(env, db, "t", W)


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(runs, "CHUNK_ROWS", 7)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.sets(st.integers(0, 400), max_size=120), min_size=1, max_size=4), st.data())
def test_merge_keeps_each_ids_newest_row_and_reads_match_a_dict(tmp_path_factory, levels, data):
    env = _env(tmp_path_factory.mktemp("runs"))
    model: dict[int, np.ndarray] = {}
    sources = []
    for salt, ids in enumerate(levels):  # oldest first: the first level is the base
        ids = np.array(sorted(ids), dtype=np.int64)
        run = _write(env, f"r{salt}".encode(), ids, salt)
        for i, row in zip(ids.tolist(), _rows(ids, salt)):
            model[i] = row
        probe = np.array(data.draw(st.lists(st.integers(0, 401), max_size=60)), dtype=np.int64)
        got, found = run.get(probe)  # each run reads exactly its own rows
        assert np.array_equal(found, np.isin(probe, ids))
        assert np.array_equal(got[found], _rows(probe[found], salt))
        sources.insert(0, run)  # newest first
    out = env.open_db(b"merged")
    free = data.draw(st.booleans())
    n = runs.merge_runs(sources, runs.RunWriter(env, out, RB, txn_chunks=3), free=free)
    assert n == len(model)
    merged = runs.SortedRun(env, out, "t", W)
    every = np.arange(0, 402, dtype=np.int64)
    got, found = merged.get(every[::-1])  # any order
    assert np.array_equal(found[::-1], np.isin(every, list(model)))
    for i, row in model.items():
        assert np.array_equal(got[::-1][i], row)
    parts = list(merged.chunks())  # the chunks are dense and in id order
    ids = np.concatenate([p[1] for p in parts]) if parts else np.zeros(0, dtype=np.int64)
    assert np.array_equal(ids, np.array(sorted(model), dtype=np.int64))
    assert all(len(p[1]) == runs.CHUNK_ROWS for p in parts[:-1])
    if free:  # every source chunk was freed with the commit that made its rows durable
        with env.begin() as txn:
            assert all(txn.stat(s.db)["entries"] == 0 for s in sources)
    env.close()


def test_writer_refuses_bad_input_and_writes_nothing(tmp_path):
    env = _env(tmp_path)
    db = env.open_db(b"r")
    w = runs.RunWriter(env, db, RB)
    ids = np.array([1, 5, 9], dtype=np.int64)
    w.add(ids, seal(ids, _rows(ids, 0)))
    for bad in (np.array([9, 12]), np.array([20, 15]), np.array([-3])):
        with pytest.raises(TierstoreError):
            w.add(bad, seal(bad, _rows(bad, 0)))
    with pytest.raises(TierstoreError):
        w.add(np.array([30]), np.zeros((1, RB + 4), dtype=np.uint8))
    assert w.finish() == 3
    got, found = runs.SortedRun(env, db, "t", W).get(np.array([1, 5, 9, 12, 20, 30]))
    assert found.tolist() == [True, True, True, False, False, False]
    with pytest.raises(TierstoreError):  # a run is written once
        runs.RunWriter(env, db, RB)
    env.close()


@pytest.mark.parametrize("where", ["record", "header", "ids", "last_id"])
def test_damage_is_detected_by_reads_and_merges(tmp_path, where):
    env = _env(tmp_path)
    ids = np.arange(0, 60, 3, dtype=np.int64)
    run = _write(env, b"r", ids, 0)
    key = runs.encode_keys(run.firsts[1:2])[0]
    with env.begin(write=True, db=run.db) as txn:
        val = bytearray(txn.get(key))
        k = int(np.frombuffer(val[8:12], dtype=np.uint32)[0])
        at = {"record": runs.HEADER + 8 * k + 5, "header": 5, "ids": runs.HEADER + 8 + 1,
              "last_id": runs.HEADER + 8 * (k - 1) + 2}[where]  # still in order: the ids' crc
        val[at] ^= 0x10
        txn.put(key, bytes(val))
    damaged = ids[runs.CHUNK_ROWS : 2 * runs.CHUNK_ROWS]
    with pytest.raises(StoreCorruptError):
        run.get(damaged)
    _, found = run.get(ids[:3])  # other chunks still read
    assert found.all()
    with pytest.raises(StoreCorruptError):
        runs.merge_runs([run], runs.RunWriter(env, env.open_db(b"out"), RB))
    env.close()


class _Cut(Exception):
    pass


@settings(max_examples=20, deadline=None)
@given(st.lists(st.sets(st.integers(0, 300), min_size=1, max_size=100), min_size=2, max_size=4),
       st.integers(0, 12))
def test_a_freeing_merge_cut_after_any_commit_reads_every_newest_row(tmp_path_factory, levels, stop):
    """A merge that frees what it consumed, stopped after commit `stop` (as a kill would leave
    it): the output, then the sources newest first, still read each id's newest row."""
    env = _env(tmp_path_factory.mktemp("cut"))
    model: dict[int, np.ndarray] = {}
    sources = []
    for salt, ids in enumerate(levels):
        ids = np.array(sorted(ids), dtype=np.int64)
        sources.insert(0, _write(env, f"r{salt}".encode(), ids, salt))
        model.update(zip(ids.tolist(), _rows(ids, salt)))
    out = env.open_db(b"merged")
    writer = runs.RunWriter(env, out, RB, txn_chunks=1)
    commits = []
    original = runs.RunWriter._commit

    def commit(self):
        if self._ready and len(commits) == stop:
            raise _Cut  # before this transaction: the state after `stop` commits stays
        if self._ready:
            commits.append(1)
        original(self)

    runs.RunWriter._commit = commit
    try:
        runs.merge_runs(sources, writer, free=True)
    except _Cut:
        pass
    finally:
        runs.RunWriter._commit = original
    levels_now = [runs.SortedRun(env, out, "t", W)] + [runs.SortedRun(env, s.db, "t", W) for s in sources]
    every = np.arange(0, 301, dtype=np.int64)
    got = np.zeros((len(every), W), dtype=np.float32)
    found = np.zeros(len(every), dtype=bool)
    for level in levels_now:  # newest first: the first level that has an id has its newest row
        rows, hit = level.get(every)
        new = hit & ~found
        got[new], found[new] = rows[new], True
    assert np.array_equal(found, np.isin(every, list(model)))
    for i, row in model.items():
        assert np.array_equal(got[i], row)
    env.close()


@settings(max_examples=15, deadline=None)
@given(st.lists(st.sets(st.integers(0, 3000), max_size=700), min_size=1, max_size=5),
       st.sampled_from([7, 150]), st.booleans())
def test_the_compiled_merge_writes_the_numpy_merges_bytes(tmp_path_factory, levels, chunk, free):
    """In place in the map (chunks of 150 rows: overflow pages) or copied out (7 rows: inside a
    leaf page, not 8-byte aligned), the numba merge writes the numpy merge's chunks exactly."""
    runs.CHUNK_ROWS = chunk
    got = []
    for compiled in (True, False):
        env = _env(tmp_path_factory.mktemp("same"))
        sources = [_write(env, f"r{salt}".encode(), np.array(sorted(ids), dtype=np.int64), salt,
                          add_sizes=(500,)) for salt, ids in enumerate(levels)][::-1]
        out = env.open_db(b"merged")
        saved = runs.HAVE_NUMBA
        runs.HAVE_NUMBA = compiled and saved
        try:
            n = runs.merge_runs(sources, runs.RunWriter(env, out, RB, txn_chunks=2), free=free)
        finally:
            runs.HAVE_NUMBA = saved
        with env.begin(db=out) as txn:
            got.append((n, list(txn.cursor().iternext())))
        env.close()
    assert got[0] == got[1]
    assert got[0][0] == len(set().union(*levels))


def test_the_compiled_merge_finds_damage_in_place(tmp_path):
    """A flipped bit in a record of an older source (superseded or not) stops the merge."""
    runs.CHUNK_ROWS = 150
    env = _env(tmp_path)
    base = _write(env, b"b", np.arange(0, 900, dtype=np.int64), 0, add_sizes=(500,))
    new = _write(env, b"n", np.arange(0, 900, 2, dtype=np.int64), 1, add_sizes=(500,))
    key = runs.encode_keys(base.firsts[2:3])[0]
    with env.begin(write=True, db=base.db) as txn:  # row 300 (superseded by the newer run)
        val = bytearray(txn.get(key))
        val[runs.HEADER + 8 * 150 + 7] ^= 0x04
        txn.put(key, bytes(val))
    with pytest.raises(StoreCorruptError, match="row 300 failed"):
        runs.merge_runs([new, base], runs.RunWriter(env, env.open_db(b"out"), RB))
    env.close()


@settings(max_examples=15, deadline=None)
@given(st.sets(st.integers(0, 5000), min_size=1, max_size=400), st.integers(1, 60), st.integers(0, 3),
       st.integers(0, 2**31))
def test_gather_from_chunks_writes_what_add_writes(tmp_path_factory, ids, per_chunk, skip, seed):
    """Records picked out of log-like chunks (a header of `skip` words in each entry) by
    (chunk, row) write the same run as `add` of the same records; a damaged one is refused."""
    env = _env(tmp_path_factory.mktemp("gather"))
    ids = np.array(sorted(ids), dtype=np.int64)
    recs = seal(ids, _rows(ids, 3)).view(np.uint32)
    perm = np.random.default_rng(seed).permutation(len(ids))  # entries in any (log) order
    entries = np.zeros((len(ids), skip + W + 1 + 2), dtype=np.uint32)
    entries[:, skip : skip + W + 1] = recs[perm]
    chunks = [entries[lo : lo + per_chunk] for lo in range(0, len(ids), per_chunk)]
    where = np.argsort(perm)  # entry of each sorted id
    out = []
    for gathered in (True, False):
        db = env.open_db(b"g" if gathered else b"a")
        w = runs.RunWriter(env, db, RB, txn_chunks=2)
        if gathered:
            w.gather(ids, chunks, where // per_chunk, where % per_chunk, skip, "t")
        else:
            w.add(ids, recs.view(np.uint8))
        w.finish()
        with env.begin(db=db) as txn:
            out.append(list(txn.cursor().iternext()))
    assert out[0] == out[1]
    entries[where[-1], skip + 1] ^= 1  # the last id's record
    w = runs.RunWriter(env, env.open_db(b"bad"), RB)
    with pytest.raises(StoreCorruptError, match=f"row {ids[-1]} failed"):
        w.gather(ids, chunks, where // per_chunk, where % per_chunk, skip, "t")
    with pytest.raises(TierstoreError):  # a row outside its chunk
        w.gather(ids[:1], chunks, np.array([0]), np.array([per_chunk]), skip)
    env.close()


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(-3, 2**62), max_size=60), st.booleans())
def test_newest_order_is_each_keys_last_position_by_key(keys, small):
    keys = np.array([k % 50 if small else k for k in keys], dtype=np.int64)
    ids, pos = runs.newest_order(keys)
    last = {int(k): i for i, k in enumerate(keys)}
    assert ids.tolist() == sorted(last) and pos.tolist() == [last[k] for k in sorted(last)]
