"""Read-only handles on a live store: flushed states only, refresh, remaps, compaction, no writes."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import hypothesis.strategies as st
import numpy as np
import pytest
import torch
from hypothesis import given, settings

import tierstore as ts
from tierstore.backends import lmdb_backend
from tierstore.serving import ReadOnlyStore

REPO = Path(__file__).resolve().parents[1]
N, DIM = 400, 4
SPEC = ts.TableSpec("t", N, DIM, optimizer=ts.Adagrad(0.1))
ALL = torch.arange(N)


def _writer(path, **kw) -> ts.TierStore:
    # caches far below the rows touched, and a write-behind ring of 8 rows (a log of 32): between
    # flushes evicted rows go through the ring to the log, and the log is merged into the tables
    kw.setdefault("write_buffer", 8)
    return ts.TierStore(path, [SPEC, ts.TableSpec("h", 50, 3, dtype="float16")],
                        device_capacity=16, host_capacity=32, device="cpu", **kw)


def _merged(store: ts.TierStore) -> int:
    """Rows the write-behind log merged into the tables so far."""
    return store.stats()["writeback"]["log_merged"]


def _train(store: ts.TierStore, gen: torch.Generator, steps: int = 3) -> None:
    for _ in range(steps):
        ids = torch.randint(0, N, (200,), generator=gen)
        store.apply("t", ids, torch.randn(200, DIM, generator=gen))


def test_reads_the_last_flush_and_refresh_moves_on(store_path):
    gen = torch.Generator().manual_seed(0)
    with _writer(store_path) as store:
        _train(store, gen)
        store.flush()
        flushed = store.read("t", ALL)
        with ReadOnlyStore(store_path, host_capacity=64, device="cpu") as reader:
            assert torch.equal(reader.read("t", ALL), flushed)
            merged = _merged(store)
            _train(store, gen)  # rows evicted after the flush (log appends and merges): invisible
            assert store.stats()["ssd"]["writebacks"] > 0
            # the background merger moves the log into the tables: wait for it (a loaded machine
            # may not have scheduled its thread yet), then the reader must still see the flush
            deadline = time.monotonic() + 30
            while _merged(store) == merged and time.monotonic() < deadline:
                time.sleep(0.01)
            assert _merged(store) > merged
            assert not torch.equal(store.read("t", ALL), flushed)
            assert torch.equal(reader.read("t", ALL), flushed)
            assert reader.refresh() is False  # no new flush: same state
            assert torch.equal(reader.read("t", ALL), flushed)
            store.flush()
            assert reader.refresh() is True
            assert torch.equal(reader.read("t", ALL), store.read("t", ALL))
            # a float16 table and never-written rows read as the writer reads them
            assert torch.equal(reader.read("h", torch.arange(50)), store.read("h", torch.arange(50)))


def test_writes_raise_read_only_error(store_path):
    with _writer(store_path) as store:
        store.flush()
    with ReadOnlyStore(store_path, device="cpu") as reader:
        before = reader.read("t", ALL)
        for call in (lambda: reader.apply("t", torch.tensor([1]), torch.ones(1, DIM)),
                     lambda: reader.apply_unique("t", torch.tensor([1]), torch.ones(1, DIM)),
                     lambda: reader.gather("t", torch.tensor([1])), reader.flush, reader.advance,
                     reader.compact,
                     lambda: reader.checkpoint(store_path.parent / "ck")):
            with pytest.raises(ts.ReadOnlyError):
                call()
        with pytest.raises(ts.InvalidIdsError):
            reader.read("t", torch.tensor([N]))
        with pytest.raises(ts.UnknownTableError):
            reader.read("nope", torch.tensor([0]))
        assert torch.equal(reader.read("t", ALL), before)
    with pytest.raises(ts.StoreClosedError):
        reader.read("t", ALL)
    empty = store_path.parent / "empty"
    empty.mkdir()
    with pytest.raises(ts.StoreCorruptError):
        ReadOnlyStore(empty)
    assert list(empty.iterdir()) == []  # nothing created there


def test_host_cache_serves_hot_rows_and_is_dropped_on_a_new_state(store_path):
    gen = torch.Generator().manual_seed(1)
    with _writer(store_path) as store:
        _train(store, gen)
        store.flush()
        with ReadOnlyStore(store_path, host_capacity=100, device="cpu") as reader:
            hot = torch.tensor([5, 7, 7, 9])
            first = reader.read("t", hot)
            again = reader.read("t", hot)
            assert torch.equal(first, again)
            st = reader.stats()["host"]
            assert st["hits"] == 3 and st["resident"] == 3
            _train(store, gen)
            store.flush()
            assert reader.refresh()
            assert reader.stats()["host"]["resident"] == 0
            assert torch.equal(reader.read("t", hot), store.read("t", hot))


def test_reader_does_not_block_a_writer_opening_and_sees_its_flushes(store_path):
    with _writer(store_path) as store:
        store.flush()
        first = store.read("t", ALL)
    reader = ReadOnlyStore(store_path, device="cpu")  # no writer: the closed store's state
    assert reader.stats()["borrowed_env"] is False
    assert torch.equal(reader.read("t", ALL), first)
    with _writer(store_path) as store:  # the writer lock is free: opening never waits
        _train(store, torch.Generator().manual_seed(2))
        store.flush()
        assert reader.refresh()
        assert torch.equal(reader.read("t", ALL), store.read("t", ALL))
    reader.close()


def test_log_appends_alone_never_make_a_reader_wait(store_path):
    """Evicted rows that only reached the write-behind log leave the tables at the flush."""
    gen = torch.Generator().manual_seed(3)
    with _writer(store_path, write_buffer=4096) as store:
        store.flush()
        flushed = store.read("t", ALL)
        _train(store, gen)  # no reader registered; the log (16,384 rows) is never merged
        assert store.stats()["ssd"]["writebacks"] > 0 and _merged(store) == 0
        with ReadOnlyStore(store_path, device="cpu", timeout=0.05) as reader:
            assert torch.equal(reader.read("t", ALL), flushed)


def test_unseen_writes_before_a_reader_registers_wait_for_the_next_flush(store_path):
    gen = torch.Generator().manual_seed(3)
    with _writer(store_path) as store:
        _train(store, gen)  # stored rows at the flush (chunk levels: published ranges)
        store.flush()
        merged = _merged(store)
        _train(store, gen)  # log merges with no reader registered: not undoable
        assert store.stats()["ssd"]["writebacks"] > 0 and _merged(store) > merged
        with pytest.raises(ts.SnapshotUnavailableError):
            ReadOnlyStore(store_path, device="cpu", timeout=0.05)
        store.flush()
        with ReadOnlyStore(store_path, device="cpu", timeout=0.05) as reader:
            assert torch.equal(reader.read("t", ALL), store.read("t", ALL))


def test_in_process_map_growth_and_compaction_reopen_transparently(store_path, monkeypatch):
    monkeypatch.setattr(lmdb_backend, "_INITIAL_MAP", 1 << 20)
    big = ts.TableSpec("big", 10**9, 32)
    gen = torch.Generator().manual_seed(4)
    with ts.TierStore(store_path, [big], device_capacity=64, host_capacity=64,
                      device="cpu") as store:
        ids = torch.arange(0, 10**9, 10**9 // 5000)
        store.apply("big", ids[:100], torch.randn(100, 32, generator=gen))
        store.flush()
        reader = ReadOnlyStore(store_path, device="cpu", host_capacity=0)
        flushed = reader.read("big", ids)
        map0 = store.backend.env.info()["map_size"]
        store.apply("big", ids, torch.randn(ids.numel(), 32, generator=gen))  # grows the map
        store.flush()
        assert store.backend.env.info()["map_size"] > map0
        # the in-process snapshot was invalidated by the remap: the reader reopened on the
        # newest flushed state (documented), never a torn one
        got = reader.read("big", ids)
        assert reader.stats()["reopens"] >= 1
        assert torch.equal(got, store.read("big", ids)) and not torch.equal(got, flushed)
        store.backend.compact()
        assert torch.equal(reader.read("big", ids), store.read("big", ids))
        reader.close()


def test_in_process_reader_never_waits_for_a_write_transaction(tmp_path):
    """A reader borrowing the writer's environment opens no database handle (a write txn).

    Run in a subprocess: a reader that waits for the write lock can hang the interpreter.
    """
    env = dict(os.environ)
    try:
        done = subprocess.run([sys.executable, str(REPO / "tests" / "serve_borrow_worker.py"),
                               str(tmp_path / "s")], env=env, capture_output=True, text=True,
                              timeout=90)
    except subprocess.TimeoutExpired:
        pytest.fail("the in-process reader waited for the writer's write transaction (hung)")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["OK"], done.stdout


def test_in_process_reader_thread_against_background_merges_and_map_growth(store_path, monkeypatch):
    """Reads in one thread while training, log merges, flushes and map growth go on: no deadlock,
    and every read is one whole flushed state (in-process a lost snapshot moves to the newest)."""
    monkeypatch.setattr(lmdb_backend, "_INITIAL_MAP", 1 << 20)
    gen = torch.Generator().manual_seed(7)
    states: dict[int, torch.Tensor] = {}
    seen: list[tuple[int, torch.Tensor]] = []
    errors: list[BaseException] = []
    stop = threading.Event()
    wide = ts.TableSpec("w", 100_000, 64)  # its rows make the 1 MiB map grow several times
    with ts.TierStore(store_path, [SPEC, wide], device_capacity=16, host_capacity=32,
                      device="cpu", write_buffer=8) as store:
        store.flush()
        states[_epoch(store)] = store.read("t", ALL)
        map0 = store.backend.env.info()["map_size"]
        reader = ReadOnlyStore(store_path, device="cpu", host_capacity=64, timeout=5)

        def serve() -> None:
            try:
                while not stop.is_set():
                    rows = reader.read("t", ALL)
                    seen.append((reader.epoch, rows))
                    reader.refresh()
            except BaseException as exc:  # reported by the main thread
                errors.append(exc)

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        try:
            for _ in range(12):
                _train(store, gen, 2)
                ids = torch.randint(0, 100_000, (2000,), generator=gen)
                store.apply("w", ids, torch.randn(2000, 64, generator=gen))
                store.flush()
                states[_epoch(store)] = store.read("t", ALL)
        finally:
            stop.set()
            thread.join(30)
        assert not thread.is_alive(), "the reader deadlocked against the writer"
        assert not errors, errors
        assert store.backend.env.info()["map_size"] > map0  # the map grew meanwhile
        reader.close()
    assert len({e for e, _ in seen}) >= 2
    for epoch, rows in seen:
        assert torch.equal(rows, states[epoch]), epoch


def test_offline_compaction_never_breaks_a_reader(store_path):
    """`tierstore compact` in another process: the open snapshot keeps reading; refresh reopens."""
    gen = torch.Generator().manual_seed(8)
    with _writer(store_path) as store:
        for _ in range(4):
            _train(store, gen)
            store.flush()
        want = store.read("t", ALL)
        store.backend.compact_on_close = None  # leave the file for the command to compact
    reader = ReadOnlyStore(store_path, device="cpu", host_capacity=0)
    try:
        assert torch.equal(reader.read("t", ALL), want)
        ino = (store_path / "data.mdb").stat().st_ino
        env = dict(os.environ)
        done = subprocess.run([sys.executable, "-c", "import sys; from tierstore.cli import main; "
                               "sys.exit(main(['compact', sys.argv[1]]))", str(store_path)],
                              env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert (store_path / "data.mdb").stat().st_ino != ino  # a new file
        assert torch.equal(reader.read("t", ALL), want)  # the old snapshot still reads
        reopens = reader.stats()["reopens"]
        reader.refresh()
        assert reader.stats()["reopens"] == reopens + 1
        assert torch.equal(reader.read("t", ALL), want)
    finally:
        reader.close()


def test_readers_in_one_process_share_an_environment_and_make_way_for_a_writer(store_path):
    """py-lmdb allows one environment per store in a process: readers share one, and a writer
    (or any handle) opening the store takes it over; the readers go on on new snapshots."""
    gen = torch.Generator().manual_seed(10)
    with _writer(store_path) as store:
        _train(store, gen)
        store.flush()
        first = store.read("t", ALL)
    a = ts.TierStore.open(store_path, readonly=True, device="cpu")
    b = ts.TierStore.open(store_path, readonly=True, device="cpu", host_capacity=1000)
    try:
        assert torch.equal(a.read("t", ALL), first) and torch.equal(b.read("t", ALL), first)
        b.close()
        assert torch.equal(a.read("t", ALL), first)  # b's close left a's environment open
        b = ts.TierStore.open(store_path, readonly=True, device="cpu", host_capacity=1000)
        with ts.TierStore.open(store_path, device="cpu", write_buffer=8,  # reads the specs too
                               device_capacity=16, host_capacity=32) as store:
            assert torch.equal(a.read("t", ALL), first)  # reopened on the same published state
            _train(store, gen)
            store.flush()
            assert a.refresh() and b.refresh()
            assert a.stats()["borrowed_env"] and b.stats()["borrowed_env"]
            assert torch.equal(a.read("t", ALL), store.read("t", ALL))
            assert torch.equal(b.read("t", ALL), store.read("t", ALL))
            second = store.read("t", ALL)
        a.refresh()  # the writer closed: a shared environment again
        assert not a.stats()["borrowed_env"]
        assert torch.equal(a.read("t", ALL), second)
        assert torch.equal(b.read("t", ALL), second)
    finally:
        a.close()
        b.close()


def test_sequence_modules_serve_from_a_read_only_handle(store_path):
    """Inference through TieredEmbedding(Collection) on a reader; training through it is refused."""
    gen = torch.Generator().manual_seed(11)
    with _writer(store_path) as store:
        _train(store, gen)
        store.flush()
        with ts.TierStore.open(store_path, readonly=True, device="cpu") as reader:
            ids = torch.tensor([[0, 5, 399], [7, 7, 3]])
            emb = ts.TieredEmbedding(reader, "t", padding_idx=3)
            out = emb(ids)
            want = store.read("t", ids.reshape(-1)).reshape(2, 3, DIM)
            want[1, 2] = 0
            assert torch.equal(out, want)
            with pytest.raises(ts.ReadOnlyError):
                out.sum().backward()
            ec = ts.TieredEmbeddingCollection(reader, {"x": "t"})
            got = ec(["x"], torch.tensor([1, 2, 3]), torch.tensor([2, 1]))["x"]
            assert torch.equal(got.values(), store.read("t", torch.tensor([1, 2, 3])))
            assert torch.equal(got.lengths(), torch.tensor([2, 1]))


def test_tierstore_open_readonly(store_path):
    gen = torch.Generator().manual_seed(9)
    with pytest.raises(ts.StoreNotFoundError):
        ts.TierStore.open(store_path, readonly=True)
    with _writer(store_path) as store:
        store.flush()
        want = store.read("t", ALL).cpu()
        with ts.TierStore.open(store_path, readonly=True, host_capacity=100) as reader:
            assert isinstance(reader, ReadOnlyStore)
            assert reader.host_tier.capacity == 100  # its own host cache
            assert torch.equal(reader.read("t", ALL).cpu(), want)
            with pytest.raises(ts.ReadOnlyError):
                reader.apply("t", torch.tensor([0]), torch.ones(1, DIM))
            _train(store, gen)
            assert torch.equal(reader.read("t", ALL).cpu(), want)
            store.flush()
            assert reader.refresh()
            assert torch.equal(reader.read("t", ALL).cpu(), store.read("t", ALL).cpu())


def _run_reader_against_writer(tmp_path: Path, steps: int, compact_at: int) -> None:
    store, states = tmp_path / "store", tmp_path / "states"
    env = dict(os.environ)
    proc = subprocess.Popen([sys.executable, str(REPO / "tests" / "serve_worker.py"), str(store),
                             str(states), str(steps), "4", str(compact_at)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout.readline().strip() == "F 1"  # the store exists and has a flush
        reader = ts.TierStore.open(store, readonly=True, host_capacity=500, device="cpu")
        seen: list[tuple[int, np.ndarray]] = []
        rows = torch.arange(3000)
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:
            # one snapshot read in pieces, with the writer running in between
            parts = []
            for chunk in torch.split(rows[torch.randperm(3000)], 700):
                parts.append((chunk, reader.read("t", chunk)))
                time.sleep(0.002)
            table = torch.empty(3000, 8)
            for chunk, vals in parts:
                table[chunk] = vals
            seen.append((reader.epoch, table.numpy()))
            reader.refresh()
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        assert out.strip().endswith("DONE")
        busy = int(out.split("MERGED ")[1].split()[0])
        assert busy >= steps // 8  # the background writer merged the log between most flushes
        stats = reader.stats()
        reader.close()
    finally:
        if proc.poll() is None:
            proc.kill()
    epochs = [e for e, _ in seen]
    assert len(set(epochs)) >= 3, epochs  # the reader followed the writer across flushes
    assert epochs == sorted(epochs)
    for epoch, table in seen:  # each snapshot is exactly the state at one flush: no mix
        assert np.array_equal(table, np.load(states / f"{epoch}.npy")), epoch
    if compact_at > 0:
        assert stats["reopens"] >= 1


def test_reader_process_sees_only_whole_flushes_of_a_writer_process(tmp_path):
    """The writer grows its map (from 1 MiB) and compacts the live store midway."""
    _run_reader_against_writer(tmp_path, steps=48, compact_at=4)


@pytest.mark.slow
def test_reader_process_against_a_long_writer_run(tmp_path):
    _run_reader_against_writer(tmp_path, steps=400, compact_at=20)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_reads_onto_cuda(store_path):
    with _writer(store_path) as store:
        store.flush()
        want = store.read("t", ALL)
    with ReadOnlyStore(store_path, device="cuda") as reader:
        got = reader.read("t", ALL)
        assert got.device.type == "cuda" and torch.equal(got.cpu(), want)


@pytest.mark.slow
def test_bench_serving_smoke(tmp_path):
    import json

    from bench import serving as bench_serving

    assert bench_serving.main(["--quick", "--out", str(tmp_path)]) == 0
    recs = json.loads((tmp_path / "serving.json").read_text())["records"]
    lat = [r for r in recs if r["part"] == "latency"]
    assert {(r["trainer"], r["cache"], r["ids"]) for r in lat} == {
        (t, c, n) for t in ("writing", "idle") for c in ("1%", "10%") for n in (1, 64, 512)}
    assert all(0 < r["p50_ms"] <= r["p99_ms"] and 0 <= r["hit_rate"] <= 1 for r in lat)
    auc = {r["dtype"]: r for r in recs if r["part"] == "auc"}
    assert set(auc) == {"float32", "int8", "int4"}
    assert abs(auc["float32"]["auc_delta"]) < 1e-4  # the read-only path reads the trained rows
    assert auc["int4"]["bytes_per_row"] < auc["int8"]["bytes_per_row"] < auc["float32"]["bytes_per_row"]


@settings(deadline=None, max_examples=15)
@given(ops=st.lists(st.sampled_from(["train", "flush", "read", "refresh", "reopen", "compact"]),
                    min_size=1, max_size=25),
       seed=st.integers(0, 2**16))
def test_any_interleaving_reads_exactly_the_readers_published_flush(tmp_path_factory, ops, seed):
    """Whatever the writer does between a reader's calls, a read equals the state at its epoch."""
    path = tmp_path_factory.mktemp("interleave") / "s"
    gen = torch.Generator().manual_seed(seed)
    states: dict[int, torch.Tensor] = {}
    with _writer(path) as store:
        store.flush()
        states[_epoch(store)] = store.read("t", ALL)
        reader = ReadOnlyStore(path, host_capacity=50, device="cpu", timeout=0.05)
        for op in ops:
            if op == "train":
                _train(store, gen, 1)
            elif op == "flush":
                store.flush()
                states[_epoch(store)] = store.read("t", ALL)
            elif op == "refresh":
                reader.refresh()
            elif op == "reopen":
                reader.close()
                try:
                    reader = ReadOnlyStore(path, host_capacity=50, device="cpu", timeout=0.05)
                except ts.SnapshotUnavailableError:  # trained since a flush no reader saw
                    store.flush()
                    states[_epoch(store)] = store.read("t", ALL)
                    reader = ReadOnlyStore(path, host_capacity=50, device="cpu", timeout=0.05)
            elif op == "compact":
                store.backend.compact()
            ids = torch.randint(0, N, (60,), generator=gen)
            got = reader.read("t", ids)
            assert torch.equal(got, states[reader.epoch][ids]), op
        reader.close()


def _epoch(store: ts.TierStore) -> int:
    """The writer's published epoch, read from its own environment."""
    import json

    from tierstore.backends.publish import PUBLISHED

    with store.backend.env.begin() as txn:
        return json.loads(txn.get(PUBLISHED, db=store.backend.publisher.meta))["epoch"]
