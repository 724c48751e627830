"""The write-behind log: rows appended in arrival order to a log database in its own LMDB env.

The writer thread appends each batch it takes from the write-behind ring to the database
`__tierstore_log__` of the log's environment (`<store>/wlog/`, `lmdb_log.py`; `MDB_APPEND`:
full pages, no random B-tree update), then folds the oldest part of the log into the tables in
large key-sorted batches (`merge`), so each leaf page of a table absorbs many rows at once.

Every row has a sequence number. The log stores rows in *chunks*: one LMDB value of up to
`CHUNK_ROWS` consecutive rows of one entry size, under the 8-byte big-endian sequence number of
its first row. A chunk is `CHUNK_MAGIC | entry size (u32) | count (u32) | 0 (u32)` and then
`count` entries of `table id (u32, crc32 of the table name) | 0 (u32) | row id (i64) | record`,
the record being the table's stored row format (row words and checksum, `record.py`). Chunks
make an append, a merge's read and its delete a handful of LMDB calls and byte copies instead of
one Python object and B-tree operation per row (values this large live in LMDB's overflow pages,
written whole). An in-memory hash index maps each (table, row) with a version in the log to the
sequence number of its newest version; it holds at most `capacity` entries (the log is merged
before it holds more), so its memory is bounded by the log's size.

The two environments share no transaction, so every merge records in the tables' environment
the sequence number it merged through (`MERGED_KEY`) after its rows and before it deletes its
chunks, and sequence numbers never restart below that record. On open, a log left by a crash is
merged into the tables before anything else (`replay`): entries at or below the record are
already in the tables and skipped (after an OS crash the log's unsynced file may come back
older than the tables), a merge that was cut short is simply done again (rows are idempotent),
and the log's files are removed once the tables hold it all. Replay first checks that the log
is the tables' own: both carry the store's identity (a random id in the `MERGED_KEY` record,
copied into the log's environment at open), and the log's chunks are contiguous and start at
or below the record plus one (a log starting past it was merged into another copy of the
tables). A store of format version 2 kept its log inside the tables' environment; `replay`
merges and drops that one too (the conversion to format 3 needs nothing else).
"""

from __future__ import annotations

import threading
import time
import uuid
import weakref
import zlib
from collections.abc import Callable

import lmdb
import numpy as np
import torch

from ..config import TableSpec
from ..errors import StoreCorruptError
from ..index import HashIndex
from .lmdb_log import DROP_HINT, LOG_DB
from .record import open_records, row_checks

MERGED_KEY = "log"  # metadata record of the tables: {"merged_through": last merged sequence number}
HEADER = 16  # table id u32, pad u32, row id i64
CHUNK_MAGIC = b"TSLC"
CHUNK_HEADER = 16  # magic, entry size u32, count u32, pad u32
CHUNK_ROWS = 4096  # rows per log value: ~1.1 MB of 66-word rows, a few hundred overflow pages
MERGE_ROWS = 131072  # rows per piece of a merge's key-sorted writes (bounds its memory)
FIND_ROWS = 16384  # log index lookups per hold of the ring's lock during a merge (a few ms)
_SEQ = np.dtype(">u8")


def table_id(name: str) -> int:
    """The stable 32-bit id of a table in log records."""
    return zlib.crc32(name.encode())


def _seq_keys(seqs: np.ndarray) -> list[bytes]:
    return np.ascontiguousarray(seqs, dtype=_SEQ).view("V8").tolist()


class WriteLog:
    """The log database, its in-memory index and the merge into the tables (used by the writer)."""

    def __init__(self, backend, names: list[str], row_dims: list[int], capacity: int,
                 lock) -> None:
        self.backend = backend
        self.names = names
        self.row_dims = row_dims
        self.ids = np.array([table_id(n) for n in names], dtype=np.uint32)
        self.widths = np.array(row_dims, dtype=np.int64)
        if len(set(self.ids.tolist())) != len(names):
            raise StoreCorruptError("two table names share a log id (crc32); rename one")
        self.capacity = max(1, int(capacity))
        self.index = HashIndex(self.capacity)
        self.seq_of = np.full(self.capacity, -1, dtype=np.int64)  # index slot -> sequence number
        self.lock = lock  # the write-behind ring's condition: guards the index
        # next sequence number: past the log's end and past every number merged before
        self.next = max(self._last(), merged_through(backend)) + 1
        self.owner = _own_log(backend)
        self.merged = self.next  # sequence numbers below are merged (or were never appended)
        # the chunks not yet merged, oldest first: first sequence number, row count, entry size
        self._chunks = np.zeros((0, 3), dtype=np.int64)
        self.rows_appended = 0
        self.chunks_appended = 0
        # one merge at a time (the background merger, the writer when the log is full, a flush);
        # reentrant: a flush holds it around its own merge (lock order: merging, then `lock`)
        self.merging = threading.RLock()
        self._wake = threading.Event()
        self._stop = False
        self._merger: threading.Thread | None = None
        self.merge_error: BaseException | None = None  # the background merger's last failure
        self.background_merges = 0
        self.rows_merged = 0
        self.merge_seconds = 0.0
        self.append_seconds = 0.0

    @property
    def db(self) -> object:
        """The log database's handle in the log's own environment (opened on first use)."""
        return self.backend.log_db(LOG_DB)

    def _last(self) -> int:
        """The last sequence number in the log (-1 when empty; the log is replayed before this)."""
        db = self.db
        with self.backend.reading(), self.backend.log_env().begin(db=db) as txn:
            cur = txn.cursor()
            if not cur.last():
                return -1
            first, val = int.from_bytes(cur.key(), "big"), cur.value()
            return first + _chunk_count(val) - 1

    @property
    def index_bytes(self) -> int:
        """Bytes of the in-memory index of the log's rows (set by its capacity)."""
        return self.index.table.nbytes + self.index.pos_of.nbytes + self.seq_of.nbytes

    @property
    def size(self) -> int:
        """Entries appended and not yet merged."""
        return self.next - self.merged

    # writer thread -------------------------------------------------------------------
    def append(self, tabs: np.ndarray, rows: np.ndarray, payload: np.ndarray) -> int:
        """Append rows (distinct keys: table indexes, row ids, payloads [n, width]) in one
        transaction (one per `capacity` rows when the batch is larger than the log).

        Returns bytes appended. Entries go table by table; a key's newer version always gets a
        larger sequence number than its older ones, which is all the log's order must keep.
        """
        n = len(rows)
        if n == 0:
            return 0
        if n > self.capacity:  # a batch larger than the whole log (a small `write_log`): in
            # parts, so sequence numbers never wrap past an entry still in the log and its index
            cap = self.capacity
            return sum(self.append(tabs[lo : lo + cap], rows[lo : lo + cap], payload[lo : lo + cap])
                       for lo in range(0, n, cap))
        if self.size + n > self.capacity:
            self.merge(self.size + n - self.capacity + self.capacity // 2)
        order, keys, vals, chunks = [], [], [], []
        seq = self.next
        widths = self.widths[tabs]
        sizes = np.unique(widths)
        for w in sizes.tolist():  # one entry size per row width (usually one for all tables)
            one = len(sizes) == 1  # the usual case: no row selection, no gathered copies
            sel = np.arange(n) if one else np.flatnonzero(widths == w)
            r = np.ascontiguousarray(rows if one else rows[sel], dtype=np.int64)
            ent = np.empty((len(sel), HEADER // 4 + w + 1), dtype=np.uint32)  # header | words | check
            ent[:, 0] = self.ids[tabs if one else tabs[sel]]
            ent[:, 1] = 0
            ent[:, 2:4] = r.view(np.uint32).reshape(-1, 2)
            ent[:, 4 : 4 + w] = (payload[:, :w] if one else payload[sel, :w]).view(np.uint32)
            ent[:, 4 + w] = row_checks(r, ent[:, 4 : 4 + w])
            order.append(sel)
            size = ent.shape[1] * 4
            for lo in range(0, len(sel), CHUNK_ROWS):
                part = ent[lo : lo + CHUNK_ROWS]
                head = np.array([0, size, len(part), 0], dtype=np.uint32)
                head[0] = np.frombuffer(CHUNK_MAGIC, dtype=np.uint32)[0]
                keys.append(seq.to_bytes(8, "big"))
                vals.append(head.tobytes() + part.tobytes())
                chunks.append((seq, len(part), size))
                seq += len(part)
        order = np.concatenate(order) if len(order) > 1 else order[0]
        tabs, rows = tabs[order], rows[order]
        seqs = np.arange(self.next, self.next + n, dtype=np.int64)
        nbytes = self.backend.append_log(self.db, keys, vals)
        with self.lock:
            tt = torch.from_numpy(np.ascontiguousarray(tabs, dtype=np.int64))
            tr = torch.from_numpy(np.ascontiguousarray(rows, dtype=np.int64))
            old = self.index.find(tt, tr)
            hit = old >= 0
            if bool(hit.any()):
                self.index.remove(old[hit])
                # forget their sequence numbers too: a merge folding those older versions then
                # sees them superseded and does not remove the (absent) keys a second time
                self.seq_of[old[hit].numpy()] = -1
            slots = torch.from_numpy(seqs % self.capacity)
            self.index.add(tt, tr, slots)
            self.seq_of[slots.numpy()] = seqs
            self._chunks = np.concatenate([self._chunks, np.array(chunks, dtype=np.int64)])
            self.next += n
        self.rows_appended += n
        self.chunks_appended += len(chunks)
        return nbytes

    # the background merger ------------------------------------------------------------
    def start_merger(self, on_written: Callable[[int], None]) -> None:
        """Start a thread that merges the older half whenever the log is 3/4 full, so the writer
        keeps appending (and the ring keeps draining) during a merge. `on_written(bytes)` is held
        weakly when it is a bound method: an abandoned store is not kept alive."""
        ref = weakref.WeakMethod(on_written) if hasattr(on_written, "__self__") else (lambda: on_written)
        self._merger = threading.Thread(target=self._merge_loop, args=(ref,), daemon=True,
                                        name="tierstore-log-merger")
        self._merger.start()

    def wants_merge(self) -> bool:
        """Whether the log is full enough for its older half to be merged."""
        return self.size >= self.capacity * 3 // 4

    def request_merge(self) -> None:
        """Wake the background merger (or do nothing when there is none: the caller merges)."""
        self._wake.set()

    def stop_merger(self) -> None:
        """Stop the background merger (after its current merge) and wait for it."""
        self._stop = True
        self._wake.set()
        if self._merger is not None and self._merger is not threading.current_thread():
            self._merger.join()
        self._merger = None

    def _merge_loop(self, on_written) -> None:
        while not self._stop:
            self._wake.wait(0.5)
            self._wake.clear()
            if on_written() is None:  # the store was dropped without close()
                return
            while not self._stop and self.wants_merge():
                sink = on_written()
                if sink is None:  # the store is gone
                    return
                try:
                    written = self.merge(self.capacity // 2)
                except BaseException as exc:  # kept; the writer's own merge raises it to callers
                    self.merge_error = exc
                    time.sleep(0.2)
                    break
                self.merge_error = None
                self.background_merges += 1
                sink(written)
                del sink

    def merge(self, n: int | None = None) -> int:
        """Fold the oldest whole chunks holding at least `n` log rows (all when None) into the
        tables; returns bytes written. One merge runs at a time (`merging`)."""
        with self.merging:
            return self._merge(n)

    def _merge(self, n: int | None) -> int:
        n = self.size if n is None else min(int(n), self.size)
        if n <= 0:
            return 0
        with self.lock:
            chunks = self._chunks
        take = int(np.searchsorted(np.cumsum(chunks[:, 1]), n)) + 1  # whole chunks
        chunks = chunks[:take]
        if int(chunks[0, 0]) != self.merged:
            raise StoreCorruptError(f"write-behind log of {self.backend.path}: chunk at "
                                    f"{int(chunks[0, 0])}, expected {self.merged}")
        hi = int(chunks[-1, 0] + chunks[-1, 1])

        def newest(tabs, rows, seqs):  # an older version was superseded by a later entry
            slots = np.empty(len(rows), dtype=np.int64)
            keep = np.empty(len(rows), dtype=bool)
            for lo in range(0, len(rows), FIND_ROWS):  # the ring's lock, in short holds
                s = slice(lo, lo + FIND_ROWS)
                with self.lock:
                    slots[s] = self.index.find(torch.from_numpy(tabs[s]), torch.from_numpy(rows[s])).numpy()
                    keep[s] = (slots[s] >= 0) & (self.seq_of[np.maximum(slots[s], 0)] == seqs[s])
            return keep, slots

        written, merged, (slots, seqs) = fold(self.backend, self.db, chunks, self.names,
                                              self.row_dims, self.ids, newest)
        record_merged(self.backend, hi - 1)  # the tables hold the log through hi - 1
        self.backend.delete_log(self.db, _seq_keys(chunks[:, 0]))
        with self.lock:
            still = self.seq_of[slots] == seqs  # not re-appended meanwhile
            if still.any():
                self.index.remove(torch.from_numpy(slots[still]))
                self.seq_of[slots[still]] = -1
            self._chunks = self._chunks[take:]
            self.merged = hi
        self.rows_merged += merged
        return written

    # readers (any thread) ------------------------------------------------------------
    def lookup(self, tab: int, rows: torch.Tensor) -> np.ndarray:
        """Sequence numbers of the rows' newest log versions (-1 where none)."""
        with self.lock:
            if self.index.live == 0:
                return np.full(rows.numel(), -1, dtype=np.int64)
            slots = self.index.find(torch.tensor(tab, dtype=torch.int64), rows).numpy()
            out = np.where(slots >= 0, self.seq_of[np.maximum(slots, 0)], -1)
        return out

    def read(self, tab: int, rows: np.ndarray, seqs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(rows [n, row_dim], found [n]) of log versions; an entry merged meanwhile is not found."""
        return self.read_entries(np.full(len(seqs), tab, dtype=np.int64), rows, seqs,
                                 self.row_dims[tab])

    def read_entries(self, tabs: np.ndarray, rows: np.ndarray, seqs: np.ndarray, width: int
                     ) -> tuple[np.ndarray, np.ndarray]:
        """Log versions of rows of any tables (table indexes, row ids, sequence numbers) in one
        pass over the chunks holding them: (rows [n, width] zero-padded, found [n]); an entry
        merged meanwhile is not found (the table has it). `width` >= the tables' row_dim."""
        n = len(seqs)
        widths = self.widths[tabs]
        out = np.zeros((n, width), dtype=np.float32)
        found = np.zeros(n, dtype=bool)
        with self.lock:
            chunks = self._chunks
        if n == 0 or len(chunks) == 0:
            return out, found
        at = np.searchsorted(chunks[:, 0], seqs, side="right") - 1
        ok = (at >= 0) & (seqs < chunks[np.maximum(at, 0), 0] + chunks[np.maximum(at, 0), 1])
        want, used, bounds = _by_chunk(at, np.flatnonzero(ok))
        sizes = HEADER + 4 * widths + 4  # each entry's size in its table's format
        entries = np.zeros((n, int(sizes.max())), dtype=np.uint8)
        got_size = np.zeros(n, dtype=np.int64)

        def pick(vals):  # inside the read transaction: copy just the wanted entries out
            for j, (c, v) in enumerate(zip(used.tolist(), vals)):
                if v is None:  # merged meanwhile: the table has it
                    continue
                mine = want[bounds[j] : bounds[j + 1]]
                size = int(chunks[c, 2])
                blob = _chunk_entries(v, int(chunks[c, 1]), size, self.backend.path)
                entries[mine, :size] = blob[seqs[mine] - chunks[c, 0]]
                got_size[mine] = size
                found[mine] = True

        if len(used):
            self.backend.log_chunks(self.db, _seq_keys(chunks[used, 0]), pick)
        if not found.any():
            return out, found
        hit = np.flatnonzero(found)
        blob, t = entries[hit], tabs[hit]
        bad = np.flatnonzero((got_size[hit] != sizes[hit])
                             | (blob[:, :4].copy().view(np.uint32).ravel() != self.ids[t])
                             | (blob[:, 8:16].copy().view("<i8").ravel() != rows[hit]))
        if bad.size:
            raise StoreCorruptError(f"write-behind log of {self.backend.path}: an entry does not "
                                    f"hold the row its index names (table {self.names[t[bad[0]]]!r})")
        for tab in np.unique(t).tolist():  # verify and decode each table's records
            sel = hit[t == tab]
            w = self.row_dims[tab]
            out[sel, :w] = open_records(self.names[tab], rows[sel],
                                        entries[sel, HEADER : HEADER + 4 * w + 4], w,
                                        f"store {self.backend.path}, ")
        return out, found


def _by_chunk(at: np.ndarray, sel: np.ndarray) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """Entries `sel` grouped by their chunk `at[sel]` with one sort: (sel in chunk order, the
    chunks used, bounds), so chunk `used[j]` holds `sel[bounds[j] : bounds[j + 1]]`."""
    sel = sel[np.argsort(at[sel], kind="stable")]
    used, starts = np.unique(at[sel], return_index=True)
    return sel, used, np.append(starts, len(sel)).tolist()


def _chunk_count(val) -> int:
    """Rows in a log value: a chunk's count, or 1 for a one-row value of an older log."""
    head = bytes(val[:CHUNK_HEADER])
    if head[:4] == CHUNK_MAGIC and len(head) == CHUNK_HEADER:
        return int.from_bytes(head[8:12], "little")
    return 1


def _chunk_entries(val, count: int, size: int, path: object) -> np.ndarray:
    """A chunk's entries, uint8 [count, size] (a view of `val`), checked against its header."""
    if val is None:
        raise StoreCorruptError(f"write-behind log of {path}: a chunk is missing")
    arr = np.frombuffer(val, dtype=np.uint8)
    head = arr[:CHUNK_HEADER].tobytes()
    if head[:4] != CHUNK_MAGIC or int.from_bytes(head[4:8], "little") != size or \
            int.from_bytes(head[8:12], "little") != count or len(arr) != CHUNK_HEADER + count * size:
        raise StoreCorruptError(f"write-behind log of {path}: a chunk's header does not match "
                                f"its size (damaged log)")
    return arr[CHUNK_HEADER:].reshape(count, size)


def parse_entries(vals: list, ids: np.ndarray, row_dims: list[int], path: object):
    """Group log values by size: yields (positions, table indexes, row ids, records uint8 [k, 4w+4])."""
    if not vals:
        return
    lens = np.fromiter(map(len, vals), dtype=np.int64, count=len(vals))
    arr = np.empty(len(vals), dtype=object)
    arr[:] = vals
    for size in np.unique(lens).tolist():
        sel = np.flatnonzero(lens == size)
        blob = np.frombuffer(b"".join(arr[sel].tolist()), dtype=np.uint8).reshape(len(sel), size)
        yield parse_blob(sel, blob, ids, row_dims, path)


def parse_blob(sel: np.ndarray, blob: np.ndarray, ids: np.ndarray, row_dims: list[int], path: object):
    """Log entries of one size (uint8 [k, size]) at log positions `sel`: (positions, table
    indexes, row ids, records uint8 [k, 4w+4]); StoreCorruptError for an unknown table or size."""
    size = blob.shape[1]
    order = np.argsort(ids)
    widths = np.array([HEADER + 4 * w + 4 for w in row_dims])
    tid = blob[:, 0:4].copy().view(np.uint32).ravel()
    pos = np.searchsorted(ids[order], tid)
    pos[pos >= len(ids)] = 0
    tabs = order[pos]
    if len(ids) == 0 or (ids[tabs] != tid).any() or (widths[tabs] != size).any():
        raise StoreCorruptError(f"write-behind log of {path}: an entry of an unknown table or "
                                "with the wrong size")
    rows = blob[:, 8:16].copy().view("<i8").ravel()
    # records as uint32 words: picking rows of them copies words, not single bytes
    return sel, tabs.astype(np.int64), rows, blob.view(np.uint32)[:, HEADER // 4 :]


def fold(backend, db, chunks: np.ndarray, names: list[str], row_dims: list[int], ids: np.ndarray,
         newest: Callable, env=None) -> tuple[int, int, tuple[np.ndarray, np.ndarray]]:
    """Write the newest versions held by these log chunks (first, count, entry size) into the
    tables, in key order; returns (bytes written, rows written, what `newest` gave for them).

    The whole merge is sorted by (table, row) before anything is written, so each leaf page of a
    table is rewritten once per merge however many of its rows the merge holds; the records are
    gathered from the mapped chunks in pieces of at most `MERGE_ROWS` rows of one table, so the
    merge's memory is its keys (~40 bytes a row) plus one piece. `newest(tabs, rows, seqs)` gives
    (mask of the entries to write, a per-entry value returned with those entries). `env` is the
    environment holding `db` (None: the log's own; the tables' for a log of format 2).
    """
    keys = _seq_keys(chunks[:, 0])
    path = backend.path

    def headers(vals):  # table, row and sequence number of every entry: headers only
        out = []
        for v, (first, count, size) in zip(vals, chunks.tolist()):
            blob = _chunk_entries(v, count, size, path)
            _, tabs, rows, _ = parse_blob(None, blob, ids, row_dims, path)
            out.append((tabs, rows, np.arange(first, first + count, dtype=np.int64)))
        return [np.concatenate(c) for c in zip(*out)]

    tabs, rows, seqs = backend.log_chunks(db, keys, headers, env)
    keep, extra = newest(tabs, rows, seqs)
    sel = np.flatnonzero(keep)
    # key order: by table, then row (row ids are < 2**63; one argsort per table present)
    by_tab = sel[np.argsort(tabs[sel], kind="stable")]
    tcuts = np.flatnonzero(np.diff(tabs[by_tab])) + 1
    order = np.concatenate([part[np.argsort(rows[part])] for part in np.split(by_tab, tcuts)]) \
        if len(by_tab) else by_tab
    cuts = np.flatnonzero(np.diff(tabs[order])) + 1  # one table per piece, then MERGE_ROWS each
    # no edges when every entry was superseded by a later one: nothing to write
    edges = np.concatenate([[0], cuts, [len(order)]]).tolist() if len(order) else []
    written = 0
    for lo, end in zip(edges[:-1], edges[1:]):
        t = int(tabs[order[lo]])
        for a in range(lo, end, MERGE_ROWS):
            part = order[a : min(a + MERGE_ROWS, end)]
            recs = _gather(backend, db, chunks, seqs[part], HEADER + 4 * row_dims[t] + 4, path, env)
            open_records(names[t], rows[part], recs, row_dims[t], f"store {path}, ")  # verified
            written += backend.put({names[t]: (rows[part], recs)}, sealed=True)
    return written, len(sel), (extra[sel], seqs[sel])


def _gather(backend, db, chunks: np.ndarray, seqs: np.ndarray, size: int, path: object,
            env=None) -> np.ndarray:
    """Records (uint8 [n, size - HEADER]) of log entries by sequence number, copied out of the map."""
    at = np.searchsorted(chunks[:, 0], seqs, side="right") - 1
    by, used, bounds = _by_chunk(at, np.arange(len(seqs)))
    out = np.empty((len(seqs), size - HEADER), dtype=np.uint8)

    def copy(vals):
        for i, (c, v) in enumerate(zip(used.tolist(), vals)):
            blob = _chunk_entries(v, int(chunks[c, 1]), int(chunks[c, 2]), path)
            if blob.shape[1] != size:
                raise StoreCorruptError(f"write-behind log of {path}: an entry has the wrong size")
            mine = by[bounds[i] : bounds[i + 1]]
            out[mine] = blob[seqs[mine] - chunks[c, 0], HEADER:]

    backend.log_chunks(db, _seq_keys(chunks[used, 0]), copy, env)
    return out


def merged_through(backend) -> int:
    """The last sequence number the tables hold the log through (-1 when none was recorded)."""
    rec = backend.get_meta(MERGED_KEY) or {}
    value = rec.get("merged_through", -1)
    if isinstance(value, bool) or not isinstance(value, int) or value < -1:
        raise StoreCorruptError(f"store {backend.path}: metadata record {MERGED_KEY!r} is damaged")
    return value


def store_identity(backend) -> str | None:
    """The store's identity, which its log carries too (None for a store that never had one)."""
    value = (backend.get_meta(MERGED_KEY) or {}).get("store")
    if value is not None and not (isinstance(value, str) and len(value) == 32
                                  and all(c in "0123456789abcdef" for c in value)):
        raise StoreCorruptError(f"store {backend.path}: metadata record {MERGED_KEY!r} is damaged")
    return value


def record_merged(backend, last: int) -> None:
    """Record in the tables' environment that they hold the log through sequence number `last`."""
    rec = {"merged_through": int(last)}
    owner = store_identity(backend)
    if owner is not None:
        rec["store"] = owner
    backend.put_meta({MERGED_KEY: rec})


def _own_log(backend) -> str:
    """Give the store an identity if it has none (stores made before identities) and write it
    into the log's environment, so a replay can tell its log from another store's."""
    owner = store_identity(backend)
    if owner is None:
        owner = uuid.uuid4().hex
        backend.put_meta({MERGED_KEY: {"merged_through": merged_through(backend), "store": owner}})
    if backend.log_owner() != owner:
        backend.set_log_owner(owner)
    return owner


def replay(backend, names: list[str], row_dims: list[int]) -> int:
    """Merge a log left by an earlier run into the tables (the newest version of each row wins).

    Returns the rows written. First a log in the tables' own environment (format 2), then the
    log's environment: its entries past the tables' `merged_through` record are folded in, the
    record moves to the log's last entry, the tables are synced and only then are the log's
    files removed, so a crash at any point replays again.
    """
    ids = np.array([table_id(n) for n in names], dtype=np.uint32)
    total = _replay_legacy(backend, names, row_dims, ids)
    db = backend.log_db(LOG_DB, create=False)
    if db is None:
        backend.drop_log_env()
        return total
    done = merged_through(backend)
    owner, mine = backend.log_owner(), store_identity(backend)
    if owner is not None and mine is not None and owner != mine:
        raise StoreCorruptError(f"write-behind log of {backend.path}: it belongs to another store "
                                f"(store {owner}; these tables are store {mine})"
                                f"{DROP_HINT.format(backend.log_path)}")
    chunks = _chunk_table(backend, backend.log_env(), db)
    if chunks is None:
        raise StoreCorruptError(f"write-behind log of {backend.path}: a value is not a chunk "
                                "(damaged log)")
    chunks = chunks[chunks[:, 0] + chunks[:, 1] - 1 > done]  # wholly merged: skipped
    _check_continues(backend, chunks, done)
    if len(chunks):
        _, rows, _ = fold(backend, db, chunks, names, row_dims, ids,
                          lambda tabs, rows, seqs: (_last_versions(tabs, rows, seqs) & (seqs > done),
                                                    seqs))
        total += rows
        record_merged(backend, int(chunks[-1, 0] + chunks[-1, 1] - 1))
        backend.sync()
    backend.drop_log_env()
    return total


def _check_continues(backend, chunks: np.ndarray, done: int) -> None:
    """StoreCorruptError unless the log's chunks past `done` are contiguous and continue the tables.

    A merge records its last sequence number in the tables before it deletes its chunks, so
    the unmerged part of a consistent pair's log starts at or below `done + 1` (chunks wholly at
    or below `done` are left out: a log whose removal failed after a replay keeps them, and new
    entries then start at `done + 1`). A log starting past it was
    merged into a tables file that is not this one: data.mdb was put back from an older copy,
    or an OS crash lost the tables' writes since their last sync but not the log's deletes.
    Replaying it would mix two states, missing the rows merged in between.
    """
    if not len(chunks):
        return
    where = f"write-behind log of {backend.path}"
    hint = DROP_HINT.format(backend.log_path)
    ends = chunks[:, 0] + chunks[:, 1]
    gap = np.flatnonzero(chunks[1:, 0] != ends[:-1])
    if gap.size:
        raise StoreCorruptError(f"{where}: entries {int(ends[gap[0]])} to "
                                f"{int(chunks[gap[0] + 1, 0]) - 1} are missing (damaged log){hint}")
    if int(chunks[0, 0]) > done + 1:
        raise StoreCorruptError(
            f"{where}: it starts at entry {int(chunks[0, 0])}, but the tables hold the log only "
            f"through entry {done}: the entries in between were merged into another tables "
            f"file (data.mdb replaced by an older copy, or its writes lost in an OS crash){hint}")


def replay_stored(backend) -> int:
    """`replay` for a store opened without its specs (export, offline compaction, upgrade): the
    tables' names and row sizes come from its metadata. Returns the rows written."""
    specs = [TableSpec.from_config(backend.get_meta(k)) for k in backend.meta_keys()
             if k.startswith("table:")]
    return replay(backend, [t.name for t in specs], [t.row_dim for t in specs])


def _replay_legacy(backend, names: list[str], row_dims: list[int], ids: np.ndarray) -> int:
    """Merge and drop a log kept in the tables' environment (format 2); rows written."""
    try:
        db = backend.open_named(LOG_DB, create=False)
    except lmdb.NotFoundError:
        return 0
    chunks = _chunk_table(backend, backend.env, db)
    total = 0
    if chunks is None:  # one-row values of logs written before chunks
        total = _replay_values(backend, db, names, row_dims, ids)
    elif len(chunks):  # chunks: merged like a log in use
        _, total, _ = fold(backend, db, chunks, names, row_dims, ids,
                           lambda tabs, rows, seqs: (_last_versions(tabs, rows, seqs), seqs),
                           env=backend.env)
    with backend.env.begin(write=True) as txn:
        txn.drop(db, delete=True)
    backend.sync()
    return total


def _chunk_table(backend, env, db) -> np.ndarray | None:
    """(first sequence number, row count, entry size) of every chunk of a log database, in key
    order, from their headers; None when a value is not a chunk."""
    with backend.reading(), env.begin(db=db, buffers=True) as txn:
        heads = [(int.from_bytes(k, "big"), bytes(v[:CHUNK_HEADER]))
                 for k, v in txn.cursor().iternext(keys=True, values=True)]
    if any(h[:4] != CHUNK_MAGIC or len(h) != CHUNK_HEADER for _, h in heads):
        return None
    return np.array([(k, int.from_bytes(h[8:12], "little"), int.from_bytes(h[4:8], "little"))
                     for k, h in heads], dtype=np.int64).reshape(-1, 3)


def _replay_values(backend, db, names: list[str], row_dims: list[int], ids: np.ndarray) -> int:
    """Write the newest rows of a log holding one-row values (written before chunks); rows written."""
    with backend.reading(), backend.env.begin(db=db) as txn:
        vals = []  # one bytes per row, in log order (chunks expanded)
        for v in txn.cursor().iternext(keys=False, values=True):
            v = bytes(v)
            if v[:4] == CHUNK_MAGIC:
                size, count = int.from_bytes(v[4:8], "little"), int.from_bytes(v[8:12], "little")
                blob = _chunk_entries(v, count, size, backend.path)
                vals += blob.view(f"V{size}").ravel().tolist()
            else:  # a one-row value (logs written before chunks)
                vals.append(v)
    keyed = list(parse_entries(vals, ids, row_dims, backend.path))
    keep = np.zeros(len(vals), dtype=bool)  # by log position
    keep[np.concatenate([k[0] for k in keyed])] = _last_versions(
        *(np.concatenate([k[i] for k in keyed]) for i in (1, 2, 0)))
    batches = {}
    total = 0
    for sel, t_, r_, recs in keyed:
        mask = keep[sel]
        for t in np.unique(t_[mask]).tolist():
            pick = mask & (t_ == t)
            data = open_records(names[t], r_[pick], recs[pick], row_dims[t], f"store {backend.path}, ")
            prev = batches.get(names[t])
            batches[names[t]] = (r_[pick], data) if prev is None else \
                (np.concatenate([prev[0], r_[pick]]), np.concatenate([prev[1], data]))
            total += int(pick.sum())
    backend.put(batches)
    return total


def _last_versions(tabs: np.ndarray, rows: np.ndarray, seqs: np.ndarray) -> np.ndarray:
    """Mask of the entries that are the last (largest sequence number) of their (table, row)."""
    order = np.lexsort((seqs, rows, tabs))
    last = np.ones(len(order), dtype=bool)
    last[:-1] = (tabs[order][1:] != tabs[order][:-1]) | (rows[order][1:] != rows[order][:-1])
    keep = np.zeros(len(order), dtype=bool)
    keep[order[last]] = True
    return keep
