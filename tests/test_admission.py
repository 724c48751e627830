"""Feature admission: count-min sketch, gating of rows, persistence, placement invariance."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tierstore as ts
from tierstore import admission as adm
from tierstore.backends.lmdb_backend import LmdbBackend
from tierstore.prefetch import Prefetcher

ROWS = 10**11
STRIDE = 49_999_999


def spec(k: int = 2, name: str = "t", dim: int = 4, **kw) -> ts.TableSpec:
    return ts.TableSpec(name, ROWS, dim, optimizer=kw.pop("optimizer", ts.Adagrad(0.1)),
                        admission=ts.CountAdmission(min_count=k, sketch="1MiB"), **kw)


def open_store(path, specs, caps=(64, 256), **kw) -> ts.TierStore:
    return ts.TierStore(path, specs, device_capacity=caps[0], host_capacity=caps[1],
                        device="cpu", seed=3, **kw)


def init_rows(tmp_path, s: ts.TableSpec, ids: torch.Tensor) -> torch.Tensor:
    """What `ids` read as in a store of the same table without admission (lazy init)."""
    plain = ts.TableSpec(s.name, s.num_rows, s.dim, optimizer=s.optimizer, init=s.init,
                         dtype=s.dtype)
    with open_store(tmp_path / "plain", plain) as st_:
        return st_.read(s.name, ids)


def stored(store: ts.TierStore, table: str = "t") -> set[int]:
    """Row ids stored in LMDB after a flush."""
    store.flush()
    txn = store.backend.snapshot()
    try:
        w = store.table_specs[table].row_dim
        return {int(i) for ids, _ in store.backend.iter_rows(table, w, txn) for i in ids}
    finally:
        txn.abort()


# config ------------------------------------------------------------------------------------
def test_config_round_trip_and_validation():
    s = spec(3)
    assert ts.TableSpec.from_config(s.to_config()) == s
    assert s.admission == ts.CountAdmission(min_count=3, sketch=1 << 20)
    assert "admission" not in ts.TableSpec("x", 10, 2).to_config()  # old stores unchanged
    for bad in (dict(min_count=0), dict(min_count=256), dict(min_count=True),
                dict(sketch="1KiB"), dict(sketch="lots"), dict(depth=3)):
        with pytest.raises(ts.ConfigError):
            ts.CountAdmission(**bad)
    with pytest.raises(ts.ConfigError):
        ts.TableSpec("x", 10, 2, admission="count")


def test_reopen_with_other_admission_is_a_mismatch(store_path):
    open_store(store_path, spec(2)).close()
    with pytest.raises(ts.ConfigMismatchError, match="admission"):
        open_store(store_path, spec(3))
    with pytest.raises(ts.ConfigMismatchError, match="admission"):
        open_store(store_path, ts.TableSpec("t", ROWS, 4, optimizer=ts.Adagrad(0.1)))
    open_store(store_path, spec(2)).close()


# gating ------------------------------------------------------------------------------------------
@settings(deadline=None, max_examples=15)
@given(k=st.integers(1, 5), via=st.sampled_from(["apply", "gather", "read", "forward"]))
def test_k_minus_one_sightings_no_row_k_sightings_stored(tmp_path_factory, k, via):
    tmp = tmp_path_factory.mktemp("adm")
    s = spec(k)
    ids = torch.tensor([11 * STRIDE, 12 * STRIDE])
    init = init_rows(tmp, s, ids)
    store = open_store(tmp / "s", s)
    bag = ts.TieredEmbeddingBag(store, "t")

    def sight_and_update():
        """One sighting of each id, by the chosen entry point, followed by an update."""
        if via == "forward":
            bag(ids.view(2, 1)).sum().backward()  # forward counts, backward updates
        elif via == "apply":
            store.apply("t", ids, torch.ones(2, 4))
        else:
            g = store.gather("t", ids) if via == "gather" else None
            if via == "read":
                store.read("t", ids)
                g = ts.Gathered(ids, torch.arange(2), torch.empty(0))
            store.apply_unique("t", g.unique, torch.ones(2, 4))  # not a sighting

    for _ in range(k - 1):
        sight_and_update()
    assert stored(store) == set()  # no stored row after k-1 sightings
    assert store.stats()["admission"]["t"]["admitted"] == 0
    with store.lock:  # the row as it is now, without counting a sighting
        before = store.read_rows(store.tables["t"], ids)
    assert torch.equal(before, init)  # updates were discarded: the row is its init
    sight_and_update()
    assert stored(store) == set(ids.tolist())  # the k-th sighting creates and updates the row
    after = store.read("t", ids)
    assert not torch.equal(after, init)
    st_ = store.stats()["admission"]["t"]
    assert st_["admitted"] == 2 and st_["rejected"] == 2 * (k - 1)
    store.close()


def test_mixed_batch_reads_init_for_rejected_and_updates_admitted(tmp_path):
    s = spec(2)
    ids = torch.tensor([1, 2, 3, 2, 4, 4]) * STRIDE  # 2 and 4 twice: admitted in this batch
    init = init_rows(tmp_path, s, ids)
    store = open_store(tmp_path / "s", s)
    got = store.gather("t", ids)
    assert torch.equal(got.weights.index_select(0, got.inverse), init)
    store.apply("t", torch.tensor([1, 2, 4]) * STRIDE, torch.ones(3, 4))  # 1: count 2 now
    assert stored(store) == {1 * STRIDE, 2 * STRIDE, 4 * STRIDE}
    r = store.read("t", torch.tensor([3, 5]) * STRIDE)  # 3: second sighting; 5: first
    assert torch.equal(r, init_rows(tmp_path, s, torch.tensor([3, 5]) * STRIDE))
    assert stored(store) == {1 * STRIDE, 2 * STRIDE, 4 * STRIDE}
    store.close()


def test_packed_dtype_reads_rounded_init(tmp_path):
    s = spec(3, dtype="bfloat16")
    ids = torch.tensor([7, 8, 9])
    with open_store(tmp_path / "s", s) as store:
        assert torch.equal(store.read("t", ids), init_rows(tmp_path, s, ids))


# the sketch -----------------------------------------------------------------------------------
@pytest.mark.skipif(not adm.HAVE_NUMBA, reason="needs numba for the kernel")
@settings(deadline=None, max_examples=30)
@given(batches=st.lists(st.lists(st.integers(0, 3000), max_size=60), min_size=1, max_size=6),
       k=st.integers(1, 6), depth=st.sampled_from([1, 2, 4, 8]))
def test_kernel_matches_numpy(batches, k, depth):
    a = adm.CountMinSketch(1 << 16, depth, k, 99, use_kernel=True)
    b = adm.CountMinSketch(1 << 16, depth, k, 99, use_kernel=False)
    for batch in batches:
        u, c = np.unique(np.array(batch, dtype=np.int64), return_counts=True)
        fa, na = a.add(u, c)
        fb, nb = b.add(u, c)
        assert np.array_equal(fa, fb) and na == nb
        assert np.array_equal(a.table, b.table) and np.array_equal(a.dirty, b.dirty)
        assert np.array_equal(a.query(u), fa)


@settings(deadline=None, max_examples=30)
@given(seq=st.lists(st.integers(0, 50), max_size=200), k=st.integers(1, 5))
def test_sketch_never_undercounts(seq, k):
    sk = adm.CountMinSketch(1 << 16, 4, k, 5)
    exact: dict[int, int] = {}
    for i in range(0, len(seq), 7):
        u, c = np.unique(np.array(seq[i: i + 7], dtype=np.int64), return_counts=True)
        sk.add(u, c)
        for x, n in zip(u.tolist(), c.tolist()):
            exact[x] = exact.get(x, 0) + n
    if exact:
        ids = np.array(sorted(exact), dtype=np.int64)
        assert (sk.query(ids) >= np.minimum([exact[i] for i in ids.tolist()], k)).all()


def test_sketch_memory_is_bounded_and_false_admission_is_low():
    size = 1 << 20
    sk = adm.CountMinSketch(size, 4, 2, 1)
    rng = np.random.default_rng(0)
    ids = rng.choice(10**11, 20_000, replace=False).astype(np.int64)  # each seen once
    ids.sort()
    sk.add(ids, np.ones(ids.size, dtype=np.int64))
    # ids never seen again: a false admission is a collision on every counter of its line
    assert (sk.query(ids) >= 2).mean() < 0.01
    for _ in range(20):  # 2M more distinct ids: the sketch's memory does not grow
        more = np.sort(rng.integers(0, 10**11, 100_000))
        sk.add(np.unique(more), np.ones(np.unique(more).size, dtype=np.int64))
    assert sk.table.nbytes == size and sk.dirty.nbytes == size >> adm.PAGE_SHIFT


# placement invariance, persistence ---------------------------------------------------------------
def _batches(steps: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        v = torch.from_numpy((rng.zipf(1.3, 96) % 1500) * STRIDE).long()
        w = torch.from_numpy(rng.integers(0, 300, 32)).long()
        yield {"sparse": (["f", "g"], torch.cat([v, w]), torch.tensor([3] * 32 + [1] * 32)),
               "y": torch.from_numpy(rng.standard_normal((32, 1)).astype(np.float32))}


def _train(path, caps, policy="lru", depth=0, steps=12, specs=None, ttl=None):
    specs = specs or [spec(2, "t", optimizer=ts.Adam(0.05), ttl=ttl), spec(3, "u", dim=2)]
    store = open_store(path, specs, caps, policy=policy)
    ebc = ts.TieredEmbeddingBagCollection(store, {"f": "t", "g": "u"})
    torch.manual_seed(0)
    dense = torch.nn.Linear(6, 1)
    batches = list(_batches(steps))
    it = Prefetcher(ebc, batches, depth=depth, extract=lambda b: b["sparse"]) if depth else batches
    for b in it:
        loss = (dense(ebc(*b["sparse"])) - b["y"]).pow(2).mean()
        loss.backward()
        if ttl is not None:
            store.advance()
        if ttl is not None and store.clock % 5 == 0:
            store.flush()  # the ttl deleter runs beside the training
    if depth:
        it.close()
    store.check()
    ids = torch.arange(1500) * STRIDE
    with store.lock:
        out = {"t": store.read_rows(store.tables["t"], ids), "u": store.read_rows(store.tables["u"],
                                                                          torch.arange(300))}
    stats = store.stats()["admission"]
    store.close()
    return out, stats


def test_bit_identical_across_placements_with_admission(tmp_path):
    ref, stats = _train(tmp_path / "ref", (8192, 8192))
    assert stats["t"]["rejected"] > 0 and stats["t"]["admitted"] > 0
    assert stats["u"]["rejected"] > 0 and stats["u"]["admitted"] > 0
    for i, (caps, policy, depth) in enumerate([((16, 32), "lru", 0), ((0, 40), "lfu", 0),
                                               ((64, 0), "lru", 2), ((24, 48), "lru", 1)]):
        got, st_ = _train(tmp_path / f"s{i}", caps, policy, depth)
        assert st_ == stats
        for t in ref:
            assert torch.equal(got[t], ref[t]), (caps, policy, depth, t)


def test_bit_identical_across_placements_with_admission_and_ttl(tmp_path):
    ref, stats = _train(tmp_path / "ref", (8192, 8192), ttl=3, steps=12)
    plain, _ = _train(tmp_path / "plain", (8192, 8192), steps=12)
    assert not torch.equal(ref["t"], plain["t"])  # rows did expire
    for i, (caps, policy, depth) in enumerate([((16, 32), "lru", 0), ((0, 40), "lfu", 2),
                                               ((64, 0), "lru", 2), ((24, 48), "arc", 1)]):
        got, st_ = _train(tmp_path / f"s{i}", caps, policy, depth, ttl=3, steps=12)
        assert st_ == stats
        for t in ref:
            assert torch.equal(got[t], ref[t]), (caps, policy, depth, t)


def _digest_store(path) -> str:
    """Exact bytes of every database (rows and sketches) of a closed store or checkpoint."""
    h = hashlib.sha256()
    b = LmdbBackend(path, readonly=True)
    try:
        with b.env.begin() as txn:
            names = sorted(k for k, _ in txn.cursor() if k.startswith((b"t:", b"s:")))
        for name in names:
            db = b.env.open_db(name, create=False)
            with b.env.begin(db=db) as txn:
                for k, v in txn.cursor():
                    h.update(name + k + bytes(v))
    finally:
        b.close()
    return h.hexdigest()


def test_sketch_survives_reopen_checkpoint_and_restore_bit_identically(tmp_path):
    specs = [spec(2, "t", optimizer=ts.Adam(0.05)), spec(3, "u", dim=2)]
    batches = list(_batches(10, seed=4))

    def steps(store, bs):
        ebc = ts.TieredEmbeddingBagCollection(store, {"f": "t", "g": "u"})
        for b in bs:
            ebc(*b["sparse"]).sum().backward()

    with open_store(tmp_path / "a", specs) as a:  # uninterrupted
        steps(a, batches)
        want = a.stats()["admission"]
    with open_store(tmp_path / "b", specs) as b:  # close and reopen in the middle
        steps(b, batches[:4])
        b.checkpoint(tmp_path / "ck")
    with open_store(tmp_path / "b", specs) as b:
        steps(b, batches[4:])
        assert b.stats()["admission"] == want
    restored = ts.TierStore.restore(tmp_path / "ck", tmp_path / "c", device_capacity=16,
                                    host_capacity=16, device="cpu")
    with restored as c:
        steps(c, batches[4:])
    assert _digest_store(tmp_path / "a") == _digest_store(tmp_path / "b") \
        == _digest_store(tmp_path / "c")


def test_corrupt_sketch_page_is_detected(tmp_path):
    with open_store(tmp_path / "s", spec(2)) as store:
        store.read("t", torch.arange(1000))
    b = LmdbBackend(tmp_path / "s")
    db = b.env.open_db(b"s:t", create=False)
    with b.env.begin(write=True, db=db) as txn:
        key, val = next(k for k in txn.cursor() if k[0] != b"stats")
        val = bytearray(val)
        val[100] ^= 1
        txn.put(key, bytes(val))
    b.close()
    with pytest.raises(ts.StoreCorruptError, match="sketch"):
        open_store(tmp_path / "s", spec(2))


# the policy benchmark ----------------------------------------------------------------------------
def test_policy_bench_admission_matches_exact_counts():
    from tierstore.sim.admission import admit_trace, parse_admission

    assert parse_admission("count:3:1MiB") == ts.CountAdmission(min_count=3, sketch="1MiB")
    for bad in ("lru:2", "count", "count:x"):
        with pytest.raises(ts.ConfigError):
            parse_admission(bad)
    rng = np.random.default_rng(1)
    ids = (rng.zipf(1.2, 20_000) % 3000).astype(np.int64)
    got = admit_trace("count:2", ids, 100)
    # an exact counter: a request is admitted once its id's count, batch included, reaches 2
    seen: dict[int, int] = {}
    want = np.zeros(ids.size, dtype=bool)
    for lo in range(0, ids.size, 100):
        part = ids[lo: lo + 100]
        for x in part.tolist():
            seen[x] = seen.get(x, 0) + 1
        want[lo: lo + 100] = [seen[x] >= 2 for x in part.tolist()]
    assert np.array_equal(got.ids, ids[want])  # 64 MiB for 3000 keys: no false admission
    assert got.rows_stored == sum(1 for c in seen.values() if c >= 2)
    assert got.distinct == len(seen) and got.requests == ids.size


# crash safety --------------------------------------------------------------------------------------
def _sketch_digest(backend) -> str:
    h = hashlib.sha256()
    for name in (b"s:a", b"s:b"):
        with backend.env.begin() as txn:
            if txn.get(name) is None:
                continue
        db = backend.open_named(name, create=False)  # env.open_db could deadlock with the deleter
        with backend.env.begin(db=db) as txn:
            for k, v in txn.cursor():
                h.update(name + k + bytes(v))
    return h.hexdigest()


def _rows_digest(backend) -> str:
    """The logical rows: stored rows less those stale under a table's ttl cutoff (still on disk
    until the background deleter reaches them, but reading as missing)."""
    from tests import crash_worker as w

    cutoffs = backend.get_meta("expiry") or {}
    h = hashlib.sha256()
    for name, (ids, pay) in sorted(w.dump_backend(backend).items()):
        if name in cutoffs:
            spec = next(s for s in w.SPECS if s.name == name)
            live = np.ascontiguousarray(pay[:, spec.stamp_col]).view(np.int32) >= cutoffs[name]
            ids, pay = ids[live], pay[live]
        h.update(name.encode() + ids.tobytes() + pay.tobytes())
    return h.hexdigest()


@pytest.mark.parametrize("acks", [3, pytest.param(8, marks=pytest.mark.slow)])
def test_kill9_with_admission_keeps_rows_and_sketch_at_a_flush_point(tmp_path, acks):
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    from tests import admission_crash_worker as aw
    from tests import crash_worker as w
    from tierstore import persistence

    saved = list(w.SPECS)
    aw.use_admission()
    try:
        repo = Path(__file__).resolve().parents[1]
        big = 8192  # every hot row stays cached: LMDB changes only at flushes
        proc = subprocess.Popen(
            [sys.executable, str(repo / "tests" / "admission_crash_worker.py"), str(tmp_path / "s"),
             str(tmp_path / "ck"), "1000000", "2", "5", str(big), str(big)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=repo,
            env={**os.environ, "OMP_NUM_THREADS": "1"})
        try:
            assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
            seen = [proc.stdout.readline().split() for _ in range(acks)]
            proc.send_signal(signal.SIGKILL)
        finally:
            proc.kill()
            proc.wait()
        seen += [ln.split() for ln in proc.stdout.read().splitlines()]  # acks before the kill landed
        acked = max(int(x[1]) for x in seen if len(x) == 2 and x[0] in ("F", "C"))
        # the uninterrupted run: digests at every flush point up to the one after `acked`
        ref = w.open_store(tmp_path / "ref", big, big)
        want: dict[int, tuple[str, str]] = {}
        for step in range(1, acked + 6):
            w.train_step(ref, step)
            if step % 2 == 0 or step % 5 == 0:
                ref.flush()
                want[step] = (_rows_digest(ref.backend), _sketch_digest(ref.backend))
        nxt = min(s for s in want if s > acked)
        live = w.open_store(tmp_path / "s", big, big)
        rows, sketch = _rows_digest(live.backend), _sketch_digest(live.backend)
        assert rows in (want[acked][0], want[nxt][0])
        assert sketch in (want[acked][1], want[nxt][1])
        live.close()
        # the last checkpoint restores rows and sketch exactly, and training resumes bit-identically
        done = sorted(p for p in (tmp_path / "ck").glob("step-*")
                      if (p / persistence.MANIFEST).exists())
        assert done
        step = persistence.read_manifest(done[-1])["step"]
        back = ts.TierStore.restore(done[-1], tmp_path / "r", device_capacity=32, host_capacity=32,
                                   device="cpu")
        for s in range(step + 1, acked + 6):
            w.train_step(back, s)
            if s in want:
                back.flush()
                assert (_rows_digest(back.backend), _sketch_digest(back.backend)) == want[s]
        assert back.stats()["admission"]["a"]["rejected"] > 0
        assert back.clock == acked + 5 and back.expiry.cutoffs[back.tables["a"].index] > 0
        back.close()
        ref.close()
    finally:
        aw.restore_plain(saved)


def test_export_import_keeps_stored_rows_visible(tmp_path):
    from tierstore.export import export_store, import_store

    s = spec(3)
    ids = torch.tensor([4, 5]) * STRIDE
    with open_store(tmp_path / "s", s) as store:
        for _ in range(3):
            store.apply("t", ids, torch.ones(2, 4))
        store.apply("t", torch.tensor([6 * STRIDE]), torch.ones(1, 4))  # seen once: no row
        want = store.read_rows(store.tables["t"], ids)
    export_store(tmp_path / "s", tmp_path / "x")
    import_store(tmp_path / "x", tmp_path / "i")  # no sketch in an export: stored ids admitted
    with open_store(tmp_path / "i", s) as store:
        assert store.stats()["admission"]["t"]["admitted"] == 2
        assert torch.equal(store.read("t", ids), want)
        assert torch.equal(store.read("t", torch.tensor([6 * STRIDE])),
                           init_rows(tmp_path, s, torch.tensor([6 * STRIDE])))


def test_sequence_lookups_count_toward_admission(tmp_path):
    """TieredEmbedding's forward counts sightings like the bag modules: an id seen k-1 times reads
    as its initial row and keeps no stored row; its k-th sighting admits it."""
    spec = ts.TableSpec("t", 10**9, 4, optimizer=ts.SGD(0.5), admission=ts.CountAdmission(min_count=3))
    with ts.TierStore(tmp_path / "s", [spec], device_capacity=8, host_capacity=8, device="cpu") as store:
        emb = ts.TieredEmbedding(store, "t")
        out = emb(torch.tensor([[5, 5]]))  # two sightings of id 5 in one call
        init = out.detach().clone()[0, 0]
        out.sum().backward()  # not admitted yet: the update is discarded
        store.flush()
        assert store.backend.count("t") == 0
        out = emb(torch.tensor([5]))  # the third sighting admits it
        assert torch.equal(out.detach()[0], init)
        out.sum().backward()
        store.flush()
        assert store.backend.count("t") == 1
        assert torch.equal(store.read("t", torch.tensor([5]))[0], init - 0.5)  # one SGD step
