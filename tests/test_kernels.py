"""The CPU fast-path helpers: dedup, key-order restore, bag positions, huge-page allocation."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

import tierstore as ts
from tests.profiles import examples
from tierstore import _memory
from tierstore.fused import bag_positions
from tierstore.index import SLOT_MASK, HashIndex, dedup, sort_unique

IDS = st.lists(st.one_of(st.integers(0, 40), st.integers(0, 2**63 - 1)), max_size=300)


@settings(max_examples=examples())
@given(ids=IDS)
def test_dedup_is_a_unique_with_inverse(ids):
    t = torch.tensor(ids, dtype=torch.int64)
    uniq, inv = dedup(t)
    assert torch.equal(uniq[inv], t)
    assert uniq.numel() == len(set(ids))
    if ids:  # first-occurrence order on the CPU kernel path
        assert uniq.tolist() == list(dict.fromkeys(ids))
    su, sinv = sort_unique(uniq, inv)
    ref_u, ref_inv = torch.unique(t, sorted=True, return_inverse=True)
    assert torch.equal(su, ref_u) and torch.equal(sinv, ref_inv)


@settings(max_examples=examples())
@given(lengths=st.lists(st.integers(0, 6), max_size=40))
def test_bag_positions_match_repeat_interleave(lengths):
    ln = torch.tensor(lengths, dtype=torch.int64)
    offsets = torch.zeros(len(lengths), dtype=torch.int64)
    if lengths:
        offsets[1:] = torch.cumsum(ln, 0)[:-1]
    bag_of, got_len = bag_positions(offsets, int(ln.sum()))
    assert torch.equal(bag_of, torch.repeat_interleave(torch.arange(len(lengths)), ln))
    assert torch.equal(got_len, ln)


def test_index_capacity_limit_is_a_config_error():
    with pytest.raises(ts.ConfigError, match="at most"):
        HashIndex(SLOT_MASK + 1, device="meta")


def test_huge_page_tensors_hold_the_fill_value():
    big = _memory.full((3 << 20,), -1, torch.int64)  # 24 MiB: asks for huge pages
    assert big.shape == (3 << 20,) and bool((big == -1).all())
    small = _memory.full((4, 3), 0.5, torch.float32)
    assert bool((small == 0.5).all())
    assert _memory.advise_huge(small) is False  # too small to bother


def test_unsorted_resident_rows_survive_eviction_before_backward(tmp_path):
    """The forward's resident fast path keeps first-occurrence order; a stale backward re-sorts."""
    spec = ts.TableSpec("t", 100, 4, optimizer=ts.Adagrad(0.2))
    ids = torch.tensor([9, 7, 9, 3, 1, 7])  # first occurrence 9, 7, 3, 1: not sorted
    offsets = torch.tensor([0, 2, 4])
    results = []
    for evict in (False, True):
        with ts.TierStore(tmp_path / f"s{evict}", [spec], device_capacity=4, host_capacity=0,
                          device="cpu") as store:
            store.read("t", torch.tensor([1, 3, 7, 9]))  # make the batch device-resident
            bag = ts.TieredEmbeddingBag(store, "t")
            out = bag(ids, offsets)
            if evict:
                store.read("t", torch.arange(20, 28))  # push every forward row down to LMDB
                assert store.stats()["device"]["resident"] == 4
            (out * torch.arange(12.0).reshape(3, 4)).sum().backward()
            results.append(store.read("t", torch.arange(30)))
            store.check()
    assert torch.equal(results[0], results[1])


def test_threads_split_kernels_without_changing_a_bit(tmp_path, monkeypatch):
    """Pooling, updates and lookups split over threads give the single-thread bits.

    The split is forced (CPUS patched) and counted, so the test means the same on a 1-CPU runner.
    """
    from tierstore import _parallel

    monkeypatch.setattr(_parallel, "CPUS", 4)
    submitted = []
    real_executor = _parallel._executor

    class Counting:
        def submit(self, fn, *args):
            submitted.append(args)
            return real_executor().submit(fn, *args)

    monkeypatch.setattr(_parallel, "_executor", Counting)
    spec = ts.TableSpec("t", 200_000, 16, optimizer=ts.RowWiseAdagrad(0.1))
    gen = torch.Generator().manual_seed(11)
    ids = torch.randint(0, 200_000, (40_000,), generator=gen)
    offsets = torch.arange(0, 40_000, 8)
    grad = torch.randn(offsets.numel(), 16, generator=gen)
    results = []
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            with ts.TierStore(tmp_path / f"s{threads}", [spec], device_capacity=100_000,
                              host_capacity=0, device="cpu") as store:
                bag = ts.TieredEmbeddingBag(store, "t")
                outs = []
                for _ in range(3):  # the first step loads rows, later ones hit the fast path
                    out = bag(ids, offsets)
                    (out * grad).sum().backward()
                    outs.append(out.detach())
                results.append((torch.stack(outs), store.read("t", ids)))
            if threads == 1:
                assert not submitted  # one thread: nothing handed to the pool
        assert len(submitted) >= 3 * 2  # every step split its pool and update over 2 threads
    finally:
        torch.set_num_threads(before)
    assert torch.equal(results[0][0], results[1][0])
    assert torch.equal(results[0][1], results[1][1])


@settings(max_examples=examples())
@given(buffered=st.sets(st.integers(0, 60), max_size=30), asked=st.lists(st.integers(0, 60), max_size=40),
       data=st.data())
def test_sorted_gather_copies_every_buffered_row_asked_in_any_order(buffered, asked, data):
    import numpy as np

    from tierstore._kernels import sorted_gather

    brows = np.array(sorted(buffered), dtype=np.int64)
    bdata = np.arange(len(brows) * 3, dtype=np.float32).reshape(-1, 3)
    bfound = np.array([r % 3 != 0 for r in brows], dtype=bool)
    rows = np.array(asked, dtype=np.int64)
    if data.draw(st.booleans()):  # the usual case: rows asked in increasing order
        rows.sort()
    todo = np.array(sorted(data.draw(st.sets(st.integers(0, max(len(asked) - 1, 0)), max_size=len(asked))))
                    if asked else [], dtype=np.int64)
    out = np.full((len(rows), 3), -1.0, dtype=np.float32)
    found, known = np.zeros(len(rows), dtype=bool), np.zeros(len(rows), dtype=bool)
    left, nf = sorted_gather(brows, bdata, bfound, rows, todo, out, found, known)
    where = {int(r): i for i, r in enumerate(brows)}
    expect_left = [int(a) for a in todo if int(rows[a]) not in where]
    assert left.tolist() == expect_left
    assert nf == sum(bool(bfound[where[int(rows[a])]]) for a in todo if int(rows[a]) in where)
    for a in range(len(rows)):
        i = where.get(int(rows[a]))
        if a in set(todo.tolist()) and i is not None:
            assert known[a] and found[a] == bfound[i] and out[a].tolist() == bdata[i].tolist()
        else:
            assert not known[a] and out[a].tolist() == [-1.0] * 3
