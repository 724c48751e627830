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

