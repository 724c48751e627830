"""The write-behind ring and its writer: no stale reads, a full ring waits, failures keep rows."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import tierstore as ts
from tests.reference import DictStore

REPO = Path(__file__).resolve().parents[1]
SPEC = ts.TableSpec("t", 10**10, 4, optimizer=ts.Adagrad(0.1))
SMALL = {"device": "cpu", "device_capacity": 8, "host_capacity": 8}


def _grads(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, SPEC.dim, generator=torch.Generator().manual_seed(seed))


def _append_random(s, specs, rng, n: int, universe: int, want: dict) -> None:
    """Append up to `n` distinct random (table, row) keys with random payloads straight to the
    log (as the writer does); record each row's newest version in `want`."""
    tabs, rows = rng.integers(0, len(specs), n), rng.integers(0, universe, n)
    _, first = np.unique(tabs * 10**6 + rows, return_index=True)
    tabs, rows = tabs[first], rows[first]
    pay = rng.standard_normal((len(rows), s.width), dtype=np.float32)
    with s.writeback.cv:
        s.log.append(tabs, rows, pay)
    for t, r, p in zip(tabs.tolist(), rows.tolist(), pay):
        want[(t, r)] = p[: specs[t].row_dim].copy()


def _log_only_store(tmp_path, specs) -> ts.TierStore:
    """A store with no cache tiers and a log that holds 10^5 rows (reads go to the log or LMDB)."""
    return ts.TierStore(tmp_path / "s", specs, device="cpu", device_capacity=0, host_capacity=0,
                        write_log=10**5)


def test_reads_are_served_from_the_ring_before_the_writer_commits(tmp_path):
    with ts.TierStore(tmp_path / "s", SPEC, device_capacity=0, host_capacity=0, device="cpu",
                      write_buffer=64) as s:
        model = DictStore([SPEC])
        s.writeback.delay = lambda: 0.3  # the writer sleeps before each batch
        ids = torch.tensor([5, 9, 10**9])
        s.apply("t", ids, _grads(3, 1))
        model.apply("t", ids, _grads(3, 1))
        assert s.writeback.pending == 3
        data, found = s.backend.get("t", ids.numpy(), SPEC.row_dim)
        assert not found.any()  # nothing reached LMDB yet ...
        assert torch.equal(s.read("t", ids), model.read("t", ids))  # ... the ring serves them
        s.apply("t", ids[:2], _grads(2, 2))  # a newer version supersedes the pending one
        model.apply("t", ids[:2], _grads(2, 2))
        assert torch.equal(s.read("t", ids), model.read("t", ids))
        s.writeback.delay = None
        s.flush()
        assert s.writeback.pending == 0
        data, found = s.backend.get("t", ids.numpy(), SPEC.row_dim)
        assert found.all()
        assert torch.equal(torch.from_numpy(data[:, : SPEC.dim]), model.read("t", ids))


def test_a_full_ring_makes_the_caller_wait_and_drops_nothing(tmp_path):
    model = DictStore([SPEC])
    with ts.TierStore(tmp_path / "s", SPEC, device_capacity=3, host_capacity=2, device="cpu",
                      write_buffer=2) as s:
        s.writeback.delay = lambda: 0.002
        for step in range(40):
            ids = torch.arange(step * 4, step * 4 + 6) % 37
            s.apply("t", ids, _grads(6, step))
            model.apply("t", ids, _grads(6, step))
        assert s.writeback.wait_seconds > 0  # the ring was full and the caller waited
        assert s.writeback.stats()["rows_in"] > 2 * 40
        every = torch.arange(37)
        assert torch.equal(s.read("t", every), model.read("t", every))
    with ts.TierStore(tmp_path / "s", SPEC, device="cpu", device_capacity=64, host_capacity=64) as s:
        assert torch.equal(s.read("t", torch.arange(37)), model.read("t", torch.arange(37)))


@pytest.mark.parametrize("ring,delay", [(8, 0.001), (64, 0.01)])
def test_prefetch_read_ahead_stays_exact_with_a_slow_writer(tmp_path, ring, delay):
    """Rows read ahead by the pipeline (or copied from the ring) are never used once a newer
    version passed through the ring; a large ring with a slow writer keeps rows in it."""
    from tierstore.prefetch import Prefetcher

    specs = [SPEC]
    batches = [torch.randint(0, 60, (24,), generator=torch.Generator().manual_seed(i)) for i in range(30)]
    model = DictStore(specs)
    with ts.TierStore(tmp_path / "s", specs, device_capacity=4, host_capacity=4, device="cpu",
                      write_buffer=ring) as s:
        s.writeback.delay = lambda: delay
        src = ({"t": b} for b in batches)
        with Prefetcher(s, src, depth=3) as pf:
            for i, batch in enumerate(pf):
                ids = batch["t"]
                assert torch.equal(s.read("t", ids), model.read("t", ids))
                s.apply("t", ids, _grads(len(ids), 100 + i))
                model.apply("t", ids, _grads(len(ids), 100 + i))
        assert s.prefetch_stats.rows_read_ahead_from_ssd > 0
        every = torch.arange(60)
        assert torch.equal(s.read("t", every), model.read("t", every))


@pytest.mark.parametrize("delay", [0.0, 0.005])
def test_staged_batches_of_two_tables_stay_exact_with_a_slow_writer_and_merges(tmp_path, monkeypatch,
                                                                               delay):
    """Prefetch staging of two tables of different widths (one placement a batch, one log read
    for both) with a slowed writer and a small log that merges while training: every step reads
    what a plain dict of rows holds."""
    from tierstore.backends import wal
    from tierstore.prefetch import Prefetcher

    monkeypatch.setattr(wal.writelog, "CHUNK_ROWS", 16)
    specs = [SPEC, ts.TableSpec("u", 10**6, 6, optimizer=ts.RowWiseAdagrad(0.2))]
    gen = torch.Generator().manual_seed(7)
    batches = [{"t": torch.randint(0, 400, (30,), generator=gen),
                "u": torch.randint(0, 300, (20,), generator=gen)} for _ in range(60)]
    model = DictStore(specs)
    with ts.TierStore(tmp_path / "s", specs, device_capacity=160, host_capacity=240, device="cpu",
                      write_buffer=32, write_log=200) as s:
        s.writeback.delay = lambda: delay
        with Prefetcher(s, iter(batches), depth=2) as pf:
            for i, batch in enumerate(pf):
                for name, ids in batch.items():
                    assert torch.equal(s.read(name, ids), model.read(name, ids))
                    g = torch.randn(len(ids), s.tables[name].spec.dim,
                                    generator=torch.Generator().manual_seed(1000 + i))
                    s.apply(name, ids, g)
                    model.apply(name, ids, g)
        st = s.prefetch_stats
        assert st.warm_only < len(batches) and st.staged_from_ssd > 0  # staged, from LMDB too
        assert s.log.rows_merged > 0 and s.log.rows_appended > 0
        for name, n in (("t", 400), ("u", 300)):
            every = torch.arange(n)
            assert torch.equal(s.read(name, every), model.read(name, every))


def test_writer_out_of_space_keeps_rows_and_fails_before_changing_anything(tmp_path):
    spec = ts.TableSpec("t", 10**10, 64, optimizer=ts.Adagrad(0.1))
    model = DictStore([spec])
    rows_per_call = 2000
    s = ts.TierStore(tmp_path / "s", spec, device_capacity=0, host_capacity=0, device="cpu",
                     write_buffer=rows_per_call, map_limit="4MiB")
    try:
        with pytest.raises(ts.OutOfSpaceError):
            for step in range(100):  # ~1 MiB of rows per call: the 4 MiB map fills up
                ids = torch.arange(step * rows_per_call, (step + 1) * rows_per_call)
                g = torch.ones(rows_per_call, 64) * (step + 1)
                before = dict(model.rows)
                try:
                    s.apply("t", ids, g)
                except ts.OutOfSpaceError:
                    model.rows = before  # the failed call changed nothing in the model either
                    raise
                model.apply("t", ids, g)
                s.flush()
        touched = torch.arange(0, (step + 1) * rows_per_call)
        # raising the limit lets the writer go on: nothing that was accepted is lost
        s.map_limit = "1GiB"
        s.flush()
        assert torch.equal(s.read("t", touched), model.read("t", touched))
    finally:
        s.map_limit = "1GiB"
        s.close()


WORKER = r"""
import sys, torch, tierstore as ts
spec = ts.TableSpec("t", 10**10, 4, optimizer=ts.Adagrad(0.1))
s = ts.TierStore(sys.argv[1], spec, device_capacity=4, host_capacity=4, device="cpu", write_buffer=3)
s.writeback.delay = lambda: 0.01
for step in range(1, 10**6):
    ids = torch.randint(0, 50, (12,), generator=torch.Generator().manual_seed(step))
    g = torch.randn(12, 4, generator=torch.Generator().manual_seed(10**6 + step))
    print(f"S {step}", flush=True)
    s.apply("t", ids, g)
    if step % 5 == 0:
        s.flush()
        print(f"F {step}", flush=True)
"""


@pytest.mark.parametrize("kill_after", [0.8, 1.7])
def test_kill_with_a_full_ring_loses_nothing_acknowledged(tmp_path, kill_after):
    path = tmp_path / "s"
    proc = subprocess.Popen([sys.executable, "-c", WORKER, str(path)], stdout=subprocess.PIPE,
                            text=True, cwd=REPO, env=dict(os.environ))
    lines: list[str] = []
    t0 = time.time()
    while time.time() - t0 < 60:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line.split())
        acks = [int(x[1]) for x in lines if x[0] == "F"]
        if acks and time.time() - t0 > kill_after + 2:
            break
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    acked = max(int(x[1]) for x in lines if x[0] == "F")
    started = max(int(x[1]) for x in lines if x[0] == "S")
    # every row must hold its value after some step in [last acknowledged flush, last step started]
    model = DictStore([SPEC])
    states = {}
    for step in range(1, started + 1):
        ids = torch.randint(0, 50, (12,), generator=torch.Generator().manual_seed(step))
        model.apply("t", ids, torch.randn(12, 4, generator=torch.Generator().manual_seed(10**6 + step)))
        if step >= acked:
            states[step] = model.read("t", torch.arange(50))
    with ts.TierStore(path, SPEC, device="cpu", device_capacity=64, host_capacity=64) as s:
        got = s.read("t", torch.arange(50))
        s.check()
    for row in range(50):
        assert any(torch.equal(got[row], st[row]) for st in states.values()), row
    assert np.isfinite(got.numpy()).all()


def _kill(s) -> None:
    """Leave a store as a kill would: its writer stopped, its log unmerged, nothing closed."""
    s.log.stop_merger()
    s.writeback.close()
    s.backend.sync()
    s.backend.close()
    s.closed = True


def _leave_a_log(path, version_rows: dict[int, int]) -> dict[int, torch.Tensor]:
    """A store whose writer appended rows to the log but never merged them (as after a kill):
    returns the rows' logged payloads."""
    from tierstore.backends import wal

    s = ts.TierStore(path, SPEC, device="cpu", device_capacity=0, host_capacity=0)
    s.flush()
    w = s.width
    rows = np.array(sorted(version_rows), dtype=np.int64)
    pay = np.zeros((len(rows), w), dtype=np.float32)
    pay[:, : SPEC.dim] = np.array([version_rows[r] for r in rows], dtype=np.float32)[:, None]
    with s.writeback.cv:
        s.log.append(np.zeros(len(rows), dtype=np.int64), rows, pay)
    assert s.log.size == len(rows) and len(s.log._chunks) >= 1
    _kill(s)  # the log stays as a kill would leave it
    return {int(r): torch.from_numpy(pay[i, : SPEC.dim]) for i, r in enumerate(rows)}, wal


def _legacy_log_value(row: int, value: float, wal) -> bytes:
    """A one-row log value as logs wrote them before chunks."""
    from tierstore.backends.record import seal

    rec = np.zeros(SPEC.row_dim, dtype=np.float32)
    rec[: SPEC.dim] = value
    body = seal(np.array([row]), rec[None, :])[0].tobytes()
    head = np.array([wal.table_id("t"), 0], dtype=np.uint32).tobytes() + \
        np.array([row], dtype="<i8").tobytes()
    return head + body


def test_a_log_left_behind_is_replayed_on_open_and_its_files_removed(tmp_path):
    path = tmp_path / "s"
    want, wal = _leave_a_log(path, {r: float(r) + 0.5 for r in range(0, 9000, 3)})
    assert (path / "wlog" / "data.mdb").exists()  # the log's own environment
    with ts.TierStore(path, SPEC, device="cpu", device_capacity=0, host_capacity=0) as s:
        assert s.log.size == 0  # replayed and emptied
        assert wal.merged_through(s.backend) == max(want) // 3  # 3000 entries: seq 0..2999
        assert s.log.next == 3000  # new entries continue past the merged ones
        ids = torch.tensor(sorted(want))
        got = s.read("t", ids)
        for i, r in enumerate(ids.tolist()):
            assert torch.equal(got[i], want[r]), r
    assert not (path / "wlog").exists()  # an empty log leaves no file behind at close


def test_a_format_2_store_with_its_log_in_the_tables_environment_is_converted(tmp_path):
    """Format 2 kept the log (chunks, and one-row values before chunks) in the tables' own
    environment: a writable open merges and drops it, and the store becomes format 3."""
    import json

    import lmdb as _lmdb

    from tierstore.backends.lmdb_backend import META_DB

    path = tmp_path / "s"
    want, wal = _leave_a_log(path, {r: float(r) + 0.5 for r in range(0, 9000, 3)})
    log_env = _lmdb.open(str(path / "wlog"), max_dbs=4, subdir=True)
    with log_env.begin(db=log_env.open_db(wal.LOG_DB)) as txn:
        chunks = [(bytes(k), bytes(v)) for k, v in txn.cursor()]
    log_env.close()
    shutil.rmtree(path / "wlog")
    env = _lmdb.open(str(path), max_dbs=4096, subdir=True)
    db = env.open_db(wal.LOG_DB)
    meta = env.open_db(META_DB)
    with env.begin(write=True) as txn:
        for k, v in chunks:
            txn.put(k, v, db=db, append=True)
        txn.put((10**9).to_bytes(8, "big"), _legacy_log_value(5, 7.25, wal), db=db, append=True)
        store = json.loads(txn.get(b"store", db=meta))
        txn.put(b"store", json.dumps({**store, "format_version": 2}).encode(), db=meta)
    env.close()
    want[5] = torch.full((SPEC.dim,), 7.25)
    with ts.TierStore(path, SPEC, device="cpu", device_capacity=0, host_capacity=0) as s:
        assert s.backend.get_meta("store")["format_version"] == ts.store.FORMAT_VERSION == 3
        ids = torch.tensor(sorted(want))
        got = s.read("t", ids)
        for i, r in enumerate(ids.tolist()):
            assert torch.equal(got[i], want[r]), r
    env = _lmdb.open(str(path), max_dbs=4096, subdir=True, readonly=True)
    with pytest.raises(_lmdb.NotFoundError):
        env.open_db(wal.LOG_DB, create=False)  # the old log is gone from the tables' file
    env.close()


def test_log_entries_the_tables_record_as_merged_are_not_replayed(tmp_path):
    """After an OS crash the log's unsynced file may come back older than the tables: holding
    entries a merge already folded in and deleted, older than rows the tables have since. The
    tables' `merged_through` record keeps replay from writing them back."""
    path = tmp_path / "s"
    _leave_a_log(path, {r: 1.0 for r in range(100)})
    old_log = (path / "wlog" / "data.mdb").read_bytes()  # the log holding version 1.0
    with ts.TierStore(path, SPEC, device="cpu", device_capacity=0, host_capacity=0) as s:
        ids = torch.arange(100)
        s.apply("t", ids, torch.ones(100, SPEC.dim))  # newer versions, merged at the flush
        s.flush()
        want = s.read("t", ids)
        assert not torch.equal(want[:, 0], torch.ones(100))
    (path / "wlog").mkdir()
    (path / "wlog" / "data.mdb").write_bytes(old_log)  # the stale log file comes back
    with ts.TierStore(path, SPEC, device="cpu", device_capacity=0, host_capacity=0) as s:
        assert torch.equal(s.read("t", torch.arange(100)), want)
        assert s.log.next > 100  # and sequence numbers go on past every merged one
    assert not (path / "wlog").exists()


def _log_rows(s, rows: np.ndarray, value: float) -> None:
    """Append versions of rows of table "t" holding `value` to the log, as the writer does."""
    pay = np.zeros((len(rows), s.width), dtype=np.float32)
    pay[:, : SPEC.dim] = value
    with s.writeback.cv:
        s.log.append(np.zeros(len(rows), dtype=np.int64), rows, pay)


def test_tables_older_than_their_log_are_refused_not_mixed_with_it(tmp_path):
    """data.mdb put back from an older copy of the same store beside a crash-left log (or an OS
    crash that kept the log's deletes but not the tables' writes): the entries a merge folded
    into the newer tables and deleted from the log are in neither file. Replaying the rest
    would give rows from two different moments; the open is refused, and removing the log
    opens the tables as they were copied."""
    path = tmp_path / "s"
    s = ts.TierStore(path, SPEC, device="cpu", device_capacity=0, host_capacity=0)
    ids = torch.arange(200)
    s.apply("t", ids, torch.ones(200, SPEC.dim))
    s.flush()
    old_rows = s.read("t", ids)
    s.backend.sync()
    old_tables = (path / "data.mdb").read_bytes()  # the tables at this flush
    _log_rows(s, np.arange(0, 200, dtype=np.int64), 2.0)  # every row: 2.0, then merged
    s.log.stop_merger()
    s.log.merge()
    _log_rows(s, np.arange(0, 200, 2, dtype=np.int64), 3.0)  # half the rows: 3.0, in the log
    _kill(s)
    (path / "data.mdb").write_bytes(old_tables)
    with pytest.raises(ts.StoreCorruptError, match="wlog") as err:
        ts.TierStore(path, SPEC, device="cpu", device_capacity=0, host_capacity=0)
    assert "another tables file" in str(err.value)
    assert (path / "wlog" / "data.mdb").exists()  # the failed open changed nothing
    assert (path / "data.mdb").read_bytes()[:4096] == old_tables[:4096]
    shutil.rmtree(path / "wlog")
    with ts.TierStore(path, SPEC, device="cpu", device_capacity=0, host_capacity=0) as again:
        assert torch.equal(again.read("t", ids), old_rows)  # the copy's rows, not a mix


def test_a_log_beside_another_stores_tables_is_refused(tmp_path):
    """data.mdb of a different store copied beside a crash-left log: the log's entries must not
    be replayed into it, even where its merged-through record would let them continue."""
    a, b = tmp_path / "a", tmp_path / "b"
    _leave_a_log(a, {r: 4.0 for r in range(30)})  # store a: a log from entry 0 on, unmerged
    with ts.TierStore(b, SPEC, device="cpu", device_capacity=0, host_capacity=0) as s:
        s.apply("t", torch.arange(30), torch.ones(30, SPEC.dim))
        s.flush()  # store b's tables hold its own log through some entry >= 0
        theirs = s.read("t", torch.arange(30))
    shutil.copyfile(b / "data.mdb", a / "data.mdb")
    with pytest.raises(ts.StoreCorruptError, match="another store") as err:
        ts.TierStore(a, SPEC, device="cpu", device_capacity=0, host_capacity=0)
    assert "wlog" in str(err.value)
    shutil.rmtree(a / "wlog")
    with ts.TierStore(a, SPEC, device="cpu", device_capacity=0, host_capacity=0) as s:
        assert torch.equal(s.read("t", torch.arange(30)), theirs)


def test_a_store_made_before_identities_gets_one_and_its_log_still_replays(tmp_path, monkeypatch):
    """Stores of format 3 written before the log carried its store's identity: their crash-left
    log replays as before, and the open gives the store an identity that its new log carries."""
    from tierstore.backends import wal

    path = tmp_path / "s"
    monkeypatch.setattr(wal.writelog, "own_log", lambda backend: None)  # as those stores were written
    want, _ = _leave_a_log(path, {r: 6.0 for r in range(40)})
    monkeypatch.undo()
    with ts.TierStore(path, SPEC, device="cpu", device_capacity=0, host_capacity=0) as s:
        got = s.read("t", torch.arange(40))
        for r in range(40):
            assert torch.equal(got[r], want[r]), r
        mine = wal.store_identity(s.backend)
        assert mine is not None and s.backend.log_owner() == mine == s.log.owner


def test_a_damaged_store_identity_fails_the_open_and_leaves_no_thread_or_lock(tmp_path):
    """The identity in the tables' `log` record is checked when the log opens, after the writer
    thread has started: the failed open stops that thread and frees the lock, so the next open
    meets the same error, not a lock held by a dead handle."""
    import threading

    from tierstore.backends import wal

    path = tmp_path / "s"
    with ts.TierStore(path, SPEC, device="cpu", device_capacity=0, host_capacity=0) as s:
        s.backend.put_meta({wal.MERGED_KEY: {"merged_through": wal.merged_through(s.backend),
                                             "store": "not an id"}})
    before = set(threading.enumerate())
    for _ in range(2):
        with pytest.raises(ts.StoreCorruptError, match="damaged"):
            ts.TierStore(path, SPEC, device="cpu", device_capacity=0, host_capacity=0)
        assert not [t for t in threading.enumerate() if t not in before]


def test_an_old_log_whose_removal_failed_is_no_gap_for_the_next_crash(tmp_path, monkeypatch):
    """Removing a replayed log is best effort. When a stale log file (all of it at or below the
    tables' record, as after an OS crash) cannot be removed, its chunks stay and the new run's
    entries start past the record: a crash then leaves a log with a hole below the record,
    which must replay, not be refused as missing entries."""
    from tierstore.backends import lmdb_log

    path = tmp_path / "s"
    _leave_a_log(path, {r: 1.0 for r in range(100)})  # entries 0..99
    stale = (path / "wlog" / "data.mdb").read_bytes()
    with ts.TierStore(path, SPEC, device="cpu", device_capacity=0, host_capacity=0) as s:
        s.apply("t", torch.arange(100, 400), torch.ones(300, SPEC.dim))
        s.flush()  # the record moves well past entry 99
    (path / "wlog").mkdir()
    (path / "wlog" / "data.mdb").write_bytes(stale)

    def cannot(_path):
        raise OSError("busy")

    monkeypatch.setattr(lmdb_log, "unlink_log_dir", cannot)
    s = ts.TierStore(path, SPEC, device="cpu", device_capacity=0, host_capacity=0)
    monkeypatch.undo()
    assert (path / "wlog" / "data.mdb").exists() and s.log.next > 100  # old chunks stayed
    want = s.read("t", torch.arange(400))
    _log_rows(s, np.arange(0, 400, 2, dtype=np.int64), 8.0)
    _kill(s)
    with ts.TierStore(path, SPEC, device="cpu", device_capacity=0, host_capacity=0) as again:
        got = again.read("t", torch.arange(400))
        assert torch.equal(got[::2, 0], torch.full((200,), 8.0))
        assert torch.equal(got[1::2], want[1::2])


def test_a_log_missing_a_chunk_between_others_is_refused(tmp_path):
    """A log whose chunks skip a range of sequence numbers lost those rows: refused, not
    replayed around the hole."""
    import lmdb

    from tierstore.backends import wal

    path = tmp_path / "s"
    s = ts.TierStore(path, SPEC, device="cpu", device_capacity=0, host_capacity=0)
    s.flush()
    for value in (1.0, 2.0, 3.0):  # three appends: three chunks
        _log_rows(s, np.arange(0, 50, dtype=np.int64), value)
    middle = int(s.log._chunks[1, 0])
    _kill(s)
    env = lmdb.open(str(path / "wlog"), max_dbs=4, subdir=True)
    with env.begin(write=True) as txn:
        db = env.open_db(wal.LOG_DB, txn=txn, create=False)
        assert txn.delete(middle.to_bytes(8, "big"), db=db)
    env.close()
    with pytest.raises(ts.StoreCorruptError, match="missing"):
        ts.TierStore(path, SPEC, device="cpu", device_capacity=0, host_capacity=0)


def test_a_damaged_log_chunk_is_reported(tmp_path):
    path = tmp_path / "s"
    _, wal = _leave_a_log(path, {r: 1.0 for r in range(100)})
    import lmdb as _lmdb

    env = _lmdb.open(str(path / "wlog"), max_dbs=4, subdir=True)
    db = env.open_db(wal.LOG_DB)
    with env.begin(write=True, db=db) as txn:
        key, val = next(iter(txn.cursor()))
        bad = bytearray(val)
        bad[8:12] = (len(bad)).to_bytes(4, "little")  # a count that does not fit the value
        txn.put(key, bytes(bad))
    env.close()
    with pytest.raises(ts.StoreCorruptError):
        ts.TierStore(path, SPEC, device="cpu", device_capacity=0, host_capacity=0)
    # the failed open released the store: the next one gets the same clear error, not a lock error
    with pytest.raises(ts.StoreCorruptError):
        ts.TierStore(path, SPEC, device="cpu", device_capacity=0, host_capacity=0)


def test_a_truncated_log_file_is_reported(tmp_path):
    path = tmp_path / "s"
    _leave_a_log(path, {r: 1.0 for r in range(5000)})
    data = path / "wlog" / "data.mdb"
    os.truncate(data, data.stat().st_size // 2)
    with pytest.raises(ts.StoreCorruptError, match="log"):
        ts.TierStore(path, SPEC, device="cpu", device_capacity=0, host_capacity=0)


@pytest.mark.parametrize("slow_merge", [0.0, 0.01])
def test_background_merges_run_beside_appends_and_flushes(tmp_path, slow_merge):
    """The log merger thread folds the log into the tables while the writer appends, reads and
    flushes go on: every read equals the model, and flush() waits for a merge in progress. A
    slowed merge makes the writer append newer versions of the rows a merge is folding."""
    specs = [SPEC]
    model = DictStore(specs)
    with ts.TierStore(tmp_path / "s", specs, device_capacity=4, host_capacity=4, device="cpu",
                      write_buffer=8) as s:
        if slow_merge:
            commit = s.backend._commit

            def slow_commit(parts, total):
                time.sleep(slow_merge)
                return commit(parts, total)

            s.backend._commit = slow_commit
        for i in range(120):
            ids = torch.randint(0, 400, (16,), generator=torch.Generator().manual_seed(i))
            s.apply("t", ids, _grads(len(ids), i))
            model.apply("t", ids, _grads(len(ids), i))
            if i % 7 == 0:
                probe = torch.randint(0, 400, (32,), generator=torch.Generator().manual_seed(10**4 + i))
                assert torch.equal(s.read("t", probe), model.read("t", probe))
            if i % 40 == 39:
                s.flush()
                assert s.log.size == 0
        st = s.stats()["writeback"]
        assert st["log_background_merges"] > 0 and st["log_merged"] > 0
        every = torch.arange(400)
        assert torch.equal(s.read("t", every), model.read("t", every))
    with ts.TierStore(tmp_path / "s", specs, device="cpu", device_capacity=4, host_capacity=4) as s:
        assert torch.equal(s.read("t", every), model.read("t", every))


def test_a_chunked_log_with_superseded_versions_replays_the_newest(tmp_path):
    """A log of chunks only (as a kill leaves it) in which rows were appended several times:
    replay writes each row's last version, for every table."""
    specs = [ts.TableSpec("a", 10**6, 4), ts.TableSpec("b", 10**6, 6)]
    s = ts.TierStore(tmp_path / "s", specs, device="cpu", device_capacity=0, host_capacity=0)
    s.flush()
    rng = np.random.default_rng(3)
    want: dict[tuple[int, int], np.ndarray] = {}
    for _ in range(4):  # four appends; later ones supersede some rows of earlier ones
        _append_random(s, specs, rng, 700, 5000, want)
    s.writeback.close()
    s.log.stop_merger()
    s.backend.sync()
    s.backend.close()
    s.closed = True
    with ts.TierStore(tmp_path / "s", specs, device="cpu", device_capacity=0, host_capacity=0) as s:
        assert s.log.size == 0
        for t, spec in enumerate(specs):
            rows = np.array(sorted(r for (tt, r) in want if tt == t))
            data, found = s.backend.get(spec.name, rows, spec.row_dim)
            assert found.all()
            assert np.array_equal(data, np.stack([want[(t, r)] for r in rows.tolist()]))


def test_a_merge_writes_each_table_once_in_ascending_key_order(tmp_path, monkeypatch):
    """However many pieces a merge takes, its writes of one table cover ascending, disjoint key
    ranges (each leaf page rewritten once per merge), and the tables end with the newest rows.
    (B-tree tables: a chunk level takes each table's merge in one call.)"""
    from tierstore.backends import wal

    monkeypatch.setattr(wal.merge, "MERGE_ROWS", 50)
    specs = [ts.TableSpec("a", 10**6, 4), ts.TableSpec("b", 10**6, 4)]
    with ts.TierStore(tmp_path / "s", specs, device="cpu", device_capacity=0, host_capacity=0,
                      table_format="btree") as s:
        s.flush()
        s.log.stop_merger()
        calls: list[tuple[str, np.ndarray]] = []
        put = s.backend.put

        def spy(batches, sealed=False):
            calls.extend((name, np.array(rows)) for name, (rows, _) in batches.items())
            return put(batches, sealed=sealed)

        monkeypatch.setattr(s.backend, "put", spy)
        rng = np.random.default_rng(5)
        want = {}
        for _ in range(3):
            _append_random(s, specs, rng, 400, 3000, want)
        s.log.merge()
        assert s.log.size == 0 and len(calls) > 4  # several pieces
        for name in ("a", "b"):
            mine = [r for n, r in calls if n == name]
            assert all((np.diff(r) > 0).all() for r in mine)
            assert all(a[-1] < b[0] for a, b in zip(mine, mine[1:]))  # one ascending pass
            assert sum(len(r) for r in mine) == sum(1 for (t, _) in want if specs[t].name == name)
        for t, spec in enumerate(specs):
            rows = np.array(sorted(r for (tt, r) in want if tt == t))
            data, found = s.backend.get(spec.name, rows, spec.row_dim)
            assert found.all() and np.array_equal(data, np.stack([want[(t, r)] for r in rows.tolist()]))


def test_a_merge_of_chunks_whose_rows_were_all_superseded_writes_nothing_and_goes_on(tmp_path):
    """The oldest chunks of a long log can hold only rows appended again later: their merge
    writes nothing (it used to index an empty key order, and the writer retried the failing
    merge forever), the log moves past them, and every row reads as its newest version."""
    with ts.TierStore(tmp_path / "s", SPEC, **SMALL) as s:
        s.flush()
        s.log.stop_merger()
        rows = np.arange(100, 140, dtype=np.int64)
        tabs = np.zeros(len(rows), dtype=np.int64)
        old = np.full((len(rows), s.width), 1.0, dtype=np.float32)
        new = np.full((len(rows), s.width), 2.0, dtype=np.float32)
        with s.writeback.cv:
            s.log.append(tabs, rows, old)  # the first chunk: superseded by the next append
            s.log.append(tabs, rows, new)
        assert s.log.size == 2 * len(rows)
        assert s.log.merge(1) == 0  # the first whole chunk: every entry superseded
        assert s.log.size == len(rows) and s.backend.count("t") == 0
        assert torch.equal(s.read("t", torch.from_numpy(rows)), torch.from_numpy(new[:, : SPEC.dim]))
        s.log.merge()
        assert s.log.size == 0
        data, found = s.backend.get("t", rows, SPEC.row_dim)
        assert found.all() and np.array_equal(data, new[:, : SPEC.row_dim])


def test_rows_appended_again_while_a_merge_runs_keep_the_log_index_whole(tmp_path, monkeypatch):
    """The writer appends newer versions of rows a background merge is folding (after the merge
    looked them up, before it finished). The merge must not drop them from the log's index a
    second time: removing an absent key corrupted the hash table, keys vanished, and later
    merges dropped newest versions (found as `kept=0` merges of 4M rows in a steady-state run)."""
    from tierstore.backends import wal

    with ts.TierStore(tmp_path / "s", SPEC, **SMALL, write_log=10**4) as s:
        s.flush()
        s.log.stop_merger()
        rows = np.arange(1000, 1300, dtype=np.int64)
        tabs = np.zeros(len(rows), dtype=np.int64)
        first = np.full((len(rows), s.width), 1.0, dtype=np.float32)
        again = np.full((len(rows) // 2, s.width), 2.0, dtype=np.float32)
        later = np.arange(5000, 5100, dtype=np.int64)  # rows the merge does not touch
        with s.writeback.cv:
            s.log.append(tabs, rows, first)
            s.log.append(tabs[:100], later, np.full((100, s.width), 3.0, dtype=np.float32))
        fold = wal.writelog.fold

        def writer_meanwhile(backend, db, chunks, names, dims, ids, newest):
            def looked_up(t, r, q):
                out = newest(t, r, q)
                with s.writeback.cv:  # what the writer thread does during a merge
                    s.log.append(tabs[::2], rows[::2], again)
                return out
            return fold(backend, db, chunks, names, dims, ids, looked_up)

        monkeypatch.setattr(wal.writelog, "fold", writer_meanwhile)
        s.log.merge(len(rows))  # the first append's chunk
        monkeypatch.setattr(wal.writelog, "fold", fold)
        s.log.index.check()  # live count, positions and lookups agree
        assert s.log.index.live == len(again) + len(later)
        want = first[:, : SPEC.dim].copy()
        want[::2] = 2.0
        assert torch.equal(s.read("t", torch.from_numpy(rows)), torch.from_numpy(want))
        s.log.merge()
        assert s.log.size == 0 and s.log.index.live == 0
        data, found = s.backend.get("t", np.concatenate([rows, later]), SPEC.row_dim)
        assert found.all()
        assert np.array_equal(data[: len(rows), : SPEC.dim], want)
        assert (data[len(rows):, : SPEC.dim] == 3.0).all()


def test_a_writer_that_finds_the_log_full_during_a_merge_waits_for_it_and_merges_nothing_more(
        tmp_path, monkeypatch):
    """The writer finds the log full while the background merger folds its older half. It used
    to decide to merge before it waited for that merge, then merged another half itself: a
    second, sparse merge while the ring backed up (writeback_wait 58 ms a step at cache1). Now
    it decides again once the merge it waited for has made room."""
    import threading

    from tierstore.backends import wal

    with ts.TierStore(tmp_path / "s", SPEC, **SMALL, write_log=10**4) as s:
        s.flush()
        s.log.stop_merger()
        width, cap = s.width, s.log.capacity
        first = np.arange(0, 9000, dtype=np.int64)
        more = np.arange(20_000, 22_000, dtype=np.int64)
        with s.writeback.cv:
            s.log.append(np.zeros(len(first), np.int64), first, np.full((len(first), width), 1.0, np.float32))
        assert s.log.size + len(more) > cap  # the writer's append below finds the log full
        fold, folds = wal.writelog.fold, []
        started, go = threading.Event(), threading.Event()

        def held_fold(*args):
            folds.append(threading.current_thread().name)
            started.set()
            assert go.wait(10)
            return fold(*args)

        monkeypatch.setattr(wal.writelog, "fold", held_fold)
        merger = threading.Thread(target=s.log.merge, args=(cap // 2,), name="merger")
        merger.start()
        assert started.wait(10)
        writer = threading.Thread(target=s.log.append, name="writer",
                                  args=(np.zeros(len(more), np.int64), more,
                                        np.full((len(more), width), 2.0, np.float32)))
        writer.start()
        time.sleep(0.2)  # the writer is now waiting for the merge
        assert writer.is_alive()
        go.set()
        merger.join(10)
        writer.join(10)
        assert not merger.is_alive() and not writer.is_alive()
        assert folds == ["merger"]  # one merge: the writer's append found room after it
        assert s.log.size == len(first) + len(more) - s.log.rows_merged <= cap
        monkeypatch.setattr(wal.writelog, "fold", fold)
        with s.log.merging, s.writeback.cv:
            s.log.index.check()
        got = s.read("t", torch.from_numpy(np.concatenate([first, more])))
        assert (got[: len(first)] == 1.0).all() and (got[len(first):] == 2.0).all()


def test_a_write_log_smaller_than_a_writer_batch_keeps_its_index_whole(tmp_path):
    """A `write_log` smaller than one batch of the writer (the ring drains up to 65,536 rows at a
    time): the batch goes into the log in parts. One append of more rows than the log holds used
    to wrap sequence numbers onto index slots still in use (found by tests/test_log_model.py)."""
    model = DictStore([SPEC])
    with ts.TierStore(tmp_path / "s", SPEC, device="cpu", device_capacity=4, host_capacity=4,
                      write_buffer=256, write_log=8) as s:
        rows = torch.arange(200)
        with s.writeback.cv:  # hold the writer so it takes all 200 evicted rows in one batch
            for ids in rows.split(20):
                s.apply("t", ids, _grads(len(ids), int(ids[0])))
                model.apply("t", ids, _grads(len(ids), int(ids[0])))
        s.writeback.drain()
        with s.log.merging, s.writeback.cv:  # no merge or append runs meanwhile
            s.log.index.check()
            assert s.log.size <= s.log.capacity and s.writeback.batches >= 1
        assert torch.equal(s.read("t", rows), model.read("t", rows))
        s.flush()
        assert s.log.size == 0 and s.log.index.live == 0
    with ts.TierStore(tmp_path / "s", SPEC, device="cpu", device_capacity=4, host_capacity=4) as s:
        assert torch.equal(s.read("t", rows), model.read("t", rows))


def test_write_log_sets_the_log_size_and_its_index_counts_in_memory(tmp_path):
    """`write_log` is the log's capacity (rows or a size of entries); the default grows with the
    declared rows up to LOG_MAX_ROWS (LOG_MAX_CHUNK_ROWS for chunked tables of wide rows, whose
    disk budget bounds what the log holds); the log's index is part of memory()'s budget; bad values are
    refused before the store is touched."""
    from tierstore import store as store_mod

    spec = ts.TableSpec("t", 1000, 4)
    budgets = []
    for log in (1000, 50_000):
        with ts.TierStore(tmp_path / f"s{log}", spec, **SMALL, write_buffer=16, write_log=log) as s:
            assert s.log.capacity == log
            budgets.append(s.memory()["budget_bytes"])
            assert s.log.index_bytes >= 8 * log
    assert budgets[1] - budgets[0] >= 8 * (50_000 - 1000)
    with ts.TierStore(tmp_path / "size", spec, **SMALL, write_log="1MiB") as s:
        assert s.log.capacity == (1 << 20) // (s.width * 4 + 20)
    big = ts.TableSpec("big", 10**10, 4)
    with ts.TierStore(tmp_path / "big", big, **SMALL, table_format="btree") as s:
        assert s.log.capacity == max(store_mod.LOG_MAX_ROWS, store_mod.LOG_RINGS * s.writeback.capacity)
    with ts.TierStore(tmp_path / "bigc", big, **SMALL, table_format="chunks") as s:
        assert s.log.capacity == max(store_mod.LOG_MAX_ROWS, store_mod.LOG_RINGS * s.writeback.capacity)
    wide = ts.TableSpec("wide", 10**10, 64)  # log entries of 16 + 4 * 64 + 4 bytes
    assert 16 + 4 * 64 + 4 >= store_mod.LOG_WIDE_ENTRY
    with ts.TierStore(tmp_path / "widec", wide, **SMALL, table_format="chunks") as s:
        assert s.log.capacity == store_mod.LOG_MAX_CHUNK_ROWS > store_mod.LOG_MAX_ROWS
        assert s.log.index_bytes <= 40 * s.log.capacity  # ~37 bytes a row: 224 MiB at most
    with ts.TierStore(tmp_path / "wideb", wide, **SMALL, table_format="btree") as s:
        assert s.log.capacity == store_mod.LOG_MAX_ROWS
    mid = ts.TableSpec("mid", 5_000_000, 4)  # half the declared rows: above 8 rings, below the cap
    with ts.TierStore(tmp_path / "mid", mid, **SMALL) as s:
        assert store_mod.LOG_RINGS * s.writeback.capacity < 2_500_000 < store_mod.LOG_MAX_ROWS
        assert s.log.capacity == 2_500_000
    with ts.TierStore(tmp_path / "ring", big, **SMALL, write_buffer=16) as s:
        assert s.log.capacity == store_mod.LOG_RINGS * 16  # a configured ring sets the log
    for bad in (0, -5, "lots", 1.5):
        with pytest.raises(ts.ConfigError):
            ts.TierStore(tmp_path / "bad", spec, **SMALL, write_log=bad)
        assert not (tmp_path / "bad" / "data.mdb").exists()


@pytest.mark.parametrize("merged", [False, True])
def test_read_ahead_outlives_a_ring_wrap_but_never_serves_a_row_written_after_it(tmp_path, merged):
    """Rows read ahead stay usable after the write-behind ring wrapped, except the rows written
    back after the read (now in the log past the read's mark): those are read again. Once a
    merge took such log entries into the tables, the wrapped buffer is not used at all."""
    model = DictStore([SPEC])
    with ts.TierStore(tmp_path / "s", SPEC, device="cpu", device_capacity=2, host_capacity=2,
                      write_buffer=4, write_log=1000) as s:
        s.log.stop_merger()
        s.apply("t", torch.arange(40), _grads(40, 1))
        model.apply("t", torch.arange(40), _grads(40, 1))
        s.writeback.drain()
        want = torch.arange(10, 20)
        tab = s.table_record("t")
        with s.lock:
            mark = s.loader.read_ahead_mark()
            data, found = s.loader.read_stored(tab, want.numpy())
            s.loader.add_read_ahead("t", mark, want.numpy(), data, found, keep=2)
        # 12 and 15 get newer versions, then batches of other rows evict them through the ring
        for i, ids in enumerate([torch.tensor([12, 15])] + list(torch.arange(100, 300).split(2))):
            s.apply("t", ids, _grads(len(ids), 10 + i))
            model.apply("t", ids, _grads(len(ids), 10 + i))
        s.writeback.drain()
        assert not s.writeback.still_current(mark[0])  # the ring wrapped since the read
        assert (s.log.lookup(tab.index, torch.tensor([12, 15])) >= mark[1]).all()  # logged after
        if merged:
            s.log.merge()
        before = s.prefetch_stats.rows_read_ahead
        assert torch.equal(s.read("t", want), model.read("t", want))
        assert s.prefetch_stats.rows_read_ahead - before == (0 if merged else 8)


def test_log_reads_across_many_chunks_in_any_order_return_each_rows_newest_version(tmp_path, monkeypatch):
    """Rows read back from an unmerged log of many small chunks, asked in random order (several
    per chunk, chunks skipped, some rows superseded by a later append), come back exactly."""
    from tierstore.backends import wal

    monkeypatch.setattr(wal.writelog, "CHUNK_ROWS", 7)
    specs = [ts.TableSpec("a", 10**6, 4), ts.TableSpec("b", 10**6, 6)]
    with _log_only_store(tmp_path, specs) as s:
        rng = np.random.default_rng(5)
        want: dict[tuple[int, int], np.ndarray] = {}
        for _ in range(5):
            _append_random(s, specs, rng, 300, 2000, want)
        assert s.log.size > 20 * 7  # many chunks, none merged
        for t in range(len(specs)):
            rows = np.array([r for (tt, r) in want if tt == t], dtype=np.int64)
            rows = rng.permutation(rows)[: len(rows) * 2 // 3]  # a random subset, in random order
            seqs = s.log.lookup(t, torch.from_numpy(rows))
            assert (seqs >= 0).all()
            data, found = s.log.read(t, rows, seqs)
            assert found.all()
            assert np.array_equal(data, np.stack([want[(t, r)] for r in rows.tolist()]))


@pytest.mark.parametrize("part_rows", [1, 5, 10**6])
def test_one_log_read_for_all_tables_returns_each_rows_newest_version(tmp_path, monkeypatch, part_rows):
    """The pipeline's batch read (the log once for all tables, in parts, then each table's other
    rows) returns exactly what a read of each table alone returns, across two row widths, with
    rows never written, rows only in the tables, and log entries merged after their lookup."""
    from concurrent.futures import ThreadPoolExecutor

    from tierstore.backends import wal
    from tierstore.prefetch.reads import StoredReads

    monkeypatch.setattr(wal.writelog, "CHUNK_ROWS", 7)
    specs = [ts.TableSpec("a", 10**6, 4), ts.TableSpec("b", 10**6, 6), ts.TableSpec("c", 10**6, 4)]
    with _log_only_store(tmp_path, specs) as s:
        rng = np.random.default_rng(11)
        want: dict[tuple[int, int], np.ndarray] = {}
        for _ in range(3):
            _append_random(s, specs, rng, 300, 1500, want)
        s.log.merge()  # these versions now live in the tables
        for _ in range(4):
            _append_random(s, specs, rng, 300, 1500, want)
        tabs = {spec.name: s.table_record(spec.name) for spec in specs}
        cold = {name: (tab, np.sort(rng.choice(2000, 400, replace=False)).astype(np.int64))
                for name, tab in tabs.items()}  # a few never written
        alone = {name: s.loader.read_stored(tab, rows) for name, (tab, rows) in cold.items()}
        with ThreadPoolExecutor(2) as pool:
            reads = StoredReads(s, cold, pool.submit, part_rows)
            with s.writeback.cv:
                s.log.merge(s.log.size // 2)  # the older half leaves the log after the lookups
            got, seconds = reads.result()
        assert seconds > 0
        for t, spec in enumerate(specs):
            data, found = got[spec.name]
            rows = cold[spec.name][1]
            assert data.shape == (len(rows), spec.row_dim)
            expect = np.array([(t, r) in want for r in rows.tolist()])
            assert np.array_equal(found, expect) and np.array_equal(found, alone[spec.name][1])
            assert np.array_equal(data[found], np.stack([want[(t, r)] for r in rows[found].tolist()]))
            assert np.array_equal(data, alone[spec.name][0])
            assert not data[~found].any()


def test_load_many_reads_the_log_once_and_equals_each_table_read_alone(tmp_path, monkeypatch):
    """`RowLoader.load_many` (staging's load: one log read for every table) returns what
    `read_stored` of each table alone returns, zero-padded to the store's width, with the lazy
    init where a row was never written; tables of two widths, rows in the log, in the tables
    only, and never written; the log is read once, not once a table."""
    from tierstore.backends import wal

    monkeypatch.setattr(wal.writelog, "CHUNK_ROWS", 7)
    specs = [ts.TableSpec("a", 10**6, 4), ts.TableSpec("b", 10**6, 6), ts.TableSpec("c", 10**6, 4)]
    with _log_only_store(tmp_path, specs) as s:
        rng = np.random.default_rng(5)
        want: dict[tuple[int, int], np.ndarray] = {}
        for _ in range(2):
            _append_random(s, specs, rng, 300, 1500, want)
        s.log.merge()  # these versions now live in the tables
        for _ in range(3):
            _append_random(s, specs, rng, 300, 1500, want)
        tabs = [s.table_record(spec.name) for spec in specs]
        rows = [torch.from_numpy(np.sort(rng.choice(2000, 300, replace=False)).astype(np.int64))
                for _ in specs]
        reads = []
        real = s.log.read_entries
        monkeypatch.setattr(s.log, "read_entries", lambda *a: reads.append(len(a[0])) or real(*a))
        got = s.loader.load_many(list(zip(tabs, rows)))
        assert len(reads) == 1 and reads[0] > 0  # every table's log entries in one read
        for t, (spec, tab, r, out) in enumerate(zip(specs, tabs, rows, got)):
            data, found = s.loader.read_stored(tab, r.numpy())
            assert out.shape == (len(r), s.width) and not out[:, spec.row_dim :].any()
            assert np.array_equal(found, np.array([(t, x) in want for x in r.tolist()]))
            assert torch.equal(out[torch.from_numpy(found), : spec.row_dim],
                               torch.from_numpy(data[found]))
            assert torch.equal(out, s.loader.load(tab, r))  # and what a load of the table gives
            lazy = ~found
            init = spec.init(tab.key, r.numpy()[lazy], spec.dim)
            assert np.array_equal(out.numpy()[lazy, : spec.weight_cols], init)


def test_a_log_read_reports_entries_merged_meanwhile_as_not_found(tmp_path):
    """`WriteLog.read_entries` finds the entries still in the log and reports merged ones as not
    found (the reader then takes them from the table), for rows of several tables at once."""
    specs = [ts.TableSpec("a", 10**6, 4), ts.TableSpec("b", 10**6, 6)]
    with _log_only_store(tmp_path, specs) as s:
        rng = np.random.default_rng(3)
        want: dict[tuple[int, int], np.ndarray] = {}
        for _ in range(3):
            _append_random(s, specs, rng, 200, 10**5, want)
        keys = list(want)
        tabs = np.array([t for t, _ in keys], dtype=np.int64)
        rows = np.array([r for _, r in keys], dtype=np.int64)
        seqs = np.concatenate([s.log.lookup(t, torch.from_numpy(rows[tabs == t])) for t in (0, 1)])
        order = np.concatenate([np.flatnonzero(tabs == t) for t in (0, 1)])
        tabs, rows = tabs[order], rows[order]
        with s.writeback.cv:
            s.log.merge(s.log.size // 2)  # whole chunks: the first append's, at least
        data, found = s.log.read_entries(tabs, rows, seqs, s.width)
        assert 0 < np.count_nonzero(found) < len(found)
        assert np.array_equal(found, seqs >= s.log.merged)
        for i in np.flatnonzero(found).tolist():
            w = specs[tabs[i]].row_dim
            assert np.array_equal(data[i, :w], want[(tabs[i], rows[i])]) and not data[i, w:].any()
        assert not data[~found].any()


MERGE_WORKER = r"""
import sys, time
import numpy as np
import tierstore as ts
from tierstore.backends import lmdb_backend, wal

path = sys.argv[1]
spec = ts.TableSpec("t", 10**6, 4)
s = ts.TierStore(path, spec, device="cpu", device_capacity=0, host_capacity=0, write_log=10**5,
                 table_format="btree")  # a merge in B-tree commits (chunks: test_chunked_store)
rows = np.arange(0, 30000, 3, dtype=np.int64)
one = np.zeros((len(rows), spec.row_dim), dtype=np.float32)
one[:, :4] = 1.0
s.backend.put({"t": (rows, one)})
s.flush()  # version 1 of every row, acknowledged
two = np.zeros((len(rows), s.width), dtype=np.float32)
two[:, :4] = (rows % 997 + 2).astype(np.float32)[:, None]
with s.writeback.cv:  # version 2 of every row: committed to the log, not merged
    s.log.append(np.zeros(len(rows), dtype=np.int64), rows, two)
wal.merge.MERGE_ROWS = 500  # a merge of 20 pieces, each its own transaction
s.backend.txn_rows = 500
commit = lmdb_backend.LmdbBackend._commit

def slow_commit(self, parts, total):
    commit(self, parts, total)
    print("P", flush=True)  # a piece of the merge is committed
    time.sleep(0.15)

lmdb_backend.LmdbBackend._commit = slow_commit
print("M", flush=True)
s.log.merge()
print("D", flush=True)
"""


@pytest.mark.parametrize("pieces", [0, 1, 7])
def test_kill_during_a_merge_loses_nothing_the_log_held(tmp_path, monkeypatch, pieces):
    """kill -9 before, and after 1 or 7 of a merge's 20 transactions: on open the log is replayed
    (in pieces too), so every row holds its logged version (none keeps the older table version,
    none is torn)."""
    from tierstore.backends import wal

    monkeypatch.setattr(wal.merge, "MERGE_ROWS", 500)
    path = tmp_path / "s"
    proc = subprocess.Popen([sys.executable, "-c", MERGE_WORKER, str(path)], stdout=subprocess.PIPE,
                            text=True, cwd=REPO, env=dict(os.environ))
    seen = []
    for line in proc.stdout:
        seen.append(line.strip())
        if seen.count("P") >= pieces and "M" in seen:
            break
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert "M" in seen and "D" not in seen, seen  # killed inside the merge
    rows = torch.arange(0, 30000, 3)
    spec = ts.TableSpec("t", 10**6, 4)
    with ts.TierStore(path, spec, device="cpu", device_capacity=0, host_capacity=0) as s:
        assert s.log.size == 0  # replayed on open
        got = s.read("t", rows)
        s.check()
    want = (rows % 997 + 2).to(torch.float32)[:, None].expand(-1, 4)
    assert torch.equal(got, want)


def test_restoring_a_checkpoint_over_a_crash_left_log_never_replays_that_log(tmp_path):
    """The log left by a crash after a checkpoint belongs to the replaced file: restore removes
    it first, so its newer entries are not replayed onto the checkpoint's rows."""
    path = tmp_path / "s"
    with ts.TierStore(path, SPEC, device="cpu", device_capacity=0, host_capacity=0) as s:
        s.apply("t", torch.arange(100), torch.ones(100, SPEC.dim))
        s.checkpoint(tmp_path / "ck")
        want = s.read("t", torch.arange(100))
    _leave_a_log(path, {r: 9.0 for r in range(100)})  # rows after the checkpoint, then a kill
    with ts.TierStore.restore(tmp_path / "ck", path, device="cpu", device_capacity=0,
                              host_capacity=0) as s:
        assert torch.equal(s.read("t", torch.arange(100)), want)


def test_export_and_offline_compaction_of_a_crash_left_store_see_the_rows_in_its_log(tmp_path):
    from tierstore.export import export_store, import_store
    from tierstore.persistence import compact

    for how in ("export", "compact"):
        path = tmp_path / how
        want, _ = _leave_a_log(path, {r: float(r) + 0.25 for r in range(0, 3000, 7)})
        if how == "export":
            export_store(path, tmp_path / "exp")
            import_store(tmp_path / "exp", tmp_path / "imp")
            path = tmp_path / "imp"
        else:
            compact(path)
        assert not (path / "wlog").exists()
        with ts.TierStore(path, SPEC, device="cpu", device_capacity=0, host_capacity=0) as s:
            ids = torch.tensor(sorted(want))
            got = s.read("t", ids)
            for i, r in enumerate(ids.tolist()):
                assert torch.equal(got[i], want[r]), (how, r)


def test_a_log_file_of_garbage_is_reported_and_removing_it_opens_the_last_flush(tmp_path):
    path = tmp_path / "s"
    with ts.TierStore(path, SPEC, device="cpu", device_capacity=0, host_capacity=0) as s:
        s.apply("t", torch.arange(10), torch.ones(10, SPEC.dim))
        s.flush()
        want = s.read("t", torch.arange(10))
    _leave_a_log(path, {r: 5.0 for r in range(10)})
    data = path / "wlog" / "data.mdb"
    data.write_bytes(np.random.default_rng(0).bytes(data.stat().st_size))
    with pytest.raises(ts.StoreCorruptError, match="wlog"):
        ts.TierStore(path, SPEC, device="cpu", device_capacity=0, host_capacity=0)
    assert data.exists()  # the failed open changed nothing
    shutil.rmtree(path / "wlog")
    with ts.TierStore(path, SPEC, device="cpu", device_capacity=0, host_capacity=0) as s:
        assert torch.equal(s.read("t", torch.arange(10)), want)


@pytest.mark.parametrize("cut", ["before_record", "before_delete"])
def test_a_merge_cut_between_its_steps_replays_to_the_newest_rows(tmp_path, monkeypatch, cut):
    """A kill inside a merge: after the rows reached the tables but before the merged-through
    record (the whole log replays again), or after the record but before the chunks were deleted
    (replay skips them). Either way every row reads its newest logged version."""
    from tierstore.backends import wal

    path = tmp_path / "s"
    want, _ = _leave_a_log(path, {r: float(r) for r in range(0, 6000, 2)})
    s = ts.TierStore(path, SPEC, device="cpu", device_capacity=0, host_capacity=0)
    w = s.width
    rows = np.arange(0, 6000, 4, dtype=np.int64)  # newer versions of half the rows, logged
    pay = np.zeros((len(rows), w), dtype=np.float32)
    pay[:, : SPEC.dim] = -rows[:, None].astype(np.float32)
    with s.writeback.cv:
        s.log.append(np.zeros(len(rows), dtype=np.int64), rows, pay)
    want.update({int(r): torch.from_numpy(pay[i, : SPEC.dim]) for i, r in enumerate(rows)})

    class Killed(Exception):
        pass

    def die(*_a, **_k):
        raise Killed

    if cut == "before_record":
        monkeypatch.setattr(wal.writelog, "record_merged", die)
    else:
        monkeypatch.setattr(s.backend, "delete_log", die)
    s.log.stop_merger()
    with pytest.raises(Killed):
        s.log.merge()
    monkeypatch.undo()
    recorded = wal.merged_through(s.backend)
    s.writeback.close()  # the process dies here: no flush
    s.backend.sync()
    s.backend.close()
    s.closed = True
    assert (path / "wlog" / "data.mdb").exists()
    with ts.TierStore(path, SPEC, device="cpu", device_capacity=0, host_capacity=0) as again:
        if cut == "before_delete":
            assert recorded == again.log.next - 1  # the merge's record survived, and replay
            # found nothing past it to write
        ids = torch.tensor(sorted(want))
        got = again.read("t", ids)
        for i, r in enumerate(ids.tolist()):
            assert torch.equal(got[i], want[r]), (cut, r)


def test_a_log_whose_tables_are_gone_is_refused_not_replayed_into_a_new_store(tmp_path):
    """data.mdb and the lock file removed, the log left behind: opening must not create a new
    store holding the old store's logged rows."""
    path = tmp_path / "s"
    _leave_a_log(path, {r: 3.0 for r in range(50)})
    (path / "data.mdb").unlink()
    (path / "tierstore.lock").unlink()
    with pytest.raises(ts.StoreCorruptError, match="wlog"):
        ts.TierStore(path, SPEC, device="cpu", device_capacity=0, host_capacity=0)
    assert (path / "wlog" / "data.mdb").exists()  # left for the user to restore or remove
    shutil.rmtree(path / "wlog")
    with ts.TierStore(path, SPEC, device="cpu", device_capacity=0, host_capacity=0) as s:
        assert s.backend.count("t") == 0  # a new, empty store
        assert not torch.equal(s.read("t", torch.arange(50))[:, 0], torch.full((50,), 3.0))
