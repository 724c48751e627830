"""The store behaves exactly like a plain dict of rows, whatever its capacities and policy."""

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
                kernels=st.booleans())
    def setup(self, opt_a, opt_b, dev_cap, host_cap, policy, seed, kernels):
        self.kernels = kernels  # False: the pure-torch index path the CUDA tier uses
        self.dir = tempfile.mkdtemp()
        self.specs = [ts.TableSpec("a", BIG, 3, optimizer=opt_a),
                      ts.TableSpec("b", BIG, 5, optimizer=opt_b, init=ts.NormalInit(0.5))]
        self.seed = seed
        self.model = DictStore(self.specs, seed, fused=kernels)
        self.store = self._open(dev_cap, host_cap, policy)

    def _open(self, dev_cap, host_cap, policy):
        store = ts.TierStore(self.dir, self.specs, device_capacity=dev_cap,
                             host_capacity=host_cap, policy=policy, seed=self.seed, device="cpu")
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

    @rule()
    def flush(self):
        self.store.flush()

    @rule(dev_cap=st.integers(0, 5), host_cap=st.integers(0, 8),
          policy=st.sampled_from(["lru", "lfu", "fifo", "clock", "sieve", "s3fifo"]))
    def reopen(self, dev_cap, host_cap, policy):
        self.store.close()
        self.store = self._open(dev_cap, host_cap, policy)

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
                    gath = s._access(s.tables[table], torch.tensor([row]), None)
                    pd = self.model.specs[table].payload_dim
                    assert torch.equal(gath[0, :pd], payload), (table, row)
            shutil.rmtree(self.dir, ignore_errors=True)


StoreVsDict.TestCase.settings = settings(max_examples=examples(0.6), stateful_step_count=25)
TestStoreVsDict = StoreVsDict.TestCase
