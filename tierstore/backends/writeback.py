"""Write-behind: dirty rows leaving the caches wait in a bounded ring while a thread writes them to LMDB.

The ring holds `capacity` rows. `put` appends rows at the tail (the training thread, under the
store lock) and waits only when the ring is full of rows not yet written; a background writer
takes rows from the head in large batches, sorts them by key and writes them to LMDB outside
any store lock. A row keeps its ring slot after it is written, until the ring wraps around and
needs the slot, so the ring is also a small cache of recently evicted rows.

One truth per row: the hash index maps a (table, row) key to the slot of its *newest* version in
the ring. A newer `put` of the same key supersedes the older slot (which the writer then skips),
and a key leaves the index only when its slot is reused, which happens after the writer
committed it. So a reader that finds a key in the ring gets its newest value, and a reader that
does not will find the key's newest value in LMDB.

Positions are monotonic counters: `tail` (next position to fill) and `head` (positions below it
are committed). A row written to the ring at or after position p is still in the ring while
`tail < p + capacity`; the read-ahead buffers of the prefetch pipeline use this to know that
rows they read from LMDB earlier are still current (see `still_current`).
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable

import numpy as np
import torch

from ..errors import StoreClosedError, TierstoreError
from ..index import HashIndex
from .slab import Rows

WRITE_CHUNK = 65536  # rows per writer batch: big sorted batches share LMDB leaf pages
_RETRY_S = 0.2


class WriteBehind:
    """A bounded ring of rows waiting for (or just past) their write to LMDB, and its writer thread."""

    def __init__(self, capacity: int, width: int, write: Callable[[np.ndarray, np.ndarray, np.ndarray], int],
                 *, chunk: int = WRITE_CHUNK, name: str = "tierstore-writer",
                 delay: Callable[[], float] | None = None) -> None:
        self.capacity = max(1, int(capacity))
        self.width = width
        # (tabs, rows, payload) -> bytes written; raises TierstoreError. A bound method is held
        # weakly: the writer thread must not keep an abandoned store (and its slabs) alive
        self._write = weakref.WeakMethod(write) if hasattr(write, "__self__") else (lambda: write)
        self.chunk = max(1, int(chunk))
        self.delay = delay  # test hook: seconds the writer sleeps before each batch
        self.payload = torch.zeros((self.capacity, width), dtype=torch.float32)
        self._tabs = np.zeros(self.capacity, dtype=np.int64)
        self._rows = np.zeros(self.capacity, dtype=np.int64)
        self.index = HashIndex(self.capacity)
        self.tail = 0  # next position to fill
        self.head = 0  # positions below are committed to LMDB
        self._floor = 0  # rows put before this position may have left the ring early (`_grow`)
        self.error: BaseException | None = None
        self.trying = False  # the writer is writing a batch (or retrying one) now
        self.cv = threading.Condition()
        self._stop = False
        # counters (read by stats)
        self.rows_in = 0
        self.rows_written = 0
        self.rows_superseded = 0
        self.bytes_written = 0
        self.batches = 0
        self.writer_seconds = 0.0
        self.wait_seconds = 0.0  # time callers waited for room
        self.hits = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # producer side (callers hold the store lock) ----------------------------------------
    @property
    def pending(self) -> int:
        """Rows in the ring not yet committed to LMDB."""
        return self.tail - self.head

    def put(self, rows: Rows) -> None:
        """Append rows (distinct keys, CPU) to the ring; waits while it is full of unwritten rows."""
        n = len(rows)
        off = 0
        while off < n:
            with self.cv:
                k = self._wait_room(n - off)
                part = rows.take(slice(off, off + k)) if (off or k < n) else rows
                self._append(part)
                self.cv.notify_all()
            off += k

    def _wait_room(self, want: int) -> int:
        """Wait (lock held) until at least one slot is free; returns how many of `want` fit."""
        self._wait_for(1, patience=2 * _RETRY_S)
        return min(want, self.capacity - (self.tail - self.head))

    def _wait_for(self, room: int, patience: float) -> None:
        """Wait (lock held) for `room` free slots; raise the writer's error once it has failed for
        `patience` seconds of this wait (0: at once), or StoreClosedError when it stopped."""
        t0 = None
        while self.capacity - (self.tail - self.head) < room:
            if self._stop:
                raise StoreClosedError("the write-behind writer has stopped")
            now = time.perf_counter()
            if self.error is not None and now - (t0 or now) >= patience:
                raise self._failure()
            t0 = t0 or now
            self.cv.wait(0.05)
        if t0 is not None:
            self.wait_seconds += time.perf_counter() - t0

    def _append(self, part: Rows) -> None:
        k = len(part)
        tabs, rows = part.tabs.reshape(-1).contiguous(), part.rows.contiguous()
        lo = self.tail % self.capacity
        slots = torch.from_numpy(np.arange(lo, lo + k, dtype=np.int64) % self.capacity)
        # one pass: a reused slot (committed, tail - capacity < head) forgets its key, and a key
        # with an older ring version moves to its new slot (the newest version wins; the writer
        # skips slots that no longer hold a key)
        self.index.assign(tabs, rows, slots)
        # the slots are at most two runs of the ring (it wraps once): plain copies
        first = min(k, self.capacity - lo)
        for dst, src in ((slice(lo, lo + first), slice(0, first)), (slice(0, k - first), slice(first, k))):
            if src.stop > src.start:
                self._tabs[dst] = tabs.numpy()[src]
                self._rows[dst] = rows.numpy()[src]
                self.payload[dst] = part.payload[src]
        self.tail += k
        self.rows_in += k

    def reserve(self, n: int) -> None:
        """Wait for room for `n` more rows before a call changes anything.

        Raises the writer's error instead when it cannot write, so a call that could not hand its
        evicted rows to the ring fails before it moves any row. A call that may hand over more
        rows than the ring holds first waits until every row is written, then grows the ring to
        hold them (issue 38: a put that outgrew the ring waited on the writer mid-call, and a
        writer failure then left the call half done, its victims in no tier).
        """
        n = int(n)
        with self.cv:
            if n > self.capacity:
                self._wait_for(self.capacity, patience=2 * _RETRY_S)  # all written: writer idle
                self._grow(n)
            self._wait_for(n, patience=2 * _RETRY_S)  # (the writer retries every _RETRY_S)

    def _grow(self, n: int) -> None:
        """Make room for `n` rows (lock held, every row committed: no unlocked copy in flight).

        The ring's written rows are dropped (LMDB and the log hold them); `still_current` is
        False for read-ahead buffers read before now, as rows put since left the ring."""
        cap = 1 << (n - 1).bit_length()
        self.capacity = cap
        self.payload = torch.zeros((cap, self.width), dtype=torch.float32)
        self._tabs = np.zeros(cap, dtype=np.int64)
        self._rows = np.zeros(cap, dtype=np.int64)
        self.index = HashIndex(cap)
        self.head = self.tail
        self._floor = self.tail

    def lookup(self, tab: int, rows: torch.Tensor, count: bool = True
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """(hit mask [n], payloads [hits, width]) of the rows' newest ring versions (copies)."""
        with self.cv:
            slots = self.index.find(torch.tensor(tab, dtype=torch.int64), rows)
            hit = slots >= 0
            data = self.payload.index_select(0, slots[hit]) if bool(hit.any()) else self.payload[:0]
        if count:
            self.hits += int(data.shape[0])
        return hit, data

    def gather_into(self, tab: int, rows: np.ndarray, data: np.ndarray, found: np.ndarray,
                    known: np.ndarray) -> int:
        """`lookup` writing straight into a loader's arrays: each row the ring holds gets its
        newest version's first `data.shape[1]` columns, and `found`/`known` set; returns how
        many (counted as ring hits). With the index's kernels, one compiled pass."""
        if not self.index.fast(self.payload):
            hit, got = self.lookup(tab, torch.from_numpy(rows))
            if got.shape[0]:
                h = hit.numpy()
                data[h] = got[:, : data.shape[1]].numpy()
                found |= h
                known |= h
            return int(got.shape[0])
        with self.cv:
            k = self.index.gather(int(tab), rows, self.payload.numpy(), data, found, known)
        self.hits += int(k)
        return int(k)

    def contains(self, tab: int, rows: torch.Tensor) -> torch.Tensor:
        """Mask of the rows that have a version in the ring."""
        with self.cv:
            return self.index.find(torch.tensor(tab, dtype=torch.int64), rows) >= 0

    def still_current(self, since_tail: int) -> bool:
        """Whether every row put at or after position `since_tail` is still in the ring."""
        return since_tail >= self._floor and self.tail - since_tail < self.capacity

    def drain(self, timeout: float | None = None) -> None:
        """Wait until every row put so far is committed; raises the writer's error if it cannot write."""
        with self.cv:
            target = self.tail
            t0 = time.perf_counter()
            while self.head < target:
                # the writer's last error, unless a retry is under way (a slow one, a merge, may
                # succeed: raising its stale error would fail a flush that is about to work)
                if self.error is not None and not self.trying and time.perf_counter() - t0 > 2 * _RETRY_S:
                    raise self._failure()
                if self._stop or not self._thread.is_alive():
                    raise StoreClosedError("the write-behind writer has stopped")
                if timeout is not None and time.perf_counter() - t0 > timeout:
                    raise TierstoreError(f"write-behind drain timed out after {timeout} s")
                self.cv.wait(0.05)

    def raise_if_failed(self) -> None:
        """Raise the writer's last error while it cannot write (rows stay in the ring, retried)."""
        if self.error is not None:
            raise self._failure()

    def _failure(self) -> TierstoreError:
        err = self.error
        if isinstance(err, TierstoreError):
            return type(err)(f"{err} ({self.pending} written-back rows are kept in memory and "
                             f"retried; free space or raise map_limit, then call flush())")
        return TierstoreError(f"the write-behind writer failed: {err!r}")

    def close(self) -> None:
        """Stop the writer thread (after `drain()` for a clean close; rows still pending are dropped)."""
        with self.cv:
            self._stop = True
            self.cv.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join()

    # writer thread ----------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self.cv:
                while self.head == self.tail and not self._stop:
                    self.cv.wait()
                if self._stop:
                    return
                lo, hi = self.head, min(self.tail, self.head + self.chunk)
                self.trying = True  # a write (or a retry) is under way: its outcome is pending
                slots = np.arange(lo, hi, dtype=np.int64) % self.capacity
                live = slots[self.index.held(torch.from_numpy(slots)).numpy()]  # skips superseded
                tabs, rows = self._tabs[live], self._rows[live]
            if self.delay is not None:
                time.sleep(self.delay())
            t0 = time.perf_counter()
            try:
                # slots in [head, tail) are never refilled before head passes them: copy unlocked
                payload = self.payload.index_select(0, torch.from_numpy(live)).numpy()
                sink = self._write()
                if sink is None:  # the store is gone (garbage-collected without close)
                    return
                written = sink(tabs, rows, payload) if len(live) else 0
                sink = None  # not kept while idle: an abandoned store must stay collectable
            except BaseException as exc:  # kept; callers see it; the batch is retried
                with self.cv:
                    self.error = exc
                    self.trying = False
                    self.cv.notify_all()
                time.sleep(_RETRY_S)
                continue
            with self.cv:
                self.head = hi
                self.error = None
                self.trying = False
                self.rows_written += len(live)
                self.rows_superseded += (hi - lo) - len(live)
                self.bytes_written += written
                self.batches += 1
                self.writer_seconds += time.perf_counter() - t0
                self.cv.notify_all()

    def stats(self) -> dict:
        """Counters of the ring and its writer."""
        return {"capacity": self.capacity, "pending": self.pending, "rows_in": self.rows_in,
                "rows_written": self.rows_written, "rows_superseded": self.rows_superseded,
                "bytes_written": self.bytes_written, "batches": self.batches,
                "writer_seconds": self.writer_seconds, "wait_seconds": self.wait_seconds,
                "hits": self.hits}
