"""Contract tests run against every registered policy, plus policy-specific behaviour."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.profiles import examples
from tierstore.backends.slab import Rows, SlabTier
from tierstore.errors import ConfigError
from tierstore.policies import POLICIES, Policy, make_policy

NAMES = sorted(POLICIES) + ["lookahead:lfu", "lookahead:s3fifo"]


def _state(policy: Policy) -> dict:
    """Every tensor and scalar of a policy's state (recursing into a fallback policy)."""
    out = {}
    for key, val in vars(policy).items():
        if isinstance(val, torch.Tensor):
            out[key] = val.clone()
        elif isinstance(val, Policy):
            out.update({f"{key}.{k}": v for k, v in _state(val).items()})
        elif isinstance(val, (int, float, str)):
            out[key] = val
    return out


def _same(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    for k, val in a.items():
        if isinstance(val, torch.Tensor):
            if not torch.equal(val, b[k]):
                return False
        elif val != b[k]:
            return False
    return True


def _drive(policy: Policy, seed: int, steps: int = 30) -> list[torch.Tensor]:
    """Run a random workload of inserts, hits, hints and evictions; return the victims."""
    gen = torch.Generator().manual_seed(seed)
    cap = policy.capacity
    live = torch.zeros(cap, dtype=torch.bool)
    out = []
    for step in range(steps):
        free = torch.nonzero(~live).flatten()
        k = int(torch.randint(0, 4, (1,), generator=gen))
        new = free[torch.randperm(free.numel(), generator=gen)[:k]]
        if new.numel():
            policy.on_insert(new)
            live[new] = True
        occ = torch.nonzero(live).flatten()
        if occ.numel():
            hits = occ[torch.randint(0, occ.numel(), (3,), generator=gen)]
            policy.on_hit(hits)
            policy.on_future(hits, step + torch.randint(1, 20, (3,), generator=gen))
        if int(live.sum()) > cap // 2:
            ev = live & (torch.rand(cap, generator=gen) < 0.8)
            n = min(2, int(ev.sum()))
            v = policy.victims(n, ev)
            policy.on_evict(v)
            live[v] = False
            out.append(v)
        policy.check()
    return out


class PolicyContract:
    """The contract every policy meets; subclasses set `name`."""

    name = "lru"
    capacity = 16

    def make(self) -> Policy:
        return make_policy(self.name, self.capacity)

    def filled(self, seed: int = 0) -> Policy:
        p = self.make()
        p.on_insert(torch.arange(self.capacity))
        _drive(p, seed, steps=0)
        gen = torch.Generator().manual_seed(seed)
        hits = torch.randint(0, self.capacity, (40,), generator=gen)
        p.on_hit(hits)
        p.on_future(hits[:8], torch.arange(100, 108))
        return p

    def test_victims_distinct_evictable_count(self):
        for seed in range(5):
            p = self.filled(seed)
            gen = torch.Generator().manual_seed(seed)
            ev = torch.rand(self.capacity, generator=gen) < 0.6
            for n in range(int(ev.sum()) + 1):
                v = p.victims(n, ev)
                assert v.dtype == torch.int64 and v.numel() == n
                assert v.unique().numel() == n
                assert bool(ev[v].all())

    def test_victims_is_a_pure_peek(self):
        p = self.filled(1)
        before = _state(p)
        ev = torch.ones(self.capacity, dtype=torch.bool)
        first = p.victims(5, ev)
        assert _same(before, _state(p))
        assert torch.equal(first, p.victims(5, ev))

    def test_deterministic(self):
        a, b = self.make(), self.make()
        assert [v.tolist() for v in _drive(a, 7)] == [v.tolist() for v in _drive(b, 7)]

    def test_check_passes_on_random_workloads(self):
        for seed in range(3):
            _drive(self.make(), seed, steps=60)

    def test_evicted_slots_can_be_reused(self):
        p = self.filled(2)
        ev = torch.ones(self.capacity, dtype=torch.bool)
        v = p.victims(4, ev)
        p.on_evict(v)
        ev[v] = False
        assert not bool(torch.isin(p.victims(int(ev.sum()), ev), v).any())
        p.on_insert(v)
        p.check()

    def test_empty_calls_change_no_eviction_order(self):
        p = self.filled(3)
        ev = torch.ones(self.capacity, dtype=torch.bool)
        order = p.victims(self.capacity, ev)  # the whole eviction order
        empty = torch.empty(0, dtype=torch.int64)
        p.on_hit(empty)
        p.on_insert(empty)
        p.on_evict(empty)
        p.on_future(empty, empty)
        assert torch.equal(p.victims(self.capacity, ev), order)
        assert p.victims(0, ev).numel() == 0
        p.check()


for _name in NAMES:
    _cls = type(f"TestContract_{_name.replace(':', '_')}", (PolicyContract,), {"name": _name})
    globals()[_cls.__name__] = _cls


# a SlabTier with any policy behaves like a dict of its resident keys -------------------------
@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=examples(0.4))
@given(data=st.data())
def test_tier_behaves_like_a_dict(name, data):
    cap = data.draw(st.integers(1, 12))
    tier = SlabTier("t", cap, 1, name)
    model: dict[int, float] = {}
    nbatches = data.draw(st.integers(1, 12))
    for step in range(nbatches):
        keys = data.draw(st.lists(st.integers(0, 30), min_size=1, max_size=10, unique=True))
        rows = torch.tensor(keys, dtype=torch.int64)
        tabs = torch.zeros_like(rows)
        slots = tier.lookup(tabs, rows)
        hit = slots >= 0
        for k, s in zip(keys, slots.tolist()):
            assert (s >= 0) == (k in model)
            if s >= 0:
                assert float(tier.read(torch.tensor([s]))[0, 0]) == model[k]
        tier.touch(slots[hit])
        miss = rows[~hit]
        payload = (miss.float() * 10).unsqueeze(1)
        k_in, evicted = tier.insert(Rows(tabs[~hit], miss, payload,
                                         torch.zeros_like(miss, dtype=torch.bool)),
                                    protect=slots[hit])
        if evicted is not None:
            for r in evicted.rows.tolist():
                del model[r]
        for r in miss[:k_in].tolist():
            model[r] = float(r * 10)
        # next-use hints for the resident keys of this batch (lookahead and belady use them)
        res = tier.lookup(tabs, rows)
        res = res[res >= 0]
        nxt = data.draw(st.lists(st.integers(step + 1, step + 20), min_size=res.numel(),
                                 max_size=res.numel()))
        tier.policy.on_future(res, torch.tensor(nxt, dtype=torch.int64))
        tier.check()
        assert sorted(tier.resident()[1].tolist()) == sorted(model)
        assert tier.size == len(model) <= cap


# policy-specific behaviour ------------------------------------------------------------------
def _fill(name: str, cap: int) -> Policy:
    p = make_policy(name, cap)
    p.on_insert(torch.arange(cap))
    return p


def test_fifo_ignores_hits():
    p = _fill("fifo", 4)
    p.on_hit(torch.tensor([0, 0, 1]))
    assert p.victims(2, torch.ones(4, dtype=torch.bool)).tolist() == [0, 1]


def test_lru_order():
    p = _fill("lru", 4)
    p.on_hit(torch.tensor([0, 2]))
    assert p.victims(4, torch.ones(4, dtype=torch.bool)).tolist() == [1, 3, 0, 2]


def test_lfu_ties_by_recency():
    p = _fill("lfu", 4)
    p.on_hit(torch.tensor([3, 0, 0, 2]))
    assert p.victims(4, torch.ones(4, dtype=torch.bool)).tolist() == [1, 3, 2, 0]


def test_clock_second_chance():
    p = _fill("clock", 4)
    p.on_hit(torch.tensor([0, 1]))
    ev = torch.ones(4, dtype=torch.bool)
    assert p.victims(3, ev).tolist() == [2, 3, 0]
    p.on_evict(torch.tensor([2]))
    # the hand passed 0 and 1: cleared and re-queued behind 3
    assert not bool(p.ref[0]) and not bool(p.ref[1])
    p.on_evict(torch.tensor([3]))
    p.on_insert(torch.tensor([2]))
    ev[3] = False
    assert p.victims(3, ev).tolist() == [0, 1, 2]


def test_sieve_hand_does_not_move_slots():
    p = _fill("sieve", 4)
    p.on_hit(torch.tensor([0]))
    ev = torch.ones(4, dtype=torch.bool)
    assert p.victims(1, ev).tolist() == [1]
    p.on_evict(torch.tensor([1]))
    p.on_insert(torch.tensor([1]))  # newest; the hand sits at slot 2
    ev = torch.ones(4, dtype=torch.bool)
    assert p.victims(4, ev).tolist() == [2, 3, 1, 0]


def test_belady_evicts_farthest_and_dead_first():
    p = _fill("belady", 4)
    p.on_future(torch.tensor([0, 1, 2]), torch.tensor([5, 9, 7]))
    assert p.victims(4, torch.ones(4, dtype=torch.bool)).tolist() == [3, 1, 2, 0]
    p.on_hit(torch.tensor([1]))  # consumes the hint
    assert p.victims(1, torch.ones(4, dtype=torch.bool)).tolist() == [3]


def test_lookahead_uses_fallback_for_unknown():
    p = _fill("lookahead:lfu", 4)
    p.on_hit(torch.tensor([0, 0, 1]))
    p.on_future(torch.tensor([2]), torch.tensor([3]))
    assert p.victims(4, torch.ones(4, dtype=torch.bool)).tolist() == [3, 1, 0, 2]


def test_unknown_policy_is_a_config_error():
    with pytest.raises(ConfigError, match=r"^unknown policy 'nope'; known: \[.*'lru'"):
        make_policy("nope", 4)
    with pytest.raises(ConfigError):
        make_policy("lru:lfu", 4)
    with pytest.raises(ConfigError):
        make_policy("lookahead:nope", 4)
    with pytest.raises(ConfigError):
        make_policy(3, 4)  # type: ignore[arg-type]


def test_lfu_long_run_fallback_orders_like_the_packed_key():
    """Past 2**40 clock ticks LFU sorts (count, recency) without packing: the same order."""
    p = make_policy("lfu", 32)
    _drive(p, 4, steps=40)
    live = p.count > 0
    for n in (1, 5, int(live.sum())):
        fast = p.victims(n, live)
        p.clock, saved = 1 << 40, p.clock
        slow = p.victims(n, live)
        p.clock = saved
        assert torch.equal(fast, slow), n
