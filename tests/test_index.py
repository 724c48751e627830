"""The hash index behaves like a dict, on the numba path and on the pure-torch (CUDA) path."""

from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
import torch
from hypothesis import given, settings

from tests.profiles import examples
from tierstore.index import HashIndex, sorted_dedup

KEYS = st.tuples(st.integers(0, 3), st.one_of(st.integers(0, 50), st.integers(0, 2**63 - 1)))
OPS = st.lists(st.tuples(st.booleans(), st.lists(KEYS, max_size=12)), max_size=30)


@settings(max_examples=examples())
@given(ops=OPS, capacity=st.integers(1, 40), kernels=st.sampled_from(["numba", "torch", "mixed"]))
def test_index_matches_dict(ops, capacity, kernels):
    """Both paths, and both interleaved (backward-shift deletion meeting torch tombstones)."""
    idx = HashIndex(capacity)
    ref: dict[tuple[int, int], int] = {}
    free = list(range(capacity))
    for step, (insert, keys) in enumerate(ops):
        idx.use_kernels = kernels == "numba" or (kernels == "mixed" and step % 2 == 0)
        if insert:
            new = list(dict.fromkeys(k for k in keys if k not in ref))[: len(free)]
            slots = [free.pop() for _ in new]
            if new:
                idx.add(torch.tensor([k[0] for k in new]), torch.tensor([k[1] for k in new]),
                        torch.tensor(slots))
            ref.update(zip(new, slots))
        else:
            gone = list(dict.fromkeys(k for k in keys if k in ref))
            slots = [ref.pop(k) for k in gone]
            idx.remove(torch.tensor(slots, dtype=torch.int64))
            free.extend(slots)
        idx.check()
        probe = list(ref) + keys
        if probe:
            got = idx.find(torch.tensor([k[0] for k in probe]), torch.tensor([k[1] for k in probe]))
            assert got.tolist() == [ref.get(k, -1) for k in probe]
            if idx.use_kernels:  # staging's one-pass probe: the same slots, misses and hits
                tabs_np = np.array([k[0] for k in probe], dtype=np.int64)
                slots, miss, hits = idx.probe(tabs_np, np.array([k[1] for k in probe], dtype=np.int64))
                assert slots.tolist() == got.tolist()
                assert miss.tolist() == [i for i, s in enumerate(slots) if s < 0]
                assert hits.tolist() == [s for s in slots if s >= 0]


def test_torch_and_numba_paths_agree_on_a_big_batch():
    gen = torch.Generator().manual_seed(0)
    rows = torch.unique(torch.randint(0, 10**12, (20_000,), generator=gen))
    slots = torch.randperm(rows.numel(), generator=gen)
    found = []
    for kernels in (True, False):
        idx = HashIndex(rows.numel())
        idx.use_kernels = kernels
        idx.add(torch.tensor(1), rows, slots)
        idx.remove(slots[:5000])
        q = torch.cat([rows, rows + 1])
        found.append(idx.find(torch.tensor(1), q))
        idx.check()
    assert torch.equal(found[0], found[1])
    assert int((found[0] >= 0).sum()) == rows.numel() - 5000


def test_numba_deletion_leaves_no_tombstones_at_full_load():
    """Churn at full capacity: backward shift keeps the table free of tombstones and rebuilds."""
    cap = 3000
    idx = HashIndex(cap)
    gen = torch.Generator().manual_seed(3)
    keys = torch.randperm(10**6, generator=gen)[: 4 * cap]
    idx.add(torch.tensor(0), keys[:cap].contiguous(), torch.arange(cap))
    live = keys[:cap].clone()
    for r in range(1, 4):
        out = torch.randperm(cap, generator=gen)[: cap // 2]
        idx.remove(out)
        new = keys[r * cap : r * cap + out.numel()].contiguous()
        idx.add(torch.tensor(0), new, out)
        live[out] = new
    assert idx.tombs == 0 and idx.live == cap
    idx.check()
    assert torch.equal(idx.find(torch.tensor(0), live), torch.arange(cap))


def test_strided_keys_and_slots_on_the_kernel_path():
    """Views (every other element) are valid input for add, find and remove."""
    idx = HashIndex(200)
    keys = torch.arange(200, dtype=torch.int64) * 7919
    slots = torch.arange(200, dtype=torch.int64)
    idx.add(torch.tensor(2), keys[::2], slots[::2])  # non-contiguous views
    assert torch.equal(idx.find(torch.tensor(2), keys[::4]), slots[::4])
    idx.remove(slots[::4])
    idx.check()
    found = idx.find(torch.tensor(2), keys[::2])
    assert torch.equal(found[::2], torch.full((50,), -1)) and torch.equal(found[1::2], slots[2::4])


def test_full_power_of_two_index_finds_slot_zero_and_misses_on_both_paths():
    """A full index whose capacity is a power of two still has empty buckets to end a probe, and
    the entry (table 0, slot 0) is found (an entry word of 0 is a valid key, not a hole)."""
    for use_kernels in (True, False):
        idx = HashIndex(16)
        idx.use_kernels = use_kernels
        rows = torch.arange(100, 116)
        idx.add(torch.zeros(16, dtype=torch.int64), rows, torch.arange(16))
        assert idx.find(torch.zeros(16, dtype=torch.int64), rows).tolist() == list(range(16))
        absent = idx.find(torch.tensor([0, 1, 0]), torch.tensor([5, 100, 2**62]))
        assert absent.tolist() == [-1, -1, -1]
        idx.remove(torch.tensor([0, 7]))
        back = idx.find(torch.zeros(3, dtype=torch.int64), torch.tensor([100, 107, 108]))
        assert back.tolist() == [-1, -1, 8]
        idx.check()


RING_OPS = st.lists(st.tuples(st.lists(KEYS, max_size=12), st.integers(0, 39)), max_size=30)


@settings(max_examples=examples())
@given(ops=RING_OPS, capacity=st.integers(1, 40), kernels=st.sampled_from(["numba", "torch", "mixed"]))
def test_assign_matches_a_dict_of_newest_slots(ops, capacity, kernels):
    """`assign` (the write-behind ring's put): a reused slot forgets its key, a present key
    moves to its new slot; both paths, interleaved with torch tombstones and removals."""
    idx = HashIndex(capacity)
    ref: dict[tuple[int, int], int] = {}
    tail = 0
    for step, (keys, drop) in enumerate(ops):
        idx.use_kernels = kernels == "numba" or (kernels == "mixed" and step % 2 == 0)
        new = list(dict.fromkeys(keys))[:capacity]
        slots = [(tail + i) % capacity for i in range(len(new))]
        tail += len(new)
        want_moved = []
        for k, s in zip(new, slots):
            ref = {key: v for key, v in ref.items() if v != s}  # the reused slot's key first
            want_moved.append(ref.pop(k, -1))  # then the key leaves its older slot, if any
            ref[k] = s
        moved = np.full(len(new), -7, dtype=np.int64)
        idx.assign(torch.tensor([k[0] for k in new], dtype=torch.int64),
                   torch.tensor([k[1] for k in new], dtype=torch.int64),
                   torch.tensor(slots, dtype=torch.int64), moved=moved)
        assert moved.tolist() == want_moved
        if drop < len(ref) and step % 3 == 2:  # a removal now and then leaves torch tombstones
            key = list(ref)[drop]
            idx.remove(torch.tensor([ref.pop(key)]))
        idx.check()
        assert idx.held(torch.arange(capacity)).tolist() == [s in ref.values() for s in range(capacity)]
        probe = list(ref) + keys
        if probe:
            got = idx.find(torch.tensor([k[0] for k in probe]), torch.tensor([k[1] for k in probe]))
            assert got.tolist() == [ref.get(k, -1) for k in probe]


@settings(max_examples=examples(200), deadline=None)
@given(ids=st.lists(st.one_of(st.integers(0, 40), st.integers(-2**62, 2**62)), max_size=300))
def test_sorted_dedup_is_torch_unique_with_inverse(ids):
    t = torch.tensor(ids, dtype=torch.int64)
    uniq, inverse = sorted_dedup(t)
    want_u, want_i = torch.unique(t, sorted=True, return_inverse=True)
    assert torch.equal(uniq, want_u) and torch.equal(inverse, want_i)
