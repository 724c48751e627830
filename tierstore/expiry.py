"""Row expiry: rows whose last update is older than a number of store clock steps read as new.

Every stored row carries the store clock at its last update (format v2's stamp column). Expiry
is a per-table *cutoff*: a row stamped below its table's cutoff is expired, wherever it lives.
Cutoffs only rise, and every later update stamps the current clock (at or above any cutoff), so
the rule "stamp below the cutoff reads as missing" is permanent and needs no bookkeeping per row:

- the device and host caches drop their stale rows when a cutoff rises (`purge_caches`);
- every row coming up from below (the write-behind ring, a read-ahead buffer, the write-behind
  log or a table) passes one vectorized mask in `TierStore._load` (`Expiry.stale_mask`), so a
  stale copy waiting in the ring or the log, or written back later, can never be read again;
- the rows are then deleted from LMDB: by `expire()` at once (with the writer quiesced), for a
  `TableSpec(ttl=K)` by a background thread after the flush that made the cutoff durable.

Crash safety: cutoffs are saved by `flush()` with the clock and the admission sketches (one
flush point), and a row is deleted from LMDB only under a cutoff that is already durable, so a
kill -9 at any point reopens at a flush point where every deleted row reads as missing anyway.
"""

from __future__ import annotations

import threading
import weakref
from collections import deque
from itertools import islice
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .backends.lmdb_backend import encode_keys
from .backends.record import CHECK_BYTES
from .errors import ConfigError

if TYPE_CHECKING:  # pragma: no cover
    from .config import TableSpec
    from .store import TierStore

SCAN_CHUNK = 65536  # rows per read transaction of a scan
DELETE_CHUNK = 8192  # deletions per write transaction (the store lock is held for one)
META_KEY = "expiry"  # metadata record: {table: cutoff}
AGE_MAX = 2**31 - 1  # the clock's range (int32 stamps): no row is older


def ttl_interval(ttl: int) -> int:
    """Clock steps between automatic expiry points: the bound on how late a row expires."""
    return max(1, ttl // 8)


def check_older_than(older_than: Any) -> int:
    """Validate an expiry age in clock steps."""
    if (isinstance(older_than, bool) or not isinstance(older_than, int) or older_than < 0
            or older_than > AGE_MAX):
        raise ConfigError(
            f"older_than must be an int in [0, {AGE_MAX}] (clock steps), got {older_than!r}")
    return older_than


def _stamps(block: np.ndarray, spec: TableSpec) -> np.ndarray:
    """The int32 stamps of stored records [k, record bytes] (uint8)."""
    col = spec.stamp_col * 4
    return np.ascontiguousarray(block[:, col: col + 4]).view(np.int32).ravel()


def purge_caches(store: TierStore, cutoffs: dict[int, int]) -> int:
    """Drop cached rows of tables {index: cutoff} whose stamp is below the cutoff; returns rows.

    Dirty or not: an older copy below is older still, so it is stale too and reads as missing.
    One vectorized pass over each tier's occupied slots, whatever the number of tables.
    """
    tables = store.by_index
    cut = torch.full((len(tables),), -(2**31), dtype=torch.int64)  # no cutoff move: keep
    for t, c in cutoffs.items():
        cut[t] = c
    cols = torch.tensor([t.spec.stamp_col for t in tables], dtype=torch.int64)
    dropped = 0
    for tier in (store.device_tier, store.host_tier):
        if tier.size == 0:
            continue
        slots = torch.nonzero(tier.occupied).flatten()
        tabs = tier.index.keys(slots)[0].to(slots.device)
        stamps = tier.slab[slots, cols.to(slots.device)[tabs]].contiguous().view(torch.int32)
        dead = slots[stamps.to(torch.int64) < cut.to(slots.device)[tabs]]
        if dead.numel():
            tier.remove(dead)
            dropped += int(dead.numel())
    return dropped


def stale_ids(backend: Any, spec: TableSpec, cutoff: int, start: int = 0
              ) -> tuple[np.ndarray, int | None]:
    """Ids of one scan chunk's stale rows from id `start` on; and where the next chunk starts."""
    if backend.is_chunked(spec.name):  # format 4: whole page chunks, one snapshot a scan
        return backend.chunk_stale_ids(spec.name, spec.row_dim, spec.stamp_col, cutoff, start,
                                       SCAN_CHUNK)
    size = spec.row_dim * 4 + CHECK_BYTES
    with backend.reading():
        db = backend.table_db(spec.name)
        if db is None:
            return np.empty(0, np.int64), None
        with backend.env.begin(db=db, buffers=False) as txn:
            cur = txn.cursor()
            if not cur.set_range(encode_keys(np.array([start], np.int64))[0]):
                return np.empty(0, np.int64), None
            items = list(islice(cur.iternext(keys=True, values=True), SCAN_CHUNK))  # a C loop
    if not items:
        return np.empty(0, np.int64), None
    keys, vals = zip(*items)
    ids = np.frombuffer(b"".join(keys), dtype=">i8").astype(np.int64)
    block = np.frombuffer(b"".join(vals), dtype=np.uint8).reshape(len(vals), size)
    nxt = int(ids[-1]) + 1 if len(items) == SCAN_CHUNK else None
    return ids[_stamps(block, spec) < cutoff], nxt


def delete_stale(backend: Any, spec: TableSpec, ids: np.ndarray, cutoff: int) -> int:
    """Delete these rows if their stored stamp is still below `cutoff` (one write transaction)."""
    if len(ids) == 0:
        return 0
    if backend.is_chunked(spec.name):  # each touched chunk rewritten without its stale rows
        return backend.chunk_delete_stale(spec.name, spec.row_dim, ids, spec.stamp_col, cutoff)
    db = backend.table_db(spec.name)
    col = spec.stamp_col * 4
    keys = encode_keys(ids)
    backend.ensure_room(4096 * 8)
    backend.wrote = True
    with backend.env.begin(write=True, db=db) as txn:
        vals = list(map(txn.get, keys))  # re-checked inside the transaction: a newer version stays
        here = [i for i, v in enumerate(vals) if v is not None]
        if not here:
            return 0
        stamps = np.frombuffer(b"".join(vals[i][col: col + 4] for i in here), dtype="<i4")
        dead = [keys[here[j]] for j in np.flatnonzero(stamps < cutoff).tolist()]
        if dead and getattr(backend, "publisher", None) is not None:
            backend.publisher.before_commit(txn, [(db, dead)])  # readers keep their flush's rows
        deque(map(txn.delete, dead), maxlen=0)
    return len(dead)


def expire_table(store: TierStore, spec: TableSpec, cutoff: int,
                 stop: threading.Event | None = None) -> int:
    """Delete every row of a table stamped below `cutoff` from LMDB, chunk by chunk; returns rows.

    With `stop` (the background deleter), each chunk takes the store lock for its write
    transaction only, and the scan ends as soon as `stop` is set.
    """
    start: int | None = 0
    deleted = 0
    while start is not None:
        if stop is not None and stop.is_set():
            return deleted
        dead, start = stale_ids(store.backend, spec, cutoff, start)
        for lo in range(0, len(dead), DELETE_CHUNK):
            part = dead[lo: lo + DELETE_CHUNK]
            if stop is None:
                deleted += delete_stale(store.backend, spec, part, cutoff)
                continue
            n = _delete_in_background(store, spec, part, cutoff, stop)
            if n is None:
                return deleted
            deleted += n
    return deleted


def _delete_in_background(store: TierStore, spec: TableSpec, ids: np.ndarray, cutoff: int,
                          stop: threading.Event) -> int | None:
    """One chunk of the deleter's deletes under the store lock; None once `stop` is set.

    A chunked table's level lock is taken first and the store lock only tried under it: a
    range rewrite by the merger holds the level lock for a whole range (about a million rows),
    and the deleter must not hold the store lock (the training step's) through that wait. The
    store lock is only tried, and the level lock let go between tries, because a flush holding
    the store lock takes the level lock to merge.
    """
    level = store.backend.chunk_level(spec.name, spec.row_dim) \
        if store.backend.is_chunked(spec.name) else None
    while True:
        if stop.is_set():
            return None
        if level is not None and not level.lock.acquire(timeout=0.05):
            continue  # a rewrite of this table is under way: wait without the store lock
        try:
            if store.lock.acquire(timeout=0.05):  # close() holds it while stopping us
                try:
                    if stop.is_set() or store.closed:
                        return None
                    n = delete_stale(store.backend, spec, ids, cutoff)
                    store.expiry.expired_rows += n  # (expire() counts its own)
                    return n
                finally:
                    store.lock.release()
        finally:
            if level is not None:
                level.lock.release()


def expire(store: TierStore, table: str | None, older_than: int) -> dict[str, int]:
    """`TierStore.expire` (store lock held): expire rows last updated more than `older_than`
    clock steps ago everywhere, delete them from LMDB; durable on return."""
    older_than = check_older_than(older_than)
    tabs = [store.table_record(table)] if table is not None else list(store.tables.values())
    ex = store.expiry
    store.flush()  # every dirty row down and the log merged: stale rows are all in the tables
    ex.raise_cutoffs({t.index: store.clock - older_than for t in tabs})
    ex.save(store.backend)
    store.backend.sync()  # the cutoffs are durable before any deletion (a crash: rows read missing)
    ex.flushed(queue=False)  # deleted here, synchronously
    with store.quiesce_writer():  # nothing is pending (we hold the lock); the writer stays idle
        out = {t.spec.name: expire_table(store, t.spec, ex.cutoffs[t.index]) for t in tabs}
    store.backend.sync()
    with ex.wake:  # a ttl table's deleter has nothing left below these cutoffs
        ex.done.update({t.index: ex.cutoffs[t.index] for t in tabs if t.index in ex.ttl})
    ex.expired_rows += sum(out.values())
    return out



class Expiry:
    """A store's expiry state: cutoffs per table, the ttl's expiry points and its deleter thread."""

    def __init__(self, store: TierStore) -> None:
        self._store = weakref.ref(store)  # the deleter thread must not keep an abandoned store
        saved = store.backend.get_meta(META_KEY) or {}
        # table index -> cutoff in force: rows stamped below read as missing (only rises)
        self.cutoffs = {t.index: int(saved[n]) for n, t in store.tables.items() if n in saved}
        self.durable = dict(self.cutoffs)  # as of the last flush (deletions may go this far)
        self._queued: dict[int, int] = {}  # ttl tables: the cutoff the deleter last got
        self.done: dict[int, int] = {}  # ttl tables: the cutoff of the last completed pass
        self._saved = dict(self.cutoffs)
        self.ttl = {t.index: t.spec.ttl for t in store.tables.values() if t.spec.ttl is not None}
        self.expired_rows = 0  # deleted from LMDB
        self.expired_cached = 0  # dropped from the caches
        self.wake = threading.Condition()
        self._pending: dict[int, int] = {}
        self._stop = threading.Event()
        self._idle = threading.Event()
        self._idle.set()
        self._thread: threading.Thread | None = None

    @property
    def store(self) -> TierStore:
        """The store this state belongs to."""
        store = self._store()
        if store is None:  # pragma: no cover - only the deleter outlives its store
            raise ReferenceError("the store is gone")
        return store

    def stats(self) -> dict[str, Any]:
        """Rows expired so far (deleted from LMDB, dropped from the caches) and the cutoffs."""
        names = self.store.by_index
        return {"expired_rows": self.expired_rows, "expired_cached": self.expired_cached,
                "cutoffs": {names[i].spec.name: c for i, c in self.cutoffs.items()}}

    def raise_cutoffs(self, cutoffs: dict[int, int]) -> None:
        """Raise tables' cutoffs (store lock held): their stale cached rows leave at once."""
        moved = {i: c for i, c in cutoffs.items() if c > self.cutoffs.get(i, -(2**31))}
        if moved:
            self.cutoffs.update(moved)
            self.expired_cached += purge_caches(self.store, moved)

    def on_advance(self) -> None:
        """After the clock moved: at each ttl table's expiry point, raise its cutoff."""
        if not self.ttl:
            return
        clock = self.store.clock
        want = {}
        for i, ttl in self.ttl.items():
            iv = ttl_interval(ttl)
            want[i] = clock // iv * iv - ttl  # the last point's cutoff: a function of the clock
        self.raise_cutoffs(want)

    def stale_mask(self, tab_index: int, data: np.ndarray, found: np.ndarray, stamp_col: int
                   ) -> tuple[np.ndarray, np.ndarray]:
        """(data, found) with rows stamped below the table's cutoff made missing (expired)."""
        cutoff = self.cutoffs.get(tab_index)
        if cutoff is None or not found.any():
            return data, found
        stamps = np.ascontiguousarray(data[:, stamp_col]).view(np.int32)
        stale = found & (stamps < cutoff)
        if not stale.any():
            return data, found
        if not data.flags.writeable:
            data = data.copy()
        data[stale] = 0  # a missing row is zeros before its lazy init
        return data, found & ~stale

    def save(self, backend: Any) -> None:
        """Write the cutoffs that changed since the last save (flush: synced with the rows)."""
        if self.cutoffs != self._saved:
            names = self.store.by_index
            backend.put_meta({META_KEY: {names[i].spec.name: c for i, c in self.cutoffs.items()}})
            self._saved = dict(self.cutoffs)

    def flushed(self, queue: bool = True) -> None:
        """After a flush synced the cutoffs: ttl tables' rows below them may now be deleted.

        The first flush after opening hands the deleter every ttl cutoff (a crash may have left
        stale rows on disk); later flushes hand it the cutoffs that rose.
        """
        self.durable = dict(self.cutoffs)
        with self.wake:
            work = {i: c for i, c in self.durable.items()
                    if i in self.ttl and c > self._queued.get(i, -(2**31))}
            self._queued.update(work)
        if queue:
            self._queue(work)

    def _queue(self, work: dict[int, int]) -> None:
        if not work or self._stop.is_set():
            return
        with self.wake:
            for i, c in work.items():
                self._pending[i] = max(c, self._pending.get(i, c))
            self._idle.clear()
            self.wake.notify()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, daemon=True,
                                            name=f"tierstore-ttl:{self.store.path.name}")
            self._thread.start()

    def _run(self) -> None:
        while True:
            with self.wake:
                while not self._pending and not self._stop.is_set():
                    self._idle.set()
                    self.wake.wait()
                if self._stop.is_set():
                    self._idle.set()
                    return
                work, self._pending = self._pending, {}
            store = self._store()  # held only while working
            if store is None:
                return
            for i, cutoff in work.items():
                try:
                    expire_table(store, store.by_index[i].spec, cutoff, stop=self._stop)
                except Exception:  # a disk error: the rows stay stale (read as missing); the
                    with self.wake:  # next flush or close() retries (never the store lock here:
                        self._queued[i] = self.done.get(i, -(2**31))  # close() joins us holding it)
                    continue
                if not self._stop.is_set():
                    with self.wake:
                        self.done[i] = max(cutoff, self.done.get(i, cutoff))
            del store

    def finish(self) -> None:
        """At close, after the last flush (store lock held, deleter stopped): delete what the
        deleter did not reach, so the closed store holds no row below a durable ttl cutoff."""
        for i, cutoff in self.durable.items():
            if i in self.ttl and cutoff > self.done.get(i, -(2**31)):
                self.expired_rows += expire_table(self.store, self.store.by_index[i].spec, cutoff)
                self.done[i] = cutoff

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the deleter has no pending work (call without the store lock held)."""
        return self._idle.wait(timeout)

    def close(self) -> None:
        """Stop the deleter thread (rows it did not reach stay stale and read as missing)."""
        self._stop.set()
        with self.wake:
            self.wake.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
