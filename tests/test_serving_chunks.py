"""Read-only handles on chunked stores (format 4): published manifests, kept and retired ranges."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import lmdb
import pytest
import torch

import tierstore as ts
from tierstore.backends import chunkmerge
from tierstore.backends.publish import PUBLISHED, RETIRED, published_manifests
from tierstore.serving import ReadOnlyStore

N, DIM = 600, 4
SPEC = ts.TableSpec("t", N, DIM, optimizer=ts.Adagrad(0.1))
ALL = torch.arange(N)


@pytest.fixture(autouse=True)
def _small_ranges(monkeypatch):
    """Ranges of about 100 rows: a table of 600 rows spans several."""
    monkeypatch.setattr(chunkmerge, "RANGE_ROWS", 100)


def _writer(path: Path) -> ts.TierStore:
    # caches far below the rows touched: evicted rows go through the log into the chunk levels
    return ts.TierStore(path, [SPEC], device_capacity=16, host_capacity=32, device="cpu",
                        write_buffer=8, table_format="chunks")


def _train(store: ts.TierStore, gen: torch.Generator, steps: int = 2) -> None:
    for _ in range(steps):
        ids = torch.randint(0, N, (200,), generator=gen)
        store.apply("t", ids, torch.randn(200, DIM, generator=gen))
    with store.quiesce_writer():  # the log merged into the chunk levels now
        pass


def _published(store: ts.TierStore) -> tuple[dict, list[bytes], set[bytes], bool]:
    """(published manifests, retired ranges, range databases present, covered) in the file now."""
    import json

    pub = store.backend.publisher
    with store.backend.env.begin() as txn:
        mans = published_manifests(txn, pub.meta, store.path)
        raw = txn.get(RETIRED, db=pub.meta)
        retired = [] if raw is None else [n.encode() for n in json.loads(bytes(raw))]
        present = {bytes(k) for k, _ in txn.cursor() if bytes(k).startswith(b"c:")}
        covered = json.loads(bytes(txn.get(PUBLISHED, db=pub.meta)))["covered"]
    return mans, retired, present, covered


@pytest.mark.parametrize("mode", ["rewrite", "in_place"])
def test_reader_sees_the_last_flush_through_merges_and_expiry(store_path, monkeypatch, mode):
    """Rewrites or in-place updates, and expiry's deletes, after a flush: a refreshed or new
    reader still reads exactly that flush; the next flush moves it on."""
    monkeypatch.setattr(chunkmerge.ChunkLevel, "_sparse", lambda self, r, rows: mode == "in_place")
    gen = torch.Generator().manual_seed(0)
    with _writer(store_path) as store:
        _train(store, gen)
        store.flush()
        reader = ReadOnlyStore(store_path, host_capacity=0, device="cpu", timeout=2)
        try:
            for _ in range(2):
                reader.refresh()
                seen = reader.read("t", ALL)  # the last published state
                store.advance()
                _train(store, gen)  # merges into the published ranges, a reader registered
                assert reader.refresh() is False and torch.equal(reader.read("t", ALL), seen)
                want = store.read("t", ALL)
                deleted = store.expire("t", older_than=0)  # flushes (publishes), then deletes
                assert deleted["t"] > 0
                assert reader.refresh()
                assert torch.equal(reader.read("t", ALL), want)
                _train(store, gen)  # merges into the published ranges, a reader registered
                assert not torch.equal(store.read("t", ALL), want)
                assert reader.refresh() is False  # no flush since: the same state
                assert torch.equal(reader.read("t", ALL), want)
                with ReadOnlyStore(store_path, host_capacity=0, device="cpu", timeout=2) as late:
                    assert torch.equal(late.read("t", ALL), want)  # a new snapshot, same state
                mans, _, present, covered = _published(store)
                assert covered and {n for n in mans["t"]["names"] if n} <= present
            store.flush()
            assert reader.refresh()
            assert torch.equal(reader.read("t", ALL), store.read("t", ALL))
        finally:
            reader.close()


def test_retired_ranges_go_at_the_next_publish_or_once_readers_leave(store_path, monkeypatch):
    monkeypatch.setattr(chunkmerge.ChunkLevel, "_sparse", lambda self, r, rows: False)
    gen = torch.Generator().manual_seed(1)
    with _writer(store_path) as store:
        _train(store, gen)
        store.flush()
        reader = ReadOnlyStore(store_path, host_capacity=0, device="cpu", timeout=2)
        _train(store, gen)  # rewrites: the published ranges are retired, not dropped
        mans, retired, present, covered = _published(store)
        assert retired and set(retired) <= present and covered
        assert set(retired) <= set(mans["t"]["names"])
        store.flush()  # the published manifest moved on: the retired ranges go
        mans, now, present, _ = _published(store)
        assert now == [] and not set(retired) & present
        assert set(n for n in mans["t"]["names"] if n) <= present
        _train(store, gen)
        _, retired, present, _ = _published(store)
        assert retired and set(retired) <= present
        reader.close()  # no reader left: the next chunk write drops them (and uncovers)
        _train(store, gen)
        _, now, present, covered = _published(store)
        assert now == [] and not set(retired) & present and not covered
        store.flush()
        with ReadOnlyStore(store_path, host_capacity=0, device="cpu", timeout=2) as late:
            assert torch.equal(late.read("t", ALL), store.read("t", ALL))


_KILLED_WRITER = textwrap.dedent("""
    import sys, time, torch
    import tierstore as ts
    from tierstore.backends import chunkmerge
    chunkmerge.RANGE_ROWS = 100
    chunkmerge.ChunkLevel._sparse = lambda self, r, rows: False  # every merge a rewrite
    spec = ts.TableSpec("t", 600, 4, optimizer=ts.Adagrad(0.1))
    store = ts.TierStore(sys.argv[1], [spec], device_capacity=16, host_capacity=32,
                         device="cpu", write_buffer=8, table_format="chunks")
    gen = torch.Generator().manual_seed(2)
    def train():
        for _ in range(2):
            store.apply("t", torch.randint(0, 600, (200,), generator=gen),
                        torch.randn(200, 4, generator=gen))
        with store.quiesce_writer():
            pass
    train()
    store.flush()
    print("F", flush=True)
    sys.stdin.readline()  # a reader registered
    train()
    print("W", flush=True)
    time.sleep(600)
""")


def test_a_writer_killed_with_retired_ranges_leaves_a_readable_store(store_path, monkeypatch):
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, str(store_path)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ))
    try:
        assert proc.stdout.readline().strip() == "F"
        reader = ReadOnlyStore(store_path, host_capacity=0, device="cpu", timeout=2)
        want = reader.read("t", ALL)
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "W"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    try:
        assert reader.refresh() is False and torch.equal(reader.read("t", ALL), want)
        monkeypatch.setattr(chunkmerge.ChunkLevel, "_sparse", lambda self, r, rows: False)
        with ts.TierStore.open(store_path, device="cpu") as store:  # the retired ranges stay
            _, retired, present, covered = _published(store)
            assert retired and set(retired) <= present and covered
            reader.refresh()
            assert torch.equal(reader.read("t", ALL), want)  # the killed writer's flush
            now = store.read("t", ALL)  # its merged rows: the current manifest
            store.flush()
            _, left, present, _ = _published(store)
            assert left == [] and not set(retired) & present
            assert reader.refresh()
            assert torch.equal(reader.read("t", ALL), now)
        reader.refresh()
        assert torch.equal(reader.read("t", ALL), now)
    finally:
        reader.close()
    env = lmdb.open(str(store_path), readonly=True, lock=False, max_dbs=64)
    try:  # every range database is one the manifest names
        with env.begin() as txn:
            present = {bytes(k) for k, _ in txn.cursor() if bytes(k).startswith(b"c:")}
    finally:
        env.close()
    assert present and not set(retired) & present
