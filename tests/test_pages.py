"""Direct page reads (backends/pages.py) return exactly what py-lmdb returns, or step aside."""

from __future__ import annotations

import threading

import lmdb
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tierstore.backends import lmdb_backend
from tierstore.backends.lmdb_backend import DATA_NAME, LmdbBackend
from tierstore.backends.pages import PageReader, find_values
from tierstore.errors import StoreCorruptError

W = 9  # row width in float32 words (payload + stamp)


def _both(be: LmdbBackend, table: str, rows: np.ndarray, width: int = W):
    """get() through the page reader and through py-lmdb."""
    fast = be.get(table, rows, width)
    pages, be._pages = be._pages, None
    try:
        slow = be.get(table, rows, width)
    finally:
        be._pages = pages
    return fast, slow


def _payload(rows: np.ndarray, version: int) -> np.ndarray:
    return (rows[:, None] * 16 + np.arange(W)[None, :] + version * 1e6).astype(np.float32)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batches=st.lists(st.lists(st.integers(0, 50_000), min_size=1, max_size=3_000),
                        min_size=1, max_size=4),
       probes=st.lists(st.integers(0, 60_000), min_size=1, max_size=500))
def test_page_reads_equal_py_lmdb(tmp_path_factory, batches, probes):
    be = LmdbBackend(tmp_path_factory.mktemp("pages"))
    try:
        assert be._pages is not None
        for v, b in enumerate(batches):  # later batches overwrite earlier rows
            rows = np.unique(np.asarray(b, dtype=np.int64))
            be.put({"t": (rows, _payload(rows, v))})
        q = np.asarray(probes + batches[-1][:50], dtype=np.int64)
        (fo, ff), (so, sf) = _both(be, "t", q)
        assert np.array_equal(ff, sf)
        assert np.array_equal(fo, so)
        assert ff.sum() > 0
        # and against a plain dict of the writes
        ref: dict[int, np.ndarray] = {}
        for v, b in enumerate(batches):
            rows = np.unique(np.asarray(b, dtype=np.int64))
            ref.update(zip(rows.tolist(), _payload(rows, v)))
        for i, r in enumerate(q.tolist()):
            assert ff[i] == (r in ref)
            if r in ref:
                assert np.array_equal(fo[i], ref[r])
    finally:
        be.close()


def test_deep_tree_and_empty_and_missing_table(tmp_path):
    be = LmdbBackend(tmp_path / "s")
    try:
        rows = np.arange(0, 400_000, 3, dtype=np.int64)  # a B-tree of depth >= 3
        be.put({"big": (rows, _payload(rows, 0))})
        be.open_tables(["empty"])
        q = np.arange(0, 400_010, 7, dtype=np.int64)
        (fo, ff), (so, sf) = _both(be, "big", q)
        assert np.array_equal(ff, (q % 3 == 0) & (q < 400_000)) and np.array_equal(fo, so)
        for table in ("empty", "nosuch"):
            (fo, ff), _ = _both(be, table, q[:10])
            assert not ff.any() and not fo.any()
    finally:
        be.close()


def test_other_value_size_falls_back_and_raises_like_py_lmdb(tmp_path):
    be = LmdbBackend(tmp_path / "s")
    try:
        rows = np.arange(100, dtype=np.int64)
        be.put({"t": (rows, _payload(rows, 0))})
        for pages in (be._pages, None):
            be._pages = pages
            with pytest.raises(StoreCorruptError):
                be.get("t", rows, W + 1)  # a record of another size is not this table's row
    finally:
        be.close()


def test_damaged_page_header_is_reported_not_misread(tmp_path):
    path = tmp_path / "s"
    be = LmdbBackend(path)
    rows = np.arange(0, 60_000, dtype=np.int64)
    be.put({"t": (rows, _payload(rows, 0))})
    be.put_meta({"note": {"what": "a store"}})
    be.sync()
    with be.env.begin() as txn:
        root = int.from_bytes(txn.get(b"t:t")[-8:], "little")
    psize = be.env.stat()["psize"]
    be.close()
    with open(path / DATA_NAME, "r+b") as f:  # the root's flags become a type we never write
        f.seek(root * psize + 10)
        f.write(bytes([0x08, 0x00]))
    be = LmdbBackend(path)
    try:
        with pytest.raises(StoreCorruptError):
            be.get("t", rows[:100], W)
    finally:
        be.close()


def test_kernel_reports_short_map_and_foreign_pages():
    mem = np.zeros(4096 * 2, dtype=np.uint8)
    keys = np.array([5], dtype=np.uint64)
    out = np.zeros((1, 8), dtype=np.uint8)
    found = np.zeros(1, dtype=bool)
    info = np.zeros(2, dtype=np.int64)
    assert find_values(mem, 4096, 7, keys, out, found, info) == 1  # page 7 lies past the mapping
    assert find_values(mem, 4096, 1, keys, out, found, info) == 3  # page 1 says it is page 0
    assert info.tolist() == [1, 1]  # (the page, "it carries another page number")
    assert not found.any()


def test_reads_during_writes_and_map_growth_see_committed_rows(tmp_path, monkeypatch):
    monkeypatch.setattr(lmdb_backend, "_INITIAL_MAP", 1 << 20)  # the writer must grow the map
    be = LmdbBackend(tmp_path / "s")
    rows = np.arange(20_000, dtype=np.int64)
    be.put({"t": (rows, _payload(rows, 0))})
    stop, errors, versions = threading.Event(), [], [0]

    def write():
        try:
            for v in range(1, 40):
                be.put({"t": (rows, _payload(rows, v))})
                versions.append(v)
                more = np.arange(20_000 + v * 5_000, 25_000 + v * 5_000, dtype=np.int64)
                be.put({"t": (more, _payload(more, v))})  # grows the file and the map
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)
        finally:
            stop.set()

    t = threading.Thread(target=write)
    t.start()
    reads = 0
    rng = np.random.default_rng(0)
    try:
        while not stop.is_set() or reads == 0:
            q = rng.choice(rows, 2_000)
            out, found = be.get("t", q, W)
            assert found.all()
            v = np.round((out[:, 0] - q * 16) / 1e6)
            assert np.array_equal(out, (q[:, None] * 16 + np.arange(W)[None, :]
                                        + v[:, None] * 1e6).astype(np.float32))
            assert set(v.tolist()) <= set(range(40))
            reads += 1
    finally:
        t.join()
        be.close()
    assert not errors and reads > 0


def test_compaction_replaces_the_file_and_reads_follow(tmp_path):
    be = LmdbBackend(tmp_path / "s")
    try:
        rows = np.arange(30_000, dtype=np.int64)
        for v in range(3):
            be.put({"t": (rows, _payload(rows, v))})
        be.put_meta({"note": {"what": "a store"}})
        before = be.get("t", rows[::7], W)
        be.compact()
        (fo, ff), (so, sf) = _both(be, "t", rows[::7])
        assert np.array_equal(fo, before[0]) and np.array_equal(fo, so) and ff.all()
        assert be._pages._mem is not None and be._pages._size == (tmp_path / "s" / "data.mdb").stat().st_size
    finally:
        be.close()


def test_trimmed_map_uses_py_lmdb(tmp_path, monkeypatch):
    be = LmdbBackend(tmp_path / "s")
    try:
        rows = np.arange(1000, dtype=np.int64)
        be.put({"t": (rows, _payload(rows, 0))})
        be.map_resident = 1 << 30
        calls = []
        real = be._pages.lookup
        monkeypatch.setattr(be._pages, "lookup", lambda *a: calls.append(1) or real(*a))
        out, found = be.get("t", rows, W)
        assert found.all() and not calls
    finally:
        be.close()


def test_lmdb_version_has_the_page_layout_we_read():
    assert lmdb.version()[:2] == (0, 9)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(1, 30_000), gaps=st.lists(st.integers(0, 30_000), max_size=400),
       probes=st.lists(st.integers(0, 31_000), min_size=1, max_size=300))
def test_dense_rows_with_gaps_read_like_py_lmdb(tmp_path_factory, n, gaps, probes):
    """Dense row ids (the first probe of a page's search lands on the key) and gaps in them
    (it lands beside it, then bisects): the page reader agrees with py-lmdb and the writes."""
    be = LmdbBackend(tmp_path_factory.mktemp("dense"))
    try:
        rows = np.setdiff1d(np.arange(n, dtype=np.int64), np.asarray(gaps, dtype=np.int64))
        if len(rows):
            be.put({"t": (rows, _payload(rows, 0))})
        q = np.concatenate([np.asarray(probes, dtype=np.int64), rows[::7]])
        (fo, ff), (so, sf) = _both(be, "t", q)
        assert np.array_equal(ff, sf) and np.array_equal(fo, so)
        assert np.array_equal(ff, np.isin(q, rows))
        assert np.array_equal(fo[ff], _payload(q[ff], 0))
    finally:
        be.close()


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1), repeats=st.integers(0, 200))
def test_keys_in_any_order_read_as_sorted(tmp_path_factory, seed, repeats):
    """The walk starts each key at the deepest page of the last key's path whose range holds it:
    keys out of order, or repeated, must read exactly as the same keys sorted."""
    from tierstore.backends.record import CHECK_BYTES

    be = LmdbBackend(tmp_path_factory.mktemp("order"))
    try:
        rows = np.arange(0, 60_000, 2, dtype=np.int64)  # a tree of three levels or more
        be.put({"t": (rows, _payload(rows, 0))})
        rng = np.random.default_rng(seed)
        keys = np.concatenate([np.arange(0, 61_000, 7), rng.integers(0, 61_000, repeats)])
        q = rng.permutation(keys).astype(np.uint64)
        size = W * 4 + CHECK_BYTES
        reader = PageReader(be.path / DATA_NAME, be.env.stat()["psize"])
        with be.env.begin() as txn:
            record = txn.get(b"t:t")
            got = reader.lookup(record, q, size)
            srt = np.argsort(q, kind="stable")
            want = reader.lookup(record, q[srt], size)
        assert got is not None and want is not None
        back = np.empty_like(srt)
        back[srt] = np.arange(len(srt))
        hit = got[1]
        assert np.array_equal(hit, want[1][back])
        assert np.array_equal(got[0][hit], want[0][back][hit])  # (a miss's row is not written)
        assert np.array_equal(got[1], (q % 2 == 0) & (q < 60_000))
    finally:
        be.close()
