"""The on-disk row record (format v2): checksums, last-update stamps, and old-format stores."""

from __future__ import annotations

import json

import lmdb
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tierstore as ts
from tierstore.backends import record
from tierstore.backends.lmdb_backend import META_DB, LmdbBackend
from tierstore.backends.upgrade import upgrade_store
from tierstore.cli import main as cli_main


def _reference_check(key: int, words: list[int]) -> int:
    """The checksum of one row in plain Python integers (the definition in record.py's docstring)."""
    m = (1 << 64) - 1
    p1, p2, p3, p4 = (0x9E3779B185EBCA87, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9,
                      0x85EBCA77C2B2AE63)
    seed = 0x7469657273746F72

    def rotl(x: int, r: int) -> int:
        return ((x << r) | (x >> (64 - r))) & m

    acc = [(seed + key * p1 + j * p4) & m for j in range(4)]
    for j, w in enumerate(words):
        acc[j & 3] = (rotl((acc[j & 3] + w * p2) & m, 31) * p1) & m
    h = (rotl(acc[0], 1) + rotl(acc[1], 7) + rotl(acc[2], 12) + rotl(acc[3], 18)) & m
    h ^= len(words)
    h ^= h >> 33
    h = (h * p2) & m
    h ^= h >> 29
    h = (h * p3) & m
    h ^= h >> 32
    return h & 0xFFFFFFFF


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 40), st.integers(1, 70), st.integers(0, 2**31))
def test_checks_match_a_plain_python_definition(n, w, seed):
    rng = np.random.default_rng(seed)
    keys = rng.integers(0, 2**63 - 1, size=n, dtype=np.int64)
    words = rng.integers(0, 2**32, size=(n, w), dtype=np.uint64).astype(np.uint32)
    got = record.row_checks(keys, words)
    want = [_reference_check(int(k), [int(x) for x in row]) for k, row in zip(keys, words)]
    assert got.tolist() == want
    assert record._checks_numpy(keys, words).tolist() == want


def test_every_single_bit_flip_of_a_row_changes_its_check():
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((1, 17)).astype(np.float32)
    sealed = record.seal(np.array([12345]), rows).copy()
    for bit in range(sealed.shape[1] * 8):
        bad = sealed.copy()
        bad[0, bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(ts.StoreCorruptError, match="row 12345"):
            record.open_records("t", np.array([12345]), bad, 17)
    # the same bytes under another row id fail too (a row stored under the wrong key)
    with pytest.raises(ts.StoreCorruptError):
        record.open_records("t", np.array([12346]), sealed, 17)
    assert np.array_equal(record.open_records("t", np.array([12345]), sealed, 17), rows)


@pytest.mark.parametrize("cut", [1, 2, 3, 4, 5, -1, -3])
def test_stored_rows_of_a_damaged_length_are_reported_not_crashed_on(cut):
    """A read whose stored bytes are a few bytes short or long (a damaged value length, not
    always whole words) raises StoreCorruptError, as bytes and as an array."""
    rows = np.random.default_rng(1).standard_normal((3, 17)).astype(np.float32)
    flat = record.seal(np.array([1, 2, 3]), rows).tobytes()
    bad = flat[:-cut] if cut > 0 else flat + b"\0" * -cut
    for blob in (bad, np.frombuffer(bad, dtype=np.uint8)):
        with pytest.raises(ts.StoreCorruptError, match="wrong size"):
            record.open_records("t", np.array([1, 2, 3]), blob, 17)


def _stored(path, table, row):
    env = lmdb.open(str(path), max_dbs=64, readonly=True, lock=False)
    try:
        db = env.open_db(f"t:{table}".encode(), create=False)
        with env.begin(db=db) as txn:
            return bytes(txn.get(int(row).to_bytes(8, "big")))
    finally:
        env.close()


def _put_raw(path, table, row, value):
    env = lmdb.open(str(path), max_dbs=64)
    try:
        db = env.open_db(f"t:{table}".encode(), create=False)
        with env.begin(write=True, db=db) as txn:
            txn.put(int(row).to_bytes(8, "big"), value)
    finally:
        env.close()


def test_a_flipped_stored_bit_is_a_store_corrupt_error_naming_the_row(tmp_path):
    """A B-tree row's value damaged by hand (chunk records: test_chunked_store.py)."""
    spec = ts.TableSpec("emb", 10**9, 8, optimizer=ts.Adagrad(lr=0.1))
    ids = torch.tensor([3, 77, 10**8])
    with ts.TierStore(tmp_path / "s", spec, device_capacity=0, host_capacity=0, device="cpu",
                      table_format="btree") as s:
        s.apply("emb", ids, torch.ones(3, 8))
        before = s.read("emb", ids)
    raw = bytearray(_stored(tmp_path / "s", "emb", 77))
    assert len(raw) == 4 * spec.row_dim + 4
    raw[5] ^= 0x10
    _put_raw(tmp_path / "s", "emb", 77, bytes(raw))
    with ts.TierStore(tmp_path / "s", spec, device_capacity=0, host_capacity=0, device="cpu") as s:
        assert torch.equal(s.read("emb", ids[:1]), before[:1])  # undamaged rows still read
        with pytest.raises(ts.StoreCorruptError, match="'emb'.*row 77"):
            s.read("emb", ids)


def test_updates_stamp_rows_with_the_store_clock_in_every_tier(tmp_path):
    spec = ts.TableSpec("t", 1000, 4)
    with ts.TierStore(tmp_path / "s", spec, device_capacity=2, host_capacity=2, device="cpu") as s:
        assert s.clock == 0
        s.apply("t", torch.arange(6), torch.ones(6, 4))  # 6 rows over 2 + 2 cache slots + LMDB
        assert s.advance() == 1 and s.advance(4) == 5
        s.apply("t", torch.tensor([1, 4]), torch.ones(2, 4))
        with pytest.raises(ts.ConfigError):
            s.advance(-1)
    with ts.TierStore(tmp_path / "s", spec, device="cpu", device_capacity=64, host_capacity=64) as s:
        assert s.clock == 5  # saved by close
    backend = LmdbBackend(tmp_path / "s", readonly=True)  # the stored records, either format
    try:
        got, found = backend.get("t", np.arange(6), spec.row_dim)
    finally:
        backend.close()
    assert found.all()
    assert got.view(np.int32)[:, spec.stamp_col].tolist() == [0, 5, 0, 0, 5, 0]


def _write_v1_store(path, spec, ids, payload):
    path.mkdir()
    env = lmdb.open(str(path), max_dbs=8, map_size=1 << 26)
    meta = env.open_db(META_DB)
    db = env.open_db(f"t:{spec.name}".encode())
    with env.begin(write=True) as txn:
        txn.put(b"store", json.dumps({"format_version": 1, "seed": 0}).encode(), db=meta)
        txn.put(f"table:{spec.name}".encode(), json.dumps(spec.to_config()).encode(), db=meta)
        for i, p in zip(ids, payload):
            txn.put(int(i).to_bytes(8, "big"), p.tobytes(), db=db)
    env.close()


def test_version_1_stores_are_refused_then_upgraded_in_place(tmp_path, capsys):
    spec = ts.TableSpec("t", 10**6, 6, optimizer=ts.RowWiseAdagrad())
    ids = np.array([2, 9, 500_000])
    payload = np.random.default_rng(1).standard_normal((3, spec.payload_dim)).astype(np.float32)
    _write_v1_store(tmp_path / "old", spec, ids, payload)
    with pytest.raises(ts.ConfigMismatchError, match="tierstore upgrade"):
        ts.TierStore(tmp_path / "old", spec, device="cpu", device_capacity=64, host_capacity=64)
    assert cli_main(["upgrade", str(tmp_path / "old")]) == 0
    assert "converted 3 rows" in capsys.readouterr().out
    assert upgrade_store(tmp_path / "old")["upgraded"] is False  # idempotent
    with ts.TierStore(tmp_path / "old", spec, device="cpu", device_capacity=64, host_capacity=64) as s:
        got = s.read("t", torch.from_numpy(ids))
        assert torch.equal(got, torch.from_numpy(payload[:, :6]))
        s.apply("t", torch.tensor([2]), torch.ones(1, 6))
    with ts.TierStore(tmp_path / "old", spec, device="cpu", device_capacity=64, host_capacity=64) as s:
        assert not torch.equal(s.read("t", torch.tensor([2])), torch.from_numpy(payload[:1, :6]))


def _format_2_store(path, spec) -> torch.Tensor:
    """A store whose metadata says format 2 (its log is empty; B-tree tables, as format 2's
    were); returns its rows 0..49."""
    with ts.TierStore(path, spec, device="cpu", device_capacity=4, host_capacity=4,
                      table_format="btree") as s:
        s.apply("t", torch.arange(50), torch.ones(50, 6))
        want = s.read("t", torch.arange(50))
    env = lmdb.open(str(path), max_dbs=8)
    meta = env.open_db(META_DB)
    with env.begin(write=True, db=meta) as txn:
        txn.put(b"store", json.dumps({**json.loads(txn.get(b"store")), "format_version": 2}).encode())
    env.close()
    return want


def test_version_2_stores_are_upgraded_by_the_cli_and_idempotently(tmp_path, capsys):
    spec = ts.TableSpec("t", 10**6, 6)
    want = _format_2_store(tmp_path / "s", spec)
    assert cli_main(["upgrade", str(tmp_path / "s")]) == 0
    assert "converted 0 rows" in capsys.readouterr().out  # its log was empty: nothing to merge
    assert upgrade_store(tmp_path / "s")["upgraded"] is False
    with ts.TierStore(tmp_path / "s", spec, device="cpu", device_capacity=4, host_capacity=4) as s:
        assert s.backend.get_meta("store")["format_version"] == 3
        assert torch.equal(s.read("t", torch.arange(50)), want)


def test_version_2_stores_export_as_they_are(tmp_path):
    from tierstore.export import export_store, import_store

    spec = ts.TableSpec("t", 10**6, 6)
    want = _format_2_store(tmp_path / "s", spec)
    export_store(tmp_path / "s", tmp_path / "exp")  # the rows of format 2 are format 3's
    import_store(tmp_path / "exp", tmp_path / "imp")
    with ts.TierStore(tmp_path / "imp", spec, device="cpu", device_capacity=4, host_capacity=4) as s:
        assert torch.equal(s.read("t", torch.arange(50)), want)
