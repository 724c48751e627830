"""Format 4's tables: each table's rows as page chunks in ranges, found through a manifest.

`ChunkTables` is the `LmdbBackend` mixin of a store created with `table_format="chunks"`
(on-disk format 4, docs/design.md "Format 4 in the store"). A table is a `ChunkLevel`: its rows
sorted into page-sized chunks (`pagechunks.py`) held by range databases `c:<table>.<n>`, each
range about a million rows. The metadata record `chunks:<table>` is the table's manifest: the
ranges' first ids, database names and row counts. Every write transaction that changes a range
rewrites it (`ChunkLevel.on_publish`), so a reader's snapshot always pairs a manifest with the
databases it names; a merge cut short (a kill) leaves fresh databases no manifest names, which
the next writable open drops.

Writes are merges: a batch of rows, sorted, rewrites each range it touches sequentially (or
updates the touched chunks in place when the batch is sparse in the range), so the tables stay
dense (~1.1x the raw rows) where a B-tree of random inserts settles near 2.2x. Reads walk the
range's tree with the page walker's floor search and search the chunk in place; every record's
checksum is verified, as for the B-tree. Expiry scans whole chunks for stale stamps
(`chunk_stale_ids`) and deletes in place, re-checking each stamp (`chunk_delete_stale`,
`ChunkLevel.delete`, `chunkupdate.py`).
"""

from __future__ import annotations

import bisect
import json
import threading
from collections.abc import Iterator

import lmdb
import numpy as np

from ..errors import StoreCorruptError, TierstoreError
from . import chunkmerge
from .chunkmerge import MDB_DB_RECORD, ChunkLevel
from .chunkupdate import chunk_stamps
from .chunkwalk import unpack_chunks
from .lmdb_common import DATA_NAME
from .pagechunks import HEAD, capacity, lookup
from .pages import PageReader
from .record import CHECK_BYTES, open_records, seal

MANIFEST = "chunks:"  # metadata record of a table's ranges: "chunks:<table>"
RANGE_PREFIX = "c:"  # range databases: "c:<table>.<n>"
BTREE_PREFIX = b"t:"  # a B-tree table's database: "t:<table>" (in a format-4 store: a wide table)
# merges check every chunk's head and ids, but copy records with the checksum they came with: a
# damaged record stays damaged (its read fails, naming it) instead of stopping every later merge;
# True checks each record copied too (~20% of a merge's CPU)
VERIFY_MERGES = False
REPACK_FILL = 0.97  # on close, ranges whose chunks are under this full on average are rewritten


class ChunkTables:
    """Tables stored as page-chunk levels (an `LmdbBackend` mixin; `self.chunked` says whether
    the store is of format 4, `is_chunked` whether a table of it is)."""

    chunked: bool = False
    # a format-4 store's tables kept as B-trees (rows too wide for a chunk): their `t:<table>`
    # database is the durable record (docs/design.md "Chunks by default")
    btree_tables: frozenset[str] = frozenset()

    def is_chunked(self, table: str) -> bool:
        """Whether a table's rows are page chunks: every table of a format-4 store, but those
        kept as B-trees."""
        return self.chunked and table not in self.btree_tables

    def find_btree_tables(self) -> frozenset[str]:
        """The tables with a B-tree database (`t:<table>`) in the environment."""
        out = set()
        with self.env.begin() as txn:
            cur = txn.cursor()
            if cur.set_range(BTREE_PREFIX):
                for key in cur.iternext(keys=True, values=False):
                    if not key.startswith(BTREE_PREFIX):
                        break
                    out.add(bytes(key[len(BTREE_PREFIX):]).decode())
        return frozenset(out)

    def keep_as_btree(self, tables: list[str]) -> None:
        """Keep these tables of a format-4 store as B-trees (their rows do not fit a chunk), before
        they open: `open_tables` creates their databases, which record it for later opens."""
        if not self.chunked:
            return
        for table in tables:
            if table in self.btree_tables:
                continue
            if self.get_meta(f"{MANIFEST}{table}") is not None:
                raise StoreCorruptError(f"store {self.path}: table {table!r} has page chunks but "
                                        f"rows too wide for them")
            self.btree_tables = self.btree_tables | {table}

    def forget_levels(self) -> None:
        """Drop the opened levels and the chunk page reader (the environment was (re)opened)."""
        for key in ("_levels", "_manifests", "_chunk_pages"):
            self.__dict__.pop(key, None)

    def _chunk_reader(self) -> PageReader:
        """The page walker chunk reads go through (the backend's, or one of their own when
        page reads are turned off for B-tree tables: chunks have no py-lmdb path)."""
        if self._pages is not None:
            return self._pages
        reader = self.__dict__.get("_chunk_pages")
        if reader is None:
            reader = PageReader(self.path / DATA_NAME, self.env.stat()["psize"])
            self.__dict__["_chunk_pages"] = reader
        return reader

    def chunk_level(self, table: str, row_dim: int) -> ChunkLevel:
        """The table's level, opened from its manifest (or empty) on first use."""
        levels = self.__dict__.setdefault("_levels", {})
        level = levels.get(table)
        if level is not None:
            return level
        # one level a table, whichever thread asks first (the merger, expiry's deleter)
        with self.__dict__.setdefault("_levels_lock", threading.Lock()):
            return levels.get(table) or self._open_level(levels, table, row_dim)

    def _open_level(self, levels: dict, table: str, row_dim: int) -> ChunkLevel:
        """`chunk_level`'s first use: the level made, restored and kept in `levels`."""
        # the module's sizes read now (tests shrink them to make many ranges and windows)
        level = ChunkLevel(self.env, table, row_dim, f"{RANGE_PREFIX}{table}",
                           range_rows=chunkmerge.RANGE_ROWS, window=chunkmerge.WINDOW)
        with self.env.begin() as txn:
            man = self._read_manifest(txn, table)
        if man is not None:
            level.restore(*man, open_db=lambda name: self.open_named(name, create=False))
        meta, key = self._meta, f"{MANIFEST}{table}".encode()

        def publish(txn, bounds, names, counts) -> None:
            txn.put(key, _manifest_json(bounds, names, counts), db=meta)

        level.on_publish = publish
        level.guard = self.publisher  # readers' ranges stay as published (publish.py)
        levels[table] = level
        return level

    def _read_manifest(self, txn: lmdb.Transaction, table: str
                       ) -> tuple[list[int], list[bytes | None], list[int]] | None:
        """(bounds, names, counts) of a table's ranges as `txn` sees them; None: no rows yet."""
        raw = txn.get(f"{MANIFEST}{table}".encode(), db=self._meta)
        if raw is None:
            return None
        cache = self.__dict__.setdefault("_manifests", {})
        key = (table, bytes(raw))
        got = cache.get(key)
        if got is None:
            try:
                rec = json.loads(bytes(raw))
                got = ([int(b) for b in rec["bounds"]],
                       [None if n is None else n.encode() for n in rec["names"]],
                       [int(c) for c in rec["counts"]])
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                raise StoreCorruptError(f"store {self.path}: the chunk manifest of table "
                                        f"{table!r} is damaged") from exc
            if len(cache) > 256:
                cache.clear()
            cache[key] = got
        return got

    def chunk_get(self, table: str, rows: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
        """`get` of a chunked table: (rows float32 [n, width], found bool [n]), checksums verified."""
        n = len(rows)
        out = np.zeros((n, width), dtype=np.float32)
        found = np.zeros(n, dtype=bool)
        if n == 0:
            return out, found
        rows = np.ascontiguousarray(rows, dtype=np.int64)
        if n < 2 or bool(np.all(rows[1:] > rows[:-1])):  # sorted and distinct (the loader's)
            order, ids, inv, got, hit = None, rows, None, out, found
        else:
            order = np.argsort(rows, kind="stable")
            srt = rows[order]
            distinct = bool(np.all(srt[1:] > srt[:-1]))
            ids, inv = (srt, None) if distinct else np.unique(srt, return_inverse=True)
            got = np.zeros((len(ids), width), dtype=np.float32)
            hit = np.zeros(len(ids), dtype=bool)
        if int(ids[0]) < 0:
            raise TierstoreError(f"table {table!r}: row ids must be non-negative")
        with self.reading():
            try:
                with self.env.begin() as txn:  # the manifest and the ranges it names, together
                    man = self._read_manifest(txn, table)
                    if man is None:
                        return out, found
                    bounds, names, _ = man
                    cuts = [0, *np.searchsorted(ids, np.array(bounds[1:], dtype=np.int64)).tolist(),
                            len(ids)]
                    for r, name in enumerate(names):
                        lo, hi = cuts[r], cuts[r + 1]
                        if name is None or lo == hi:
                            continue
                        part = lookup(self._chunk_reader(), txn, name, table, ids[lo:hi],
                                      width, f"store {self.path}, ")
                        if part is None:
                            raise StoreCorruptError(f"store {self.path}: chunk range {name!r} of "
                                                    f"table {table!r} holds a layout chunks never use")
                        got[lo:hi], hit[lo:hi] = part
            except lmdb.Error as exc:
                self._raise_io(exc)
        if order is None:  # read in place into `out`
            return out, found
        if inv is not None:
            got, hit = got[inv], hit[inv]
        out[order], found[order] = got, hit
        return out, found

    def chunk_put(self, table: str, rows: np.ndarray, payload: np.ndarray, sealed: bool,
                  row_dim: int) -> int:
        """Merge rows into a chunked table (the last of a repeated id wins); returns bytes.

        `payload` holds float32 rows [n, row_dim], or with `sealed` their records (uint8 [n, 4
        row_dim + 4], `record.seal`)."""
        rows = np.asarray(rows, dtype=np.int64)
        n = len(rows)
        if n == 0:
            return 0
        order = np.argsort(rows, kind="stable")
        srt = rows[order]
        last = np.ones(n, dtype=bool)  # a repeated id keeps its last write, as B-tree puts do
        last[:-1] = srt[1:] != srt[:-1]
        order, srt = order[last], srt[last]
        if sealed:
            recs = np.ascontiguousarray(np.asarray(payload)[order]).view(np.uint8)
        else:
            recs = seal(srt, np.ascontiguousarray(np.asarray(payload, dtype=np.float32)[order]))
        recs = recs.reshape(len(srt), 4 * row_dim + CHECK_BYTES)
        level = self.chunk_level(table, row_dim)
        self._chunk_merge(level, len(srt), lambda: level.merge(srt, recs, verify=VERIFY_MERGES,
                                                               in_place=None))
        return int(recs.nbytes + 8 * len(srt))

    def chunk_room(self, table: str, row_dim: int, rows: int) -> None:
        """Grow the map ahead of a merge of `rows` rows into a chunked table (call it outside any
        read of this backend: growing waits for the readers)."""
        level = self.chunk_level(table, row_dim)
        # one range at a time exists twice (its pages are reused a range later): room for two
        # ranges' rows and the batch's (ensure_room doubles it again)
        again = min(level.rows(), 2 * level.range_rows) + rows
        self.ensure_room(again * (level.vb // level.cap + 1) + 8 * level.vb)

    def chunk_merge_gather(self, table: str, row_dim: int, ids: np.ndarray, chunks: list,
                           chunk_of: np.ndarray, row_of: np.ndarray, skip: int) -> None:
        """Merge sorted distinct rows whose records lie in other chunks (the write-behind log's,
        read in place inside the caller's transaction, itself inside `reading()`, after
        `chunk_room`): `ChunkLevel.merge_gather`, each range rewritten or updated in place."""
        self.wrote = True
        self.chunk_level(table, row_dim).merge_gather(ids, chunks, chunk_of, row_of, skip,
                                                      verify=VERIFY_MERGES, in_place=None)

    def _chunk_merge(self, level: ChunkLevel, rows: int, merge) -> None:
        """Run a merge into `level` with room in the map for it (grown first, and again if the
        map fills: a merge cut short keeps what it published, and redoing it is harmless)."""
        self.wrote = True
        while True:
            self.chunk_room(level.table, level.row_dim, rows)
            try:
                with self.reading():
                    merge()
                return
            except lmdb.MapFullError:
                self._grow((min(level.rows(), 2 * level.range_rows) + rows) * level.vb // level.cap)
            except lmdb.Error as exc:
                self._raise_io(exc)

    def repack_levels(self, min_fill: float = REPACK_FILL) -> int:
        """Rewrite, packed, the ranges of the levels written through this handle that in-place
        updates left under `min_fill` full (on close: a closed store is dense); returns how many."""
        done = 0
        for level in list(self.__dict__.get("_levels", {}).values()):
            self.chunk_room(level.table, level.row_dim, 0)
            with self.reading():
                done += level.repack(min_fill)
        return done

    def chunk_count(self, table: str, txn: lmdb.Transaction | None = None) -> int:
        """Rows stored in a chunked table (its manifest's counts), in `txn`'s snapshot or now."""
        if txn is None:
            with self.reading(), self.env.begin() as own:
                return self.chunk_count(table, own)
        man = self._read_manifest(txn, table)
        return 0 if man is None else sum(man[2])

    def chunk_iter(self, table: str, width: int, txn: lmdb.Transaction, chunk: int = 65536
                   ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """`iter_rows` of a chunked table: (ids [k], payload [k, width]) in id order, from `txn`."""
        man = self._read_manifest(txn, table)
        if man is None:
            return
        # the table's geometry and leaf walk only: nothing opened (no write inside a snapshot)
        level = self.__dict__.get("_levels", {}).get(table) or \
            ChunkLevel(self.env, table, width, f"{RANGE_PREFIX}{table}")
        cap, rb, vb = level.cap, level.record_bytes, level.vb
        per = max(1, chunk // cap)  # chunks a piece
        for name in man[1]:
            if name is None:
                continue
            mem, offs, lens = level.leaves(txn, name)
            for c in range(0, len(offs), per):
                o, ln = offs[c : c + per], lens[c : c + per]
                ids = np.empty(len(o) * cap, dtype=np.int64)
                recs = np.empty((len(o) * cap, rb), dtype=np.uint8)
                k, bad = unpack_chunks(mem, o, ln, cap, rb, vb, ids, recs)
                if bad:
                    raise StoreCorruptError(f"store {self.path}: chunk {c + bad - 1} of range "
                                            f"{name!r} of table {table!r} is damaged")
                yield ids[:k], open_records(table, ids[:k], recs[:k].ravel(), width,
                                            f"store {self.path}, ")

    def chunk_stale_ids(self, table: str, row_dim: int, stamp_col: int, cutoff: int,
                        start: int = 0, limit: int = 65536) -> tuple[np.ndarray, int | None]:
        """Ids from `start` on of the rows of a chunked table whose stamp (record word
        `stamp_col`, as int32) is below `cutoff`, in id order, over whole chunks of about
        `limit` rows read in one snapshot; and the id the next scan starts at (None: the end)."""
        rb = 4 * row_dim + CHECK_BYTES
        cap = capacity(rb)
        per = max(1, limit // cap)  # chunks a scan
        found: list[np.ndarray] = []
        with self.reading(), self.env.begin() as txn:
            man = self._read_manifest(txn, table)
            if man is None:
                return np.zeros(0, dtype=np.int64), None
            bounds, names, _ = man
            # the table's geometry and leaf walk only: nothing opened (no write inside a snapshot)
            level = self.__dict__.get("_levels", {}).get(table) or \
                ChunkLevel(self.env, table, row_dim, f"{RANGE_PREFIX}{table}")
            r = max(0, bisect.bisect_right(bounds, start) - 1)
            while r < len(names) and per > 0:
                if names[r] is not None:
                    mem, offs, lens = level.leaves(txn, names[r])
                    c = 0
                    if len(offs) and start > bounds[r]:  # the chunk holding `start`, on
                        firsts = mem[offs[:, None] + HEAD + np.arange(8)].view(np.int64).ravel()
                        c = max(0, int(np.searchsorted(firsts, start, side="right")) - 1)
                    o, ln = offs[c : c + per], lens[c : c + per]
                    ids = np.empty(len(o) * cap, dtype=np.int64)
                    stamps = np.empty(len(o) * cap, dtype=np.int64)
                    k, bad = chunk_stamps(mem, o, ln, cap, row_dim, stamp_col, ids, stamps)
                    if bad:
                        raise StoreCorruptError(f"store {self.path}: chunk {c + bad - 1} of range "
                                                f"{names[r]!r} of table {table!r} is damaged")
                    found.append(ids[:k][(ids[:k] >= start) & (stamps[:k] < cutoff)])
                    per -= len(o)
                    if c + len(o) < len(offs):  # the scan stops inside this range
                        nxt = int(mem[offs[c + len(o)] + HEAD + np.arange(8)].view(np.int64)[0])
                        return np.concatenate(found), nxt
                r += 1
        out = np.concatenate(found) if found else np.zeros(0, dtype=np.int64)
        return out, (bounds[r] if r < len(names) else None)

    def chunk_delete_stale(self, table: str, row_dim: int, ids: np.ndarray, stamp_col: int,
                           cutoff: int) -> int:
        """Delete rows of sorted distinct `ids` of a chunked table whose stored stamp is still
        below `cutoff` (`ChunkLevel.delete`, re-checked as each chunk is rewritten); returns
        how many."""
        if len(ids) == 0:
            return 0
        level = self.chunk_level(table, row_dim)
        tally = np.zeros(1, dtype=np.int64)  # rows deleted by committed transactions
        self.wrote = True
        while True:
            # each chunk rewritten copies its leaf page and the path to it
            self.ensure_room(len(ids) * (level.vb + 256) + (1 << 20))
            try:
                with self.reading():
                    level.delete(ids, stamp_col, cutoff, tally)
                return int(tally[0])
            except lmdb.MapFullError:  # what committed stays; the redo skips the rows gone
                self._grow(len(ids) * level.vb)
            except lmdb.Error as exc:
                self._raise_io(exc)

    def chunk_tree_pages(self, tables: list[str]) -> dict[str, int]:
        """`tree_pages` of chunked tables: their range databases' pages (chunks fill the leaves)."""
        out = {"leaf_pages": 0, "branch_pages": 0, "dense_leaf_pages": 0}
        with self.reading(), self.env.begin() as txn:
            for table in tables:
                man = self._read_manifest(txn, table)
                for name in [] if man is None else man[1]:
                    if name is None:
                        continue
                    rec = txn.get(name)  # the database's record: no handle needed in `txn`
                    if rec is None or len(rec) != MDB_DB_RECORD.size:
                        raise StoreCorruptError(f"store {self.path}: chunk range {name!r} of "
                                                f"table {table!r} is missing")
                    _, _, _, branch, leaf, overflow, _, _ = MDB_DB_RECORD.unpack(rec)
                    out["leaf_pages"] += leaf + overflow
                    out["branch_pages"] += branch
                    out["dense_leaf_pages"] += leaf + overflow  # chunks fill their leaves
        return out

    def drop_unnamed_ranges(self, tables: list[str]) -> int:
        """Drop range databases no manifest names (a rewrite cut short by a kill); returns how many.

        A range a published manifest names while the published marker is covered stays (a
        reader may read it, even one that outlived a killed writer): it is named retired, and
        goes at the next publish or at a chunk write that finds no reader."""
        with self.env.begin() as txn:
            names = [k for k, _ in txn.cursor() if k.startswith(RANGE_PREFIX.encode())]
            named = set()
            for table in tables:
                man = self._read_manifest(txn, table)
                named.update(n for n in ([] if man is None else man[1]) if n is not None)
        readable = set() if self.publisher is None else self.publisher.readable_ranges()
        kept = [n for n in names if n not in named and n in readable]
        if kept:
            with self.env.begin(write=True) as txn:
                for name in kept:
                    self.publisher.retire(txn, name, None)
        stale = [n for n in names if n not in named and n not in readable]
        for name in stale:
            db = self.open_named(name, create=False)
            with self.env.begin(write=True) as txn:
                txn.drop(db, delete=True)
        if stale:
            self.wrote = True
        return len(stale)


def _manifest_json(bounds: list[int], names: list[bytes | None], counts: list[int]) -> bytes:
    """A manifest record's bytes."""
    return json.dumps({"bounds": [int(b) for b in bounds],
                       "names": [None if n is None else n.decode() for n in names],
                       "counts": [int(c) for c in counts]}).encode()

