"""Steps on a direct device cache (a sets cache with a line for every declared row): each id is
its row's slot, so the step neither deduplicates, looks up nor stages (`DirectSteps.forward`,
`Plan.keyed_step`). Where rows live must never change a bit: these steps are compared with a
store whose slab tier holds every row, and the keyed batch with the engine's own numbering."""

from __future__ import annotations

import contextlib
import os
import threading

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") in (None, "", "0") and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton's first import: kernels on CPU tensors

import hypothesis.strategies as st  # noqa: E402
from hypothesis import given, settings  # noqa: E402

import tierstore as ts  # noqa: E402
from tests.engine_cases import Case, cases, engine_step, keyed_engine_step  # noqa: E402
from tests.feature_batches import feature_batches  # noqa: E402
from tests.profiles import examples  # noqa: E402
from tests.syncs import SyncCounter  # noqa: E402
from tierstore.engine import interpreting  # noqa: E402
from tierstore.errors import ConfigError, InvalidGradientError  # noqa: E402
from tierstore.prefetch import Prefetcher  # noqa: E402

FEATS = {"x": "a", "y": "b", "z": "a"}  # two features share table a
SPECS = [ts.TableSpec("a", 300, 8, optimizer=ts.RowWiseAdagrad(0.1, weight_decay=0.01)),
         ts.TableSpec("b", 200, 4, optimizer=ts.Adam(0.01, weight_decay=0.01), clip=0.5)]
TOTAL = 500
interpreted = pytest.mark.skipif(not interpreting(), reason="triton was imported without its interpreter")


@pytest.mark.parametrize("kernels", ["numba", pytest.param("triton", marks=interpreted)])
@settings(max_examples=examples(0.5))
@given(case=cases(modes=("sum", "mean", "max")))
def test_a_keyed_batch_updates_the_same_bits_as_the_engines_own(kernels, case: Case):
    out, slab = engine_step(case, "numba")  # the engine's numbering by table, on numba
    k_out, k_slab = keyed_engine_step(case, kernels)
    assert torch.equal(out, k_out)
    assert torch.equal(slab.view(torch.int32), k_slab.view(torch.int32))


@interpreted
@settings(max_examples=examples())
@given(slots=st.lists(st.integers(0, 40), max_size=3000), tables=st.integers(1, 4))
def test_the_keyed_rows_kernels_equal_the_torch_ops(slots, tables):
    from tierstore.engine.plan import keyed_rows
    from tierstore.engine.triton_backend import keyed_rows as compiled

    keys = torch.tensor(slots, dtype=torch.int64)
    sk, perm = torch.sort(keys, stable=True)
    pos_table = keys % tables  # each position's table: a slot belongs to one table
    want, got = keyed_rows(sk, perm, pos_table), compiled(sk, perm, pos_table)
    for w, g in zip(want, got):
        assert torch.equal(w, g)
    inverse, rows, _, starts = got  # and what they mean: ids == rows[inverse], runs in order
    assert torch.equal(rows.index_select(0, inverse), keys)
    assert starts[-1] == keys.numel() and bool((starts[1:] >= starts[:-1]).all())


def test_a_keyed_step_refuses_16_bit_tables():
    plan = ts.engine.Plan([ts.TableSpec("h", 10, 4, dtype="float16")], [("f", "h", "sum")])
    with pytest.raises(ConfigError, match="float32"):
        plan.keyed_step(torch.tensor([1, 2]), [2], torch.tensor([2]))


def _batches(n):
    return feature_batches(n, FEATS, batch=5, seed=3, rows=190, max_len=5)


def _store(path, cache, kernels="auto", device="cpu"):
    return ts.TierStore(path, SPECS, device=device, kernels=kernels, device_cache=cache,
                        device_capacity=TOTAL, host_capacity=0, policy="lru")


def _preload(store, rows=None):
    """Bring rows [0, rows) of both tables (all by default) into the store's caches."""
    for t in ("a", "b"):
        store.read(t, torch.arange(store.tables[t].spec.num_rows if rows is None else rows))


def _same(want, got):
    """Every table's rows equal bit for bit."""
    for t in want:
        assert torch.equal(want[t].view(torch.int32), got[t].view(torch.int32)), t


def _rows(store):
    """Every row of both tables as stored now: weights, optimizer state and stamp."""
    return {t: store.cascade.access(store.tables[t], torch.arange(store.tables[t].spec.num_rows),
                                    None, promote=False).cpu() for t in ("a", "b")}


def _train(store, steps, mode, prefetch, preload=True, between=None, before=None):
    """Train `steps` batches; `between(store, i)` runs after step i's forward, before its
    backward, and `before(store, i, sparse)` before its forward (it may return other input).
    `prefetch`: False, True (a pipeline over the store), or "module" (over the collection:
    it makes a direct store's steps ahead)."""
    if preload:  # the rows batches use in the cache: a direct store takes every step directly
        _preload(store, None if preload is True else preload)
    ebc = ts.TieredEmbeddingBagCollection(store, FEATS, mode=mode)
    src = _batches(steps)
    over = ebc if prefetch == "module" else store
    with Prefetcher(over, src, depth=2, features=FEATS, extract=lambda b: b[0]) \
            if prefetch else contextlib.nullcontext(src) as pf:
        for i, (sparse, weight) in enumerate(pf):
            store.advance()
            if before is not None:
                sparse = before(store, i, sparse)
            out = ebc(*sparse)
            if between is not None:
                between(store, i)
            (out * weight.to(store.device)).sum().backward()
    return _rows(store)


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("prefetch", [True, "module", False], ids=["prefetched", "made-ahead", "plain"])
def test_direct_steps_equal_a_slab_store_bit_for_bit(tmp_path, mode, prefetch, device):
    with _store(tmp_path / "slab", "slab", device=device) as ref:
        want = _train(ref, 6, mode, prefetch)
        assert not ref.stats()["layout"]["device_direct"]
    with _store(tmp_path / "sets", "sets", device=device) as store:
        assert store.stats()["layout"]["device_direct"]
        got = _train(store, 6, mode, prefetch)
        assert store.prefetch_stats.lock_free_bags == 6 * 2  # every step the direct way
        # over the collection, the pipeline made every step ahead (the first two included)
        assert store.prefetch_stats.steps_made_ahead == (6 if prefetch == "module" else 0)
        store.check()
    _same(want, got)


@interpreted
def test_direct_steps_on_triton_equal_a_slab_store_on_numba(tmp_path):
    with _store(tmp_path / "slab", "slab") as ref:
        want = _train(ref, 5, "sum", True)
    with _store(tmp_path / "sets", "sets", kernels="triton") as store:
        got = _train(store, 5, "sum", True)
        assert store.prefetch_stats.lock_free_bags == 5 * 2
    _same(want, got)


def test_a_prefetched_step_trusts_the_pipelines_check_only_for_the_ids_it_checked(tmp_path, monkeypatch):
    from tierstore.backends.set_tier import SetTier

    calls = []
    keys = SetTier.direct_keys

    def counted(self, table, rows, ids, out, check=True):
        calls.append((threading.get_ident(), check))
        return keys(self, table, rows, ids, out, check)

    monkeypatch.setattr(SetTier, "direct_keys", counted)
    with _store(tmp_path / "slab", "slab") as ref:
        want = _train(ref, 6, "sum", True)
    with _store(tmp_path / "sets", "sets") as store:
        got = _train(store, 6, "sum", True)
    mine = [c for t, c in calls if t == threading.get_ident()]
    # table b has one feature: its ids are the pipeline's, checked there; table a has two,
    # each a part of what the pipeline checked: checked again
    assert mine.count(False) == 6 and mine.count(True) == 12
    _same(want, got)


def test_a_step_made_ahead_checks_its_ids_once(tmp_path, monkeypatch):
    from tierstore.backends.set_tier import SetTier

    calls = []
    keys = SetTier.direct_keys

    def counted(self, table, rows, ids, out, check=True):
        calls.append((threading.get_ident(), check))
        return keys(self, table, rows, ids, out, check)

    monkeypatch.setattr(SetTier, "direct_keys", counted)
    with _store(tmp_path / "slab", "slab") as ref:
        want = _train(ref, 6, "sum", "module")
    calls.clear()
    with _store(tmp_path / "sets", "sets") as store:
        got = _train(store, 6, "sum", "module")
        assert store.prefetch_stats.steps_made_ahead == 6
    mine = [c for t, c in calls if t == threading.get_ident()]
    staging = [c for t, c in calls if t != threading.get_ident()]
    # the pipeline checks each table's ids once (`holds`); the step made ahead from them and
    # the step itself check nothing again
    assert mine == [] and staging.count(True) == 6 * 2 and staging.count(False) == 6 * 3
    _same(want, got)


def _other_ids(store, i, sparse):
    """Input the pipeline did not stage: step 2's first id of feature y moved to a row of b
    that no batch uses (not held yet)."""
    if i != 2:
        return sparse
    keys, values, lengths = sparse
    values = values.clone()
    batch = lengths.numel() // 3
    at = int(lengths[:batch].sum())  # feature y's first position
    values[at] = 199 if int(lengths[batch:2 * batch].sum()) else values[at]
    return keys, values, lengths


def _expire_first(store, i, sparse):
    if i == 3:  # rows of b (one feature: trusted when nothing left) leave the cache between
        store.expire("b", older_than=1)  # the pipeline's check and the step
    return sparse


@pytest.mark.parametrize("over", [True, "module"], ids=["store", "collection"])
@pytest.mark.parametrize("before", [_other_ids, _expire_first], ids=["other-ids", "expired"])
def test_a_step_whose_rows_are_not_the_ones_checked_checks_again(tmp_path, before, over, device):
    with _store(tmp_path / "slab", "slab", device=device) as ref:
        want = _train(ref, 6, "sum", over, preload=190, before=before)
    with _store(tmp_path / "sets", "sets", device=device) as store:
        got = _train(store, 6, "sum", over, preload=190, before=before)
        if over == "module":  # the steps made ahead for other input (or before an expiry)
            assert store.prefetch_stats.steps_made_ahead == (5 if before is _other_ids else 3)
        # other ids: all steps but that one go direct; expired: the steps after the expiry
        # find rows of theirs gone and go the staged way
        assert store.prefetch_stats.lock_free_bags == (5 * 2 if before is _other_ids else 3 * 2)
        store.check()
    _same(want, got)


def test_rows_not_yet_held_are_staged_then_stepped_directly(tmp_path):
    # nothing preloaded: the first batches bring their rows in (lazily initialized) through
    # staging; a batch whose rows are all held by then goes the direct way
    with _store(tmp_path / "slab", "slab") as ref:
        want = _train(ref, 8, "sum", True, preload=False)
    with _store(tmp_path / "sets", "sets") as store:
        got = _train(store, 8, "sum", True, preload=False)
        assert store.prefetch_stats.lock_free_bags == 8 * 2
        store.check()
    _same(want, got)


def test_rows_expired_between_forward_and_backward_are_updated_where_they_are(tmp_path):
    def expire(store, i):
        if i == 3:  # rows not updated in the last step leave the cache (and LMDB)
            assert sum(store.expire(older_than=1).values()) >= 0
    with _store(tmp_path / "slab", "slab") as ref:
        want = _train(ref, 6, "sum", False, between=expire)
    with _store(tmp_path / "sets", "sets") as store:
        removals = store.device_tier.removals
        got = _train(store, 6, "sum", False, between=expire)
        assert store.device_tier.removals > removals  # the expiry took rows out of the cache
        store.check()
    _same(want, got)


def test_a_non_finite_gradient_without_a_pipeline_raises_at_once(tmp_path, device):
    with _store(tmp_path / "n", "sets", device=device) as store:
        _preload(store)
        ebc = ts.TieredEmbeddingBagCollection(store, FEATS)
        (sparse, weight), = list(_batches(1))
        before = _rows(store)
        weight[0, 0] = float("nan")
        with pytest.raises(InvalidGradientError, match="nothing was updated"):
            ebc(*sparse).mul(weight.to(store.device)).sum().backward()
        after = _rows(store)
        assert not store.paths.deferred_checks
    _same(before, after)  # weights, state and stamps as they were


def test_a_non_finite_prefetched_gradient_changes_nothing_and_is_raised_next(tmp_path, device):
    with _store(tmp_path / "p", "sets", device=device) as store:
        _preload(store)
        ebc = ts.TieredEmbeddingBagCollection(store, FEATS)
        with Prefetcher(store, _batches(3), depth=2, features=FEATS, extract=lambda b: b[0]) as pf:
            sparse, weight = next(pf)
            ebc(*sparse).mul(weight.to(store.device)).sum().backward()
            sparse, weight = next(pf)
            before = _rows(store)
            weight[0, 0] = float("inf")
            store.advance()  # a new clock: a stamp written by the refused update would show
            ebc(*sparse).mul(weight.to(store.device)).sum().backward()
            assert store.prefetch_stats.lock_free_bags == 2 * 2
            assert len(store.paths.deferred_checks) == 1  # left to the device, read next batch
            with pytest.raises(InvalidGradientError, match="discarded"):
                next(pf)
        after = _rows(store)
    _same(before, after)  # weights, state and stamps as they were


@interpreted
@pytest.mark.parametrize("ahead", [False, True], ids=["over-store", "made-ahead"])
def test_a_direct_prefetched_step_makes_no_syncing_call(tmp_path, ahead):
    counters = []
    with _store(tmp_path / "s", "sets", kernels="triton") as store:
        _preload(store)
        ebc = ts.TieredEmbeddingBagCollection(store, FEATS)
        with Prefetcher(ebc if ahead else store, _batches(6), depth=2, features=FEATS,
                        extract=lambda b: b[0]) as pf:
            for i, (sparse, weight) in enumerate(pf):
                with (SyncCounter() if i >= 2 else contextlib.nullcontext()) as c:
                    ebc(*sparse).mul(weight.to(store.device)).sum().backward()
                if c is not None:
                    counters.append(c)
        assert store.prefetch_stats.lock_free_bags == 6 * 2
        assert store.prefetch_stats.rows_staged == 0  # every batch held: nothing staged
        assert store.prefetch_stats.steps_made_ahead == (6 if ahead else 0)
    assert len(counters) == 4
    assert [c.calls for c in counters] == [[]] * 4
