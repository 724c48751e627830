"""Deletes from a level of page chunks (backends/chunkupdate.py) on real LMDB files: any mix of
merges and predicate deletes reads like a dict, chunks keep their first ids as keys, emptied
ranges drop their databases, and damage or bad input is an error that changes nothing."""

from __future__ import annotations

import threading
import time
from unittest import mock

import lmdb
import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import tierstore as ts
from tests.profiles import examples
from tests.test_chunkmerge import TOP, _damage, _named, ids_st
from tierstore.backends import chunkupdate, pagechunks
from tierstore.backends.chunkmerge import ChunkLevel
from tierstore.backends.lmdb_common import encode_keys
from tierstore.backends.record import seal
from tierstore.errors import StoreCorruptError, TierstoreError

ALL = 2**31  # a cutoff above every int32 stamp: every asked row goes


def _env(path):
    return lmdb.open(str(path), map_size=1 << 30, max_dbs=1024, sync=False, metasync=False)


def _rows(ids: np.ndarray, w: int, gen: int) -> np.ndarray:
    """Rows whose last word (the stamp column) holds `gen` as int32 bits."""
    rows = (ids[:, None] % 100_003 * 10 + np.arange(w) + 0.5).astype(np.float32)
    rows[:, w - 1] = np.full(len(ids), gen, dtype=np.int32).view(np.float32)
    return rows


def _merge(level: ChunkLevel, ref: dict, ids, gen: int, in_place: bool | None = False) -> None:
    ids = np.array(sorted(set(ids)), dtype=np.int64)
    rows = _rows(ids, level.row_dim, gen)
    level.merge(ids, seal(ids, rows), in_place=in_place)
    ref.update((int(x), (row, gen)) for x, row in zip(ids, rows))


def _delete(level: ChunkLevel, ref: dict, ids, cutoff: int) -> None:
    ids = np.array(sorted(set(ids)), dtype=np.int64)
    gone = [int(x) for x in ids if int(x) in ref and ref[int(x)][1] < cutoff]
    assert level.delete(ids, level.row_dim - 1, cutoff) == len(gone)
    for x in gone:
        del ref[x]


def _check(level: ChunkLevel, ref: dict, probes=()) -> None:
    """Every stored id reads its newest row, others read absent; counts, databases and keys hold."""
    q = np.array(sorted(set(ref) | set(probes)), dtype=np.int64)
    rows, found = level.get(q)
    assert found.tolist() == [int(x) in ref for x in q]
    for x, row in zip(q[found].tolist(), rows[found]):
        assert np.array_equal(row.view(np.int32), ref[x][0].view(np.int32))
    assert level.rows() == len(ref) == level.walked_rows()
    assert all(c == 0 for c, n in zip(level.counts, level.names) if n is None)
    assert _named(level) == {n for n in level.names if n is not None}  # emptied ranges dropped
    assert level.bounds[0] == 0 and all(a < b for a, b in zip(level.bounds, level.bounds[1:]))
    with level.env.begin() as txn:
        for lo, name, count in zip(level.bounds, level.names, level.counts):
            if name is None:
                continue
            kept = 0
            for key, val in txn.cursor(db=level.db(name)):  # under its first id, none empty
                n = int(np.frombuffer(val[:4], dtype=np.uint32)[0])
                first = np.frombuffer(val[pagechunks.HEAD : pagechunks.HEAD + 8], dtype=np.int64)
                assert n > 0 and key == encode_keys(first)[0] and int(first[0]) >= lo
                kept += n
            assert kept == count > 0


@st.composite
def _picks(draw, keys: list[int]) -> list[int]:
    """Ids to delete: a run of stored ids (whole chunks, ranges or all), some of them, or none
    stored; with absent ids mixed in."""
    kind = draw(st.sampled_from(["run", "some", "absent", "all"]))
    out: list[int] = []
    if keys and kind == "run":
        a = draw(st.integers(0, len(keys) - 1))
        out = keys[a : draw(st.integers(a, len(keys)))]
    elif keys and kind == "some":
        out = draw(st.lists(st.sampled_from(keys), max_size=200))
    elif kind == "all":
        out = list(keys)
    return out + draw(st.lists(ids_st, max_size=20))


# a merge's ids: scattered, or a block (whole chunks and ranges to delete later)
batch_st = st.one_of(st.lists(ids_st, max_size=300),
                     st.builds(lambda a, n, step: list(range(a, a + n * step, step)),
                               st.integers(0, 500), st.integers(0, 600), st.integers(1, 3)))


@settings(max_examples=examples(0.5), deadline=None)
@given(steps=st.lists(st.tuples(st.sampled_from(["merge", "delete"]), batch_st,
                                st.sampled_from([False, True, None])), min_size=1, max_size=8),
       w=st.sampled_from([1, 5, 65]), range_rows=st.sampled_from([5, 40, 150, 10_000]),
       window=st.sampled_from([1, 3, 8192]), data=st.data())
@example(steps=[("merge", list(range(200)), False), ("delete", [], False),
                ("merge", list(range(0, 200, 3)), True), ("delete", [], True)],
         w=5, range_rows=62, window=3, data=None)
def test_merges_and_deletes_read_like_a_dict(tmp_path_factory, steps, w, range_rows, window, data):
    """Any sequence of merges and deletes (runs of stored ids: first rows of chunks, whole
    chunks, whole ranges, everything; scattered ids; absent ids; a cutoff that keeps the rows
    merged since) leaves a level that reads as a dict, counts its rows right, drops emptied
    ranges' databases and keeps every chunk under its first id; the manifest published last is
    the level's."""
    env = _env(tmp_path_factory.mktemp("cd"))
    level = ChunkLevel(env, "t", w, "t", range_rows=range_rows, window=2)
    published = []
    level.on_publish = lambda txn, bounds, names, counts: published.append((bounds, names, counts))
    ref: dict = {}
    with mock.patch.object(chunkupdate, "DELETE_WINDOW_ROWS", window):
        for gen, (op, batch, in_place) in enumerate([("merge", range(0, 900, 2), False), *steps]):
            if op == "merge":
                _merge(level, ref, batch, gen, in_place)
            else:
                keys = sorted(ref)
                if data is not None:
                    ids = data.draw(_picks(keys))
                    cutoff = data.draw(st.one_of(st.integers(-1, gen + 1), st.just(ALL)))
                else:  # the example: every stored id, then the cutoff keeps the newest merge's
                    ids, cutoff = keys, (ALL if gen == 2 else gen - 1)
                _delete(level, ref, ids, cutoff)
            if published:
                assert published[-1] == (level.bounds, level.names, level.counts)
            _check(level, ref, [0, 1, TOP - 1])
    _merge(level, ref, range(0, 500, 7), len(steps) + 1)  # merges go on over what deletes left
    _check(level, ref)


def test_first_rows_whole_chunks_and_whole_ranges(tmp_path):
    """A chunk losing its first row moves to its new first id (the old key goes); a chunk
    emptied is deleted; a range emptied drops its database, keeps its bound, and takes rows
    again on the next merge."""
    env = _env(tmp_path)
    w = 5
    cap = pagechunks.capacity(4 * w + 4)
    level = ChunkLevel(env, "t", w, "t", range_rows=2 * cap)
    ref: dict = {}
    _merge(level, ref, range(0, 12 * cap, 2), 0)  # 3 ranges of 2 full chunks
    bounds = list(level.bounds)
    assert len(bounds) == 3
    with env.begin() as txn:
        before = [k for k, _ in txn.cursor(db=level.db(level.names[0]))]
    _delete(level, ref, [0], 1)  # the level's first row
    _delete(level, ref, [2 * cap], 1)  # the second chunk's first row
    with env.begin() as txn:
        after = [k for k, _ in txn.cursor(db=level.db(level.names[0]))]
    assert after[0] == encode_keys(np.array([2]))[0] and before[0] not in after
    assert after[1] == encode_keys(np.array([2 * cap + 2]))[0] and before[1] not in after
    _check(level, ref)
    chunks = len(after)
    _delete(level, ref, range(2 * cap + 2, 4 * cap, 2), ALL)  # the rest of the second chunk
    with env.begin() as txn:
        assert sum(1 for _ in txn.cursor(db=level.db(level.names[0]))) == chunks - 1
    _check(level, ref)
    name = level.names[1]
    r1 = [x for x in ref if bounds[1] <= x < bounds[2]]
    _delete(level, ref, r1, ALL)  # the whole second range
    assert level.names[1] is None and level.counts[1] == 0 and level.bounds == bounds
    assert name not in _named(level)
    _check(level, ref, [bounds[1], bounds[1] + 2])
    _merge(level, ref, [bounds[1] + 1, bounds[1] + 3], 1, in_place=True)  # it fills again
    _merge(level, ref, [bounds[2] - 1], 2)
    _check(level, ref)
    _delete(level, ref, sorted(ref), ALL)  # everything
    assert level.names == [None] * len(bounds) and level.rows() == 0
    _check(level, ref, [0, 1])


def test_the_predicate_keeps_rows_updated_since(tmp_path):
    """A delete asked for rows stamped below its cutoff keeps the rows whose stored stamp is at
    or above it (updated after the scan that chose them): it re-checks what it reads."""
    env = _env(tmp_path)
    level = ChunkLevel(env, "t", 3, "t", range_rows=100)
    ref: dict = {}
    _merge(level, ref, range(1000), 0)
    _merge(level, ref, range(0, 1000, 3), 5)  # a third updated since
    _delete(level, ref, range(1000), 5)
    assert sorted(ref) == list(range(0, 1000, 3))
    _check(level, ref)
    _delete(level, ref, range(1000), 5)  # nothing is below 5 now
    assert level.rows() == 334
    stamps = level.get(np.arange(0, 1000, 3))[0][:, 2].view(np.int32)
    assert (stamps == 5).all()
    _merge(level, ref, [3, 6], -3)  # stamps are int32: a negative one is below -1
    _delete(level, ref, [0, 3, 6], -1)
    assert sorted(ref)[:2] == [0, 9]
    _check(level, ref)


@pytest.mark.parametrize("where", ["record", "other record", "id", "count", "ids check"])
def test_damage_stops_the_delete_and_changes_nothing(tmp_path, where):
    """A damaged chunk (its count, an id, the check of its ids) or a damaged record anywhere in
    a chunk a delete reads is a StoreCorruptError, and that window commits nothing; a delete of
    rows in whole chunks goes on."""
    env = _env(tmp_path)
    w = 5
    cap = pagechunks.capacity(4 * w + 4)
    level = ChunkLevel(env, "t", w, "t", range_rows=10_000)
    ref: dict = {}
    _merge(level, ref, range(0, 2000, 2), 0)
    rb = 4 * w + 4
    at = {"record": pagechunks.HEAD + 8 * cap + 5, "count": 1, "ids check": 9,
          "other record": pagechunks.HEAD + 8 * cap + 3 * rb + 2,  # a row the delete keeps
          "id": pagechunks.HEAD + 8 * 3}[where]
    _damage(env, level, at)  # the second chunk: ids 2 cap .. 4 cap - 2
    counts = list(level.counts)
    with pytest.raises(StoreCorruptError):
        level.delete(np.array([2, 2 * cap, 2 * cap + 2]), w - 1, ALL)
    assert level.counts == counts
    if where != "count":  # (a walk sums the damaged count)
        assert level.walked_rows() == len(ref)
    rows, found = level.get(np.array([2]))  # the first chunk's row was not deleted either
    assert found.all()
    _delete(level, ref, [0, 4 * cap, 4 * cap + 2], ALL)  # chunks 1 and 3 are whole
    rows, found = level.get(np.array([0, 2, 4 * cap]))
    assert found.tolist() == [False, True, False] and level.rows() == len(ref)


def test_bad_input_is_refused_and_changes_nothing(tmp_path):
    env = _env(tmp_path)
    w = 5
    level = ChunkLevel(env, "t", w, "t")
    ref: dict = {}
    _merge(level, ref, range(100), 0)
    for ids, col, cutoff in [([5, 3], 4, ALL), ([3, 3], 4, ALL), ([-1, 3], 4, ALL),
                             ([[3]], 4, ALL), ([1.0, 3.0], 4, ALL), ([3], 5, ALL), ([3], -1, ALL),
                             ([3], True, ALL), ([3], 4, ALL + 1), ([3], 4, 1.5), ([3], 4, None)]:
        with pytest.raises(TierstoreError):
            level.delete(np.array(ids), col, cutoff)
    _check(level, ref)
    assert level.delete(np.zeros(0, dtype=np.int64), 4, ALL) == 0


def test_deletes_beside_a_merging_thread_keep_the_level_whole(tmp_path):
    """Deletes of the first merge's rows (cutoff 1) on one thread while another merges newer
    versions of some of them (splitting and rewriting ranges): whatever the interleaving, a row
    merged since stays and every other row of the first merge goes (the level lock keeps each
    range's read-modify-write whole)."""
    env = _env(tmp_path)
    w = 3
    level = ChunkLevel(env, "t", w, "t", range_rows=300, window=2)
    ref: dict = {}
    first = np.arange(0, 6000, 2)
    _merge(level, ref, first, 0)
    rng = np.random.default_rng(3)
    batches = [np.unique(rng.integers(0, 7000, 400)) for _ in range(12)]
    errors = []

    def merging():
        try:
            for gen, batch in enumerate(batches, 1):
                _merge(level, {}, batch, gen, in_place=[False, True, None][gen % 3])
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    th = threading.Thread(target=merging)
    with mock.patch.object(chunkupdate, "DELETE_WINDOW_ROWS", 64):
        th.start()
        for part in np.array_split(first, 30):
            level.delete(part, w - 1, 1)
        th.join()
    assert not errors
    for gen, batch in enumerate(batches, 1):
        ref.update((int(x), (row, gen)) for x, row in zip(batch, _rows(batch, w, gen)))
    merged = set(np.concatenate(batches).tolist())
    for x in first.tolist():
        if x not in merged:
            del ref[x]
    _check(level, ref)


def test_the_ttl_deleter_waits_for_a_range_rewrite_without_the_store_lock(tmp_path):
    """While the merger rewrites a range (it holds the level's lock), the background deleter
    waits for that lock without holding the store lock, which the training step needs."""
    spec = ts.TableSpec("t", 10**9, 4, optimizer=ts.Adagrad(0.1), ttl=2)
    ids = torch.arange(300) * 7919
    with ts.TierStore(tmp_path / "s", [spec], device_capacity=0, host_capacity=0, device="cpu",
                      seed=5, table_format="chunks") as store:
        store.apply("t", ids, torch.ones(300, 4))
        store.flush()
        level = store.backend.chunk_level("t", store.table_specs["t"].row_dim)
        with level.lock:  # a rewrite under way
            store.advance(3)  # every row stale
            store.flush()  # the cutoff durable: the deleter starts and waits for the level
            time.sleep(0.3)
            assert not store.expiry.wait(0)  # it has work and cannot do it yet ...
            got = store.lock.acquire(timeout=2)  # ... but leaves the store lock free
            assert got
            store.lock.release()
        assert store.expiry.wait(10)
        assert store.backend.count("t") == 0
