"""The write-behind log against a dict of newest rows, under any appends, merges and interleavings.

Rows go straight into `WriteLog.append` (as the writer thread does), merges fold any number of
the oldest rows, and a merge may have the "writer" append newer versions of rows while it runs
(after it looked its entries up, before it finished: the race that once corrupted the log's
index). Two tables of different row sizes share the log, chunks are a few rows each, and the log
is small enough to fill and merge inline. After every step the log's hash index is whole, and
every row reads as its newest version through the path the store uses: the log when the index
names a version, the table otherwise.

The store may also be killed and reopened at any point (the log replayed), or, after a merge of
the whole log, reopened with the log's file put back as a copy taken at any earlier point (what
an OS crash may leave of the log's unsynced file, or worse): the tables' merged-through record
must keep every stale entry out.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import hypothesis.strategies as st
import numpy as np
import torch
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import tierstore as ts
from tests.profiles import examples
from tierstore.backends import wal

SPECS = [ts.TableSpec("a", 10**6, 3), ts.TableSpec("b", 10**6, 5)]
KEYS = st.tuples(st.integers(0, 1), st.integers(0, 30))
KEY_LISTS = st.lists(KEYS, min_size=0, max_size=12, unique=True)


class LogVsDict(RuleBasedStateMachine):
    """Random appends, merges (some with appends meanwhile) and reads against the newest rows."""

    @initialize(chunk=st.integers(1, 6), capacity=st.integers(8, 40))
    def setup(self, chunk, capacity):
        self.dir = tempfile.mkdtemp()
        self.store = ts.TierStore(self.dir, SPECS, device="cpu", device_capacity=0,
                                  host_capacity=0, write_log=capacity)
        self.saved_chunk = wal.writelog.CHUNK_ROWS
        wal.writelog.CHUNK_ROWS = chunk
        self.store.log.stop_merger()  # merges happen when a rule (or a full log) says so
        self.log = self.store.log
        self.capacity = capacity
        self.model: dict[tuple[int, int], np.ndarray] = {}
        self.version = 0
        self.log_copies: list[bytes] = []  # the log's file at earlier points

    def _append(self, keys: list[tuple[int, int]]) -> None:
        if not keys:
            return
        tabs = np.array([t for t, _ in keys], dtype=np.int64)
        rows = np.array([r for _, r in keys], dtype=np.int64)
        self.version += 1
        pay = np.zeros((len(keys), self.store.width), dtype=np.float32)
        pay[:] = np.arange(len(keys), dtype=np.float32)[:, None] + 1000.0 * self.version
        with self.store.writeback.cv:
            self.log.append(tabs, rows, pay)
        for (t, r), p in zip(keys, pay):
            self.model[(t, r)] = p[: SPECS[t].row_dim].copy()

    @precondition(lambda self: hasattr(self, "store"))
    @rule(keys=KEY_LISTS)
    def append(self, keys):
        self._append(keys)

    @precondition(lambda self: hasattr(self, "store"))
    @rule(n=st.integers(1, 50), meanwhile=KEY_LISTS)
    def merge(self, n, meanwhile):
        """Merge the oldest `n` rows (whole chunks); the writer appends `meanwhile` during it.

        An append that would fill the log waits for the merge in the store (the writer thread
        blocks on the merge lock); here it runs right after the merge instead."""
        fold = wal.writelog.fold
        late = []

        def writer_meanwhile(backend, db, chunks, names, dims, ids, newest):
            def looked_up(tabs, rows, seqs):
                out = newest(tabs, rows, seqs)
                if self.log.size + len(meanwhile) <= self.log.capacity:
                    self._append(meanwhile)
                else:
                    late.append(meanwhile)
                return out
            return fold(backend, db, chunks, names, dims, ids, looked_up)

        wal.writelog.fold = writer_meanwhile
        try:
            self.log.merge(n)
        finally:
            wal.writelog.fold = fold
        for keys in late:
            self._append(keys)

    @precondition(lambda self: hasattr(self, "store"))
    @rule()
    def copy_log_file(self):
        """Keep the log's file as it is now (nothing writes it between rules)."""
        self.log_copies.append((Path(self.dir) / "wlog" / "data.mdb").read_bytes())

    @precondition(lambda self: hasattr(self, "store"))
    @rule(stale=st.booleans(), pick=st.integers(0, 10**6))
    def kill_and_reopen(self, stale, pick):
        """A kill (no flush): replay must bring back every logged row. `stale`: the whole log is
        merged first, then the log's file comes back as an earlier copy."""
        if stale:
            self.log.merge()
        self.store.writeback.close()  # the writer stops as a kill would leave it
        self.store.backend.sync()
        self.store.backend.close()
        self.store.closed = True
        log_dir = Path(self.dir) / "wlog"
        if stale and self.log_copies:
            shutil.rmtree(log_dir, ignore_errors=True)
            log_dir.mkdir()
            (log_dir / "data.mdb").write_bytes(self.log_copies[pick % len(self.log_copies)])
        self.store = ts.TierStore(self.dir, SPECS, device="cpu", device_capacity=0,
                                  host_capacity=0, write_log=self.capacity)
        self.store.log.stop_merger()
        self.log = self.store.log
        assert self.log.size == 0  # replayed: nothing of the old log is pending
        assert self.log.next > wal.merged_through(self.store.backend)

    @precondition(lambda self: hasattr(self, "store"))
    @invariant()
    def newest_everywhere(self):
        self.log.index.check()
        for t, spec in enumerate(SPECS):
            rows = np.array(sorted(r for (tt, r) in self.model if tt == t), dtype=np.int64)
            if not len(rows):
                continue
            seqs = self.log.lookup(t, torch.from_numpy(rows))
            inlog = seqs >= 0
            assert self.log.index.live >= int(inlog.sum())
            got = np.zeros((len(rows), spec.row_dim), dtype=np.float32)
            data, found = self.log.read(t, rows[inlog], seqs[inlog])
            assert found.all()  # no merge runs now: every indexed version is in the log
            got[inlog] = data
            data, found = self.store.backend.get(spec.name, rows[~inlog], spec.row_dim)
            assert found.all()  # a row not in the log was merged into its table
            got[~inlog] = data
            want = np.stack([self.model[(t, r)] for r in rows.tolist()])
            assert np.array_equal(got, want), t

    def teardown(self):
        if hasattr(self, "store"):
            try:
                self.log.merge()
                assert self.log.size == 0 and self.log.index.live == 0
                for t, spec in enumerate(SPECS):
                    rows = np.array(sorted(r for (tt, r) in self.model if tt == t), dtype=np.int64)
                    data, found = self.store.backend.get(spec.name, rows, spec.row_dim)
                    assert found.all()
                    if len(rows):
                        assert np.array_equal(data, np.stack([self.model[(t, r)] for r in rows.tolist()]))
                self.store.close()
            finally:
                wal.writelog.CHUNK_ROWS = self.saved_chunk
                shutil.rmtree(self.dir, ignore_errors=True)


LogVsDict.TestCase.settings = settings(max_examples=examples(0.5), stateful_step_count=30,
                                       deadline=None)
TestLogVsDict = LogVsDict.TestCase
