"""Page chunks by default (docs/design.md "Chunks by default"): a new store keeps its tables as
page-chunk levels (format 4), and a table whose rows do not fit a chunk stays a B-tree inside it.

A chunked store with a wide table must hold exactly what a B-tree store holds through writes,
merges, flushes, reopens, checkpoints, exports, compaction, expiry and read-only handles; the
choice must survive reopening (the wide table's `t:` database records it) and be reported by
`stats()` and `tierstore info`.
"""

from __future__ import annotations

import json

import lmdb
import numpy as np
import pytest
import torch

import tierstore as ts
from tests import as_format
from tierstore.backends.lmdb_chunked import MANIFEST
from tierstore.backends.pagechunks import ROW_WORDS_MAX
from tierstore.cli import main as cli_main
from tierstore.export import export_store, import_store
from tierstore.persistence import compact
from tierstore.quantize import export_quantized

NARROW = ts.TableSpec("n", 4000, 8, optimizer=ts.Adagrad(0.1))
WIDE = ts.TableSpec("w", 3000, 600)  # 601 words a row with the stamp: wider than a chunk
SPECS = [NARROW, WIDE]


def _open(path, fmt: str, specs=SPECS, **kw) -> ts.TierStore:
    kw.setdefault("device_capacity", 64)
    kw.setdefault("host_capacity", 64)
    kw.setdefault("write_log", 300)  # a small log: merges into the tables happen often
    return ts.TierStore(path, specs, device="cpu", table_format=fmt, **kw)


def _write(store: ts.TierStore, seed: int, n: int = 300) -> None:
    rng = np.random.default_rng(seed)
    for spec in store.table_specs.values():
        ids = torch.from_numpy(np.unique(rng.integers(0, spec.num_rows, n)))
        store.apply_unique(spec.name, ids, torch.from_numpy(
            rng.standard_normal((len(ids), spec.dim)).astype(np.float32)))


def _rows(store, specs=SPECS) -> dict[str, torch.Tensor]:
    return {s.name: store.read(s.name, torch.arange(s.num_rows)).cpu().clone() for s in specs}


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def _formats(path) -> tuple[int, set[bytes]]:
    """The store record's format and the names of the main database (tables, ranges)."""
    env = lmdb.open(str(path), readonly=True, lock=False, max_dbs=4096)
    try:
        with env.begin() as txn:
            names = {bytes(k) for k, _ in txn.cursor()}
            meta = env.open_db(b"__tierstore_meta__", txn=txn, create=False)
            store = json.loads(txn.get(b"store", db=meta))
    finally:
        env.close()
    return store["format_version"], names


def test_new_stores_keep_page_chunks_unless_asked_otherwise(tmp_path):
    """Without `table_format`, a new store is format 4 (under TIERSTORE_TEST_TABLE_FORMAT=btree,
    format 3: tests/as_format.py); an explicit "btree" is format 3; reopening keeps either."""
    default = 3 if as_format.wanted() == "btree" else 4
    with ts.TierStore(tmp_path / "d", [NARROW], device="cpu") as s:
        _write(s, 1)
        assert s.stats()["ssd"]["table_formats"] == {"n": "chunks" if default == 4 else "btree"}
    assert _formats(tmp_path / "d")[0] == default
    with ts.TierStore(tmp_path / "b", [NARROW], device="cpu", table_format="btree") as s:
        _write(s, 1)
    assert _formats(tmp_path / "b")[0] == 3
    with ts.TierStore.open(tmp_path / "b", device="cpu", table_format="chunks") as s:
        assert not s.backend.chunked  # an existing store keeps its format


def test_a_wide_table_stays_a_btree_beside_chunked_ones(tmp_path, capsys):
    """A table too wide for a chunk is a B-tree (its `t:` database, no manifest) in a chunked
    store, which reads what a B-tree store reads through merges, flushes and reopens; stats,
    `tierstore info` and a read-only handle agree."""
    assert 4 * WIDE.row_dim + 4 > 4 * ROW_WORDS_MAX + 4 >= 4 * NARROW.row_dim + 4
    stores = {f: _open(tmp_path / f, f) for f in ("btree", "chunks")}
    try:
        for step in range(4):
            for s in stores.values():
                _write(s, 10 + step)
                if step % 2:
                    s.flush()
        _same(_rows(stores["btree"]), _rows(stores["chunks"]))
        mixed = stores["chunks"]
        assert mixed.backend.is_chunked("n") and not mixed.backend.is_chunked("w")
        assert mixed.stats()["ssd"]["table_formats"] == {"n": "chunks", "w": "btree"}
        assert mixed.log.stored == sum(mixed.backend.count(n) for n in ("n", "w")) > 0
        want = _rows(mixed)
    finally:
        for s in stores.values():
            s.close()
    version, names = _formats(tmp_path / "chunks")
    assert version == 4 and b"t:w" in names and b"t:n" not in names
    assert any(n.startswith(b"c:n.") for n in names) and not any(n.startswith(b"c:w") for n in names)
    with ts.TierStore.open(tmp_path / "chunks", device="cpu") as s:
        assert s.backend.btree_tables == {"w"} and s.backend.get_meta(f"{MANIFEST}w") is None
        _same(_rows(s), want)
        stored = {n: s.backend.count(n) for n in ("n", "w")}
    assert cli_main(["info", str(tmp_path / "chunks"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert {t["name"]: (t["table_format"], t["rows_stored"]) for t in report["tables"]} == \
        {"n": ("chunks", stored["n"]), "w": ("btree", stored["w"])}
    with ts.TierStore.open(tmp_path / "chunks", readonly=True, device="cpu") as ro:
        for spec in SPECS:
            got = ro.read(spec.name, torch.arange(spec.num_rows))
            assert torch.equal(got, want[spec.name][:, : spec.dim])


def test_a_wide_table_added_later_or_left_without_its_database_is_a_btree(tmp_path):
    """A wide table added at a later open is a B-tree; one whose (empty) database a crash left
    unmade is decided again, the same way, at the next open."""
    with _open(tmp_path / "s", "chunks", specs=[NARROW]) as s:
        _write(s, 3)
    with _open(tmp_path / "s", "chunks", add_tables=True) as s:
        assert s.backend.btree_tables == {"w"}
        _write(s, 4)
        want = _rows(s)
    with ts.TierStore.open(tmp_path / "s", device="cpu") as s:
        assert not s.backend.is_chunked("w") and s.backend.is_chunked("n")
        _same(_rows(s), want)
    with _open(tmp_path / "e", "chunks") as s:
        pass  # the wide table's database made, empty
    env = lmdb.open(str(tmp_path / "e"), max_dbs=4096)
    with env.begin(write=True) as txn:
        txn.drop(env.open_db(b"t:w", txn=txn, create=False), delete=True)
    env.close()
    assert b"t:w" not in _formats(tmp_path / "e")[1]
    with ts.TierStore.open(tmp_path / "e", device="cpu") as s:
        assert s.backend.btree_tables == {"w"}
        _write(s, 5)
        want = _rows(s)
    assert b"t:w" in _formats(tmp_path / "e")[1]
    with ts.TierStore.open(tmp_path / "e", device="cpu") as s:
        _same(_rows(s), want)


def test_checkpoint_export_compact_and_expiry_with_a_wide_table(tmp_path):
    """Checkpoint/restore, export/import (into the default), offline compaction and expiry keep
    a chunked store's wide B-tree table as they keep its chunked table."""
    specs = SPECS
    with _open(tmp_path / "s", "chunks", specs=specs) as s, \
            _open(tmp_path / "b", "btree", specs=specs) as b:
        for store in (s, b):
            _write(store, 6)
            store.advance(10)
            _write(store, 7, 50)
            store.flush()
        want = _rows(s, specs)
        _same(want, _rows(b, specs))
        s.checkpoint(tmp_path / "ck")
        export_store(s, tmp_path / "ex")
        removed = {f: st.expire(older_than=5) for f, st in (("chunks", s), ("btree", b))}
        assert removed["chunks"] == removed["btree"] and min(removed["btree"].values()) > 0
        expired = _rows(s, specs)
        assert not all(torch.equal(expired[n], want[n]) for n in want)
        _same(expired, _rows(b, specs))
    with ts.TierStore.restore(tmp_path / "ck", tmp_path / "r", device="cpu") as r:
        assert r.backend.btree_tables == {"w"} and r.backend.is_chunked("n")
        _same(_rows(r, specs), want)
    import_store(tmp_path / "ex", tmp_path / "i", table_format="chunks")
    with ts.TierStore.open(tmp_path / "i", device="cpu") as i:
        assert i.backend.btree_tables == {"w"}
        _same(_rows(i, specs), want)
    compact(tmp_path / "s")
    with ts.TierStore.open(tmp_path / "s", device="cpu") as c:
        assert c.backend.btree_tables == {"w"}
        _same(_rows(c, specs), expired)


@pytest.mark.parametrize("fmt", ["chunks", "btree"])
def test_a_quantized_export_records_the_format_of_its_btree_tables(tmp_path, fmt):
    """A quantized export writes B-tree tables whatever its source's format, so its store record
    says format 3 (a chunked source's 4 would send readers to chunk manifests); it serves."""
    with _open(tmp_path / "s", fmt, specs=[NARROW]) as s:
        _write(s, 8)
        s.flush()
        want = _rows(s, [NARROW])["n"]
    export_quantized(tmp_path / "s", tmp_path / "q", "int8")
    version, names = _formats(tmp_path / "q")
    assert version == 3 and b"t:n" in names
    with ts.TierStore.open(tmp_path / "q", readonly=True, device="cpu") as ro:
        got = ro.read("n", torch.arange(NARROW.num_rows))
    assert torch.allclose(got, want, atol=0.02)
