"""Row expiry: store.expire, `tierstore expire`, TableSpec(ttl=K) during training."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tierstore as ts
from tierstore import persistence
from tierstore.cli import main as cli_main

ROWS = 10**11
STRIDE = 49_999_999


def spec(name="t", dim=4, **kw) -> ts.TableSpec:
    return ts.TableSpec(name, ROWS, dim, optimizer=ts.Adagrad(0.1), **kw)


def open_store(path, specs, caps=(8, 16)) -> ts.TierStore:
    return ts.TierStore(path, specs, device_capacity=caps[0], host_capacity=caps[1], device="cpu",
                        seed=5)


def stored_ids(store, table="t") -> set[int]:
    store.flush()
    txn = store.backend.snapshot()
    try:
        w = store.table_specs[table].row_dim
        return {int(i) for ids, _ in store.backend.iter_rows(table, w, txn) for i in ids}
    finally:
        txn.abort()


def peek(store, table, ids):
    """Current rows without counting a sighting (no admission here; plain read)."""
    with store.lock:
        return store.read_rows(store.tables[table], ids)


@settings(deadline=None, max_examples=20)
@given(plan=st.lists(st.tuples(st.lists(st.integers(0, 40), min_size=1, max_size=8),
                               st.integers(0, 3)), min_size=1, max_size=12),
       older=st.integers(0, 12), caps=st.sampled_from([(0, 0), (4, 6), (64, 64), (0, 5)]))
def test_expire_deletes_exactly_the_rows_older_than_k(tmp_path_factory, plan, older, caps):
    tmp = tmp_path_factory.mktemp("exp")
    store = open_store(tmp / "s", [spec()], caps)
    fresh = open_store(tmp / "init", [spec()])  # never written: lazy init values
    last: dict[int, int] = {}  # the model: row -> clock at its last update
    for ids, adv in plan:
        t = torch.tensor(ids) * STRIDE
        store.apply("t", t, torch.ones(len(ids), 4))
        for i in ids:
            last[i * STRIDE] = store.clock
        store.advance(adv)
    everyone = torch.tensor(sorted(last))
    before = peek(store, "t", everyone)
    deleted = store.expire(older_than=older)
    dead = {i for i, c in last.items() if store.clock - c > older}
    assert deleted == {"t": len(dead)}
    assert stored_ids(store) == set(last) - dead
    after = peek(store, "t", everyone)
    init = peek(fresh, "t", everyone)
    for j, i in enumerate(everyone.tolist()):
        want = init[j] if i in dead else before[j]
        assert torch.equal(after[j], want)
    store.check()
    store.close()
    fresh.close()


def test_expire_validates_and_changes_nothing_on_bad_input(store_path):
    with open_store(store_path, [spec()]) as store:
        store.apply("t", torch.tensor([1]), torch.ones(1, 4))
        store.advance(5)
        for bad in (-1, 1.5, True, "3"):
            with pytest.raises(ts.ConfigError):
                store.expire(older_than=bad)
        with pytest.raises(ts.UnknownTableError):
            store.expire("nope", older_than=1)
        assert stored_ids(store) == {1}
    with pytest.raises(ts.ConfigError):
        spec(ttl=0)
    assert ts.TableSpec.from_config(spec(ttl=7).to_config()).ttl == 7


def test_expire_frees_disk_after_compaction_and_cli(tmp_path):
    path = tmp_path / "s"
    with open_store(path, [spec(dim=32)], caps=(256, 256)) as store:
        for step in range(40):  # 40 steps x 2000 fresh rows each
            ids = torch.arange(step * 2000, (step + 1) * 2000) * STRIDE // 40
            store.apply("t", ids, torch.ones(ids.numel(), 32))
            store.advance()
        full = stored_ids(store)
    persistence.compact(path)
    size_full = (path / "data.mdb").stat().st_size
    assert cli_main(["expire", str(path), "--older-than", "9"]) == 0  # keeps ages 1..9: 9 steps
    size_after = (path / "data.mdb").stat().st_size
    with open_store(path, [spec(dim=32)]) as store:
        left = stored_ids(store)
        assert store.clock == 40
    assert len(left) == 18_000 and left < full
    assert size_after < 0.4 * size_full


def _ttl_run(path, caps, ttl, steps=30, explicit=False):
    """Train with a ttl (or, `explicit`, without one, calling expire at the ttl's fixed points)."""
    from tierstore.expiry import ttl_interval

    s = spec(ttl=None if explicit else ttl)
    store = open_store(path, [s], caps)
    rng = np.random.default_rng(2)
    iv = ttl_interval(ttl)
    for _ in range(steps):
        ids = torch.from_numpy(rng.zipf(1.4, 64) % 400 * STRIDE).long()
        store.read("t", ids)
        store.apply("t", ids, torch.from_numpy(rng.standard_normal((64, 4)).astype(np.float32)))
        store.advance()
        if explicit and store.clock % iv == 0 and store.clock > ttl:
            store.expire(older_than=ttl)
    store.flush()  # the cutoffs are durable: the deleter may remove the stale rows from LMDB
    assert store.expiry.wait(10)
    out = peek(store, "t", torch.arange(400) * STRIDE)
    rows = stored_ids(store)
    stats = store.stats()["expiry"]
    store.close()
    return out, rows, stats


def test_ttl_equals_expiry_at_fixed_points_for_every_placement(tmp_path):
    want, rows, _ = _ttl_run(tmp_path / "ref", (4096, 4096), ttl=8, explicit=True)
    for i, caps in enumerate([(4096, 4096), (8, 16), (0, 24), (32, 0)]):
        got, got_rows, stats = _ttl_run(tmp_path / f"s{i}", caps, ttl=8)
        assert torch.equal(got, want), caps
        assert got_rows == rows  # the background deleter has removed every stale row
        assert stats["expired_cached"] + stats["expired_rows"] > 0
        if caps == (8, 16):  # rows went down to LMDB: the deleter removed some there
            assert stats["expired_rows"] > 0


def test_ttl_cutoff_survives_reopen_and_checkpoint(tmp_path):
    s = spec(ttl=4)
    with open_store(tmp_path / "s", [s]) as store:
        store.apply("t", torch.tensor([1, 2]), torch.ones(2, 4))
        store.advance(3)
        store.apply("t", torch.tensor([2]), torch.ones(1, 4))
        store.advance(3)  # clock 6: cutoff 2 at the boundary 6 (interval 1): row 1 (stamp 0) stale
        store.flush()
        assert store.expiry.wait(10)
        value2 = peek(store, "t", torch.tensor([2]))
        store.checkpoint(tmp_path / "ck")
    with open_store(tmp_path / "s", [s]) as store:
        assert store.expiry.cutoffs[0] == 2 and store.clock == 6
        assert stored_ids(store) == {2}
        assert torch.equal(peek(store, "t", torch.tensor([2])), value2)
    back = ts.TierStore.restore(tmp_path / "ck", tmp_path / "r", device="cpu", device_capacity=8,
                                host_capacity=8)
    with back:
        assert back.clock == 6 and stored_ids(back) == {2}


_HOLDER = """
import sys, threading, time
import torch
import tierstore as ts
store = ts.TierStore(sys.argv[1], ts.TableSpec("t", 10**11, 4, optimizer=ts.Adagrad(0.1),
                     admission=ts.CountAdmission(min_count=1, sketch="1MiB"), ttl=4),
                     device="cpu", device_capacity=0, host_capacity=0)
store.apply("t", torch.arange(3000), torch.ones(3000, 4))
store.flush()
store.read("t", torch.arange(5000, 6000))  # sketch pages to save at the next flush
inside = threading.Event()

def hold():  # a background writer (the ttl deleter, the write-behind writer) mid-transaction
    with store.backend.env.begin(write=True) as txn:
        inside.set()
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 0.5:  # Python work: needs the GIL to finish
            txn.get(b"x")

for _ in range(2):
    inside.clear()
    th = threading.Thread(target=hold)
    th.start()
    inside.wait()
    store.checkpoint(sys.argv[2] + str(_))  # flush (sketch save) + snapshot (named databases)
    th.join()
store.close()
print("ok")
"""


def test_named_database_opens_wait_for_a_writer_thread_without_the_gil(tmp_path):
    # py-lmdb's env.open_db without a transaction waits for LMDB's writer lock holding the GIL:
    # a checkpoint taken while the ttl deleter was inside a write transaction hung forever
    import subprocess
    import sys

    try:
        out = subprocess.run([sys.executable, "-c", _HOLDER, str(tmp_path / "s"),
                              str(tmp_path / "ck")], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("deadlock: a named-database open waited for the writer lock holding the GIL")
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_stale_copies_in_the_ring_and_the_log_never_come_back(tmp_path):
    s = spec(ttl=2)  # expiry points every clock step
    store = ts.TierStore(tmp_path / "s", [s], device_capacity=0, host_capacity=0, device="cpu",
                         seed=5, write_buffer=4096)
    fresh = open_store(tmp_path / "init", [spec()])
    logged, ringed = torch.arange(40) * STRIDE, torch.arange(40, 80) * STRIDE
    store.apply("t", logged, torch.ones(40, 4))
    store.writeback.drain()  # in the write-behind log, not merged; a committed copy in the ring
    assert store.log.size == 40
    store.writeback.delay = lambda: 0.3  # the next rows wait in the ring, unwritten
    store.apply("t", ringed, torch.ones(40, 4))
    assert store.writeback.pending == 40
    everyone = torch.cat([logged, ringed])
    init = peek(fresh, "t", everyone)
    assert not torch.equal(peek(store, "t", everyone), init)
    store.advance(3)  # cutoff 1: every row (stamp 0) is stale wherever it is
    assert torch.equal(peek(store, "t", everyone), init)
    store.writeback.delay = None
    store.writeback.drain()  # the old copies are written back after their expiry ...
    assert torch.equal(peek(store, "t", everyone), init)  # ... and stay expired
    store.apply("t", ringed[:5], torch.ones(5, 4))  # a fresh update after expiry: a new row
    again = peek(store, "t", ringed[:5])
    assert not torch.equal(again, init[40:45])
    store.flush()  # the cutoff is durable: the deleter removes the stale rows from LMDB
    assert store.expiry.wait(10)
    assert stored_ids(store) == set(ringed[:5].tolist())
    assert store.stats()["expiry"]["expired_rows"] == 75  # 80 stale, 5 of them updated since
    store.close()
    with open_store(tmp_path / "s", [s]) as store:
        assert torch.equal(peek(store, "t", everyone[45:]), init[45:])
        assert torch.equal(peek(store, "t", ringed[:5]), again)
        assert stored_ids(store) == set(ringed[:5].tolist())
    fresh.close()


def test_expire_reaches_rows_in_the_ring_the_log_and_read_ahead(tmp_path):
    store = ts.TierStore(tmp_path / "s", [spec()], device_capacity=0, host_capacity=0,
                         device="cpu", seed=5, write_buffer=4096)
    fresh = open_store(tmp_path / "init", [spec()])
    ids = torch.arange(60) * STRIDE
    store.apply("t", ids[:20], torch.ones(20, 4))
    store.flush()  # in the table
    store.apply("t", ids[20:40], torch.ones(20, 4))
    store.writeback.drain()  # in the log
    store.writeback.delay = lambda: 0.2
    store.apply("t", ids[40:], torch.ones(20, 4))  # pending in the ring
    with store.lock:  # a read-ahead buffer holding the table's copies (as the Prefetcher makes)
        data, found = store.loader.read_stored(store.tables["t"], ids[:20].numpy())
        store.loader.add_read_ahead("t", store.writeback.tail, ids[:20].numpy(), data, found, keep=2)
    store.advance(2)
    store.writeback.delay = None
    assert store.expire(older_than=1) == {"t": 60}
    assert torch.equal(peek(store, "t", ids), peek(fresh, "t", ids))
    assert stored_ids(store) == set()
    store.close()
    fresh.close()


def test_export_leaves_out_expired_rows_the_deleter_has_not_reached(tmp_path):
    from tierstore.export import export_store, import_store

    s = spec(ttl=2)
    fresh = open_store(tmp_path / "init", [spec()])
    ids = torch.arange(30) * STRIDE
    with open_store(tmp_path / "s", [s], caps=(0, 0)) as store:
        store.apply("t", ids, torch.ones(30, 4))
        store.advance(3)
        store.apply("t", ids[:10], torch.ones(10, 4))  # fresh again at clock 3
        live = peek(store, "t", ids[:10])
        store.expiry.close()  # no deleter: the 20 stale rows stay on disk
        store.flush()
        assert len(stored_ids(store)) == 30
        export_store(store, tmp_path / "ex")
    import_store(tmp_path / "ex", tmp_path / "back")
    with open_store(tmp_path / "back", [spec()]) as back:
        assert stored_ids(back) == set(ids[:10].tolist())
        assert torch.equal(peek(back, "t", ids[:10]), live)
        assert torch.equal(peek(back, "t", ids[10:]), peek(fresh, "t", ids[10:]))
    fresh.close()


_CRASH_IN_EXPIRE = """
import os, sys
import numpy as np
import torch
import tierstore as ts
from tierstore import expiry
spec = ts.TableSpec("t", 10**11, 4, optimizer=ts.Adagrad(0.1))
store = ts.TierStore(sys.argv[1], spec, device="cpu", device_capacity=0, host_capacity=0, seed=5)
expiry.DELETE_CHUNK = 500
ids = torch.arange(2000) * 4999
store.apply("t", ids, torch.ones(2000, 4))
store.advance()
store.apply("t", ids[:100], torch.ones(100, 4))
np.save(sys.argv[2], store.read("t", ids[:100]).numpy())
real, calls = expiry.delete_stale, []

def dying(*a):
    calls.append(1)
    if len(calls) == 2:  # one chunk of the stale rows deleted, then kill -9
        os._exit(9)
    return real(*a)

expiry.delete_stale = dying
store.expire(older_than=0)
"""


def test_kill9_inside_expire_reopens_with_the_rows_expired(tmp_path):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _CRASH_IN_EXPIRE, str(tmp_path / "s"),
                          str(tmp_path / "v.npy")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 9, out.stderr
    s = ts.TableSpec("t", 10**11, 4, optimizer=ts.Adagrad(0.1))
    ids = torch.arange(2000) * 4999
    with open_store(tmp_path / "init", [s]) as fresh:
        init = fresh.read("t", ids[100:])
    with open_store(tmp_path / "s", [s]) as store:
        assert store.clock == 1 and store.expiry.cutoffs == {0: 1}
        left = store.backend.count("t")
        assert 100 < left < 2000  # a crash mid-way: part of the stale rows still on disk ...
        assert torch.equal(store.read("t", ids[100:]), init)  # ... reading as expired
        assert torch.equal(store.read("t", ids[:100]), torch.from_numpy(np.load(tmp_path / "v.npy")))
        assert store.expire(older_than=0) == {"t": left - 100}  # the next expire finishes the job
        assert store.backend.count("t") == 100


def test_an_abandoned_store_with_a_ttl_deleter_is_collected(tmp_path):
    import gc
    import time
    import weakref

    store = open_store(tmp_path / "s", [spec(ttl=2)], caps=(0, 0))
    store.apply("t", torch.arange(50) * STRIDE, torch.ones(50, 4))
    store.advance(3)
    store.flush()  # starts the deleter
    assert store.expiry.wait(10) and store.expiry._thread.is_alive()
    thread, ref = store.expiry._thread, weakref.ref(store)
    del store
    gc.collect()
    assert ref() is None  # closed by __del__ (acknowledged writes kept), its deleter stopped
    t0 = time.monotonic()
    while thread.is_alive() and time.monotonic() - t0 < 10:
        time.sleep(0.02)
    assert not thread.is_alive()
    with open_store(tmp_path / "s", [spec(ttl=2)]) as again:
        assert again.clock == 3 and stored_ids(again) == set()


def test_close_deletes_the_rows_below_a_durable_ttl_cutoff(tmp_path):
    s = spec(ttl=2)
    ids = torch.arange(500) * STRIDE
    with open_store(tmp_path / "s", [s], caps=(0, 0)) as store:
        store.apply("t", ids, torch.ones(500, 4))
        store.flush()
        store.advance(3)  # every row expired; no flush since: nothing deleted yet
        store.apply("t", ids[:7], torch.ones(7, 4))
        assert store.backend.count("t") == 500
    with open_store(tmp_path / "s", [s]) as store:  # close() flushed and deleted the rest
        assert store.backend.count("t") == 7 and store.clock == 3


_CRASH_IN_DELETER = """
import sys, time
import numpy as np
import torch
import tierstore as ts
from tierstore import expiry
expiry.DELETE_CHUNK = 40  # many short write transactions: the kill lands between or inside them
spec = ts.TableSpec("t", 10**11, 4, optimizer=ts.Adagrad(0.1), ttl=4)
store = ts.TierStore(sys.argv[1], spec, device="cpu", device_capacity=0, host_capacity=0, seed=5)
ids = torch.arange(12000) * 4999
store.apply("t", ids, torch.ones(12000, 4))
store.advance(2)
store.apply("t", ids[:500], torch.ones(500, 4))
store.advance(3)  # cutoff 1: the 11,500 rows stamped 0 are stale
np.save(sys.argv[2], store.read("t", ids).numpy())
store.flush()  # the cutoff is durable: the deleter starts
print("flushed", flush=True)
store.apply("t", ids[500:600], torch.ones(100, 4))  # more write-backs beside the deleter
time.sleep(60)
"""


@pytest.mark.parametrize("delay", [0.03, 0.06, pytest.param(0.0, marks=pytest.mark.slow),
                                   pytest.param(0.3, marks=pytest.mark.slow)])
def test_kill9_while_the_ttl_deleter_runs_keeps_the_flush_point(tmp_path, delay):
    import signal
    import subprocess
    import sys
    import time

    proc = subprocess.Popen([sys.executable, "-c", _CRASH_IN_DELETER, str(tmp_path / "s"),
                             str(tmp_path / "v.npy")], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "flushed", proc.stderr.read()
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    s = ts.TableSpec("t", 10**11, 4, optimizer=ts.Adagrad(0.1), ttl=4)
    ids = torch.arange(12000) * 4999
    want = torch.from_numpy(np.load(tmp_path / "v.npy"))
    with open_store(tmp_path / "ref", [s]) as ref:  # the write made after the flush, replayed
        ref.apply("t", ids, torch.ones(12000, 4))
        ref.advance(5)
        ref.apply("t", ids[500:600], torch.ones(100, 4))
        later = ref.read("t", ids[500:600])
    with open_store(tmp_path / "s", [s]) as store:
        assert store.clock == 5 and store.expiry.cutoffs == {0: 1}
        assert 500 <= store.backend.count("t") <= 12000
        got = store.read("t", ids)
        # the flush point: fresh rows kept, stale rows initial; the write-behind may have landed
        # the post-flush update of rows 500..599 (whole, or not at all) before the kill
        assert torch.equal(got[:500], want[:500]) and torch.equal(got[600:], want[600:])
        assert torch.equal(got[500:600], want[500:600]) or torch.equal(got[500:600], later)
    with open_store(tmp_path / "s", [s]) as store:
        assert store.backend.count("t") in (500, 600)  # the reopened store finished the deletion
