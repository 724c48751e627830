"""`WriteLog`: appends to the log, its in-memory index, reads of it, and the background merger."""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable

import numpy as np
import torch

from ...errors import StoreCorruptError, TierstoreError
from ...index import HashIndex
from ..chunk_kernels import HAVE_NUMBA, pack_log
from ..lmdb_log import LOG_DB
from ..record import open_records, row_checks
from . import budget
from .budget import DiskShape, log_bound, merge_start, table_bytes
from .chunks import (
    CHUNK_MAGIC,
    HEADER,
    _by_chunk,
    _chunk_count,
    _chunk_entries,
    _seq_keys,
    table_id,
)
from .marks import merged_through, own_log, record_merged
from .merge import fold

if HAVE_NUMBA:
    from ..chunk_kernels import pick_chunks, pick_entries

CHUNK_ROWS = 4096  # rows per log value: ~1.1 MB of 66-word rows, a few hundred overflow pages
FIND_ROWS = 16384  # log index lookups per hold of the ring's lock during a merge (a few ms)
CHUNK_LOG_MIN = 1 << 17  # chunked tables: the least bound of the log (`budget.log_bound`)

_MAGIC = np.frombuffer(CHUNK_MAGIC, dtype=np.uint8)  # a chunk's first 4 bytes (compiled pick)
_MAGIC_WORD = int(_MAGIC.view(np.uint32)[0])  # the same as one word (compiled append)


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
        self._packed = np.zeros(0, dtype=np.uint32)  # the append's chunk buffer, kept (no faults)
        self.lock = lock  # the write-behind ring's condition: guards the index
        # next sequence number: past the log's end and past every number merged before
        self.next = max(self._last(), merged_through(backend)) + 1
        self.owner = own_log(backend)
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
        # a snapshot's hold (`freeze`): no merge takes an entry at or past this sequence number
        self._ceiling: int | None = None
        self._thawed = threading.Event()
        self._thawed.set()
        self.background_merges = 0
        self.merges = 0  # merges that took rows (background, inline, flushes)
        self.rows_merged = 0
        self.merge_seconds = 0.0  # wall seconds in merges
        self.merge_cpu = 0.0  # CPU seconds of the threads that merged (`time.thread_time`)
        # chunked tables (format 4): the log is bounded by the disk budget (`bound`, budget.py):
        # an append past the bound merges the whole log first, inline (a flush hands the caches'
        # dirty rows down at once), and the background merge takes the whole log 1/5 below it
        # (a format-4 store whose tables are all too wide for chunks keeps the B-trees' rules)
        self._chunked = any(backend.is_chunked(n) for n in names)

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
        full = self.full_at()
        while self.size and self.size + n > full:  # full: merge, unless a merge running now frees room
            with self.merging:
                if self.size + n > full:
                    self._merge(self.size if self._chunked else
                                self.size + n - self.capacity + self.capacity // 2)
            if self.size + n > full:  # a snapshot holds the merges back: wait for it
                self._thawed.wait(0.05)
                full = max(full, self.full_at())
        seq = self.next
        widths = self.widths[tabs]
        if HAVE_NUMBA and int(widths.min()) == int(widths.max()):  # one pass: entries and checks
            keys, vals, chunks = self._pack(tabs, rows, payload, int(widths[0]), seq)
            nbytes = self.backend.append_log(self.db, keys, vals)
            return self._appended(tabs, rows, chunks, nbytes)
        order, keys, vals, chunks = [], [], [], []
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
                head[0] = _MAGIC_WORD
                keys.append(seq.to_bytes(8, "big"))
                vals.append(head.tobytes() + part.tobytes())
                chunks.append((seq, len(part), size))
                seq += len(part)
        order = np.concatenate(order) if len(order) > 1 else order[0]
        nbytes = self.backend.append_log(self.db, keys, vals)
        return self._appended(tabs[order], rows[order], chunks, nbytes)

    def _pack(self, tabs: np.ndarray, rows: np.ndarray, payload: np.ndarray, w: int, seq: int
              ) -> tuple[list[bytes], list[memoryview], list[tuple[int, int, int]]]:
        """Chunk keys, values and (first, count, entry size) of rows of one width, built by the
        compiled `pack_log` into one buffer kept between appends (the values are views of it: no
        further copy; LMDB has copied them when `append_log` returns)."""
        n = len(rows)
        ew = HEADER // 4 + w + 1
        size = 4 * (-(-n // CHUNK_ROWS)) + n * ew
        if len(self._packed) < size:  # LMDB copies the values: the buffer is reused, its pages
            self._packed = np.empty(size, dtype=np.uint32)  # faulted in once, not every batch
        out = self._packed[:size]
        words = payload.view(np.uint32) if payload.dtype == np.float32 else \
            np.ascontiguousarray(payload, dtype=np.float32).view(np.uint32)
        pack_log(self.ids[tabs].astype(np.uint32), np.ascontiguousarray(rows, dtype=np.int64),
                 words, w, CHUNK_ROWS, _MAGIC_WORD, out)
        raw = out.view(np.uint8)
        keys, vals, chunks = [], [], []
        for lo in range(0, n, CHUNK_ROWS):
            count = min(CHUNK_ROWS, n - lo)
            start = 4 * (4 * (lo // CHUNK_ROWS) + lo * ew)
            keys.append((seq + lo).to_bytes(8, "big"))
            vals.append(memoryview(raw[start : start + 16 + 4 * count * ew]))
            chunks.append((seq + lo, count, 4 * ew))
        return keys, vals, chunks

    def _appended(self, tabs: np.ndarray, rows: np.ndarray, chunks: list, nbytes: int) -> int:
        """Index rows just appended (in log order: sequence numbers from `next`); returns `nbytes`."""
        n = len(rows)
        seqs = np.arange(self.next, self.next + n, dtype=np.int64)
        with self.lock:
            tt = torch.from_numpy(np.ascontiguousarray(tabs, dtype=np.int64))
            tr = torch.from_numpy(np.ascontiguousarray(rows, dtype=np.int64))
            slots = seqs % self.capacity
            old = np.empty(n, dtype=np.int64)
            # one probe a key: each moves to its new slot (a key already in the log leaves its
            # older one)
            self.index.assign(tt, tr, torch.from_numpy(slots), moved=old)
            # forget the older versions' sequence numbers too: a merge folding them then sees
            # them superseded and does not remove the (moved) keys
            self.seq_of[old[old >= 0]] = -1
            self.seq_of[slots] = seqs
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

    @property
    def merger(self) -> threading.Thread | None:
        """The background merger thread while one runs (`start_merger`), else None."""
        return self._merger

    def wants_merge(self) -> bool:
        """Whether the log is full enough for its older half to be merged (and a snapshot's
        hold leaves something to merge)."""
        ceiling = self._ceiling
        return self.size >= self.merge_at() and (ceiling is None or ceiling > self.merged)

    @property
    def stored(self) -> int | None:
        """Rows the tables store, for a store of chunked tables (their levels' counts, kept by
        every write to them, the log's merges and direct puts alike; a wide table kept as a
        B-tree counts its entries); None for B-tree stores."""
        if not self._chunked:
            return None
        backend = self.backend
        return sum(backend.chunk_level(n, d).rows() if backend.is_chunked(n) else backend.count(n)
                   for n, d in zip(self.names, self.row_dims))

    def disk_shape(self) -> DiskShape:
        """The chunked tables' disk as the log's bound sees it: rows stored, their payload bytes,
        the tables' file as the next merge leaves it (the larger of its size now and the levels'
        pages packed plus `budget.TRANSIENT_RANGES` of the largest range), and a log entry's
        bytes in the log's file (its chunks of CHUNK_ROWS entries fill whole overflow pages).
        From the levels' counts: no transaction."""
        stored = raw = pages = 0
        largest = 0.0  # bytes of the largest range
        psize = 4096
        for name, dim in zip(self.names, self.row_dims):
            if not self.backend.is_chunked(name):  # a wide table kept as a B-tree: its rows
                rows = self.backend.count(name)  # count; its pages are in the file's size
                stored += rows
                raw += rows * 4 * dim
                continue
            level = self.backend.chunk_level(name, dim)
            psize = level.reader.psize
            per_page = 2 * level.cap  # two chunk values fill a leaf page (pagechunks.VALUE_MAX)
            rows = level.rows()
            stored += rows
            raw += rows * 4 * dim
            pages += sum(-(-c // per_page) for c in level.counts)
            largest = max(largest, max(level.counts, default=0) * psize / per_page)
        entry = HEADER + 4 * max(self.row_dims) + 4
        # a full chunk: its 16-byte head and the overflow page's header, in whole pages
        entry_bytes = -(-(-(-(CHUNK_ROWS * entry + 32) // psize) * psize) // CHUNK_ROWS)
        return DiskShape(stored, raw, table_bytes(self.backend.data_bytes(), pages * psize,
                                                  int(largest)), entry_bytes)

    def bound(self) -> int:
        """The most rows the log holds before an append merges it: the capacity, or for chunked
        tables the largest log the disk budget allows (`budget.log_bound`, at least
        CHUNK_LOG_MIN rows, at most half the rows stored and the capacity)."""
        if not self._chunked:
            return self.capacity
        return log_bound(self.disk_shape(), self.capacity, CHUNK_LOG_MIN, budget.DISK_BUDGET)

    def merge_at(self) -> int:
        """The log's size that starts a background merge: 3/4 of its capacity, or for chunked
        tables 1/5 below its bound (`budget.merge_start`: room for the writer's appends while
        the merge runs)."""
        if not self._chunked:
            return self.capacity * 3 // 4
        return merge_start(self.bound())

    def full_at(self) -> int:
        """The log's size at which an append merges first (inline, on the writer): `bound`.
        For chunked tables the log's file stays within the disk budget even when a flush hands
        the caches' dirty rows down at once."""
        return self.bound()

    def merge_rows(self) -> int:
        """Rows a background merge takes: the older half of the capacity, or for chunked tables
        the whole log (so the tables' rows are about twice the merge's)."""
        return self.size if self._chunked else self.capacity // 2

    def freeze(self) -> int:
        """Hold every merge below the log's end as it is now (a snapshot's point, taken while
        nothing is appended: the ring drained under the store lock); returns that sequence
        number. The writer keeps appending past it; `merge_below` and `thaw` end the hold."""
        with self.lock:
            if self._ceiling is not None:
                raise TierstoreError("the write-behind log is already held for a snapshot")
            self._ceiling = self.next
            self._thawed.clear()
            return self._ceiling

    def merge_below(self, mark: int) -> int:
        """Merge every entry below sequence number `mark` (a `freeze` point); returns bytes written."""
        with self.merging:
            return self._merge(max(0, int(mark) - self.merged))

    def thaw(self) -> None:
        """End a snapshot's hold: merges go on past it (the background merger is woken)."""
        with self.lock:
            self._ceiling = None
            self._thawed.set()
        self._wake.set()

    def wait_thawed(self) -> None:
        """Wait until no snapshot holds the merges (a full merge must see the whole log)."""
        self._thawed.wait()

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
                    written = self.merge(self.merge_rows())
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
        tables, never past a snapshot's hold (`freeze`); returns bytes written. One merge runs
        at a time (`merging`)."""
        with self.merging:
            return self._merge(n)

    def _merge(self, n: int | None) -> int:
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            return self._merge_chunks(n)
        finally:
            self.merge_seconds += time.perf_counter() - t0
            self.merge_cpu += time.thread_time() - c0

    def _merge_chunks(self, n: int | None) -> int:
        n = self.size if n is None else min(int(n), self.size)
        with self.lock:  # the chunks and a snapshot's hold, read together (`freeze` sets it here)
            chunks, ceiling = self._chunks, self._ceiling
        if ceiling is not None:  # whole chunks end at the hold's point: none is cut
            n = min(n, ceiling - self.merged)
        if n <= 0 or not len(chunks):
            return 0
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
        record_merged(self.backend, hi - 1, self.owner)  # the tables hold the log through hi - 1
        self.backend.delete_log(self.db, _seq_keys(chunks[:, 0]))
        with self.lock:
            still = self.seq_of[slots] == seqs  # not re-appended meanwhile
            if still.any():
                self.index.remove(torch.from_numpy(slots[still]))
                self.seq_of[slots[still]] = -1
            self._chunks = self._chunks[take:]
            self.merged = hi
        self.merges += 1
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
            if HAVE_NUMBA and all(v is not None for v in vals):  # one compiled call for all
                bufs = [np.frombuffer(v, dtype=np.uint8) for v in vals]  # (views: no copy)
                addrs = np.fromiter((b.__array_interface__["data"][0] for b in bufs),
                                    dtype=np.int64, count=len(bufs))
                lens = np.fromiter(map(len, bufs), dtype=np.int64, count=len(bufs))
                head = chunks[used]
                bad = pick_chunks(addrs, lens, head[:, 1], head[:, 2], head[:, 0],
                                  np.asarray(bounds, dtype=np.int64), want, seqs, _MAGIC, entries,
                                  got_size, found)
                if bad < 0:
                    return
                vals = [None] * bad + list(vals[bad:])  # the rest one by one: raises below
            heads = chunks[used].tolist()
            for j, v in enumerate(vals):
                if v is None:  # merged meanwhile: the table has it
                    continue
                mine = want[bounds[j] : bounds[j + 1]]
                first, count, size = heads[j]
                if HAVE_NUMBA:  # one compiled call a chunk: header check and the copies
                    if not pick_entries(np.frombuffer(v, dtype=np.uint8), count, size, first,
                                        seqs, mine, _MAGIC, entries, got_size, found):
                        _chunk_entries(v, count, size, self.backend.path)  # raises: damaged
                        raise StoreCorruptError(f"write-behind log of {self.backend.path}: a "
                                                "chunk's header does not match its size")
                    continue
                blob = _chunk_entries(v, count, size, self.backend.path)
                entries[mine, :size] = blob[seqs[mine] - first]
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
