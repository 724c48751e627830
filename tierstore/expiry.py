"""Row expiry: delete rows whose last update is older than a number of store clock steps.

Every stored row carries the store clock at its last update (format v2's stamp column). A row
is *stale* at cutoff `c` when its stamp is below `c` (`c = clock - older_than`). Expiry drops
stale rows from the caches (dirty or not) and deletes them from LMDB; an expired row reads as
freshly initialized. `TableSpec(ttl=K)` does this during training: at every `interval` clock
steps the cutoff moves to `clock - K` (a deterministic point, so results do not depend on
timing), stale cached rows leave at once, stale rows on disk read as missing from then on, and a
background thread deletes them from LMDB (re-checking each stamp in its write transaction).
"""

from __future__ import annotations

import threading
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


def ttl_interval(ttl: int) -> int:
    """Clock steps between automatic expiry passes: the bound on how late a row expires."""
    return max(1, ttl // 8)


def check_older_than(older_than: Any) -> int:
    """Validate an expiry age in clock steps."""
    if isinstance(older_than, bool) or not isinstance(older_than, int) or older_than < 0:
        raise ConfigError(f"older_than must be an int >= 0 (clock steps), got {older_than!r}")
    return older_than


def _stamps(block: np.ndarray, spec: TableSpec) -> np.ndarray:
    """The int32 stamps of stored records [k, record bytes] (uint8)."""
    col = spec.stamp_col * 4
    return np.ascontiguousarray(block[:, col: col + 4]).view(np.int32).ravel()


def purge_caches(store: TierStore, cutoffs: dict[int, int]) -> int:
    """Drop cached rows of tables {index: cutoff} whose stamp is below the cutoff; returns rows."""
    dropped = 0
    for tier in (store.device_tier, store.host_tier):
        if tier.size == 0:
            continue
        slots = torch.nonzero(tier.occupied).flatten()
        tabs, _ = tier.index.keys(slots)
        tabs = tabs.to(slots.device)
        for t, cutoff in cutoffs.items():
            mine = slots[tabs == t]
            if mine.numel() == 0:
                continue
            col = store._by_index[t].spec.stamp_col
            stamps = tier.slab[mine, col].contiguous().view(torch.int32)
            dead = mine[stamps < cutoff]
            if dead.numel():
                tier.remove(dead)
                dropped += int(dead.numel())
    return dropped


def stale_ids(backend: Any, spec: TableSpec, cutoff: int, start: int = 0) -> tuple[np.ndarray, int | None]:
    """Ids of one scan chunk's stale rows from id `start` on; and where the next chunk starts."""
    db = backend._db(spec.name)
    if db is None:
        return np.empty(0, np.int64), None
    size = spec.row_dim * 4 + CHECK_BYTES
    with backend.reading(), backend.env.begin(db=db, buffers=False) as txn:
        cur = txn.cursor()
        if not cur.set_range(encode_keys(np.array([start], np.int64))[0]):
            return np.empty(0, np.int64), None
        keys, vals = [], []
        for k, v in cur:
            keys.append(k)
            vals.append(v)
            if len(keys) == SCAN_CHUNK:
                break
    ids = np.frombuffer(b"".join(keys), dtype=">i8").astype(np.int64)
    block = np.frombuffer(b"".join(vals), dtype=np.uint8).reshape(len(vals), size)
    nxt = int(ids[-1]) + 1 if len(keys) == SCAN_CHUNK else None
    return ids[_stamps(block, spec) < cutoff], nxt


def delete_stale(backend: Any, spec: TableSpec, ids: np.ndarray, cutoff: int) -> int:
    """Delete these rows if their stored stamp is still below `cutoff` (one write transaction)."""
    if len(ids) == 0:
        return 0
    db = backend._db(spec.name)
    col = spec.stamp_col * 4
    n = 0
    backend._ensure_room(4096 * 8)
    backend._wrote = True
    with backend.env.begin(write=True, db=db) as txn:
        for key in encode_keys(ids):
            v = txn.get(key)
            if v is not None and int.from_bytes(v[col: col + 4], "little", signed=True) < cutoff:
                txn.delete(key)
                n += 1
    return n


def expire_table(store: TierStore, spec: TableSpec, cutoff: int,
                 stop: threading.Event | None = None) -> int:
    """Delete every stale row of a table from LMDB, chunk by chunk; returns rows deleted.

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
            while not store._lock.acquire(timeout=0.05):  # close() holds it while stopping us
                if stop.is_set():
                    return deleted
            try:
                if stop.is_set() or store._closed:
                    return deleted
                deleted += delete_stale(store.backend, spec, part, cutoff)
            finally:
                store._lock.release()
    return deleted


def expire(store: TierStore, table: str | None, older_than: int) -> dict[str, int]:
    """`TierStore.expire`: delete rows last updated more than `older_than` steps ago; durable."""
    older_than = check_older_than(older_than)
    tabs = [store._table(table)] if table is not None else list(store.tables.values())
    cutoff = store.clock - older_than
    store.flush()  # every row's latest version on disk: the caches then hold clean copies only
    cached = purge_caches(store, {t.index: cutoff for t in tabs})
    out = {t.spec.name: expire_table(store, t.spec, cutoff) for t in tabs}
    store.backend.sync()
    store.expiry_stats["expired_rows"] += sum(out.values())
    store.expiry_stats["expired_cached"] += cached
    return out


def expire_path(path: str, older_than: int, table: str | None = None) -> dict:
    """`tierstore expire`: open a closed store, expire its old rows, close it (compacting)."""
    from .store import TierStore, open_tables

    older_than = check_older_than(older_than)
    specs = list(open_tables(path))
    from .backends.lmdb_backend import LmdbBackend

    meta = LmdbBackend(path, readonly=True)
    try:
        seed = int((meta.get_meta("store") or {}).get("seed", 0))
    finally:
        meta.close()
    with TierStore(path, specs, seed=seed, device="cpu", device_capacity=0,
                   host_capacity=0) as store:
        before = store.backend.disk_bytes()
        deleted = store.expire(table, older_than)
        clock = store.clock
    from .persistence import compact

    sizes = compact(path)
    return {"path": str(path), "clock": clock, "older_than": older_than, "deleted": deleted,
            "bytes_before": before, "bytes_after": sizes["bytes_after"]}


class TtlExpiry:
    """Automatic expiry of the tables with a `ttl`: cutoffs at fixed clock points, a deleter thread."""

    def __init__(self, store: TierStore) -> None:
        self.store = store
        self.tables = {t.index: t for t in store.tables.values() if t.spec.ttl is not None}
        saved = store.backend.get_meta("ttl") or {}
        # table index -> cutoff in force (stale rows on disk read as missing)
        self.cutoffs = {i: int(saved.get(t.spec.name, -(2**31))) for i, t in self.tables.items()}
        self._wake = threading.Condition()
        self._pending: dict[int, int] = {}
        self._stop = threading.Event()
        self._idle = threading.Event()
        self._idle.set()
        self._thread: threading.Thread | None = None

    def on_advance(self) -> None:
        """Called after the clock moved: at each table's interval boundary, move its cutoff."""
        clock = self.store.clock
        moved = {}
        for i, tab in self.tables.items():
            ttl = tab.spec.ttl
            iv = ttl_interval(ttl)
            target = clock // iv * iv - ttl  # the last boundary's cutoff: a function of the clock
            if target > self.cutoffs[i]:
                self.cutoffs[i] = moved[i] = target
        if not moved:
            return
        self.store.expiry_stats["expired_cached"] += purge_caches(self.store, moved)
        # the cutoffs are committed before the deleter (which syncs first) deletes anything, so
        # after a crash every deleted row is stale under the cutoff the store reopens with
        self.store.backend.put_meta({"ttl": {self.tables[i].spec.name: c
                                             for i, c in self.cutoffs.items()}})
        with self._wake:
            self._pending.update(moved)
            self._idle.clear()
            self._wake.notify()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="tierstore-ttl", daemon=True)
            self._thread.start()

    def stale_mask(self, tab_index: int, data: np.ndarray, found: np.ndarray, stamp_col: int
                   ) -> tuple[np.ndarray, np.ndarray]:
        """(data, found) with rows whose stamp is below the table's cutoff made missing (expired)."""
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

    def _run(self) -> None:
        store = self.store
        while True:
            with self._wake:
                while not self._pending and not self._stop.is_set():
                    self._idle.set()
                    self._wake.wait()
                if self._stop.is_set():
                    return
                work, self._pending = self._pending, {}
            try:
                store.backend.sync()  # the cutoffs' metadata is durable before any deletion
                for i, cutoff in work.items():
                    n = expire_table(store, self.tables[i].spec, cutoff, stop=self._stop)
                    store.expiry_stats["expired_rows"] += n
            except Exception:  # the store closed under us, or a disk error: the next pass retries
                continue

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the deleter has no pending work (call without the store lock held)."""
        return self._idle.wait(timeout)

    def close(self) -> None:
        """Stop the deleter thread (rows it did not reach stay stale and read as missing)."""
        self._stop.set()
        with self._wake:
            self._wake.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
