"""Checkpoint, restore and resume are exact; bad inputs get clear errors and change nothing."""

from __future__ import annotations

import errno
import json
import os
import shutil
import threading
import time

import numpy as np
import pytest
import torch

import tierstore as ts
from tests.crash_worker import SPECS, dump_backend, dump_path, open_store, same, train_step
from tierstore import cli, persistence
from tierstore.backends import lmdb_backend
from tierstore.backends.lmdb_backend import LmdbBackend
from tierstore.export import export_store, import_store

CAPS = [(64, 256), (0, 0), (10_000, 10_000)]


def trained(path, steps, caps=(64, 256), **kw):
    store = open_store(path, *caps, **kw)
    for step in range(1, steps + 1):
        train_step(store, step)
    return store


def full_payloads(store):
    """Payloads (weights + optimizer state) of every row ever stored, read through the store."""
    store.flush()
    out = {}
    for name, (ids, _) in dump_backend(store.backend).items():
        tab = store.tables[name]
        uniq = torch.from_numpy(ids)
        out[name] = store.cascade.access(tab, uniq, None)[:, : tab.spec.payload_dim].cpu().clone()
    return out


def test_checkpoint_restore_is_exact(tmp_path):
    store = trained(tmp_path / "s", 5)
    manifest = store.checkpoint(tmp_path / "ck", step=5)
    want = dump_backend(store.backend)
    assert manifest["step"] == 5 and manifest["seed"] == 7
    assert {t["spec"]["name"]: t["rows_stored"] for t in manifest["tables"]} == {
        k: len(v[0]) for k, v in want.items()}
    assert sorted(os.listdir(tmp_path / "ck")) == ["MANIFEST.json", "data.mdb"]
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]  # no staging left
    train_step(store, 6)  # the live store moves on; the checkpoint does not
    store.close()
    assert same(dump_path(tmp_path / "ck"), want)
    back = ts.TierStore.restore(tmp_path / "ck", tmp_path / "s", device_capacity=8,
                                host_capacity=8, device="cpu")
    assert same(dump_backend(back.backend), want)
    assert back.seed == 7 and set(back.tables) == {"a", "b"}
    back.close()
    assert persistence.verify_checkpoint(tmp_path / "ck")["step"] == 5


@pytest.mark.parametrize("caps", CAPS)
def test_resume_is_bit_identical(tmp_path, caps):
    n, m = 4, 4
    store = trained(tmp_path / "s", n)
    store.checkpoint(tmp_path / "ck", step=n)
    for step in range(n + 1, n + m + 1):
        train_step(store, step)
    want = full_payloads(store)
    store.close()
    back = ts.TierStore.restore(tmp_path / "ck", tmp_path / "r", device_capacity=caps[0],
                                host_capacity=caps[1], device="cpu", policy="lfu")
    for step in range(n + 1, n + m + 1):
        train_step(back, step)
    got = full_payloads(back)
    back.close()
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(want[name], got[name]), name


def test_background_checkpoint_snapshot_ignores_later_writes(tmp_path):
    store = trained(tmp_path / "s", 3, caps=(0, 0))  # every write goes straight to LMDB
    store.flush()
    want = dump_backend(store.backend)
    pending = persistence.start_checkpoint(store, tmp_path / "ck", step=3)
    for step in range(4, 10):  # keeps writing (and growing) while the copy runs
        train_step(store, step)
    manifest = pending.wait()
    assert pending.done() and manifest["step"] == 3 and pending.pause_s >= 0
    assert same(dump_path(tmp_path / "ck"), want)
    store.close()


def test_a_checkpoint_holds_the_logs_merges_at_its_pause(tmp_path):
    """The pause hands the dirty rows to the write-behind log and returns; the copying thread
    merges them. Until it has, the training thread goes on, the writer keeps appending, and no
    merge passes the pause's point, even with a log too small for the writes that follow (the
    writer waits for the hold to end): the checkpoint is the state at the pause, and the live
    store ends as one that took no checkpoint."""
    kw = {"write_log": 200, "write_buffer": 64}  # a tiny log: merges all the time
    ref = trained(tmp_path / "ref", 4, **kw)
    ref.flush()
    want = dump_backend(ref.backend)
    store = trained(tmp_path / "s", 4, **kw)
    release = threading.Event()
    snapshot_at = store.snapshot_at
    seen = []

    def slow_snapshot_at(mark):  # the copying thread waits here until the test lets it go on
        seen.append(mark)
        release.wait(30)
        seen.append(store.log.merged)  # merges went on meanwhile, none past the point
        return snapshot_at(mark)

    store.snapshot_at = slow_snapshot_at
    pending = persistence.start_checkpoint(store, tmp_path / "ck", step=4)
    # the pause returned before the copying thread merged anything past the point
    threading.Timer(0.5, release.set).start()  # the writer may wait on the hold until then
    for step in range(5, 12):
        train_step(store, step)
    assert pending.wait()["step"] == 4
    mark, merged_then = seen
    assert merged_then <= mark < store.log.next  # rows appended past the point meanwhile
    assert same(dump_path(tmp_path / "ck"), want)
    for step in range(5, 12):
        train_step(ref, step)
    store.flush()
    ref.flush()
    assert same(dump_backend(store.backend), dump_backend(ref.backend))
    store.close()
    ref.close()


def test_checkpoints_back_to_back_each_hold_their_own_point(tmp_path):
    """Checkpoints started while the one before is still copying (each waits for it), with a
    tiny log the writer and merger keep filling: every checkpoint is the state at its own pause."""
    kw = {"write_log": 150, "write_buffer": 64}
    ref = trained(tmp_path / "ref", 0, **kw)
    store = trained(tmp_path / "s", 0, **kw)
    snapshot_at = store.snapshot_at

    def late_snapshot_at(mark):  # training runs on (and fills the log) before each snapshot
        time.sleep(0.15)
        return snapshot_at(mark)

    store.snapshot_at = late_snapshot_at
    wants, pendings = {}, []
    for step in range(1, 13):
        train_step(store, step)
        train_step(ref, step)
        if step % 3 == 0:
            ref.flush()
            wants[step] = dump_backend(ref.backend)
            pendings.append(persistence.start_checkpoint(store, tmp_path / f"ck{step}", step=step))
    for p in pendings:
        p.wait()
    for step, want in wants.items():
        assert same(dump_path(tmp_path / f"ck{step}"), want), step
    store.close()
    ref.close()


def test_checkpoint_during_map_growth_waits(tmp_path, monkeypatch):
    monkeypatch.setattr(lmdb_backend, "_INITIAL_MAP", 4 << 20)
    store = open_store(tmp_path / "s", 0, 0)
    map0 = store.backend.env.info()["map_size"]
    ids = torch.arange(20_000) * 1000
    store.apply("a", ids, torch.ones(20_000, 8))
    pending = persistence.start_checkpoint(store, tmp_path / "ck")
    big = torch.arange(200_000, 400_000) * 1000
    store.apply("a", big, torch.ones(len(big), 8))  # may remap the map: waits for the copy
    pending.wait()
    assert store.backend.env.info()["map_size"] > map0  # the map did grow
    persistence.verify_checkpoint(tmp_path / "ck")
    assert len(dump_path(tmp_path / "ck")["a"][0]) == 20_000
    store.close()


def test_checkpoint_overwrite_and_existing_dest(tmp_path):
    store = trained(tmp_path / "s", 2)
    store.checkpoint(tmp_path / "ck", step=2)
    with pytest.raises(ts.ConfigError, match="not empty"):
        store.checkpoint(tmp_path / "ck", step=3)
    assert persistence.read_manifest(tmp_path / "ck")["step"] == 2
    train_step(store, 3)
    store.checkpoint(tmp_path / "ck", step=3, overwrite=True)
    assert persistence.verify_checkpoint(tmp_path / "ck")["step"] == 3
    (tmp_path / "file").write_text("x")
    with pytest.raises(ts.ConfigError, match="not a directory"):
        store.checkpoint(tmp_path / "file")
    store.close()


def test_checkpoint_full_disk_leaves_nothing(tmp_path, monkeypatch):
    store = trained(tmp_path / "s", 2)

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(persistence, "file_digest", full)
    with pytest.raises(ts.OutOfSpaceError):
        store.checkpoint(tmp_path / "ck")
    assert not (tmp_path / "ck").exists()
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]
    monkeypatch.undo()
    train_step(store, 3)  # the store keeps working
    store.checkpoint(tmp_path / "ck")
    store.close()


def test_a_checkpoint_whose_merge_fails_ends_its_hold(tmp_path):
    """A merge that fails in the copying thread (a full disk there) fails the checkpoint and
    ends the log's hold: the writer, with a log too small to go on without merging, keeps
    writing, and the next flush and checkpoint succeed with every row."""
    kw = {"write_log": 150, "write_buffer": 64}
    store = trained(tmp_path / "s", 3, **kw)
    merge_below = store.log.merge_below

    def full(mark):
        raise ts.OutOfSpaceError("no space left on device (injected)")

    store.log.merge_below = full
    with pytest.raises(ts.OutOfSpaceError):
        store.checkpoint(tmp_path / "ck")
    assert not (tmp_path / "ck").exists()
    store.log.merge_below = merge_below
    done = threading.Event()

    def train_on():  # past the log's capacity: merges must go on
        for step in range(4, 10):
            train_step(store, step)
        done.set()

    threading.Thread(target=train_on, daemon=True).start()
    assert done.wait(60), "the writer stayed blocked: the failed checkpoint kept its hold"
    store.flush()
    ref = trained(tmp_path / "ref", 9, **kw)
    ref.flush()
    assert same(dump_backend(store.backend), dump_backend(ref.backend))
    store.checkpoint(tmp_path / "ck")
    assert same(dump_path(tmp_path / "ck"), dump_backend(ref.backend))
    store.close()
    ref.close()


# hardened inputs -------------------------------------------------------------------------------
@pytest.fixture
def ckpt(tmp_path):
    """A trained store (closed) at tmp/s, its checkpoint at tmp/ck and its rows."""
    store = trained(tmp_path / "s", 3)
    store.checkpoint(tmp_path / "ck", step=3)
    train_step(store, 4)
    store.close()
    return tmp_path / "ck", tmp_path / "s", dump_path(tmp_path / "s")


def _restore(ck, path, **kw):
    return ts.TierStore.restore(ck, path, device_capacity=16, host_capacity=16, device="cpu", **kw)


def test_restore_truncated_or_corrupt_checkpoint(ckpt, tmp_path):
    ck, live, rows = ckpt
    for how in ("truncate", "flip"):
        bad = tmp_path / f"bad-{how}"
        shutil.copytree(ck, bad)
        data = bad / "data.mdb"
        if how == "truncate":
            os.truncate(data, data.stat().st_size // 2)
        else:
            with open(data, "r+b") as f:
                f.seek(data.stat().st_size - 100)
                f.write(b"\xff" * 8)
        with pytest.raises(ts.StoreCorruptError):
            persistence.verify_checkpoint(bad)
        with pytest.raises(ts.StoreCorruptError, match="corrupt or truncated"):
            _restore(bad, live)
        assert same(dump_path(live), rows)  # the target store is untouched
        assert not [p for p in os.listdir(live) if p.startswith(".")]


def test_restore_incomplete_or_foreign_manifest(ckpt, tmp_path):
    ck, live, rows = ckpt
    partial = tmp_path / "partial"
    shutil.copytree(ck, partial)
    (partial / "MANIFEST.json").unlink()
    with pytest.raises(ts.StoreCorruptError, match="not a complete checkpoint"):
        _restore(partial, live)
    for field, value, err in [("version", 99, ts.ConfigMismatchError),
                              ("store_format_version", 0, ts.ConfigMismatchError),
                              ("format", "other", ts.StoreCorruptError)]:
        other = tmp_path / f"other-{field}"
        shutil.copytree(ck, other)
        m = json.loads((other / "MANIFEST.json").read_text())
        m[field] = value
        (other / "MANIFEST.json").write_text(json.dumps(m))
        with pytest.raises(err):
            _restore(other, live)
    (partial / "MANIFEST.json").write_text("{not json")
    with pytest.raises(ts.StoreCorruptError, match="unreadable"):
        _restore(partial, live)
    with pytest.raises(ts.ConfigMismatchError, match="seed"):
        _restore(ck, live, seed=8)
    assert same(dump_path(live), rows)


def test_restore_into_locked_store(ckpt):
    ck, live, rows = ckpt
    holder = open_store(live, 16, 16)
    with pytest.raises(ts.StoreLockedError):
        _restore(ck, live)
    holder.close()
    assert same(dump_path(live), rows)


def test_restore_paths_that_are_files(ckpt, tmp_path):
    ck, live, rows = ckpt
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ts.ConfigError, match="not a directory"):
        _restore(ck, f)
    with pytest.raises(ts.StoreCorruptError, match="not a checkpoint"):
        _restore(f, live)
    with pytest.raises(ts.TierstoreError):
        open_store(f, 1, 1)
    assert f.read_text() == "x"


def test_truncated_live_store_is_an_error_not_a_crash(ckpt):
    _, live, _ = ckpt
    data = live / "data.mdb"
    os.truncate(data, data.stat().st_size // 2)
    with pytest.raises(ts.StoreCorruptError, match="truncated"):
        open_store(live, 16, 16)
    with pytest.raises(ts.StoreCorruptError):
        LmdbBackend(live, readonly=True)


def test_garbage_live_store(tmp_path):
    path = tmp_path / "s"
    path.mkdir()
    (path / "data.mdb").write_bytes(os.urandom(64 << 10))
    with pytest.raises(ts.StoreCorruptError):
        open_store(path, 16, 16)


def test_full_disk_keeps_flushed_rows(tmp_path):
    path = tmp_path / "s"
    store = open_store(path, 0, 0, map_limit="2MiB")
    train_step(store, 1)
    store.flush()
    want = dump_backend(store.backend)
    big = torch.arange(100_000) * 1000 + 1
    store.apply("a", big, torch.ones(len(big), 8))  # accepted: the rows wait in the write-behind ring
    expect = store.read("a", big[:5])
    with pytest.raises(ts.OutOfSpaceError):
        store.flush()  # the writer cannot write them: the flush is not acknowledged
    assert torch.equal(store.read("a", big[:5]), expect)  # kept in memory, nothing lost
    with pytest.raises(ts.OutOfSpaceError):
        store.close()  # (issue 38) the store stays open, nothing lost: retryable
    with pytest.raises(ts.StoreLockedError, match="close"):
        open_store(path, 0, 0, map_limit="2MiB")
    store.map_limit = None
    store.close()  # the retry
    again = open_store(path, 0, 0)
    got = dump_backend(again.backend)
    assert torch.equal(again.read("a", big[:5]), expect)  # the unacknowledged batch made it too
    again.close()
    assert torch.equal(torch.from_numpy(got["b"][1]), torch.from_numpy(want["b"][1]))
    # table a: every acknowledged row intact; every other row is one of the batch
    ids_a, pay_a = got["a"]
    keep = np.isin(ids_a, want["a"][0])
    assert np.array_equal(ids_a[keep], want["a"][0]) and np.array_equal(pay_a[keep], want["a"][1])
    assert np.isin(ids_a[~keep], big.numpy()).all() and (~keep).sum() == len(big)


def test_restore_keeps_open_kwargs(ckpt, tmp_path):
    ck, _, _ = ckpt
    store = _restore(ck, tmp_path / "new", policy="lfu", map_limit="1GiB")
    assert store.policy == "lfu" and store.backend.map_limit == 1 << 30
    assert store.table_specs == {s.name: s for s in SPECS}
    store.close()
    assert np.array_equal(dump_path(tmp_path / "new")["b"][1], dump_path(ck)["b"][1])


# export / import -------------------------------------------------------------------------------
def _shards(exp):
    return sorted(p for p in exp.rglob("*.zst"))


@pytest.mark.parametrize("shuffle,level", [(True, 1), (False, 3)])
def test_export_import_roundtrip(tmp_path, shuffle, level):
    store = trained(tmp_path / "s", 4)
    m = export_store(store, tmp_path / "exp", shuffle=shuffle, level=level, shard_bytes="16KiB")
    want = dump_backend(store.backend)
    store.close()
    assert len(_shards(tmp_path / "exp")) > 4 and m["bytes"] < m["raw_bytes"]
    got = import_store(tmp_path / "exp", tmp_path / "imp")
    assert sum(t["rows"] for t in got["tables"]) == sum(len(v[0]) for v in want.values())
    assert same(dump_path(tmp_path / "imp"), want)
    back = open_store(tmp_path / "imp", 8, 8)  # a normal store: same seed, specs, lazy rows
    ref = open_store(tmp_path / "s", 8, 8)
    ids = torch.arange(0, 10**11, 10**8)
    assert torch.equal(back.read("a", ids), ref.read("a", ids))
    back.close()
    ref.close()


def test_export_from_closed_store_and_checkpoint(ckpt, tmp_path):
    ck, live, rows = ckpt
    export_store(live, tmp_path / "e1")
    export_store(ck, tmp_path / "e2")
    import_store(tmp_path / "e1", tmp_path / "i1")
    import_store(tmp_path / "e2", tmp_path / "i2")
    assert same(dump_path(tmp_path / "i1"), rows)
    assert same(dump_path(tmp_path / "i2"), dump_path(ck))


def test_export_bad_sources(ckpt, tmp_path):
    ck, live, rows = ckpt
    holder = open_store(live, 8, 8)
    with pytest.raises(ts.StoreLockedError):
        export_store(live, tmp_path / "e")
    holder.close()
    with pytest.raises(ts.StoreCorruptError):
        export_store(tmp_path / "nothing", tmp_path / "e")
    assert not (tmp_path / "nothing").exists()
    (tmp_path / "file").write_text("x")
    with pytest.raises(ts.ConfigError):
        export_store(tmp_path / "file", tmp_path / "e")
    with pytest.raises(ts.ConfigError):
        export_store(live, tmp_path / "file")
    with pytest.raises(ts.ConfigError):
        export_store(live, tmp_path / "e", level=0)
    assert not (tmp_path / "e").exists()
    assert same(dump_path(live), rows)


@pytest.fixture
def exported(ckpt, tmp_path):
    """An export (several shards) of the checkpoint."""
    export_store(ckpt[0], tmp_path / "exp", shard_bytes="16KiB")
    return tmp_path / "exp"


def _nothing_left(tmp_path, path):
    assert not path.exists()
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]


def test_import_corrupt_or_truncated_shard(exported, tmp_path):
    for how in ("flip", "truncate", "missing"):
        bad = tmp_path / f"bad-{how}"
        shutil.copytree(exported, bad)
        shard = _shards(bad)[-1]
        if how == "flip":
            blob = bytearray(shard.read_bytes())
            blob[len(blob) // 2] ^= 0xFF
            shard.write_bytes(bytes(blob))
        elif how == "truncate":
            os.truncate(shard, shard.stat().st_size // 2)
        else:
            shard.unlink()
        with pytest.raises(ts.StoreCorruptError):
            import_store(bad, tmp_path / "imp")
        _nothing_left(tmp_path, tmp_path / "imp")


def test_import_foreign_manifest(exported, tmp_path):
    for field, value, err in [("version", 1, ts.ConfigMismatchError),
                              ("format", "x", ts.StoreCorruptError),
                              ("codec", {"name": "lz4"}, ts.ConfigMismatchError)]:
        bad = tmp_path / f"bad-{field}"
        shutil.copytree(exported, bad)
        m = json.loads((bad / "manifest.json").read_text())
        m[field] = value
        (bad / "manifest.json").write_text(json.dumps(m))
        with pytest.raises(err):
            import_store(bad, tmp_path / "imp")
        _nothing_left(tmp_path, tmp_path / "imp")
    with pytest.raises(ts.StoreCorruptError):
        import_store(tmp_path / "nothing", tmp_path / "imp")


def test_import_destination_checks(exported, ckpt, tmp_path):
    _, live, rows = ckpt
    with pytest.raises(ts.ConfigError, match="not empty"):
        import_store(exported, live)
    assert same(dump_path(live), rows)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ts.ConfigError, match="not a directory"):
        import_store(exported, tmp_path / "file")
    with pytest.raises(ts.OutOfSpaceError):
        import_store(exported, tmp_path / "imp", map_limit="64KiB")
    _nothing_left(tmp_path, tmp_path / "imp")


def test_cli_export_import_verify(ckpt, tmp_path, capsys):
    ck, live, rows = ckpt
    assert cli.main(["checkpoint-verify", str(ck)]) == 0
    assert cli.main(["export", str(live), str(tmp_path / "e"), "--shard-size", "8KiB"]) == 0
    assert cli.main(["import", str(tmp_path / "e"), str(tmp_path / "i")]) == 0
    assert same(dump_path(tmp_path / "i"), rows)
    assert cli.main(["import", str(tmp_path / "e"), str(tmp_path / "i")]) == 2
    assert cli.main(["checkpoint-verify", str(live)]) == 2
    err = capsys.readouterr().err
    assert "not empty" in err and "not a complete checkpoint" in err


def test_restore_with_default_capacities(tmp_path):
    # wide rows: the default 64MiB + 512MiB hold few slots (narrow rows made this test peak at 3 GiB)
    spec = ts.TableSpec("t", 100, 1024)
    with ts.TierStore(tmp_path / "s", [spec], device_capacity=2, host_capacity=2) as s:
        s.apply("t", torch.arange(10), torch.ones(10, 1024))
        want = s.read("t", torch.arange(10))
        s.checkpoint(tmp_path / "ck")
    with ts.TierStore.restore(tmp_path / "ck", tmp_path / "r") as r:
        assert torch.equal(r.read("t", torch.arange(10)), want)
        lay = r.stats()["layout"]  # the defaults, resolved (on a CPU device: one tier of both)
        if r.device_cache == "slab":  # the sets cache (CUDA's default) rounds to whole sets, or
            assert r.device_tier.capacity == lay["device_rows"] > 0  # holds just every row
        else:
            assert 0 < r.device_tier.capacity <= max(lay["device_rows"] + 31, 100)
        assert r.host_tier.capacity == lay["host_rows"]
        assert lay["host_rows"] == 0 or r.device.type != "cpu"
