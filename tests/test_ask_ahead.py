"""Cold reads ask the disk for a batch's pages at once (backends/pageahead.py): every page on the
search paths is asked exactly once, the rows read stay the same bits, and damage is harmless."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tierstore.backends import lmdb_backend, pageahead
from tierstore.backends.lmdb_backend import DATA_NAME, LmdbBackend
from tierstore.backends.pages import PageReader

pytestmark = pytest.mark.skipif(not pageahead.AVAILABLE, reason="needs numba and posix_fadvise")

W = 9  # row width in float32 words
ROWS = np.arange(0, 90_000, 3, dtype=np.int64)  # 30k rows: a three-level B-tree


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    path = tmp_path_factory.mktemp("ahead")
    be = LmdbBackend(path)
    be.put({"t": (ROWS, (ROWS[:, None] * 10 + np.arange(W)).astype(np.float32))})
    be.sync()
    yield be, path
    be.close()


def _record(be: LmdbBackend) -> bytes:
    with be.env.begin() as txn:
        return bytes(txn.get(b"t:t"))


def test_every_page_on_the_paths_is_asked_once(store):
    be, path = store
    record = _record(be)
    with be.env.begin() as txn:
        tree = txn.stat(be.table_db("t"))
    depth, branch, leaf = tree["depth"], tree["branch_pages"], tree["leaf_pages"]
    assert depth >= 3
    reader = PageReader(path / DATA_NAME, be.env.stat()["psize"])
    # every key: every branch and leaf page of the tree, each once
    assert reader.ask_ahead(record, ROWS.astype(np.uint64)) == branch + leaf
    # one key: one page a level; keys in one leaf: the same
    assert reader.ask_ahead(record, ROWS[:1].astype(np.uint64)) == depth
    assert reader.ask_ahead(record, ROWS[:2].astype(np.uint64)) == depth
    # absent keys walk the same paths; no keys, no record: nothing
    assert reader.ask_ahead(record, np.array([1, 10**9], dtype=np.uint64)) >= depth
    assert reader.ask_ahead(record, np.zeros(0, dtype=np.uint64)) == 0
    assert reader.ask_ahead(None, ROWS[:5].astype(np.uint64)) == 0


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(probe=st.lists(st.integers(0, 100_000), min_size=1, max_size=2_000))
def test_reads_asked_ahead_are_the_same_bits(store, probe):
    be, _ = store
    rows = np.asarray(probe, dtype=np.int64)  # unsorted, repeated, absent rows too
    data, found = be.get("t", rows, W, ahead=True)
    ref_data, ref_found = be.get("t", rows, W)
    assert np.array_equal(found, ref_found) and np.array_equal(found, (rows % 3 == 0) & (rows < 90_000))
    assert np.array_equal(data.view(np.uint32), ref_data.view(np.uint32))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(flips=st.lists(st.tuples(st.integers(0, 2**31), st.integers(1, 255)), min_size=1, max_size=40))
def test_damaged_pages_only_misdirect_the_hint(store, tmp_path_factory, flips):
    be, path = store
    record = _record(be)
    copy = tmp_path_factory.mktemp("damaged") / DATA_NAME
    shutil.copyfile(path / DATA_NAME, copy)
    raw = bytearray(copy.read_bytes())
    for pos, x in flips:  # bytes flipped anywhere, branch pages and page headers included
        raw[pos % len(raw)] ^= x
    copy.write_bytes(bytes(raw))
    reader = PageReader(copy, be.env.stat()["psize"])
    asked = reader.ask_ahead(record, ROWS[::7].astype(np.uint64))
    assert 1 <= asked <= len(raw) // be.env.stat()["psize"]


def test_py_lmdb_reads_ask_ahead_too(tmp_path, monkeypatch):
    monkeypatch.setattr(lmdb_backend, "PAGE_READS", False)  # the page walker off: py-lmdb reads
    be = LmdbBackend(tmp_path / "s")
    try:
        be.put({"t": (ROWS, (ROWS[:, None] * 10 + np.arange(W)).astype(np.float32))})
        rows = np.array([9, 3, 4, 0, 89_997, 10**6], dtype=np.int64)
        data, found = be.get("t", rows, W, ahead=True)
        ref_data, ref_found = be.get("t", rows, W)
        assert found.tolist() == [True, True, False, True, True, False]
        assert np.array_equal(found, ref_found)
        assert np.array_equal(data.view(np.uint32), ref_data.view(np.uint32))
        assert np.array_equal(data[0], 90 + np.arange(W, dtype=np.float32))
    finally:
        be.close()
