"""Issue 38: nothing lost, nothing silently wrong, round 3.

Each test names the row of the issue's table it covers; each failed on 3e9f718.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import tierstore as ts
from tierstore.export import export_store, import_store


def _store(path: Path, **kw) -> ts.TierStore:
    spec = ts.TableSpec("t", 10**6, 8, optimizer=ts.Adagrad(0.1))
    kw.setdefault("device_capacity", 16)
    kw.setdefault("host_capacity", 32)
    return ts.TierStore(path, spec, seed=3, device="cpu", **kw)


# row 8: an age beyond the clock's range --------------------------------------------------------
@pytest.mark.parametrize("age", [10**30, 2**63, 2**31])
def test_expire_huge_age_is_config_error(tmp_path, age):
    store = _store(tmp_path / "s")
    ids = torch.arange(10)
    store.apply("t", ids, torch.ones(10, 8))
    store.advance(3)
    before = store.read("t", ids)
    with pytest.raises(ts.ConfigError):
        store.expire(older_than=age)
    assert torch.equal(store.read("t", ids), before)
    assert store.expire(older_than=2**31 - 1) == {"t": 0}  # the largest age: nothing that old
    store.close()


# row 9: expire through a read-only handle -----------------------------------------------------
def test_readonly_expire_and_map_limit_are_readonly_errors(tmp_path):
    store = _store(tmp_path / "s")
    store.apply("t", torch.arange(4), torch.ones(4, 8))
    store.close()
    with ts.TierStore.open(tmp_path / "s", readonly=True) as ro:
        with pytest.raises(ts.ReadOnlyError):
            ro.expire(older_than=1)
        with pytest.raises(ts.ReadOnlyError):
            ro.expire()
        with pytest.raises(ts.ReadOnlyError):
            ro.map_limit = "1GiB"


# row 11: bad values accepted ------------------------------------------------------------------
@pytest.mark.parametrize("limit", [-5, 0, "0MiB", 1.5, True])
def test_map_limit_must_be_positive(tmp_path, limit):
    store = _store(tmp_path / "s")
    with pytest.raises(ts.ConfigError):
        store.map_limit = limit
    assert store.map_limit is None
    store.close()
    with pytest.raises(ts.ConfigError):
        _store(tmp_path / "s2", map_limit=limit)


def test_checkpoint_negative_step_refused(tmp_path):
    store = _store(tmp_path / "s")
    with pytest.raises(ts.ConfigError):
        store.checkpoint(tmp_path / "ck", step=-1)
    assert not (tmp_path / "ck").exists()
    assert not (tmp_path / "ck").exists()
    assert store.checkpoint(tmp_path / "ck", step=0, overwrite=True)["step"] == 0
    store.close()


@pytest.mark.parametrize("which", ["lengths", "offsets"])
@pytest.mark.parametrize("kind", ["bag", "seq"])
def test_float_lengths_refused(tmp_path, which, kind):
    store = _store(tmp_path / "s")
    mod = (ts.TieredEmbeddingBagCollection(store, ["t"]) if kind == "bag"
           else ts.TieredEmbeddingCollection(store, ["t"]))
    values = torch.tensor([1, 2, 3])
    jag = {"lengths": torch.tensor([1.0, 2.0])} if which == "lengths" else \
        {"offsets": torch.tensor([0.0, 1.0, 3.0])}
    with pytest.raises(ts.ShapeError):
        mod(["t"], values, **jag)
    good = {"lengths": torch.tensor([1, 2])} if which == "lengths" else \
        {"offsets": torch.tensor([0, 1, 3])}
    mod(["t"], values, **good)
    store.close()


@pytest.mark.parametrize("idx", [-5, -1, 10**6, 2.0])
def test_padding_idx_must_be_a_row_id(tmp_path, idx):
    store = _store(tmp_path / "s")
    with pytest.raises(ts.ConfigError):
        ts.TieredEmbedding(store, "t", padding_idx=idx)
    assert ts.TieredEmbedding(store, "t", padding_idx=0).padding_idx == 0
    store.close()


# rows 1-2: a checkpoint or export over, inside or around the live store --------------------------
def _dests(root: Path, store: Path) -> list[tuple[Path, bool]]:
    link = root / "link"
    link.symlink_to(store)
    return [(store, True), (store / "inner", False), (store / "a" / "b", False),
            (root, True), (link, True), (link / "x", False)]


def test_checkpoint_over_or_inside_the_store_refused(tmp_path):
    store = _store(tmp_path / "s")
    ids = torch.arange(50)
    store.apply("t", ids, torch.ones(50, 8))
    store.flush()
    before = sorted(p.name for p in (tmp_path / "s").iterdir())
    for dest, overwrite in _dests(tmp_path, tmp_path / "s"):
        with pytest.raises(ts.ConfigError, match="store"):
            store.checkpoint(dest, overwrite=overwrite)
        with pytest.raises(ts.ConfigError):
            export_store(store, dest, overwrite=overwrite)
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == before  # lock file kept
    probe = "import sys, tierstore as ts\ntry: ts.TierStore.open(sys.argv[1])\n" \
        "except ts.StoreLockedError: sys.exit(7)"
    locked = subprocess.run([sys.executable, "-c", probe, str(tmp_path / "s")], timeout=120)
    assert locked.returncode == 7  # another process still cannot open it for writing
    store.apply("t", ids, torch.ones(50, 8))
    store.flush()
    want = store.read("t", ids)
    store.close()
    with ts.TierStore.open(tmp_path / "s") as again:  # the acknowledged flush survived
        assert torch.equal(again.read("t", ids).cpu(), want)  # (opened on CUDA where there is one)
    with pytest.raises(ts.ConfigError):  # the CLI path too: a closed store's directory
        export_store(tmp_path / "s", tmp_path / "s" / "out")


def test_restore_and_import_into_their_source_refused(tmp_path):
    store = _store(tmp_path / "s")
    store.apply("t", torch.arange(5), torch.ones(5, 8))
    store.checkpoint(tmp_path / "ck")
    export_store(store, tmp_path / "ex")
    store.close()
    for path in (tmp_path / "ck", tmp_path / "ck" / "inner"):
        with pytest.raises(ts.ConfigError):
            ts.TierStore.restore(tmp_path / "ck", path)
    with pytest.raises(ts.ConfigError):
        import_store(tmp_path / "ex", tmp_path / "ex" / "inner")
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["MANIFEST.json", "data.mdb"]


# row 3: a flipped byte in a leaf's node pointers or mp_lower hid stored rows ----------------------
def _table_leaves(data: Path, record: int) -> list[int]:
    """Page numbers of the leaf pages holding rows (8-byte keys, `record`-byte values)."""
    raw = data.read_bytes()
    out = []
    for pg in range(2, len(raw) // 4096):
        b = pg * 4096
        own, flags, lower = (int.from_bytes(raw[b: b + 8], "little"),
                             int.from_bytes(raw[b + 10: b + 12], "little"),
                             int.from_bytes(raw[b + 12: b + 14], "little"))
        if own != pg or flags & 0x3FEF != 2 or lower < 18:
            continue
        node = b + int.from_bytes(raw[b + 16: b + 18], "little")
        if int.from_bytes(raw[node + 6: node + 8], "little") == 8 and \
                int.from_bytes(raw[node: node + 4], "little") == record:
            out.append(pg)
    return out


@pytest.mark.parametrize("page_reads", [True, False])
@pytest.mark.parametrize("readonly", [False, True])
def test_flipped_leaf_pointer_or_lower_is_corrupt_not_lazy_init(tmp_path, page_reads, readonly,
                                                               monkeypatch):
    from tierstore.backends import lmdb_backend

    monkeypatch.setattr(lmdb_backend, "PAGE_READS", page_reads)
    store = _store(tmp_path / "s", table_format="btree")  # the B-tree's leaf pages damaged
    ids = torch.arange(3000) * 7
    store.apply("t", ids, torch.randn(3000, 8, generator=torch.Generator().manual_seed(1)))
    want = store.read("t", ids)
    record = store.table_specs["t"].row_dim * 4 + 4
    store.close()
    base = (tmp_path / "s" / "data.mdb").read_bytes()
    leaves = _table_leaves(tmp_path / "s" / "data.mdb", record)
    assert len(leaves) >= 10
    rng = np.random.default_rng(5)
    outcomes = {"error": 0, "exact": 0}
    for case in range(12):
        pg = int(rng.choice(leaves))
        b = pg * 4096
        lower = int.from_bytes(base[b + 12: b + 14], "little")
        at = b + 12 if case % 3 == 0 else b + 16 + int(rng.integers(0, lower - 16))
        raw = bytearray(base)
        raw[at] ^= int(rng.integers(1, 256))
        (tmp_path / "s" / "data.mdb").write_bytes(bytes(raw))
        try:
            with (ts.TierStore.open(tmp_path / "s", readonly=True) if readonly
                  else ts.TierStore.open(tmp_path / "s", device_capacity=0, host_capacity=0,
                                         device="cpu")) as s:
                got = s.read("t", ids).cpu()  # the read-only handle's default: CUDA where there is one
        except ts.StoreCorruptError as exc:
            assert "page" in str(exc) or "damaged" in str(exc) or "corrupt" in str(exc), exc
            outcomes["error"] += 1
            continue
        assert torch.equal(got, want), f"page {pg} byte {at - b}: rows silently wrong"
        outcomes["exact"] += 1
    assert outcomes["error"] >= 6, outcomes  # the damage is seen, not only harmless


def test_verify_cli_finds_a_damaged_page_and_passes_a_sound_store(tmp_path, capsys):
    from tierstore.cli import main

    store = _store(tmp_path / "s", table_format="btree")  # a B-tree leaf damaged
    ids = torch.arange(3000) * 7
    store.apply("t", ids, torch.ones(3000, 8))
    record = store.table_specs["t"].row_dim * 4 + 4
    with pytest.raises(ts.StoreLockedError):  # a live writer's file may change under the scan
        from tierstore.verify import verify_store

        verify_store(tmp_path / "s")
    store.close()
    assert main(["verify", str(tmp_path / "s"), "--no-progress"]) == 0
    assert "3000 rows in 1 tables" in capsys.readouterr().out
    data = tmp_path / "s" / "data.mdb"
    raw = bytearray(data.read_bytes())
    pg = _table_leaves(data, record)[3]
    raw[pg * 4096 + 16] ^= 0x10  # one node pointer
    data.write_bytes(bytes(raw))
    assert main(["verify", str(tmp_path / "s"), "--no-progress"]) == 2
    assert f"page {pg}" in capsys.readouterr().err


# rows 6-7: a full map with a small write ring -------------------------------------------------------
def _sgd_specs() -> list[ts.TableSpec]:
    return [ts.TableSpec(n, 10**6, 16, optimizer=ts.SGD(0.1), init=ts.ConstantInit(0.0))
            for n in ("a", "b")]


def _check_model(s, model: dict) -> None:
    for t, rows in model.items():
        if not rows:
            continue
        ids = torch.tensor(sorted(rows))
        want = torch.tensor([rows[i] for i in ids.tolist()], dtype=torch.float32)
        got = s.read(t, ids)
        assert torch.equal(got, want[:, None].expand_as(got)), \
            f"table {t}: {int((got[:, 0] != want).sum())} rows wrong"


def _step(model: dict, t: str, ids: torch.Tensor) -> None:
    for i in ids.tolist():  # SGD(0.1) with gradient 1.0: one float32 subtraction per update
        model[t][i] = float(np.float32(model[t].get(i, 0.0)) - np.float32(0.1))


@pytest.mark.parametrize("limit", ["2MiB", "3MiB"])
def test_failed_apply_with_a_small_ring_changes_nothing_and_retries_once(tmp_path, limit):
    s = ts.TierStore(tmp_path / "s", _sgd_specs(), device_capacity=64, host_capacity=64,
                     device="cpu", write_buffer=64, map_limit=limit)
    g = torch.Generator().manual_seed(0)
    model: dict = {"a": {}, "b": {}}
    failed = None
    for step in range(600):
        t = "ab"[step % 2]
        ids = torch.randint(0, 10**6, (960,), generator=g).unique()
        try:
            s.apply(t, ids, torch.ones(len(ids), 16))
        except ts.OutOfSpaceError:
            failed = (t, ids)
            break
        _step(model, t, ids)
    assert failed is not None, "the map limit was never reached"
    s.map_limit = None
    _check_model(s, model)  # the failed call changed nothing; no earlier apply regressed
    t, ids = failed
    s.apply(t, ids, torch.ones(len(ids), 16))  # the natural retry: exactly one update
    _step(model, t, ids)
    _check_model(s, model)
    s.close()
    with ts.TierStore.open(tmp_path / "s", device="cpu") as again:
        _check_model(again, model)


def test_close_out_of_space_keeps_the_store_open_and_retryable(tmp_path):
    s = ts.TierStore(tmp_path / "s", _sgd_specs(), device_capacity=40_000, host_capacity=0,
                     device="cpu", write_buffer=64, map_limit="2MiB")
    model: dict = {"a": {}, "b": {}}
    ids = torch.arange(30_000) * 3
    s.apply("a", ids, torch.ones(len(ids), 16))  # all cached: nothing written yet
    _step(model, "a", ids)
    with pytest.raises(ts.OutOfSpaceError):
        s.close()
    with pytest.raises(ts.StoreLockedError, match="close"):  # says why, and what to do
        ts.TierStore.open(tmp_path / "s", device="cpu")
    s.map_limit = None
    s.close()  # the retry
    with ts.TierStore.open(tmp_path / "s", device="cpu") as again:
        _check_model(again, model)
