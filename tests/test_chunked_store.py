"""Format 4 in the store: tables kept as page-chunk levels (`table_format="chunks"`), real LMDB.

A chunked store must hold exactly the rows a B-tree store holds under any sequence of writes,
flushes, merges and reopens; its manifest must always name the ranges that hold the rows; a
kill at any point of a merge must leave a store that opens with every acknowledged row; expiry
(expire(), ttl tables) must delete what it deletes on a B-tree store. Wide rows (B-tree tables
inside a chunked store): test_chunks_default.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tierstore as ts
import tierstore.backends.chunkmerge as chunkmerge
from tests.profiles import examples
from tierstore.backends.lmdb_chunked import MANIFEST, RANGE_PREFIX
from tierstore.cli import main as cli_main
from tierstore.errors import ConfigError
from tierstore.export import export_store, import_store
from tierstore.persistence import compact

REPO = Path(__file__).resolve().parents[1]
SPECS = [ts.TableSpec("a", 5000, 8, optimizer=ts.Adagrad(0.1)), ts.TableSpec("b", 3000, 4)]


def _open(path: Path, fmt: str, **kw) -> ts.TierStore:
    kw.setdefault("device_capacity", 64)
    kw.setdefault("host_capacity", 64)
    kw.setdefault("write_log", 300)  # a small log: merges into the tables happen often
    return ts.TierStore(path, SPECS, device="cpu", table_format=fmt, **kw)


def _all_rows(store: ts.TierStore) -> dict[str, np.ndarray]:
    """Every row of every table as the store reads it (rows never written read their init)."""
    out = {}
    for spec in SPECS:
        ids = torch.arange(spec.num_rows)
        out[spec.name] = store.gather(spec.name, ids).weights.numpy().copy()
    return out


def _stored(store: ts.TierStore) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The rows in the tables' file, through `iter_rows` on a snapshot (the export's path)."""
    backend = store.backend
    txn = backend.snapshot()
    try:
        out = {}
        for spec in SPECS:
            parts = list(backend.iter_rows(spec.name, spec.row_dim, txn, chunk=97))
            ids = np.concatenate([p[0] for p in parts]) if parts else np.zeros(0, np.int64)
            rows = np.concatenate([p[1] for p in parts]) if parts else np.zeros((0, spec.row_dim))
            out[spec.name] = (ids, rows)
        return out
    finally:
        txn.abort()


def _write(store: ts.TierStore, rng: np.random.Generator, n: int) -> None:
    for spec in SPECS:
        ids = torch.from_numpy(np.unique(rng.integers(0, spec.num_rows, n)))
        store.apply_unique(spec.name, ids, torch.from_numpy(
            rng.standard_normal((len(ids), spec.dim)).astype(np.float32)))


def _check_manifests(store: ts.TierStore) -> None:
    """Each table's manifest names live ranges whose chunks hold as many rows as it counts,
    and no other range database exists."""
    backend = store.backend
    with backend.env.begin() as txn:
        present = {k for k, _ in txn.cursor() if k.startswith(RANGE_PREFIX.encode())}
    named = set()
    for spec in SPECS:
        level = backend.chunk_level(spec.name, spec.row_dim)
        man = backend.get_meta(f"{MANIFEST}{spec.name}")
        if man is None:
            assert level.rows() == 0
            continue
        assert man["counts"] == level.counts and sum(man["counts"]) == level.walked_rows()
        named |= {n.encode() for n in man["names"] if n is not None}
        assert backend.count(spec.name) == sum(man["counts"])
    assert present == named


@settings(max_examples=examples(0.3), deadline=None)
@given(plan=st.lists(st.tuples(st.integers(1, 400), st.sampled_from(["none", "flush", "reopen"])),
                     min_size=1, max_size=5),
       range_rows=st.sampled_from([60, 500, 100_000]), seed=st.integers(0, 2**16))
def test_a_chunked_store_holds_what_a_btree_store_holds(tmp_path_factory, plan, range_rows, seed):
    """Any sequence of writes (small caches: rows go down to the log and into the tables),
    flushes and reopens leaves the chunked store's rows bit for bit the B-tree store's, through
    reads, counts and the snapshot's iteration; the manifests stay true (ranges rewritten and
    updated in place, several ranges a table)."""
    base = tmp_path_factory.mktemp("cs")
    old = chunkmerge.RANGE_ROWS
    chunkmerge.RANGE_ROWS = range_rows
    try:
        stores = {f: _open(base / f, f) for f in ("btree", "chunks")}
        assert stores["chunks"].backend.chunked and not stores["btree"].backend.chunked
        for f, store in stores.items():
            rng = np.random.default_rng(seed)
            for n, then in plan:
                _write(store, rng, n)
                if then == "flush":
                    store.flush()
                elif then == "reopen":
                    store.close()
                    stores[f] = store = _open(base / f, f)
        for store in stores.values():
            store.flush()
        a, b = (_all_rows(stores[f]) for f in ("btree", "chunks"))
        for name in a:
            assert np.array_equal(a[name], b[name])
        sa, sb = (_stored(stores[f]) for f in ("btree", "chunks"))
        for name in sa:
            assert np.array_equal(sa[name][0], sb[name][0]) and np.array_equal(sa[name][1], sb[name][1])
            assert stores["chunks"].backend.count(name) == len(sa[name][0])
        _check_manifests(stores["chunks"])
        for store in stores.values():
            store.close()
    finally:
        chunkmerge.RANGE_ROWS = old


def test_the_format_is_the_stores_own_and_survives_reopen_and_info(tmp_path, capsys):
    """A chunked store records format 4; reopening without `table_format` keeps it; `tierstore
    info` counts its rows from the manifests; a B-tree store stays format 3."""
    with _open(tmp_path / "c", "chunks") as s:
        _write(s, np.random.default_rng(1), 300)
    with ts.TierStore.open(tmp_path / "c", device="cpu") as s:
        assert s.backend.chunked and s.backend.get_meta("store")["format_version"] == 4
        rows = {n: s.backend.count(n) for n in ("a", "b")}
        assert all(rows.values())
        stored = s.stats()["ssd"]["rows_stored"]
        assert stored == sum(rows.values())
    assert cli_main(["info", str(tmp_path / "c"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["format_version"] == 4
    assert {t["name"]: t["rows_stored"] for t in report["tables"]} == rows
    with _open(tmp_path / "b", "btree") as s:
        assert s.backend.get_meta("store")["format_version"] == 3 and not s.backend.chunked


def test_checkpoint_restore_export_import_and_compact(tmp_path):
    """A chunked store's checkpoint restores to the same rows (still chunked), its export
    imports to the same rows, and compaction keeps them."""
    with _open(tmp_path / "c", "chunks") as s:
        _write(s, np.random.default_rng(2), 500)
        s.flush()
        want = _all_rows(s)
        s.backend.compact()  # an open handle's compaction reopens the file: levels reopen too
        got = _all_rows(s)
        assert all(np.array_equal(got[n], want[n]) for n in want)
        _write(s, np.random.default_rng(3), 100)
        s.flush()
        want = _all_rows(s)
        man = s.checkpoint(tmp_path / "ck")
        assert man["store_format_version"] == 4
        export_store(s, tmp_path / "ex")
    with ts.TierStore.restore(tmp_path / "ck", tmp_path / "r", device="cpu") as r:
        assert r.backend.chunked
        got = _all_rows(r)
        assert all(np.array_equal(got[n], want[n]) for n in want)
        _check_manifests(r)
    import_store(tmp_path / "ex", tmp_path / "i", table_format="btree")  # chunks -> B-trees
    assert cli_main(["import", str(tmp_path / "ex"), str(tmp_path / "i2"), "--table-format",
                     "chunks", "--no-progress"]) == 0  # and into chunks again
    for where, chunked in (("i", False), ("i2", True)):
        with ts.TierStore.open(tmp_path / where, device="cpu") as i:
            assert i.backend.chunked == chunked
            got = _all_rows(i)
            assert all(np.array_equal(got[n], want[n]) for n in want)
    compact(tmp_path / "c")
    with ts.TierStore.open(tmp_path / "c", device="cpu") as c:
        got = _all_rows(c)
        assert all(np.array_equal(got[n], want[n]) for n in want)
        _check_manifests(c)


def test_chunks_are_dense_on_disk(tmp_path):
    """The tables' pages are about the raw rows: stats report chunk leaves, no half-full B-tree."""
    specs = [ts.TableSpec("a", 200_000, 16)]
    with ts.TierStore(tmp_path / "c", specs, device="cpu", device_capacity=0, host_capacity=0,
                      table_format="chunks") as s:
        rng = np.random.default_rng(3)
        for _ in range(4):
            ids = torch.from_numpy(np.unique(rng.integers(0, 200_000, 40_000)))
            s.apply_unique("a", ids, torch.ones(len(ids), 16))
        s.flush()
        ssd = s.stats()["ssd"]
        raw = ssd["rows_stored"] * (4 * specs[0].row_dim + 4)
        assert ssd["leaf_pages"] * 4096 < 1.3 * raw  # chunks fill their pages
        assert ssd["leaf_pages"] == ssd["dense_leaf_pages"]


def test_a_bad_format_refuses_and_readonly_handles_read_chunks(tmp_path):
    """A bad table_format is refused before any file is made; a read-only handle reads a closed
    chunked store. (Rows wider than a page chunk: test_chunks_default.py.)"""
    with pytest.raises(ConfigError, match="table_format"):
        ts.TierStore(tmp_path / "x", SPECS, table_format="lsm")
    assert not (tmp_path / "x").exists()
    with _open(tmp_path / "c", "chunks") as s:
        _write(s, np.random.default_rng(4), 200)
        want = {spec.name: s.read(spec.name, torch.arange(spec.num_rows)).cpu() for spec in SPECS}
    with ts.TierStore.open(tmp_path / "c", readonly=True, device="cpu") as ro:
        for spec in SPECS:
            assert torch.equal(ro.read(spec.name, torch.arange(spec.num_rows)), want[spec.name])


def _same(stores: dict[str, ts.TierStore]) -> None:
    """The chunked store reads, stores and counts the B-tree store's rows; its manifests hold."""
    a, b = (_all_rows(stores[f]) for f in ("btree", "chunks"))
    assert all(np.array_equal(a[n], b[n]) for n in a)
    sa, sb = (_stored(stores[f]) for f in ("btree", "chunks"))
    for name in sa:
        assert np.array_equal(sa[name][0], sb[name][0]) and np.array_equal(sa[name][1], sb[name][1])
        assert stores["chunks"].backend.count(name) == len(sa[name][0])
    _check_manifests(stores["chunks"])


@settings(max_examples=examples(0.2), deadline=None)
@given(plan=st.lists(st.tuples(st.integers(1, 400), st.integers(0, 3)), min_size=1, max_size=5),
       older=st.lists(st.integers(0, 8), min_size=1, max_size=3),
       range_rows=st.sampled_from([60, 500, 100_000]), scan=st.sampled_from([40, 65536]),
       seed=st.integers(0, 2**16))
def test_expire_matches_a_btree_store(tmp_path_factory, plan, older, range_rows, scan, seed):
    """expire() on a chunked store deletes the rows a B-tree store's deletes (the same counts),
    and both then read, store and count the same rows; more writes and expiries after it (into
    ranges it emptied) agree too. Scans of a few chunks each cross chunks and ranges."""
    from tierstore import expiry

    base = tmp_path_factory.mktemp("ce")
    with mock.patch.object(chunkmerge, "RANGE_ROWS", range_rows), \
            mock.patch.object(expiry, "SCAN_CHUNK", scan), \
            mock.patch.object(expiry, "DELETE_CHUNK", max(1, scan // 3)):
        stores = {f: _open(base / f, f) for f in ("btree", "chunks")}
        try:
            for round_, k in enumerate(older):
                got = {}
                for f, store in stores.items():
                    rng = np.random.default_rng(seed + round_)
                    for n, adv in plan:
                        _write(store, rng, n)
                        store.advance(adv)
                    got[f] = store.expire(older_than=k)
                assert got["chunks"] == got["btree"]
                _same(stores)
        finally:
            for store in stores.values():
                store.close()


@pytest.mark.parametrize("scan", [7, 100, 65536])
def test_the_stale_scan_lists_what_a_btree_scan_lists(tmp_path, scan):
    """`expiry.stale_ids` over a chunked table, from any start (a chunk's first id, inside a
    chunk, between ranges, past the end) and scan size, lists the B-tree table's stale ids."""
    from tierstore import expiry

    with mock.patch.object(chunkmerge, "RANGE_ROWS", 60), mock.patch.object(expiry, "SCAN_CHUNK", scan):
        stores = {f: _open(tmp_path / f, f) for f in ("btree", "chunks")}
        for store in stores.values():
            rng = np.random.default_rng(5)
            for _ in range(4):
                _write(store, rng, 300)
                store.advance(2)
            store.flush()
        spec = stores["btree"].table_specs["a"]
        for start in [0, 1, 17, 1000, 2501, 4999, 10**6]:
            got = {}
            for f, store in stores.items():
                out, at = [], start
                while at is not None:
                    ids, at = expiry.stale_ids(store.backend, spec, 5, at)
                    out.append(ids)
                got[f] = np.concatenate(out)
            assert np.array_equal(got["chunks"], got["btree"])
            assert len(got["btree"]) or start > 4000
            assert (got["chunks"] >= start).all()
        for store in stores.values():
            store.close()


def test_ttl_expiry_matches_a_btree_store(tmp_path):
    """ttl tables on a chunked store: the background deleter removes the stale rows from the
    chunk levels after each flush, and the store reads, stores and counts what a B-tree store
    with the same ttl does, before and after a reopen (close deletes what it did not reach)."""
    specs = [ts.TableSpec("a", 5000, 8, optimizer=ts.Adagrad(0.1), ttl=4),
             ts.TableSpec("b", 3000, 4, ttl=6)]

    def open_(f):
        return ts.TierStore(tmp_path / f, specs, device="cpu", device_capacity=64,
                            host_capacity=64, write_log=300, table_format=f)

    with mock.patch.object(chunkmerge, "RANGE_ROWS", 200):
        stores = {f: open_(f) for f in ("btree", "chunks")}
        for store in stores.values():
            rng = np.random.default_rng(11)
            for step in range(24):
                _write(store, rng, 150)
                store.advance()
                if step % 5 == 4:
                    store.flush()  # the cutoffs durable: the deleter runs
            store.flush()
            assert store.expiry.wait(10)
        assert stores["chunks"].stats()["expiry"]["expired_rows"] > 0
        _same(stores)
        for f in stores:
            stores[f].close()
            stores[f] = open_(f)
        _same(stores)
        for store in stores.values():
            store.close()


_KILL = textwrap.dedent("""
    import os, sys
    import numpy as np
    import tierstore as ts
    import tierstore.backends.chunkmerge as cm
    import tierstore.backends.chunkupdate as cu
    from tests.test_chunked_store import SPECS, _write
    path, kill_at, where, second = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    cm.RANGE_ROWS, cm.WINDOW = 200, 2  # many ranges, several windows a range
    seen = {"passes": 0, "commits": 0}
    armed = [False]
    def hook(kind, orig):
        def wrapped(*a, **k):
            if armed[0]:
                seen[kind] += 1
                if kind == where and seen[kind] == kill_at:
                    os._exit(9)  # a kill: no cleanup, no commit
            return orig(*a, **k)
        return wrapped
    cm.merge_into = hook("passes", cm.merge_into)  # a window of a range's rewrite
    cu.update_chunks = hook("passes", cu.update_chunks)  # a window of an in-place update
    s = ts.TierStore(path, SPECS, device="cpu", device_capacity=64, host_capacity=64,
                     write_log=100_000, table_format="chunks")
    for spec in SPECS:  # inside a range's publishing commit
        level = s.backend.chunk_level(spec.name, spec.row_dim)
        level.on_publish = hook("commits", level.on_publish)
    rng = np.random.default_rng(7)
    _write(s, rng, 3000)
    s.flush()  # the tables now in many ranges
    armed[0] = True
    _write(s, rng, second)
    s.flush()  # every row durable in the log, then merged: the kill lands in the merge
    print("done", seen, flush=True)
""")


@pytest.mark.parametrize("where,kill_at,second", [
    ("passes", 1, 3000), ("passes", 7, 3000), ("commits", 1, 3000), ("commits", 5, 3000),
    ("passes", 2, 60), ("commits", 3, 60), ("passes", 10**6, 3000)])
def test_a_kill_during_a_merge_loses_nothing(tmp_path, where, kill_at, second):
    """kill -9 inside a range's rewrite (after some of its windows committed into a fresh
    database no manifest names), inside a publishing commit, or inside an in-place update of a
    sparse batch: the store opens, drops the orphan ranges, replays the log, and reads every row
    as the uninterrupted run does."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *sys.path])}
    path = tmp_path / "s"
    proc = subprocess.run([sys.executable, "-c", _KILL, str(path), str(kill_at), where, str(second)],
                          env=env, capture_output=True, text=True, timeout=300)
    if kill_at < 10**6:  # the kill happened where it was asked (the merge reached it)
        assert proc.returncode == 9, proc.stdout + proc.stderr[-2000:]
    else:
        assert proc.returncode == 0 and "done" in proc.stdout, proc.stderr[-2000:]
    with ts.TierStore(tmp_path / "ref", SPECS, device="cpu", device_capacity=64, host_capacity=64,
                      write_log=100_000, table_format="chunks") as ref:
        rng = np.random.default_rng(7)
        _write(ref, rng, 3000)
        ref.flush()
        _write(ref, rng, second)
        ref.flush()
        want = _all_rows(ref)
    with ts.TierStore.open(path, device="cpu") as s:
        got = _all_rows(s)
        assert all(np.array_equal(got[n], want[n]) for n in want)
        _check_manifests(s)


def test_a_damaged_record_fails_its_read_and_keeps_failing_after_merges(tmp_path):
    """A record damaged on disk fails the read of its row (StoreCorruptError naming the store),
    other rows read fine, and merges that copy its chunk keep it damaged rather than sealing it
    under a fresh checksum or stopping: it still fails its read."""
    specs = [ts.TableSpec("a", 1000, 4)]
    with ts.TierStore(tmp_path / "s", specs, device="cpu", device_capacity=0, host_capacity=0,
                      table_format="chunks") as s:
        ids = torch.arange(0, 1000, 3)
        s.apply_unique("a", ids, torch.ones(len(ids), 4))
        s.flush()
        backend = s.backend
        level = backend.chunk_level("a", specs[0].row_dim)
        name = next(n for n in level.names if n is not None)
        db = level.db(name)
        with backend.env.begin(write=True, db=db) as txn:  # flip a byte of the first record
            key, val = next(iter(txn.cursor()))
            val = bytearray(val)
            cap = level.cap
            val[16 + 8 * cap + 2] ^= 0xFF
            txn.put(key, bytes(val))
        w = specs[0].row_dim
        with pytest.raises(ts.StoreCorruptError, match="checksum"):
            backend.get("a", np.array([0]), w)  # (the tables' own read: the caches may hold it)
        rows, found = backend.get("a", np.array([3, 999, 5]), w)
        assert found.tolist() == [True, True, False] and (rows[:2, :4] != 0).all()
        more = torch.arange(1, 1000, 3)  # rows beside it: the merge rewrites its range
        s.apply_unique("a", more, torch.ones(len(more), 4))
        s.flush()
        assert s.backend.count("a") == 334 + 333
        with pytest.raises(ts.StoreCorruptError, match="checksum"):
            backend.get("a", np.array([0]), w)
        assert backend.get("a", np.array([1, 3]), w)[1].all()


def test_the_log_of_chunked_tables_merges_by_its_disk_bound(tmp_path, monkeypatch):
    """With chunked tables the log's bound is the disk budget's (`budget.log_bound` over the
    levels' shape: rows stored, their payload bytes, the tables' file, a log entry's bytes), the
    background merge starts 1/5 below it and takes the whole log, and an append past the bound
    merges first, inline; B-tree tables keep the capacity's 3/4 trigger and merge its older half."""
    import time

    from tierstore.backends.wal import budget, writelog

    monkeypatch.setattr(writelog, "CHUNK_LOG_MIN", 200)
    # a budget these small tables can meet (LMDB's fixed pages are most of their file), so the
    # bound lies between its clamps and follows the rows stored
    monkeypatch.setattr(budget, "DISK_BUDGET", 3.0)
    with _open(tmp_path / "b", "btree", write_log=100_000) as b:
        assert b.log.stored is None and b.log.merge_at() == b.log.capacity * 3 // 4
        assert b.log.full_at() == b.log.capacity
    with _open(tmp_path / "c", "chunks", write_log=100_000) as s:
        assert s.log.stored == 0 and s.log.full_at() == 200 and s.log.merge_at() == 160
        rng = np.random.default_rng(5)
        _write(s, rng, 3000)
        s.flush()
        shape = s.log.disk_shape()
        stored = sum(s.backend.count(n) for n in ("a", "b"))
        assert shape.stored_rows == stored == s.log.stored
        assert shape.raw_bytes == sum(s.backend.count(t.name) * 4 * t.row_dim for t in SPECS)
        assert shape.table_bytes >= s.backend.data_bytes()
        assert shape.entry_bytes >= writelog.HEADER + 4 * max(t.row_dim for t in SPECS) + 4
        bound = int((3.0 * shape.raw_bytes - shape.table_bytes) // shape.entry_bytes)
        assert 200 < bound < stored // 2  # the budget sets it, not a clamp
        assert s.log.full_at() == bound and s.log.merge_at() == bound - bound // 5
        merges = s.log.background_merges
        _write(s, rng, 4000)  # more than the merge's start: the merger runs by itself
        s.writeback.drain()
        deadline = time.monotonic() + 30
        while s.log.background_merges == merges and time.monotonic() < deadline:
            time.sleep(0.05)
        assert s.log.background_merges > merges
        while s.log.wants_merge() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert s.log.size < s.log.merge_at()  # the whole log went: it is below its trigger
        # an append past the bound merges first, inline: however much a flush hands down at
        # once, the log stays near its bound
        s.log.stop_merger()
        peak = 0
        for _ in range(6):
            _write(s, rng, 400)
            s.writeback.drain()
            peak = max(peak, s.log.size)
        assert s.log.rows_appended and peak <= s.log.full_at() + 800
        monkeypatch.setattr(budget, "DISK_BUDGET", 1.9)  # the real budget: these tables are
        assert s.log.full_at() == 200  # too small for it, the bound is the clamp's least
        big = torch.arange(0, 5000, 2)  # one batch larger than the bound: appended whole
        s.apply_unique("a", big, torch.ones(len(big), 8))
        s.flush()
        rows, found = s.backend.get("a", big.numpy(), SPECS[0].row_dim)
        assert found.all()  # every row of the big batch reached the tables


def test_in_place_updates_keep_ranges_full_and_close_packs_them(tmp_path, monkeypatch):
    """Sparse merges update ranges in place only while their chunks stay REFILL full even if
    every batch row splits one; closing the store rewrites, packed, every range under
    REPACK_FILL; the rows read the same before and after."""
    monkeypatch.setattr(chunkmerge, "RANGE_ROWS", 2000)
    monkeypatch.setattr(chunkmerge, "REWRITE_MAX", 10**9)  # the fill rule alone (tiny batches:
    specs = [ts.TableSpec("a", 10**6, 4)]  # test_chunkmerge's regime test)
    path = tmp_path / "s"

    def fills(store) -> list[float]:
        level = store.backend.chunk_level("a", specs[0].row_dim)
        out = []
        with store.backend.env.begin() as txn:
            for name, count in zip(level.names, level.counts):
                if name is not None:
                    entries = txn.stat(level.db(name))["entries"]
                    out.append(count / (entries * level.cap))
        return out

    rng = np.random.default_rng(9)
    with ts.TierStore(path, specs, device="cpu", device_capacity=0, host_capacity=0,
                      table_format="chunks") as s:
        s.apply_unique("a", torch.arange(0, 10**6, 50), torch.ones(20_000, 4))
        s.flush()
        for _ in range(6):  # sparse batches: a few rows a range
            ids = torch.from_numpy(np.unique(rng.integers(0, 10**6, 25)))
            s.apply_unique("a", ids, torch.ones(len(ids), 4))
            s.flush()
            assert min(fills(s)) >= chunkmerge.REFILL - 0.02  # (a range's last chunk is short)
        want = s.gather("a", torch.arange(0, 10**6, 7)).weights.clone()
        thin = sum(f < 0.97 for f in fills(s))
        assert thin  # in-place splits left some ranges below the close's bar
    with ts.TierStore.open(path, device="cpu") as s:
        assert all(f >= 0.95 for f in fills(s))  # packed (a range's last chunk may be short)
        assert torch.equal(s.gather("a", torch.arange(0, 10**6, 7)).weights, want)
        _check_manifests_of(s, "a", specs[0].row_dim)


def _check_manifests_of(store: ts.TierStore, table: str, row_dim: int) -> None:
    level = store.backend.chunk_level(table, row_dim)
    assert sum(level.counts) == level.walked_rows() == store.backend.count(table)
