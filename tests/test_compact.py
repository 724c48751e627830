"""Compaction, key-range write transactions and map trimming, on real LMDB files."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import lmdb
import numpy as np
import pytest
import torch

import tierstore as ts
from tierstore import cli, persistence
from tierstore.backends import lmdb_backend
from tierstore.backends.lmdb_backend import LmdbBackend
from tierstore.errors import StoreCorruptError, StoreLockedError

REPO = Path(__file__).resolve().parents[1]
SPECS = [ts.TableSpec("big", 10**11, 16, optimizer=ts.RowWiseAdagrad(0.1)),
         ts.TableSpec("small", 5000, 4, optimizer=ts.Adam(0.01))]
W_BIG, W_SMALL = SPECS[0].row_dim, SPECS[1].row_dim  # 18 and 14 floats (payload + stamp)


def random_writes(backend: LmdbBackend, n: int, chunk: int, seed: int = 0) -> None:
    """Write n random-id rows of 'big' (and some of 'small') in puts of `chunk` rows."""
    rng = np.random.default_rng(seed)
    ids = rng.choice(10**11, n, replace=False)
    for i in range(0, n, chunk):
        rows = ids[i:i + chunk]
        small = rng.choice(5000, 500, replace=False)
        backend.put({"big": (rows, rng.standard_normal((len(rows), W_BIG), dtype=np.float32)),
                     "small": (small, rng.standard_normal((500, W_SMALL), dtype=np.float32))})
    # rewrite some rows: copy-on-write leaves freed pages behind
    again = ids[: n // 3]
    backend.put({"big": (again, rng.standard_normal((len(again), W_BIG), dtype=np.float32))})


def bloated_store(path: Path, n: int = 120_000, chunk: int = 20_000) -> None:
    """A closed store whose file is far larger than its rows need (no compaction on close)."""
    store = ts.TierStore(path, SPECS, device_capacity=0, host_capacity=0, seed=3, device="cpu")
    store.backend.compact_on_close = None
    random_writes(store.backend, n, chunk)
    store.close()


def dump_of(backend: LmdbBackend) -> dict:
    """Every row of both tables and every metadata record, from one snapshot."""
    txn = backend.snapshot()
    try:
        out = {}
        for spec in SPECS:
            parts = list(backend.iter_rows(spec.name, spec.row_dim, txn))
            out[spec.name] = (np.concatenate([p[0] for p in parts]),
                              np.concatenate([p[1] for p in parts]))
        out["meta"] = backend.snapshot_meta(txn)
        return out
    finally:
        txn.abort()


def dump(path: Path) -> dict:
    """`dump_of` a closed store or checkpoint directory."""
    backend = LmdbBackend(path, readonly=True)
    try:
        return dump_of(backend)
    finally:
        backend.close()


def same_dump(x: dict, y: dict) -> bool:
    return x["meta"] == y["meta"] and all(
        np.array_equal(x[k][0], y[k][0]) and x[k][1].tobytes() == y[k][1].tobytes()
        for k in ("big", "small"))


def data_bytes(path: Path) -> int:
    return (path / "data.mdb").stat().st_blocks * 512


def test_compact_keeps_every_row_and_config_and_shrinks(tmp_path):
    path = tmp_path / "s"
    bloated_store(path)
    before, size0 = dump(path), data_bytes(path)
    raw = sum(before[k][1].nbytes + 4 * len(before[k][1]) for k in ("big", "small"))  # + check words
    assert size0 > 2.0 * raw  # random inserts + rewrites: half-full pages and freed pages
    report = persistence.compact(path)
    assert report["bytes_before"] == size0 and report["bytes_after"] == data_bytes(path)
    after = dump(path)
    assert same_dump(before, after)  # every row bit for bit, and every metadata record
    assert data_bytes(path) < 1.35 * raw  # 8-B key + 8-B node header per 72-B record, full pages
    assert not [p for p in os.listdir(path) if p.startswith(".compact")]
    # the store opens with its config, serves its rows, and rejects another config
    store = ts.TierStore(path, SPECS, device_capacity=0, host_capacity=0, seed=3, device="cpu")
    ids = before["big"][0][:1000]
    got = store.read("big", ids)
    assert np.array_equal(got.numpy(), before["big"][1][:1000, :16])
    store.close()
    with pytest.raises(ts.ConfigMismatchError):
        ts.TierStore(path, [ts.TableSpec("big", 10**11, 8)], seed=3, device="cpu")


def test_estimate_matches_compacted_size(tmp_path):
    path = tmp_path / "s"
    bloated_store(path)
    backend = LmdbBackend(path)
    est = backend.estimate_compact_bytes()
    backend.compact_on_close = None
    backend.close()
    persistence.compact(path)
    assert abs(data_bytes(path) - est) <= 0.05 * est + 64 * 1024


def test_close_compacts_a_bloated_store(tmp_path):
    path = tmp_path / "s"
    store = ts.TierStore(path, SPECS, device_capacity=0, host_capacity=0, seed=3, device="cpu")
    random_writes(store.backend, 120_000, 20_000)
    store.backend.sync()
    size0 = data_bytes(path)
    want = dump_of(store.backend)
    store.close()
    assert data_bytes(path) < 0.6 * size0
    assert same_dump(dump(path), want)


def test_tree_pages_show_the_leaves_fill_and_stats_split_the_files(tmp_path):
    """The B-tree's leaf fill (chunk levels fill theirs: test_chunked_store.py)."""
    path = tmp_path / "s"
    store = ts.TierStore(path, SPECS, device_capacity=0, host_capacity=0, seed=3, device="cpu",
                         table_format="btree")
    random_writes(store.backend, 120_000, 20_000)
    store.backend.sync()
    pages = store.backend.tree_pages(["big", "small"])
    # a leaf node: 8-B header, 8-B key, the record (row_dim floats + check), a 2-B pointer
    per_leaf = [4080 // (16 + 4 * w + 4 + 2) for w in (W_BIG, W_SMALL)]  # 43 and 52
    full = sum(-(-store.backend.count(t) // k) for t, k in zip(("big", "small"), per_leaf))
    assert pages["dense_leaf_pages"] == full
    fill = pages["dense_leaf_pages"] / pages["leaf_pages"]
    assert 0.4 < fill < 0.8  # random inserts split leaves in half: about 2/3 full
    ssd = store.stats()["ssd"]
    assert ssd["disk_bytes"] == ssd["data_bytes"] + ssd["log_bytes"]
    assert ssd["data_bytes"] == data_bytes(path)
    assert ssd["leaf_pages"] == pages["leaf_pages"]
    store.close()
    backend = LmdbBackend(path)  # close compacted it: every leaf full
    dense = backend.tree_pages(["big", "small"])
    assert dense["dense_leaf_pages"] == pages["dense_leaf_pages"]
    assert dense["leaf_pages"] <= dense["dense_leaf_pages"] + 2
    assert backend.tree_pages(["absent"]) == {"leaf_pages": 0, "branch_pages": 0, "dense_leaf_pages": 0}
    backend.close()


def test_close_after_reads_only_does_not_rewrite(tmp_path):
    path = tmp_path / "s"
    bloated_store(path)
    ino = (path / "data.mdb").stat().st_ino
    backend = LmdbBackend(path)  # as export does: a writable handle that only reads
    backend.get("big", np.arange(10), W_BIG)
    backend.close()
    assert (path / "data.mdb").stat().st_ino == ino


def test_online_compact_keeps_serving(tmp_path):
    path = tmp_path / "s"
    store = ts.TierStore(path, SPECS, device_capacity=64, host_capacity=64, seed=3, device="cpu")
    rng = np.random.default_rng(1)
    ids = np.unique(rng.choice(10**11, 3000))
    for _ in range(3):
        store.apply("big", ids, torch.full((len(ids), 16), 0.1))
    want = store.read("big", ids).clone()
    before, after = store.backend.compact()
    assert after <= before
    assert np.array_equal(store.read("big", ids).numpy(), want.numpy())
    store.apply("big", ids[:10], torch.ones(10, 16))  # writes work after the swap
    store.close()


def test_online_compact_counts_the_rows_still_in_the_write_behind_ring_as_before(tmp_path):
    """`before` is the file once the ring is drained and the log merged: measured earlier, a
    slow writer left rows in the ring, the drain grew the file, and `after` could pass it."""
    path = tmp_path / "s"
    store = ts.TierStore(path, SPECS, device_capacity=8, host_capacity=8, seed=3, device="cpu")
    ids = np.arange(0, 40_000, dtype=np.int64) * 7919
    store.apply("big", ids[:2_000], torch.full((2_000, 16), 0.1))
    store.flush()
    store.writeback.delay = lambda: 0.05  # the writer sleeps before each batch it takes
    store.apply("big", ids, torch.full((len(ids), 16), 0.2))  # dirty rows wait in the ring
    assert store.writeback.pending > 10_000
    want = store.read("big", ids).clone()
    store.writeback.delay = None
    before, after = store.backend.compact()
    assert after <= before
    assert np.array_equal(store.read("big", ids).numpy(), want.numpy())
    store.close()


def test_compact_bad_paths(tmp_path):
    with pytest.raises(StoreCorruptError):
        persistence.compact(tmp_path / "nothing")
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ts.ConfigError):
        persistence.compact(f)
    path = tmp_path / "s"
    store = ts.TierStore(path, SPECS, seed=3, device="cpu", device_capacity=0, host_capacity=0)
    with pytest.raises(StoreLockedError):
        persistence.compact(path)
    store.close()


def test_cli_compact(tmp_path, capsys):
    path = tmp_path / "s"
    bloated_store(path, n=40_000, chunk=10_000)
    assert cli.main(["compact", str(path)]) == 0
    assert "compacted" in capsys.readouterr().out
    assert cli.main(["compact", str(tmp_path / "missing")]) == 2


def test_stale_compaction_dir_is_removed(tmp_path):
    path = tmp_path / "s"
    bloated_store(path, n=20_000, chunk=10_000)
    want = dump(path)
    stale = path / ".compact-deadbeef"
    stale.mkdir()
    (stale / "data.mdb").write_bytes(b"half a file")
    LmdbBackend(path).close()
    assert not stale.exists()
    assert same_dump(dump(path), want)


COMPACT_WORKER = "import sys; from tierstore.persistence import compact; print('go', flush=True); " \
                 "compact(sys.argv[1])"


@pytest.mark.parametrize("trial", range(3))
def test_kill9_during_compaction(tmp_path, trial):
    path = tmp_path / "s"
    bloated_store(path, n=150_000, chunk=30_000)
    want = dump(path)
    env = dict(os.environ)
    proc = subprocess.Popen([sys.executable, "-c", COMPACT_WORKER, str(path)], env=env,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "go"
    deadline = time.monotonic() + 60
    while not [p for p in os.listdir(path) if p.startswith(".compact")]:  # compaction started
        assert proc.poll() is None and time.monotonic() < deadline, "compaction never started"
        time.sleep(0.001)
    time.sleep((0.0, 0.005, 0.02)[trial])
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    # the kill landed during compaction: its staging directory (removed when compaction ends,
    # also on an error) is still there
    assert [p for p in os.listdir(path) if p.startswith(".compact")], "kill landed after compaction"
    assert same_dump(dump(path), want)  # the old file or the new one, never a torn one
    store = ts.TierStore(path, SPECS, seed=3, device="cpu", device_capacity=0, host_capacity=0)
    store.close()
    assert not [p for p in os.listdir(path) if p.startswith(".compact")]
    assert same_dump(dump(path), want)


def test_checkpoint_is_compact(tmp_path):
    path = tmp_path / "s"
    store = ts.TierStore(path, SPECS, device_capacity=0, host_capacity=0, seed=3, device="cpu")
    random_writes(store.backend, 120_000, 20_000)
    store.checkpoint(tmp_path / "ck", step=1)
    live = dump_of(store.backend)
    store.close()
    raw = sum(live[k][1].nbytes + 4 * len(live[k][1]) for k in ("big", "small"))  # + check words
    assert same_dump(dump(tmp_path / "ck"), live)
    assert data_bytes(tmp_path / "ck") < 1.35 * raw


def leaf_stats(backend: LmdbBackend, table: str) -> dict:
    with backend.env.begin() as txn:
        return txn.stat(backend.table_db(table))


def test_large_puts_leave_few_free_pages(tmp_path):
    """Key-range transactions: the file stays close to the tree's own pages."""
    backend = LmdbBackend(tmp_path / "s")
    rng = np.random.default_rng(2)
    ids = rng.choice(10**11, 300_000, replace=False)
    for i in range(0, len(ids), 65_536):
        rows = ids[i:i + 65_536]
        backend.put({"big": (rows, np.ones((len(rows), W_BIG), np.float32))})
    backend.sync()
    st = leaf_stats(backend, "big")
    tree = (st["leaf_pages"] + st["branch_pages"]) * st["psize"]
    assert backend.disk_bytes() < 1.4 * tree  # one transaction per put: ~2.2x
    got, found = backend.get("big", ids, W_BIG)
    assert found.all() and (got == 1).all()
    backend.compact_on_close = None
    backend.close()


def test_put_appends_beyond_last_key(tmp_path):
    backend = LmdbBackend(tmp_path / "s")
    for start in range(0, 100_000, 20_000):  # increasing ids, as an import writes them
        rows = np.arange(start, start + 20_000) * 7
        backend.put({"big": (rows, np.full((len(rows), W_BIG), start, np.float32))})
    st = leaf_stats(backend, "big")
    assert st["entries"] == 100_000
    # full pages: a leaf node is an 8-B header, the 8-B key and the record (row + check word),
    # plus a 2-B pointer, in a 4 KiB page with a 16-B header (43 records of 76 B)
    per_page = (4096 - 16) // (8 + 8 + 4 * W_BIG + 4 + 2)
    assert st["entries"] / st["leaf_pages"] > per_page - 1
    got, found = backend.get("big", np.array([0, 7 * 20_000, 7 * 99_999]), W_BIG)
    assert found.all() and got[:, 0].tolist() == [0, 20_000, 80_000]
    # a later put with duplicates and keys before the end still overwrites correctly
    backend.put({"big": (np.array([7, 7, 3]), np.array([[1.0] * W_BIG, [2.0] * W_BIG, [3.0] * W_BIG],
                                                       np.float32))})
    got, found = backend.get("big", np.array([7, 3, 5]), W_BIG)
    assert found.tolist() == [True, True, False] and got[:, 0].tolist() == [2.0, 3.0, 0.0]
    backend.close()


def rss_file() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssFile:"):
                return int(line.split()[1]) * 1024
    return 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and madvise are Linux")
def test_trim_map_drops_resident_file_pages(tmp_path):
    path = tmp_path / "s"
    bloated_store(path, n=200_000, chunk=50_000)
    rows = dump(path)["big"][0]
    backend = LmdbBackend(path, readonly=True)
    backend.map_resident = None  # no automatic trims while we measure
    base = rss_file()
    want, found = backend.get("big", rows, W_BIG)  # touches every leaf page
    assert found.all()
    grown = rss_file()
    assert grown - base > 8 << 20
    assert backend.trim_map() > 0
    assert rss_file() < grown - (8 << 20)
    again, _ = backend.get("big", rows, W_BIG)  # pages fault back in from the page cache
    assert np.array_equal(want, again)
    backend.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and madvise are Linux")
def test_map_resident_bound(tmp_path, monkeypatch):
    path = tmp_path / "s"
    bloated_store(path, n=200_000, chunk=50_000)
    rows = dump(path)["big"][0]
    backend = LmdbBackend(path, readonly=True)
    backend.map_resident = 4 << 20
    base = rss_file()
    peak = 0
    for part in np.array_split(rows, 50):
        backend.get("big", part, W_BIG)
        peak = max(peak, rss_file() - base)
    backend.close()
    assert peak < 24 << 20  # about the bound plus a batch's pages, not the whole file


def test_write_compact_copes_with_a_small_map(tmp_path, monkeypatch):
    """The fresh file's map grows when the estimate is short."""
    path = tmp_path / "s"
    bloated_store(path, n=30_000, chunk=10_000)
    want = dump(path)
    real = lmdb.open

    def tiny(*a, **kw):
        if kw.get("lock") is False and not kw.get("readonly"):
            kw["map_size"] = 64 * 1024
        return real(*a, **kw)

    monkeypatch.setattr(lmdb_backend.lmdb, "open", tiny)
    persistence.compact(path)
    monkeypatch.undo()
    assert same_dump(dump(path), want)


@pytest.fixture
def writemap(monkeypatch):
    """Writers open a writable map (TIERSTORE_WRITEMAP=1)."""
    monkeypatch.setattr(lmdb_backend, "WRITEMAP", True)


@pytest.mark.parametrize("text, want", [("", False), ("0", False), ("off", False), ("1", True),
                                        ("on", True), ("auto", None)])
def test_writers_commit_with_pwrite_unless_told_to_map_writable(tmp_path, monkeypatch, text, want):
    """TIERSTORE_WRITEMAP picks the write path; unset, commits pwrite and the file stays its size."""
    monkeypatch.setenv("TIERSTORE_WRITEMAP", text)
    assert lmdb_backend._writemap_default() is want
    monkeypatch.setattr(lmdb_backend, "WRITEMAP", want)
    backend = LmdbBackend(tmp_path / "s")
    try:
        assert backend.writemap is (want is not False)  # "auto": the map is never trimmed here
        random_writes(backend, 2_000, 5_000)
        size = (tmp_path / "s" / "data.mdb").stat().st_size
        assert (size >= backend.env.info()["map_size"]) is backend.writemap  # a writable map spans the map
    finally:
        backend.close()


def test_writemap_store_roundtrip_and_file_size(tmp_path, writemap):
    path = tmp_path / "s"
    store = ts.TierStore(path, SPECS, device_capacity=0, host_capacity=0, seed=3, device="cpu")
    assert store.backend.writemap
    random_writes(store.backend, 60_000, 20_000)
    want = dump_of(store.backend)
    assert (path / "data.mdb").stat().st_size >= store.backend.env.info()["map_size"]  # sparse
    store.backend.compact_on_close = None
    store.close()
    assert same_dump(dump(path), want)
    backend = LmdbBackend(path, readonly=True)
    used = backend.used_bytes()
    backend.close()
    assert (path / "data.mdb").stat().st_size == used  # the map's tail is given back at close
    os.truncate(path / "data.mdb", used // 2)
    with pytest.raises(StoreCorruptError, match="truncated"):  # checked before mapping writable
        LmdbBackend(path)


def test_writemap_refuses_a_commit_the_disk_cannot_hold(tmp_path, writemap, monkeypatch):
    backend = LmdbBackend(tmp_path / "s")
    backend.put({"big": (np.arange(100), np.ones((100, W_BIG), np.float32))})
    real = os.statvfs

    class Full:
        f_bavail, f_frsize = 10, 4096

    monkeypatch.setattr(lmdb_backend.os, "statvfs", lambda p: Full())
    with pytest.raises(ts.OutOfSpaceError):
        backend.put({"big": (np.arange(100, 200), np.ones((100, W_BIG), np.float32))})
    monkeypatch.setattr(lmdb_backend.os, "statvfs", real)
    got, found = backend.get("big", np.arange(200), W_BIG)
    assert found.tolist() == [True] * 100 + [False] * 100  # the refused commit changed nothing
    backend.close()


def test_bench_lmdb_io_smoke(tmp_path, monkeypatch, capsys):
    from bench import lmdb_io

    monkeypatch.chdir(tmp_path)
    assert lmdb_io.main(["--interleaved", "--tables", "2", "--rows", "3000", "--batch", "256",
                         "--blocks", "1", "--steps", "1", "--rounds", "1",
                         "--layouts", "one_txn,key_range_pwrite,untrimmed"]) == 0
    out = capsys.readouterr().out
    assert "key_range_pwrite" in out and (tmp_path / "bench/out/lmdb_io_interleaved.json").exists()
