"""The store behaves exactly like a plain dict of rows, whatever its capacities and policy.

Also whatever its write-behind ring: a ring of 1-6 rows, with a writer slowed down at random,
so rows are read back while they wait in the ring, while they are being written, and after;
and whatever the merges: the log's oldest rows are folded into the tables at random moments.
"""

from __future__ import annotations

import shutil
import tempfile

import hypothesis.strategies as st
import torch
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import tierstore as ts
from tests.profiles import examples
from tests.reference import DictStore

OPTIMIZERS = [ts.SGD(0.1), ts.SGD(0.05, weight_decay=0.01), ts.Adagrad(0.1),
              ts.RowWiseAdagrad(0.2, eps=1e-6), ts.Adam(0.01), ts.Adam(0.02, weight_decay=0.1)]
BIG = 10**11
ROW_IDS = st.one_of(st.integers(0, 12), st.integers(BIG - 3, BIG - 1))
ID_LISTS = st.lists(ROW_IDS, min_size=0, max_size=10)


class StoreVsDict(RuleBasedStateMachine):
    """Random read/apply/flush/reopen sequences against the dict model."""

    @initialize(opt_a=st.sampled_from(OPTIMIZERS), opt_b=st.sampled_from(OPTIMIZERS),
                dev_cap=st.integers(0, 5), host_cap=st.integers(0, 8),
                policy=st.sampled_from(["lru", "lfu"]), seed=st.integers(0, 3),
                kernels=st.booleans(), ring=st.integers(1, 6),
                delay=st.sampled_from([0.0, 0.0005, 0.003]))
    def setup(self, opt_a, opt_b, dev_cap, host_cap, policy, seed, kernels, ring, delay):
        self.kernels = kernels  # False: the pure-torch index path the CUDA tier uses
        self.ring, self.delay = ring, delay
        self.clock = 0
        self.stamps: dict[tuple[str, int], int] = {}
        self.dir = tempfile.mkdtemp()
        self.specs = [ts.TableSpec("a", BIG, 3, optimizer=opt_a),
                      ts.TableSpec("b", BIG, 5, optimizer=opt_b, init=ts.NormalInit(0.5))]
        self.seed = seed
        self.model = DictStore(self.specs, seed, fused=kernels)
        self.store = self._open(dev_cap, host_cap, policy)

    def _open(self, dev_cap, host_cap, policy):
        store = ts.TierStore(self.dir, self.specs, device_capacity=dev_cap,
                             host_capacity=host_cap, policy=policy, seed=self.seed, device="cpu",
                             write_buffer=self.ring)
        if self.delay:
            store.writeback.delay = lambda: self.delay
        store.device_tier.index.use_kernels = store.host_tier.index.use_kernels = self.kernels
        store.fused = self.kernels
        return store

    @rule(table=st.sampled_from(["a", "b"]), ids=ID_LISTS)
    def read(self, table, ids):
        ids = torch.tensor(ids, dtype=torch.int64)
        got = self.store.read(table, ids)
        want = self.model.read(table, ids)
        assert torch.equal(got, want), (got, want)

    @rule(table=st.sampled_from(["a", "b"]), ids=ID_LISTS, data=st.data())
    def apply(self, table, ids, data):
        dim = self.model.specs[table].dim
        seed = data.draw(st.integers(0, 2**31 - 1))
        grads = torch.randn(len(ids), dim, generator=torch.Generator().manual_seed(seed))
        ids = torch.tensor(ids, dtype=torch.int64)
        self.store.apply(table, ids, grads)
        self.model.apply(table, ids, grads)
        for row in ids.tolist():
            self.stamps[(table, row)] = self.clock

    @rule(steps=st.integers(0, 3))
    def advance(self, steps):
        assert self.store.advance(steps) == self.clock + steps
        self.clock += steps

    @rule()
    def drain(self):
        self.store.writeback.drain()
        assert self.store.writeback.pending == 0

    @rule()
    def flush(self):
        self.store.flush()

    @rule(n=st.integers(1, 40))
    def merge(self, n):
        """Fold the log's oldest n rows (whole chunks) into the tables at any moment, beside the
        writer's appends and the background merger, as a merger thread would."""
        self.store.log.merge(n)

    @rule(dev_cap=st.integers(0, 5), host_cap=st.integers(0, 8),
          policy=st.sampled_from(["lru", "lfu", "fifo", "clock", "sieve", "s3fifo"]))
    def reopen(self, dev_cap, host_cap, policy):
        self.store.close()
        self.store = self._open(dev_cap, host_cap, policy)
        assert self.store.clock == self.clock  # saved at close

    @precondition(lambda self: hasattr(self, "store"))
    @invariant()
    def consistent(self):
        self.store.check()

    def teardown(self):
        if hasattr(self, "store"):
            # everything the model holds must also hold after a final reopen, full payloads too
            self.store.close()
            with self._open(2, 2, "lru") as s:
                for (table, row), payload in self.model.rows.items():
                    gath = s.cascade.access(s.tables[table], torch.tensor([row]), None)
                    spec = self.model.specs[table]
                    pd = spec.payload_dim
                    assert torch.equal(gath[0, :pd], payload), (table, row)
                    if (table, row) in self.stamps:  # the clock at the row's last update
                        stamp = gath[0, spec.stamp_col : spec.stamp_col + 1].view(torch.int32)
                        assert int(stamp) == self.stamps[(table, row)], (table, row)
            shutil.rmtree(self.dir, ignore_errors=True)


StoreVsDict.TestCase.settings = settings(max_examples=examples(0.6), stateful_step_count=25)
TestStoreVsDict = StoreVsDict.TestCase
