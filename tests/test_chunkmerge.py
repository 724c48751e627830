"""Merges of sorted rows into a level of page chunks (backends/chunkmerge.py) on real LMDB files:
the level reads as a dict updated by every batch, ranges split and drop their old databases,
and damage or bad input is an error that changes nothing."""

from __future__ import annotations

import struct

import lmdb
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tests.profiles import examples
from tierstore.backends import chunkmerge, pagechunks
from tierstore.backends.chunkmerge import ChunkLevel
from tierstore.backends.lmdb_common import encode_keys
from tierstore.backends.record import seal
from tierstore.errors import StoreCorruptError, TierstoreError

TOP = 1 << 40


def _env(path):
    return lmdb.open(str(path), map_size=1 << 30, max_dbs=64, sync=False, metasync=False)


def _rows(ids: np.ndarray, w: int, gen: int) -> np.ndarray:
    return (ids[:, None] % 100_003 * 10 + np.arange(w) + 1000 * gen).astype(np.float32)


def _merge(level: ChunkLevel, ref: dict, ids, gen: int, verify: bool = True, gather: bool = False,
           in_place: bool = False):
    ids = np.array(sorted(set(ids)), dtype=np.int64)
    rows = _rows(ids, level.row_dim, gen)
    recs = seal(ids, rows)
    if gather:  # the records in log-like entries (4 header words first), shuffled over 3 chunks
        n, rw = len(ids), recs.shape[1] // 4
        order = np.random.default_rng(gen).permutation(n)
        entries = np.zeros((n, 4 + rw + 1), dtype=np.uint32)
        entries[:, 4 : 4 + rw] = recs.view(np.uint32)[order]
        chunks = np.array_split(entries, 3)
        at = np.argsort(order)  # row i's entry, then its chunk and row
        edges = np.cumsum([0] + [len(c) for c in chunks])
        of = np.searchsorted(edges, at, side="right") - 1
        stats = level.merge_gather(ids, chunks, of, at - edges[of], skip=4, verify=verify,
                                   in_place=in_place)
    else:
        stats = level.merge(ids, recs, verify=verify, in_place=in_place)
    ref.update(zip(ids.tolist(), rows))
    return stats


def _named(level: ChunkLevel) -> set:
    """The level's databases in its environment."""
    with level.env.begin() as txn:
        return {k for k, _ in txn.cursor() if k.startswith(level.prefix.encode() + b".")}


def _check(level: ChunkLevel, ref: dict, probes=()) -> None:
    """Every stored id reads its newest row; other ids read as absent."""
    q = np.array(sorted(set(ref) | set(probes)), dtype=np.int64)
    rows, found = level.get(q)
    assert found.tolist() == [int(x) in ref for x in q]
    for x, row in zip(q[found].tolist(), rows[found]):
        assert np.array_equal(row, ref[x])
    assert not rows[~found].any()
    assert level.rows() == len(ref) == level.walked_rows()  # the counts kept match the chunks
    assert len(level.counts) == len(level.names)
    assert all(c == 0 for c, n in zip(level.counts, level.names) if n is None)
    # the level's databases are all that is left: every old range was dropped
    assert _named(level) == {n for n in level.names if n is not None}
    assert level.bounds[0] == 0 and all(a < b for a, b in zip(level.bounds, level.bounds[1:]))


ids_st = st.one_of(st.integers(0, 300), st.integers(TOP - 300, TOP), st.integers(0, TOP))
batch_st = st.lists(ids_st, max_size=400)


@settings(max_examples=examples(0.5), deadline=None)
@given(batches=st.lists(batch_st, min_size=1, max_size=6), w=st.sampled_from([1, 5, 65]),
       range_rows=st.sampled_from([1, 40, 150, 10_000]), window=st.sampled_from([1, 2, 5, 64]),
       verify=st.booleans(), gather=st.booleans(),
       in_place=st.lists(st.sampled_from([False, True, None]), min_size=6, max_size=6),
       data=st.data())
@example(batches=[list(range(0, 62 * 3)), list(range(61, 62 * 4, 2)), [], [0, TOP]], w=5,
         range_rows=62, window=1, verify=True, gather=True, in_place=[False, True] * 3, data=None)
@example(batches=[list(range(7)), list(range(7, 14)), list(range(14)), list(range(6, 8))], w=65,
         range_rows=7, window=1, verify=False, gather=False, in_place=[True] * 6, data=None)
def test_merges_read_like_a_dict(tmp_path_factory, batches, w, range_rows, window, verify, gather,
                                 in_place, data):
    """Any sequence of merges (new ids, updated ids, ids at both ends, empty batches, batches
    that fill chunks exactly; records in an array or gathered from log-like chunks; ranges
    rewritten or updated in place, mixed) leaves a level that reads as a dict updated by each
    batch in turn."""
    env = _env(tmp_path_factory.mktemp("cm"))
    level = ChunkLevel(env, "t", w, "t", range_rows=range_rows, window=window)
    published = []
    level.on_publish = lambda txn, bounds, names, counts: published.append((bounds, names, counts))
    ref: dict = {}
    for gen, batch in enumerate(batches):
        before = list(level.names)
        stats = _merge(level, ref, batch, gen, verify, gather, in_place[gen])
        assert stats.batch_rows == len(set(batch))
        assert stats.rows_written >= stats.batch_rows
        assert stats.ranges_rewritten + stats.ranges_kept == len(before)
        if not batch:
            assert level.names == before and stats.rows_written == 0
        if published:
            assert published[-1] == (level.bounds, level.names, level.counts)
        probes = data.draw(st.lists(ids_st, max_size=50)) if data is not None else [1, TOP - 1]
        _check(level, ref, probes)


def test_chunks_are_full_and_ranges_split(tmp_path):
    """Every chunk of a range is full but its last; a range grown past twice `range_rows` is cut
    into parts of about `range_rows`; a range the batch does not touch keeps its database."""
    env = _env(tmp_path)
    w = 5
    cap = pagechunks.capacity(4 * w + 4)
    level = ChunkLevel(env, "t", w, "t", range_rows=1000, window=3)
    ref: dict = {}
    _merge(level, ref, range(0, 10_000, 2), 0)
    assert len(level.names) == 5  # 5,000 rows in ranges of ~1,000
    _merge(level, ref, range(1, 1000, 2), 1)  # 500 more rows into the first range only
    stats = _merge(level, ref, range(9001, 9004, 2), 2)
    assert stats.ranges_rewritten == 1 and stats.ranges_kept == len(level.names) - 1
    assert stats.old_rows < 1100 and stats.rows_written == stats.old_rows + 2
    short = 0
    with env.begin() as txn:
        for name in level.names:
            db = env.open_db(name, txn=txn, create=False)
            vals = [np.frombuffer(v, dtype=np.uint8) for _, v in txn.cursor(db=db)]
            counts = [int(v[:4].view(np.uint32)[0]) for v in vals]
            assert all(c == cap for c in counts[:-1]) and 0 < counts[-1] <= cap
            # a short chunk's unused slots are zeros (not the buffer's last contents)
            k, ids = counts[-1], vals[-1][pagechunks.HEAD :]
            assert not ids[8 * k : 8 * cap].any() and not ids[8 * cap + k * (4 * w + 4) :].any()
            short += k < cap
    assert short
    _check(level, ref)


def _damage(env, level: ChunkLevel, at: int, last: bool = False) -> None:
    """Flip a byte `at` into the second chunk of the level's first range (or its last chunk)."""
    with env.begin(write=True) as txn:
        db = env.open_db(level.names[0], txn=txn, create=False)
        cur = txn.cursor(db=db)
        if last:
            cur.last()
        else:
            cur.first()
            cur.next()
        key, val = cur.key(), bytearray(cur.value())
        val[at] ^= 0x10
        txn.put(key, bytes(val), db=db)


@pytest.mark.parametrize("where", ["record", "id", "last id", "count"])
def test_damage_is_found_by_the_merge_or_the_read(tmp_path, where):
    """A damaged id or count stops the merge (it must not be sealed under a fresh check) and
    changes nothing; a damaged record stops a verifying merge, and a merge that copies it blind
    keeps it damaged: the next read of its row fails."""
    env = _env(tmp_path)
    w = 5
    cap = pagechunks.capacity(4 * w + 4)
    level = ChunkLevel(env, "t", w, "t", range_rows=10_000, window=1)  # a commit a chunk
    ref: dict = {}
    _merge(level, ref, range(0, 2000, 2), 0)
    # the second chunk holds ids 2 cap .. 4 cap - 2; its first record is row 2 cap's
    # (the range's very last id made larger still breaks no order: only the ids' check sees it)
    at = {"record": pagechunks.HEAD + 8 * cap + 5, "id": pagechunks.HEAD + 8 * 3, "count": 1,
          "last id": pagechunks.HEAD + 8 * (1000 % cap - 1) + 6}[where]
    _damage(env, level, at, last=where == "last id")
    names = list(level.names)
    with pytest.raises(StoreCorruptError):
        _merge(level, {}, [1, 3], 1, verify=True)
    assert level.names == names and _named(level) == set(names)  # the merge's fresh range went
    if where == "record":
        _merge(level, ref, [1, 3], 1, verify=False)
        with pytest.raises(StoreCorruptError):
            level.get(np.array([2 * cap]))
        rows, found = level.get(np.array([0, 3, 2 * cap + 2]))  # the rows around it still read
        assert found.all() and np.array_equal(rows[1], ref[3])
    else:
        with pytest.raises(StoreCorruptError):
            _merge(level, {}, [1, 3], 1, verify=False)


def _synced_range(tmp_path) -> tuple[ChunkLevel, int]:
    """A level of one range (every third id below 5,000) synced to its file, and its root page."""
    env = _env(tmp_path)
    level = ChunkLevel(env, "t", 5, "t")
    _merge(level, {}, range(0, 5000, 3), 0)
    env.sync()
    with env.begin() as txn:
        return level, struct.unpack("<IHHQQQQQ", txn.get(level.names[0]))[-1]


def test_a_damaged_page_stops_the_walk(tmp_path):
    """A leaf page whose node area no longer tiles (its mp_upper flipped) is a StoreCorruptError
    naming the page, before any row is merged."""
    level, root = _synced_range(tmp_path)
    path = tmp_path / "data.mdb"
    with open(path, "r+b") as f:  # the range's root page: its mp_upper below its mp_lower
        f.seek(root * 4096 + 14)
        f.write(b"\x10\x00")
    with pytest.raises(StoreCorruptError, match=r"page \d+"):
        _merge(level, {}, [1], 1)


def test_a_leaf_out_of_order_stops_the_walk(tmp_path):
    """A leaf whose node pointers are swapped (its keys out of order) is found by the page check
    of the walk, naming the page, not later by a chunk's id order."""
    level, root = _synced_range(tmp_path)
    path = tmp_path / "data.mdb"
    with open(path, "r+b") as f:
        f.seek(root * 4096)
        page = f.read(4096)
        node = struct.unpack_from("<H", page, 16)[0]  # the root's first child: a leaf
        lo, hi, top = struct.unpack_from("<HHH", page, node)
        leaf = lo | hi << 16 | top << 32
        f.seek(leaf * 4096 + 16)
        a, b = struct.unpack("<HH", f.read(4))
        f.seek(leaf * 4096 + 16)
        f.write(struct.pack("<HH", b, a))
    with pytest.raises(StoreCorruptError, match=rf"page {leaf}: keys out of order"):
        _merge(level, {}, [1], 1)


def test_bad_input_is_refused_and_changes_nothing(tmp_path):
    env = _env(tmp_path)
    w = 5
    level = ChunkLevel(env, "t", w, "t")
    ref: dict = {}
    _merge(level, ref, range(100), 0)
    names = list(level.names)
    ids = np.array([5, 3], dtype=np.int64)
    for bad_ids, recs in [(ids, seal(ids, _rows(ids, w, 1))),  # out of order
                          (np.array([3, 3]), seal(np.array([3, 3]), _rows(np.array([3, 3]), w, 1))),
                          (np.array([-1, 3]), seal(np.array([-1, 3]), _rows(np.array([-1, 3]), w, 1))),
                          (np.array([3]), seal(np.array([3, 4]), _rows(np.array([3, 4]), w, 1))),
                          (np.array([3]), np.zeros((1, 4 * w), dtype=np.uint8))]:
        with pytest.raises(TierstoreError):
            level.merge(bad_ids, recs)
    recs = seal(np.array([3, 4]), _rows(np.array([3, 4]), w, 1))
    recs[1, 0] ^= 1  # a record that fails its checksum is refused by a verifying merge
    with pytest.raises(TierstoreError, match="checksum"):
        level.merge(np.array([3, 4]), recs)
    with pytest.raises(TierstoreError):
        level.get(np.array([4, 3]))
    chunk = np.zeros((4, 4 * w + 4), dtype=np.uint32)
    for args in [([3], [chunk], [0], [4]),  # a row past its chunk
                 ([3], [chunk], [1], [0]),  # a chunk that does not exist
                 ([3], [chunk.astype(np.int64)], [0], [0]),  # not uint32 words
                 ([3, 4], [chunk], [0], [0])]:  # lengths that do not match
        with pytest.raises(TierstoreError):
            level.merge_gather(np.array(args[0]), args[1], np.array(args[2]), np.array(args[3]),
                               verify=False)
    entries = np.zeros((1, 4 + w + 1), dtype=np.uint32)
    entries[0, 4:] = seal(np.array([3]), _rows(np.array([3]), w, 1)).view(np.uint32)
    entries[0, 5] ^= 1  # a gathered record that fails its checksum
    with pytest.raises(TierstoreError, match="checksum"):
        level.merge_gather(np.array([3]), [entries], np.array([0]), np.array([0]), skip=4)
    with pytest.raises(TierstoreError):
        ChunkLevel(env, "t", w, "u", range_rows=0)
    assert level.names == names
    _check(level, ref)


def test_keys_are_the_chunks_first_ids(tmp_path):
    """Each chunk is stored under its first id (the floor search depends on it)."""
    env = _env(tmp_path)
    level = ChunkLevel(env, "t", 17, "t", range_rows=100, window=2)
    _merge(level, {}, range(0, 3000, 7), 0)
    _merge(level, {}, range(3, 3000, 11), 1)
    with env.begin() as txn:
        for name in level.names:
            db = env.open_db(name, txn=txn, create=False)
            for key, val in txn.cursor(db=db):
                first = np.frombuffer(val[pagechunks.HEAD : pagechunks.HEAD + 8], dtype=np.int64)
                assert key == encode_keys(first)[0]


def _chunks(level: ChunkLevel) -> list[tuple[bytes, int]]:
    """(key, count) of every chunk of the level, in id order."""
    with level.env.begin() as txn:
        return [(k, int(np.frombuffer(v[:4], dtype=np.uint32)[0])) for name in level.names
                for k, v in txn.cursor(db=level.db(name))]


def test_in_place_touches_only_its_chunks_and_splits_what_overflows(tmp_path):
    """An in-place merge reads and writes only the chunks its rows fall into; a chunk that
    overflows is split into chunks of near-equal counts, no other key moves; a rewrite packs
    the level full again."""
    env = _env(tmp_path)
    w = 5
    cap = pagechunks.capacity(4 * w + 4)
    level = ChunkLevel(env, "t", w, "t", range_rows=100_000)
    ref: dict = {}
    _merge(level, ref, range(0, 100 * cap * 10, 10), 0)  # 100 full chunks, ids 10 apart
    before = dict(_chunks(level))
    stats = _merge(level, ref, [5, 10 * cap * 50 + 5], 1, in_place=True)  # chunks 0 and 50
    assert stats.old_rows == 2 * cap and stats.rows_written == 2 * cap + 2
    after = dict(_chunks(level))
    changed = {k for k in after if k not in before or after[k] != before[k]}
    assert len(after) == 102 and set(before) <= set(after) and len(changed) == 4
    assert sorted(after[k] for k in changed) == sorted([(cap + 2) // 2, (cap + 1) // 2] * 2)
    stats = _merge(level, ref, range(1, 10 * cap, 10), 2, in_place=True)  # cap more rows in chunk 0
    assert all(c <= cap for _, c in _chunks(level))
    _check(level, ref)
    _merge(level, ref, [3], 3)  # the rewrite
    counts = [c for _, c in _chunks(level)]
    assert all(c == cap for c in counts[:-1])
    _check(level, ref)


def test_in_place_damage_is_a_store_corrupt_error(tmp_path):
    env = _env(tmp_path)
    w = 5
    level = ChunkLevel(env, "t", w, "t")
    ref: dict = {}
    _merge(level, ref, range(0, 2000, 2), 0)
    _damage(env, level, pagechunks.HEAD + 8 * 3)  # an id of the second chunk
    with pytest.raises(StoreCorruptError):
        _merge(level, {}, [2 * pagechunks.capacity(4 * w + 4) + 1], 1, in_place=True)
    _merge(level, ref, [1], 1, in_place=True)  # the first chunk is whole: it updates
    rows, found = level.get(np.array([0, 1]))
    assert found.all() and np.array_equal(rows[1], ref[1])


def test_the_regime_follows_the_batch_share(tmp_path, monkeypatch):
    """`in_place=None`: a batch under 1 row in 4 of a range's updates it in place (reading only
    the chunks it touches); a denser one rewrites the range (reading all of it)."""
    env = _env(tmp_path)
    w = 5
    cap = pagechunks.capacity(4 * w + 4)
    level = ChunkLevel(env, "t", w, "t", range_rows=1000)
    ref: dict = {}
    _merge(level, ref, range(0, 40_000, 10), 0)  # 4 ranges of 1,000 rows
    stats = _merge(level, ref, [5, 15, 25_005], 1, in_place=None)  # ranges 0 and 2, sparsely
    assert stats.old_rows == 2 * cap and stats.ranges_rewritten == 2
    stats = _merge(level, ref, range(1, 10_000, 30), 2, in_place=None)  # 334 rows into range 0
    assert stats.old_rows >= 1000 and stats.ranges_rewritten == 1
    _check(level, ref)
    # sparse inserts split the full chunks they land in: a range is updated in place only while
    # its chunks would stay REFILL full if every batch row split one, else rewritten, packed
    def chunks_of_range() -> int:
        with env.begin() as txn:
            return txn.stat(level.db(level.names[0]))["entries"]

    gen, kinds = 3, set()
    monkeypatch.setattr(chunkmerge, "REWRITE_MAX", 10**9)  # (tiny batches: next part)
    for k in range(2, 12):
        batch = list(range(k, 10_000, 3400))  # 3 rows into range 0
        entries, count = chunks_of_range(), level.counts[0]
        in_place = count + 3 >= chunkmerge.REFILL * (entries + 3) * cap
        stats = _merge(level, ref, batch, gen, in_place=None)
        gen += 1
        kinds.add(in_place)
        if in_place:  # only the touched chunks read
            assert stats.old_rows <= 3 * cap
        else:  # rewritten whole, and packed again
            assert stats.old_rows == count and level.counts[0] > 0.97 * chunks_of_range() * cap
        assert level.counts[0] >= chunkmerge.REFILL * chunks_of_range() * cap
    assert kinds == {True, False}
    _check(level, ref)
    # a batch too small to pay for the range's rewrite (REWRITE_MAX rows copied a batch row)
    # goes in place however thin it leaves the range; `close`-time repack packs it again
    monkeypatch.setattr(chunkmerge, "REWRITE_MAX", 64)
    for k in range(12, 20):
        count = level.counts[0]
        stats = _merge(level, ref, [k, k + 3400], gen, in_place=None)
        gen += 1
        assert stats.old_rows <= 2 * cap < count  # in place, whatever the fill
    assert level.repack() >= 1 and chunks_of_range() == -(-level.counts[0] // cap)  # packed
    assert level.repack() == 0  # (a packed level is left alone)
    _check(level, ref)


def test_a_rewrite_grows_the_file_by_about_one_range(tmp_path):
    """Merges that rewrite every range keep the file within about one range of the level's own
    pages, not two: each range is written into the pages the range before it freed (a window
    later), since no snapshot is held through a rewrite (the old range is read in place under
    the level's lock); the rows read as merged."""
    env = _env(tmp_path)
    w = 64
    cap = pagechunks.capacity(4 * w + 4)
    level = ChunkLevel(env, "t", w, "t", range_rows=8000, window=64)
    ref: dict = {}
    _merge(level, ref, range(0, 64_000), 0)  # 8 ranges of 8,000 rows
    assert len(level.names) == 8
    for gen in (1, 2, 3):
        _merge(level, ref, range(gen, 64_000, 3), gen)  # rows in every range: all rewritten
    with env.begin() as txn:
        own = 0  # the level's pages
        for name in level.names:
            st = txn.stat(env.open_db(name, txn=txn, create=False))
            own += st["leaf_pages"] + st["branch_pages"] + st["overflow_pages"]
    file_pages = env.info()["last_pgno"] + 1  # the file's high-water mark
    range_pages = -(-8000 // cap) // 2  # two chunks a leaf page
    # (one snapshot held through each rewrite: ~2.25 ranges over the level's pages)
    assert file_pages - own <= 1.3 * range_pages + 16, (file_pages - own, range_pages)
    _check(level, ref)
