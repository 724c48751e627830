"""The prefetch pipeline: bit-identical results at any depth, clean shutdown, stats."""

from __future__ import annotations

import dataclasses
import random
import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tierstore as ts
from tests.profiles import examples
from tierstore.prefetch import Prefetcher

FEATS = {"f1": "a", "f2": "a", "f3": "b"}


def _specs(policy_opt=None):
    return [ts.TableSpec("a", 10**11, 3, optimizer=policy_opt or ts.Adagrad(0.2)),
            ts.TableSpec("b", 40, 5, optimizer=ts.RowWiseAdagrad(0.3))]


def _batches(n_steps, seed=3, batch=4):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n_steps):
        lengths = torch.randint(0, 5, (3 * batch,), generator=gen)
        vals = []
        for i, t in enumerate(FEATS.values()):
            n = int(lengths[i * batch : (i + 1) * batch].sum())
            vals.append(torch.randint(0, 40, (n,), generator=gen) * (1 if t == "b" else 7919))
        yield {"sparse": (list(FEATS), torch.cat(vals), lengths), "target": torch.randn(batch, 1,
                                                                                       generator=gen)}


def _train(path, depth, caps=(2, 3), policy="lru", steps=30, delay=None, side=None, **store_kw):
    store = ts.TierStore(path, _specs(), device_capacity=caps[0], host_capacity=caps[1],
                         policy=policy, device="cpu", **store_kw)
    ebc = ts.TieredEmbeddingBagCollection(store, FEATS)
    torch.manual_seed(0)
    dense = torch.nn.Linear(11, 1)
    dopt = torch.optim.SGD(dense.parameters(), lr=0.05)
    with Prefetcher(store, _batches(steps), depth=depth, features=FEATS,
                    extract=lambda b: b["sparse"], delay=delay) as pf:
        for i, b in enumerate(pf):
            if side is not None:
                side(store, i)
            out = ebc(*b["sparse"])
            loss = (dense(out) - b["target"]).pow(2).mean()
            dopt.zero_grad()
            loss.backward()
            dopt.step()
    store.check()
    stats = store.stats()
    result = {"a": store.cascade.access(store.tables["a"], torch.arange(40) * 7919, None).clone(),
              "b": store.cascade.access(store.tables["b"], torch.arange(40), None).clone(),
              "dense": dense.weight.detach().clone()}
    store.close()
    return result, stats


def _assert_stored(path, base, caps=(2, 2), **store_kw):
    """The closed store at `path`, reopened, reads the reference run's rows of both tables."""
    with ts.TierStore(path, _specs(), device_capacity=caps[0], host_capacity=caps[1],
                      device="cpu", **store_kw) as again:
        assert torch.equal(again.read("b", torch.arange(40)), base["b"][:, :5])
        assert torch.equal(again.read("a", torch.arange(40) * 7919), base["a"][:, :3])


def _delays(seed):
    rng = random.Random(seed)
    return lambda: rng.random() * 0.004


def test_a_staged_use_is_reported_once_and_consumes_its_look_ahead_hint(tmp_path):
    # staging reports each access of a staged row (on_hit / on_insert); the step's own use is
    # reported as on_use, which drops the look-ahead hint of that use but counts nothing again
    store = ts.TierStore(tmp_path / "s", _specs(), device_capacity=4000, host_capacity=4000,
                         policy="lookahead", device="cpu")
    ebc = ts.TieredEmbeddingBagCollection(store, FEATS)
    dev = store.device_tier
    hits = []
    real_on_hit = dev.policy.on_hit

    def on_hit(slots):
        hits.append(int(slots.numel()))
        real_on_hit(slots)

    dev.policy.on_hit = on_hit
    steps = 12
    with Prefetcher(store, _batches(steps), depth=2, features=FEATS,
                    extract=lambda b: b["sparse"]) as pf:
        for b in pf:
            ebc(*b["sparse"]).sum().backward()
    with store.exclusive():  # drains the last lock-free gathers
        pass
    st = store.prefetch_stats
    assert st.lock_free_bags == 2 * steps and st.warm_only == 0  # every step staged, lock-free
    # every hint was for a step that has run: all were consumed by the steps' uses
    assert not dev.policy.hinted.any(), dev.policy.next_use[dev.policy.hinted]
    # the policy heard of each staged row's use once: staging's device hits, not again at use
    assert sum(hits) == st.rows_resident_at_use - st.staged_from_host > 0
    store.close()


def test_bit_identical_at_every_depth_with_random_delays(tmp_path):
    base, _ = _train(tmp_path / "base", 0, caps=(10**5, 10**5))
    staged = lock_free = 0
    for depth in (0, 1, 2, 8):
        # tiny caches (windows do not fit: warm-up only) and caches that hold a short window
        for caps, policy in (((2, 3), "lru"), ((40, 60), "lookahead"), ((30, 50), "lru"),
                             ((3, 4), "hlfu")):
            got, stats = _train(tmp_path / f"d{depth}{policy}{caps[0]}", depth, caps=caps,
                                policy=policy, delay=_delays(depth))
            for k in base:
                assert torch.equal(got[k], base[k]), (depth, caps, policy, k)
            assert stats["prefetch"]["batches"] == 30
            staged += stats["prefetch"]["rows_staged"]
            lock_free += stats["prefetch"]["lock_free_bags"]
    assert staged > 0  # the staging path itself ran, not only the warm-up
    assert lock_free > 0  # and steps ran on pinned slots without the store lock


@pytest.mark.parametrize("policy,slow", [("lru", False), ("hlfu", False), ("hlfu", True)])
def test_a_warm_only_forward_moves_no_row_and_its_backward_moves_each_once(tmp_path, monkeypatch,
                                                                           policy, slow):
    # caches far smaller than a batch: every step is warm-only. Its forward reads missed rows
    # where they are (no insertion, no eviction); its backward brings them up after the update
    # (hlfu: only the rows its admission test lets in; the rest go to the write-behind ring).
    # `slow`: a tiny ring drained by a slowed writer into a small log that merges meanwhile
    from tierstore.backends import wal

    base, _ = _train(tmp_path / "base", 0, caps=(10**5, 10**5))
    store_kw = {}
    if slow:
        monkeypatch.setattr(wal.writelog, "CHUNK_ROWS", 4)
        store_kw = {"write_buffer": 6, "write_log": 24}
    phase, inserts = ["idle"], {"forward": 0, "backward": 0, "idle": 0}
    side_store, refused = [], []

    def side(store, i):
        if not side_store:
            side_store.append(store)
            if slow:
                store.writeback.delay = lambda: 0.002
            real = store.device_tier.insert

            def insert(rows, *a, **k):
                inserts[phase[0]] += len(rows)
                return real(rows, *a, **k)

            store.device_tier.insert = insert
            real_admit = store.device_tier.policy.admit

            def admit(keys):
                out = real_admit(keys)
                if out is not None:
                    refused.append(int((~out).sum()))
                return out

            store.device_tier.policy.admit = admit
            ebc_forward = ts.TieredEmbeddingBagCollection.forward

            def forward(self, *a, **k):
                phase[0] = "forward"
                try:
                    return ebc_forward(self, *a, **k)
                finally:
                    phase[0] = "backward"

            monkey.setattr(ts.TieredEmbeddingBagCollection, "forward", forward)

    with pytest.MonkeyPatch.context() as monkey:
        got, stats = _train(tmp_path / "t", 2, caps=(3, 4), policy=policy, side=side, **store_kw)
    for k in base:
        assert torch.equal(got[k], base[k]), k
    assert stats["prefetch"]["warm_only"] == 30
    assert inserts["forward"] == 0 and inserts["backward"] > 0, inserts
    # lru admits every row; hlfu refused some (their updates reached the store all the same)
    assert (sum(refused) > 0) == (policy == "hlfu"), refused
    if slow:  # the log merged while refused rows kept arriving
        assert stats["writeback"]["log_merged"] > 0, stats["writeback"]
    # and they are on disk: the closed store, reopened, reads the reference's rows
    _assert_stored(tmp_path / "t", base, caps=(3, 4), **store_kw)


@pytest.mark.parametrize("caps,depth", [((64, 0), 1), ((64, 0), 2), ((80, 0), 8), ((48, 64), 2)])
def test_staged_rows_hlfu_refuses_go_to_the_scratch_pad_and_stay_exact(tmp_path, caps, depth):
    # a staged batch's rows from below that hlfu does not admit are staged in the device tier's
    # scratch pad (pinned, unranked, evicting nothing) and leave at their last unpin; the pad is
    # used where the device tier is the only cache tier
    base, _ = _train(tmp_path / "base", 0, caps=(10**5, 10**5))
    padded = []

    def side(store, i):
        if i % 7 == 3:  # the tier's invariants hold with rows in the pad
            store.check()
        if i == 0:
            real = store.device_tier.insert_scratch

            def insert_scratch(rows):
                k = real(rows)
                padded.append(k)
                return k

            store.device_tier.insert_scratch = insert_scratch

    got, stats = _train(tmp_path / "t", depth, caps=caps, policy="hlfu", side=side,
                        delay=_delays(depth))
    for k in base:
        assert torch.equal(got[k], base[k]), k
    assert stats["prefetch"]["warm_only"] < 30, stats["prefetch"]
    assert (sum(padded) > 0) == (caps[1] == 0), padded  # no pad above a host tier
    assert stats["device"]["scratch_rows"] == sum(padded)
    # the closed store holds the reference's rows: pad rows reached the disk
    _assert_stored(tmp_path / "t", base)


@pytest.mark.parametrize("staging", [0, 400])
def test_a_pipeline_closed_mid_run_empties_the_scratch_pad(tmp_path, staging):
    # the pad carved from a 64-row tier, or 400 staging slots past an 8-row one
    cap = 8 if staging else 64
    store = ts.TierStore(tmp_path / "s", _specs(), device_capacity=cap, host_capacity=0,
                         policy="hlfu", device="cpu", staging_capacity=staging)
    ebc = ts.TieredEmbeddingBagCollection(store, FEATS)
    dev = store.device_tier
    pf = Prefetcher(store, _batches(30), depth=2, features=FEATS, extract=lambda b: b["sparse"])
    held = 0
    for i, b in enumerate(pf):
        ebc(*b["sparse"]).sum().backward()
        held = max(held, int(dev.transient[dev.capacity if staging else 0:].sum()))
        if i == 12:
            break
    assert held > 0  # rows were in the pad (the staging slots) while batches were staged
    pf.close()  # unpins the window: every pad row leaves, dirty ones for the ring
    assert not dev.transient.any() and len(dev._scratch) == dev.scratch_slots > 0
    if staging:
        assert dev.scratch_slots == staging and dev.size <= dev.capacity
    store.check()
    before = store.read("a", torch.arange(40) * 7919)
    store.close()
    with ts.TierStore(tmp_path / "s", _specs(), device_capacity=2, host_capacity=2,
                      device="cpu") as again:
        assert torch.equal(again.read("a", torch.arange(40) * 7919), before)


def _record_policy_slots(store, seen):
    """Wrap the device policy's slot hooks: every slot it is told of goes into `seen`."""
    pol = store.device_tier.policy
    for name in ("on_hit", "on_use", "on_insert", "on_remove", "on_evict"):
        real = getattr(pol, name)

        def hook(slots, *rest, _real=real, **kw):
            seen.append(torch.as_tensor(slots).reshape(-1).clone())
            return _real(slots, *rest, **kw)

        setattr(pol, name, hook)


@pytest.mark.parametrize("depth,staging,delayed", [(1, 400, True), (2, 400, True), (8, 400, True),
                                                   (6, 30, True), (6, 30, False), (8, 30, False)])
def test_staging_slots_keep_a_window_the_cache_cannot_hold_pinned_and_exact(tmp_path, depth,
                                                                           staging, delayed):
    # with staging_capacity, rows hlfu refuses wait in slots past the cache's capacity: a window
    # far larger than the 8-row cache is staged and trained lock-free instead of warm-only, the
    # bits equal an all-resident run's, and the policy never hears of a staging slot. With only
    # 30 staging slots, batches alternate between staged and warm-only and some staged rows find
    # the cache and the slots full (they go to the ring unpinned, and their batch's release
    # must not unpin a later batch's copy of them: it did, and a row left mid-step)
    base, _ = _train(tmp_path / "base", 0, caps=(10**5, 10**5))
    _, plain = _train(tmp_path / "plain", depth, caps=(8, 0), policy="hlfu")
    assert plain["prefetch"]["warm_only"] > 0  # the reference point: no staging slots
    assert 2 * plain["prefetch"]["window_rows"] > 8  # its largest window: more than fits
    seen = []
    state = {}

    def side(store, i):
        if i == 0:
            _record_policy_slots(store, seen)
        if i % 5 == 2:
            store.check()
        state["held"] = max(state.get("held", 0), int(store.device_tier.transient.sum()))

    got, stats = _train(tmp_path / "t", depth, caps=(8, 0), policy="hlfu", side=side,
                        delay=_delays(depth) if delayed else None, staging_capacity=staging)
    for k in base:
        assert torch.equal(got[k], base[k]), k
    assert stats["prefetch"]["lock_free_bags"] > 0, stats["prefetch"]
    assert stats["device"]["staging"] == staging and stats["device"]["capacity"] == 8
    assert stats["device"]["scratch_rows"] > 0 and state["held"] > 8  # more than the cache holds
    if staging == 400:  # the window always fits: no warm-only batch
        assert stats["prefetch"]["warm_only"] == 0, stats["prefetch"]
        assert 8 < stats["prefetch"]["window_rows"] <= 8 + 400  # what staging is sized by
    else:
        assert 0 < stats["prefetch"]["warm_only"] < plain["prefetch"]["warm_only"]
    told = torch.cat(seen)
    assert told.numel() and int(told.max()) < 8, int(told.max())  # cache slots only
    _assert_stored(tmp_path / "t", base)  # staged rows reached the disk


_BASE: dict = {}


@settings(max_examples=examples(0.12))
@given(cap=st.integers(1, 40), staging=st.integers(1, 160), depth=st.integers(1, 6),
       delayed=st.booleans())
def test_any_cache_and_staging_size_trains_the_reference_bits(tmp_path_factory, cap, staging,
                                                              depth, delayed):
    # whatever the cache, the staging slots and the depth (staged, warm-only, or alternating;
    # slots full or not), training gives an all-resident run's bits and keeps the invariants
    if "base" not in _BASE:
        _BASE["base"], _ = _train(tmp_path_factory.mktemp("base") / "s", 0, caps=(10**5, 10**5))
    base = _BASE["base"]
    got, _ = _train(tmp_path_factory.mktemp("t") / "s", depth, caps=(cap, 0), policy="hlfu",
                    delay=_delays(depth) if delayed else None, staging_capacity=staging,
                    side=lambda store, i: store.check() if i % 9 == 4 else None)
    for k in base:
        assert torch.equal(got[k], base[k]), (k, cap, staging, depth)


@pytest.mark.parametrize("kw", [dict(policy="lru", host_capacity=0),
                                dict(policy="hlfu", host_capacity=4),
                                dict(policy="hlfu", host_capacity=0, staging_capacity=-1)])
def test_staging_capacity_outside_its_configuration_is_refused_before_any_file(tmp_path, kw):
    kw = {"staging_capacity": 100, **kw}
    with pytest.raises(ts.ConfigError, match="staging_capacity|capacity"):
        ts.TierStore(tmp_path / "s", _specs(), device_capacity=8, device="cpu", **kw)
    assert not (tmp_path / "s").exists()


def test_locked_operations_from_another_thread_wait_for_lock_free_updates(tmp_path):
    """Flushes, reads and stats from a second thread while the training thread updates pinned
    rows without the store lock: no torn row is flushed, nothing deadlocks, results unchanged."""
    base, _ = _train(tmp_path / "base", 0, caps=(10**5, 10**5))
    stop = threading.Event()
    seen, threads = [], []

    def side(store, i):
        if i == 0:
            def loop():
                while not stop.is_set():
                    store.flush()
                    seen.append(store.read("a", torch.arange(40) * 7919).sum().item())
                    store.stats()
            threads.append(threading.Thread(target=loop, daemon=True))
            threads[0].start()
        if i == 29:  # the last step: stop the side thread before the store closes
            stop.set()
            threads[0].join()

    try:
        got, stats = _train(tmp_path / "t", 2, caps=(40, 60), side=side,
                            delay=lambda: 0.001)
    finally:
        stop.set()
    for k in base:
        assert torch.equal(got[k], base[k]), k
    assert stats["prefetch"]["lock_free_bags"] > 0 and seen


@pytest.mark.slow
@pytest.mark.parametrize("trial", [pytest.param(0, marks=pytest.mark.ci), *range(1, 20)])
def test_stress_many_trials(tmp_path, trial):
    base, _ = _train(tmp_path / "base", 0, caps=(10**5, 10**5), steps=40)
    rng = random.Random(trial)
    depth = rng.choice([1, 2, 3, 8])
    caps = rng.choice([(rng.randint(0, 6), rng.randint(0, 6)), (rng.randint(20, 60), rng.randint(20, 90))])
    got, _ = _train(tmp_path / "t", depth, caps=caps, policy=rng.choice(["lru", "lfu", "lookahead"]),
                    steps=40, delay=_delays(trial))
    for k in base:
        assert torch.equal(got[k], base[k]), (depth, caps, k)


def test_staging_moves_rows_up_and_pins_them(tmp_path):
    spec = ts.TableSpec("a", 1000, 4, optimizer=ts.SGD(0.1))
    with ts.TierStore(tmp_path / "s", [spec], device_capacity=20, host_capacity=100,
                      policy="lru", device="cpu") as store:  # named: two tiers as given
        store.apply("a", torch.arange(200), torch.ones(200, 4))
        store.flush()
        batches = [{"a": torch.arange(100, 110)}, {"a": torch.arange(120, 130)},
                   {"a": torch.arange(140, 150)}]
        with Prefetcher(store, batches, depth=2) as pf:
            first = next(pf)
            # wait until the stager has staged the window (bounded)
            for _ in range(200):
                if len(pf._window) == 3:
                    break
                threading.Event().wait(0.01)
            assert sorted(pf._window) == [0, 1, 2]
            tab = store.tables["a"]
            for ids in (torch.arange(100, 110), torch.arange(140, 150)):
                d = store.device_tier.index.find(torch.tensor(tab.index), ids)
                h = store.host_tier.index.find(torch.tensor(tab.index), ids)
                assert bool(((d >= 0) | (h >= 0)).all())
                pins = torch.cat([store.device_tier.pins[d[d >= 0]], store.host_tier.pins[h[h >= 0]]])
                assert bool((pins > 0).all())
            # a flood of other rows must not evict pinned ones
            store.read("a", torch.arange(500, 1000))
            h = store.host_tier.index.find(torch.tensor(tab.index), torch.arange(140, 150))
            d = store.device_tier.index.find(torch.tensor(tab.index), torch.arange(140, 150))
            assert bool(((d >= 0) | (h >= 0)).all())
            assert torch.equal(first["a"], torch.arange(100, 110))
            rest = list(pf)
        assert len(rest) == 2
        assert int(store.device_tier.pins.sum()) == 0 and int(store.host_tier.pins.sum()) == 0
        st = store.stats()["prefetch"]
        assert st["batches"] == 3 and st["rows_staged"] == 30
        assert st["staged_from_ssd"] + st["staged_from_host"] == 30 and st["staged_from_ssd"] >= 20
        assert st["stall_seconds"] >= 0


def test_update_after_staging_is_seen(tmp_path):
    spec = ts.TableSpec("a", 100, 2, optimizer=ts.SGD(1.0))
    with ts.TierStore(tmp_path / "s", [spec], device_capacity=1, host_capacity=1,
                      device="cpu") as store:
        batches = [{"a": torch.tensor([1, 2, 3])}, {"a": torch.tensor([1, 2, 3])}]
        with Prefetcher(store, batches, depth=1) as pf:
            next(pf)
            before = store.read("a", torch.tensor([1, 2, 3]))
            store.apply("a", torch.tensor([1, 2, 3]), torch.ones(3, 2))
            next(pf)
            assert torch.equal(store.read("a", torch.tensor([1, 2, 3])), before - 1)


def test_consumer_stops_early_and_errors_surface(tmp_path):
    spec = ts.TableSpec("a", 100, 2)
    with ts.TierStore(tmp_path / "s", [spec], device_capacity=4, host_capacity=4,
                      device="cpu") as store:
        before = threading.active_count()
        for _ in range(3):
            pf = Prefetcher(store, ({"a": torch.tensor([i % 100])} for i in range(10**6)), depth=3)
            next(pf)
            pf.close()
        assert threading.active_count() == before

        def bad_source():
            yield {"a": torch.tensor([1])}
            raise RuntimeError("reader broke")

        with pytest.raises(ts.TierstoreError, match="reader broke"):
            with Prefetcher(store, bad_source(), depth=2) as pf:
                for _ in pf:
                    pass
        with pytest.raises(ts.InvalidIdsError):
            with Prefetcher(store, [{"a": torch.tensor([1])}, {"a": torch.tensor([500])}],
                            depth=1) as pf:
                list(pf)
        with pytest.raises(ValueError):
            with Prefetcher(store, [{"a": torch.tensor([1])}] * 5, depth=2) as pf:
                for _ in pf:
                    raise ValueError("training step failed")
        assert threading.active_count() == before
        assert int(store.host_tier.pins.sum()) == 0 and int(store.device_tier.pins.sum()) == 0
        store.check()
        with pytest.raises(ts.ConfigError):
            Prefetcher(store, [], depth=-1)


def test_prefetcher_over_a_collection_with_feature_names(tmp_path):
    specs = [ts.TableSpec("users", 1000, 2), ts.TableSpec("items", 1000, 3)]
    with ts.TierStore(tmp_path / "s", specs, device_capacity=8, host_capacity=8,
                      device="cpu") as store:
        ebc = ts.TieredEmbeddingBagCollection(store, [("u", "users"), ("i", "items"), ("j", "items")])
        batches = [(["u", "i", "j"], torch.tensor([1, 2, 3, 4, 5, 6]), torch.tensor([1, 1, 1, 1, 1, 1]))
                   for _ in range(4)]
        with Prefetcher(ebc, batches, depth=2) as pf:
            outs = [ebc(*b) for b in pf]
        assert len(outs) == 4 and outs[0].shape == (2, 2 + 3 + 3)
        assert store.stats()["prefetch"]["batches"] == 4


def test_prefetcher_over_a_store_knows_collection_features(tmp_path):
    specs = [ts.TableSpec("users", 1000, 2), ts.TableSpec("items", 1000, 3)]
    with ts.TierStore(tmp_path / "s", specs, device_capacity=64, host_capacity=64,
                      device="cpu") as store:
        ebc = ts.TieredEmbeddingBagCollection(store, {"u": "users", "i": "items"})
        batches = [(["u", "i"], torch.tensor([1, 2, 3, 4]), torch.tensor([1, 1, 1, 1]))] * 3
        with Prefetcher(store, batches, depth=1) as pf:
            outs = [ebc(*b) for b in pf]
        assert len(outs) == 3 and store.stats()["prefetch"]["rows_staged"] > 0


@pytest.mark.parametrize("between", ["nothing", "apply", "advance", "expire", "two forwards"])
def test_a_warm_only_backward_updates_the_rows_its_forward_read_unless_the_table_changed(
        tmp_path, between):
    """A warm-only forward reads its missed rows where they are and keeps them; the backward
    updates that copy instead of loading the rows cached nowhere a second time. Anything that
    may change the table's rows in between (an update, a second forward's backward, the clock)
    makes the backward fetch them again. Either way the bits equal a run that always fetches."""
    from tierstore.bagpaths import BagPaths
    from tierstore.stored_rows import RowLoader

    feats = {"f1": "a", "f3": "b"}  # a table each: the backward of one leaves the other's copy

    def run(path, reuse):
        store = ts.TierStore(path, _specs(), device_capacity=3, host_capacity=4, policy="lru",
                             device="cpu")  # named: two tiers and no staging slots, warm-only
        ebc = ts.TieredEmbeddingBagCollection(store, feats)
        torch.manual_seed(0)
        dense = torch.nn.Linear(8, 1)
        counts = {"reused": 0, "loaded": 0}
        phase = ["forward"]
        load, payload_now = RowLoader.load, BagPaths._payload_now

        def counted_load(self, tab, rows, *a, **k):
            if phase[0] == "backward" and threading.current_thread() is threading.main_thread():
                counts["loaded"] += 1
            return load(self, tab, rows, *a, **k)

        def counted_payload(self, tab, g, keep):
            if not reuse:
                g = dataclasses.replace(g, payload=None)
            if g.payload is not None and g.writes == tab.writes:
                counts["reused"] += 1
            return payload_now(self, tab, g, keep)

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(RowLoader, "load", counted_load)
            mp.setattr(BagPaths, "_payload_now", counted_payload)
            batches = _two_table_batches(20)
            with Prefetcher(store, batches, depth=2, features=feats, extract=lambda b: b["sparse"]) as pf:
                for i, b in enumerate(pf):
                    phase[0] = "forward"
                    if between == "expire":
                        store.advance()
                    outs = [ebc(*b["sparse"])]
                    if between == "two forwards":  # gradient accumulation: both update in turn
                        outs.append(ebc(*b["sparse"]))
                    elif between == "apply":
                        ids = b["sparse"][1][:3].clone()
                        store.apply("a", ids, torch.full((len(ids), 3), 0.1 * (i + 1)))
                    elif between == "advance":
                        store.advance()
                    elif between == "expire":  # table a's rows updated before this step reset
                        store.expire("a", older_than=0)
                    phase[0] = "backward"
                    sum((dense(o) - b["target"]).pow(2).mean() for o in outs).backward()
            phase[0] = "done"
            st = store.stats()["prefetch"]
            result = {"a": store.read("a", torch.arange(40) * 7919), "b": store.read("b", torch.arange(40))}
        store.check()
        store.close()
        return result, counts, st

    got, counts, st = run(tmp_path / "reuse", True)
    want, fetched, _ = run(tmp_path / "fetch", False)
    assert st["warm_only"] == 20
    for k in want:
        assert torch.equal(got[k], want[k]), k
    assert fetched["reused"] == 0 and fetched["loaded"] > 0
    if between == "nothing":
        assert counts["reused"] > 0 and counts["loaded"] == 0, counts
    elif between in ("advance", "expire"):  # how any row reads may change: every table fetches
        assert counts["reused"] == 0 and counts["loaded"] > 0, counts
    else:  # table a changed in between (an apply, the other forward's backward); b did not
        assert counts["reused"] > 0 and counts["loaded"] > 0, counts


@pytest.mark.parametrize("resident", [0, 2])  # no device hit (the copy is the whole batch), some
def test_a_warm_only_backward_leaves_the_weights_its_forward_returned_unchanged(tmp_path, resident):
    """The backward updates its own copy of the forward's rows, never the tensor the forward
    handed out (`Gathered.weights` views it)."""
    store = ts.TierStore(tmp_path / "s", _specs(), device_capacity=3, host_capacity=0, device="cpu")
    try:
        tab = store.tables["b"]
        if resident:  # some of the rows device-resident before the warm-only step
            store.read("b", torch.arange(resident))
        ids, offsets = torch.tensor([0, 1, 2, 3, 4, 5, 6]), torch.tensor([0, 3])
        store.staging.deferring = threading.get_ident()  # as the pipeline marks a warm-only batch
        g = store.paths.step_rows(tab, ids)
        assert g.payload is not None
        before, kept = g.weights.clone(), g.payload.clone()
        store.paths.apply_bag_grads(tab, g, offsets, torch.ones(2, 5), None, "sum")
        store.staging.deferring = 0
        assert torch.equal(g.weights, before)
        assert torch.equal(g.payload, kept)
        assert not torch.equal(store.read("b", torch.arange(7)), before)  # the update did land
    finally:
        store.close()


def _two_table_batches(n_steps, seed=5, batch=4):
    """Batches of features f1 (table a, sparse ids) and f3 (table b)."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n_steps):
        lengths = torch.randint(1, 6, (2 * batch,), generator=gen)
        a = torch.randint(0, 40, (int(lengths[:batch].sum()),), generator=gen) * 7919
        b = torch.randint(0, 40, (int(lengths[batch:].sum()),), generator=gen)
        yield {"sparse": (["f1", "f3"], torch.cat([a, b]), lengths),
               "target": torch.randn(batch, 1, generator=gen)}


def test_settle_waits_for_staging_and_the_reads_it_started(tmp_path):
    spec = ts.TableSpec("a", 1000, 2)
    with ts.TierStore(tmp_path / "s", [spec], device_capacity=4, host_capacity=4,
                      device="cpu") as store:
        store.apply("a", torch.arange(1000), torch.ones(1000, 2))  # every row stored
        store.flush()
        taken = []

        def source():
            for i in range(40):
                taken.append(i)
                yield {"a": torch.arange(20 * i, 20 * i + 20) % 1000}

        with Prefetcher(store, source(), depth=2) as pf:
            for step, _ in enumerate(pf):
                if step % 5:
                    continue
                assert pf.settle(5.0)
                stats = store.prefetch_stats
                before = (len(taken), stats.rows_read_ahead_from_ssd, stats.stage_seconds)
                time.sleep(0.05)  # settled: nothing moves until the consumer takes a batch
                assert (len(taken), stats.rows_read_ahead_from_ssd, stats.stage_seconds) == before

        gate = threading.Event()

        def blocked():  # staging batch i takes batch i + 1 from the source first
            yield {"a": torch.tensor([1])}
            yield {"a": torch.tensor([2])}
            gate.wait(10)

        with Prefetcher(store, blocked(), depth=2) as pf:
            next(pf)
            assert not pf.settle(0.2)  # the staging thread waits in the source, not for a slot
            gate.set()
            assert pf.settle(5.0)


def test_reader_pool_wait_idle_counts_queued_and_running_tasks():
    from tierstore.prefetch.reads import ReaderPool

    pool = ReaderPool(1)
    try:
        assert pool.wait_idle(0)
        gate = threading.Event()
        first = pool.submit(gate.wait, 5)
        second = pool.submit(lambda: 7)  # queued behind the first
        assert not pool.wait_idle(0.05)
        gate.set()
        assert pool.wait_idle(5) and first.result() and second.result() == 7
    finally:
        pool.shutdown()
    with pytest.raises(RuntimeError):  # a shut-down pool queues nothing, and counts nothing
        pool.submit(lambda: 1)
    assert pool.wait_idle(0)
