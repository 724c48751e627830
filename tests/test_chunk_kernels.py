"""The compiled loops of the chunk formats (backends/chunk_kernels.py) against their numpy paths."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tierstore as ts
from tierstore.backends import record
from tierstore.backends.wal import writelog

pytestmark = pytest.mark.skipif(not record.HAVE_NUMBA, reason="the compiled loops need numba")


def _log_values(store: ts.TierStore) -> list[tuple[bytes, bytes]]:
    """Every (key, value) of the store's log database, as bytes."""
    with store.backend.log_env().begin(db=store.log.db) as txn:
        return list(txn.cursor().iternext())


@settings(max_examples=12, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 2**40)), min_size=1, max_size=40,
                unique=True), st.integers(1, 9), st.integers(0, 2**31))
def test_packed_log_chunks_are_the_numpy_paths_bytes(tmp_path_factory, keys, chunk, seed):
    """One pass in numba (entries, words, checks) writes the log's format byte for byte."""
    specs = [ts.TableSpec(n, 2**41, 7) for n in ("a", "b", "c")]
    tabs = np.array([t for t, _ in keys], dtype=np.int64)
    rows = np.array([r for _, r in keys], dtype=np.int64)
    saved = writelog.CHUNK_ROWS, writelog.HAVE_NUMBA
    got = []
    try:
        writelog.CHUNK_ROWS = chunk
        for compiled in (True, False):
            writelog.HAVE_NUMBA = compiled
            path = tmp_path_factory.mktemp("log")
            store = ts.TierStore(path, specs, device_capacity=0, host_capacity=0, write_log=64)
            store.log.stop_merger()
            pay = np.random.default_rng(seed).standard_normal((len(rows), store.width),
                                                              dtype=np.float32)
            with store.writeback.cv:
                store.log.append(tabs, rows, pay)
            got.append(_log_values(store))
            w = store.tables["a"].spec.row_dim
            for t in range(3):  # reads through the log see the rows appended
                sel = np.flatnonzero(tabs == t)
                seqs = store.log.lookup(t, torch.from_numpy(rows[sel]))
                vals, found = store.log.read_entries(tabs[sel], rows[sel], seqs, w)
                assert found.all() and np.array_equal(vals, pay[sel, :w])
            store.close()
    finally:
        writelog.CHUNK_ROWS, writelog.HAVE_NUMBA = saved
    assert got[0] == got[1]
    assert len(got[0]) == -(-len(rows) // chunk)



@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("damage", ["magic", "count", "length"])
def test_log_reads_refuse_a_damaged_chunk_header(tmp_path, compiled, damage):
    """A log read through a chunk whose header does not match its entries is a StoreCorruptError,
    in the compiled pick as in the numpy path; the intact chunks still read."""
    spec = ts.TableSpec("a", 1000, 5)
    saved = writelog.CHUNK_ROWS, writelog.HAVE_NUMBA
    try:
        writelog.CHUNK_ROWS, writelog.HAVE_NUMBA = 4, compiled
        store = ts.TierStore(tmp_path / "s", [spec], device_capacity=0, host_capacity=0, write_log=64)
        store.log.stop_merger()
        rows = np.arange(10, 18, dtype=np.int64)
        pay = np.random.default_rng(0).standard_normal((8, store.width), dtype=np.float32)
        with store.writeback.cv:
            store.log.append(np.zeros(8, dtype=np.int64), rows, pay)
        (k0, v0), (k1, _) = _log_values(store)
        bad = bytearray(v0)
        if damage == "magic":
            bad[0] ^= 0xFF
        elif damage == "count":
            bad[8] += 1
        else:
            bad = bad[:-1]
        with store.backend.log_env().begin(write=True, db=store.log.db) as txn:
            txn.put(k0, bytes(bad))
        w = spec.row_dim
        seqs = store.log.lookup(0, torch.from_numpy(rows))
        with pytest.raises(ts.StoreCorruptError):
            store.log.read_entries(np.zeros(8, dtype=np.int64), rows, seqs, w)
        vals, found = store.log.read_entries(np.zeros(4, dtype=np.int64), rows[4:], seqs[4:], w)
        assert found.all() and np.array_equal(vals, pay[4:, :w])  # the intact second chunk
        with store.backend.log_env().begin(write=True, db=store.log.db) as txn:
            txn.put(k0, v0)  # mended: the close merges the log
        store.close()
    finally:
        writelog.CHUNK_ROWS, writelog.HAVE_NUMBA = saved
