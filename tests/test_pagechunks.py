"""Page-sized sorted chunks (backends/pagechunks.py) on real LMDB files: reads against a dict,
the page walker's floor search against py-lmdb's, density, and damage."""

from __future__ import annotations

import lmdb
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.profiles import examples
from tierstore.backends import pagechunks
from tierstore.backends.lmdb_common import decode_keys, encode_keys
from tierstore.backends.pages import PageReader
from tierstore.backends.record import seal
from tierstore.errors import StoreCorruptError, TierstoreError


def _env(path):
    return lmdb.open(str(path), map_size=1 << 28, max_dbs=8, sync=False, metasync=False)


def _rows(ids: np.ndarray, w: int) -> np.ndarray:
    return (ids[:, None] * 10 + np.arange(w)).astype(np.float32)


def _store(path, ids: np.ndarray, w: int, txn_chunks: int = pagechunks.TXN_CHUNKS):
    env = _env(path)
    db = env.open_db(b"t")
    ids = np.sort(ids)
    pagechunks.write(env, db, ids, seal(ids, _rows(ids, w)), txn_chunks=txn_chunks)
    env.sync()
    return env, db, PageReader(path / "data.mdb", env.stat()["psize"])


@settings(max_examples=examples(0.4), deadline=None)
@given(ids=st.lists(st.integers(0, 1 << 40), min_size=0, max_size=3000, unique=True),
       w=st.sampled_from([1, 5, 17, 65]), data=st.data())
def test_reads_match_a_dict(tmp_path_factory, ids, w, data):
    ids = np.array(sorted(ids), dtype=np.int64)
    env, _, reader = _store(tmp_path_factory.mktemp("pc"), ids, w, txn_chunks=7)
    stored = set(ids.tolist())
    probe = data.draw(st.lists(st.integers(0, 1 << 40), max_size=300, unique=True))
    some = data.draw(st.lists(st.sampled_from(ids.tolist()), max_size=300, unique=True)) if len(ids) \
        else []
    q = np.array(sorted(set(probe) | set(some)), dtype=np.int64)
    with env.begin() as txn:
        rows, found = pagechunks.lookup(reader, txn, b"t", "t", q, w)
    assert found.tolist() == [int(x) in stored for x in q]
    assert np.array_equal(rows[found], _rows(q[found], w))
    assert not rows[~found].any()


def test_floor_spans_match_py_lmdb(tmp_path):
    """The walker's floor search finds, for any key, the entry py-lmdb's set_range-then-back
    finds: the greatest key <= it (across leaves, over a tree several levels deep)."""
    ids = np.arange(0, 60_000, 3, dtype=np.int64) * 7
    env, db, reader = _store(tmp_path, ids, 5)
    rng = np.random.default_rng(0)
    q = np.unique(np.concatenate([rng.integers(-5, int(ids[-1]) + 50, 3000), ids[::97], [0, -1]]))
    q = q[q >= 0]
    with env.begin(db=db) as txn:
        assert txn.stat(db)["depth"] >= 2
        mem, offs, _ = reader.floor_spans(txn.get(b"t", db=env.open_db(None)), q.astype(np.uint64))
        cur = txn.cursor()
        for k, off in zip(q.tolist(), offs.tolist()):
            key = encode_keys(np.array([k], dtype=np.int64))[0]
            if cur.set_range(key):  # the first key >= k: k itself, or step back once
                want = cur.key() if cur.key() == key else (cur.key() if cur.prev() else None)
            else:  # every key is below k: the last
                want = cur.key() if cur.last() else None
            if want is None:
                assert off < 0
            else:
                assert off >= 0
                first = int(mem[off + pagechunks.HEAD : off + pagechunks.HEAD + 8].view(np.int64)[0])
                assert first == int(decode_keys([want])[0])


@pytest.mark.parametrize("w,rows_a_page", [(16, 52), (17, 50), (65, 14)])
def test_chunks_fill_pages(tmp_path, w, rows_a_page):
    ids = np.arange(0, 200_000, 5, dtype=np.int64)
    env, db, _ = _store(tmp_path, ids, w)
    with env.begin(db=db) as txn:
        st_ = txn.stat(db)
    assert st_["overflow_pages"] == 0
    assert 2 * pagechunks.capacity(4 * w + 4) == rows_a_page
    assert st_["leaf_pages"] == -(-len(ids) // rows_a_page)  # every leaf full but the last


def test_bad_input_is_refused_and_writes_nothing(tmp_path):
    env = _env(tmp_path)
    db = env.open_db(b"t")
    ids = np.array([5, 3], dtype=np.int64)
    with pytest.raises(TierstoreError):
        pagechunks.write(env, db, ids, seal(ids, _rows(ids, 5)))
    with pytest.raises(TierstoreError):
        pagechunks.write(env, db, ids[:1], seal(ids, _rows(ids, 5)))
    with pytest.raises(TierstoreError):
        pagechunks.capacity(4000)
    pagechunks.write(env, db, np.array([10]), seal(np.array([10]), _rows(np.array([10]), 5)))
    with pytest.raises(TierstoreError):  # ids below the level's last: refused, nothing added
        pagechunks.write(env, db, np.array([4]), seal(np.array([4]), _rows(np.array([4]), 5)))
    with env.begin(db=db) as txn:
        assert txn.stat(db)["entries"] == 1


@pytest.mark.parametrize("where", ["record", "id", "count"])
def test_damage_is_a_store_corrupt_error(tmp_path, where):
    """A flipped byte in a record, an id or a chunk's count never reads as another value or as
    an absent row."""
    ids = np.arange(0, 600, 2, dtype=np.int64)
    w = 5
    env, db, _ = _store(tmp_path, ids, w)
    cap = pagechunks.capacity(4 * w + 4)
    key = encode_keys(ids[:1])[0]
    with env.begin(write=True, db=db) as txn:
        val = bytearray(txn.get(key))
        at = {"record": pagechunks.HEAD + 8 * cap + 3, "id": pagechunks.HEAD + 8 * 2,
              "count": 0}[where]
        val[at] ^= 0x40 if where != "count" else 0x7F
        txn.put(key, bytes(val))
    env.sync()
    reader = PageReader(tmp_path / "data.mdb", env.stat()["psize"])
    # the damaged id's row (id 4), the row a flipped record bit belongs to (id 0), and an absent
    # id inside the chunk's range
    q = np.array({"record": [0], "id": [3], "count": [2]}[where], dtype=np.int64)
    with env.begin() as txn, pytest.raises(StoreCorruptError):
        pagechunks.lookup(reader, txn, b"t", "t", q, w)
