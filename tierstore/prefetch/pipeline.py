"""The look-ahead pipeline: stage upcoming batches' rows LMDB -> host -> device before use."""

from __future__ import annotations

import queue
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, NamedTuple

import lmdb
import numpy as np
import torch

import tierstore.hostread as hostread

from .._parallel import CPUS
from ..backends.lmdb_backend import lmdb_error
from ..errors import ConfigError, TierstoreError
from ..gathered import Staged
from ..store import TierStore
from .batch_ids import jagged_ids, sorted_unique_each
from .loop import END, Permits, run, shutdown, unpin_all
from .reads import ReaderPool, StoredReads

# reader threads of a pipeline: one per CPU but one, at least one, at most 4. More only queue
# for cores: the training and staging threads need one each. On the 2-core VM one reader ran
# issue 36's held-out cache10 and cache1 steps 10-15% faster than two, and the standard shape
# as fast (BENCHMARKS.md, 2026-11-27); two ran 1.04x faster than four (session 9)
DEFAULT_READERS = max(1, min(4, CPUS - 1))
# reads judged cold (waiting on the disk) run on their own pool of at least this many threads:
# one reader read a half-cached table 1.75x slower than two (BENCHMARKS.md, 2026-11-27)
COLD_READERS_MIN = min(4, CPUS)
READ_CHUNK = 16384  # rows per reader task: page-cached reads gain nothing from more GIL hand-offs
# while reads wait on the disk, batches are read further ahead than the one being staged: up to
# this many, and within `read_ahead_bytes` (their ids plus the rows read), so the disk's queue
# never empties between batches. Page-cached reads take less time than staging: one is enough
READS_AHEAD = 8
READ_AHEAD_BYTES = 64 << 20


class Prep(NamedTuple):
    """A batch between the pipeline's two phases (`prepare_batch`, `finish_batch`)."""

    per_table: dict  # table -> its sorted unique ids to stage
    tabs: dict  # table -> its record
    since: Any  # the read-ahead mark the reads started after
    warm_only: bool  # the window cannot stay cached: nothing is pinned
    ringed: dict  # table -> (ids, rows) copied from the write-behind ring
    cold: dict  # table -> ids read below the caches
    reads: StoredReads  # those reads, on the reader threads
    seen: dict  # table -> (its ids, their inverse map), or `Staged.held` for a batch held whole
    ahead: Any = None  # the module's step made ahead for a batch held whole (`prepare_step`)


class Prefetcher:
    """Iterate over batches while the rows of the next `depth` batches are staged in the background.

    Staged rows are pinned (protected from eviction) until their batch has been used: batch i is
    released when the consumer asks for batch i+1. Cold rows are first read from LMDB by
    `readers` threads (default: one per CPU but one, 1 to 4) without the store lock (py-lmdb releases
    the GIL), which pulls their pages into the page cache; staging then moves them into the
    caches under the store lock, so a row staged early still reflects every update made before
    its batch runs. Look-ahead policies receive each staged row's next use within the window.
    While those reads wait on the disk, later batches are read ahead too: up to `reads_ahead`
    beyond the one being staged, within `read_ahead_bytes` of ids and rows read, and each read
    first asks the disk for all its pages at once (`ask_ahead`).
    Use it with `with` or call `close()`; one dropped without either is stopped (threads ended,
    pins released) when it is garbage-collected or when its store closes (docs/reliability.md).
    """

    def __new__(cls, store: Any = None, *args: Any, **kwargs: Any) -> Any:
        make = getattr(store, "_sharded_prefetcher", None)  # a sharded collection's own pipeline
        if cls is Prefetcher and callable(make):
            return make(*args, **kwargs)
        return super().__new__(cls)

    def __init__(self, store: TierStore | Any, batches: Iterable[Any], depth: int = 2, *,
                 features: Mapping[str, str] | None = None,
                 extract: Callable[[Any], Any] | None = None, readers: int = DEFAULT_READERS,
                 reads_ahead: int = READS_AHEAD, read_ahead_bytes: int = READ_AHEAD_BYTES,
                 ask_ahead: bool = True, delay: Callable[[], float] | None = None) -> None:
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 0:
            raise ConfigError(f"depth must be an int >= 0, got {depth!r}")
        for name, value, low in (("readers", readers, 1), ("reads_ahead", reads_ahead, 1),
                                 ("read_ahead_bytes", read_ahead_bytes, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"{name} must be an int >= {low}, got {value!r}")
        if not isinstance(ask_ahead, bool):
            raise ConfigError(f"ask_ahead must be a bool, got {ask_ahead!r}")
        self._module = None  # a collection whose steps the pipeline makes ahead (`prepare_step`)
        if not isinstance(store, TierStore) and hasattr(store, "store") and hasattr(store, "features"):
            # a TieredEmbeddingBagCollection: take its store and feature -> table map
            features = store.features if features is None else features
            self._module = store if callable(getattr(store, "prepare_step", None)) else None
            store = store.store
        if not isinstance(store, TierStore):
            raise ConfigError("Prefetcher needs a TierStore or a TieredEmbeddingBagCollection")
        self.store = store
        self.depth = depth
        self.reads_ahead = reads_ahead  # batches read ahead at most while reads are cold
        self.read_ahead_bytes = read_ahead_bytes  # and the memory they may hold
        # while reads are cold, each read task first asks the disk for all its rows' pages at
        # once, in page order (`PageReader.ask_ahead`): one thread keeps a batch of reads in flight
        self.ask_ahead = ask_ahead
        if features is None:  # feature names the store's collections registered, if any
            features = {f: t for f, t in store.feature_tables.items() if t is not None}
        self.features = dict(features)
        # the batches' ids this pipeline checks are every one the module reads (same tables)
        self._checks_module = self._module is not None and all(
            self.features.get(f) == t for f, t in self._module.features.items())
        self.extract = extract or (lambda b: b)
        self.delay = delay  # test hook: seconds to sleep inside staging
        self._source = iter(batches)
        self._window: dict[int, dict[str, torch.Tensor]] = {}  # staged, unreleased batches
        # step -> ({table: its rows staged (`Staged`)}, pin epoch, the step made ahead or None)
        self._slots: dict[int, tuple] = {}
        self._unpin_slots: dict[int, tuple] = {}  # step -> ({table: device slots}, pin epoch)
        self.warm_only = False  # the last batch's mode (warm-only batches are not read a batch early)
        self._warm_steps: set[int] = set()  # warm-only batches not yet handed over
        self._consumed = -1
        self._closed = False
        self._errbox: list[BaseException] = []  # the staging thread's error, if any
        self._in_source = threading.Event()  # set while the staging thread waits in next(source)
        self._stop = threading.Event()
        self._ready: queue.Queue = queue.Queue()
        self._permits = Permits(depth + 1)
        # while reads wait on the disk, at least COLD_READERS_MIN threads read (one reader per
        # CPU but one suits page-cached reads, not a disk's queue)
        self._pool = ReaderPool(readers, cold_readers=max(readers, COLD_READERS_MIN)) \
            if depth > 0 else None
        self._thread: threading.Thread | None = None
        # Lifecycle: the threads hold no strong reference to this object (the staging loop
        # takes one through a weakref only while it stages), so an abandoned Prefetcher is
        # collected; the finalizer then stops the threads and unpins the window. The store
        # stops its prefetchers when it closes.
        if depth > 0:
            self._thread = threading.Thread(
                target=run, name="tierstore-prefetch", daemon=True,
                args=(weakref.ref(self), self._source, self._permits, self._stop, self._ready,
                      self._errbox, self._in_source))
        self._finalizer = weakref.finalize(self, shutdown, store, self._window, self._stop,
                                           self._permits, depth, self._pool, self._thread,
                                           self._in_source)
        store.prefetchers.add(self)
        if self._thread is not None:
            self._thread.start()

    @property
    def _error(self) -> BaseException | None:
        return self._errbox[0] if self._errbox else None

    # consumer side ------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        if self._closed:
            raise StopIteration
        self._release(self._consumed)
        self.store.paths.raise_deferred()  # a staged step's gradient check left to the device
        if self.depth == 0:
            try:
                batch = next(self._source)
            except StopIteration:
                self.close()
                self.store.paths.raise_deferred(wait=True)  # the last steps' checks too
                raise
            self._consumed += 1
            self.store.prefetch_stats.batches += 1
            return batch
        t0 = time.perf_counter()
        while True:
            try:
                item = self._ready.get(timeout=0.1)
                break
            except queue.Empty:
                if self._error is not None or (self._thread is not None and
                                               not self._thread.is_alive() and self._ready.empty()):
                    self._raise_worker_error()
        stats = self.store.prefetch_stats
        stats.stall_seconds += time.perf_counter() - t0
        if item is END:
            self._raise_worker_error()
            self.close()
            self.store.paths.raise_deferred(wait=True)  # the last steps' checks too
            raise StopIteration
        step, batch = item
        self._consumed = step
        stats.batches += 1
        # this thread's forward and backward may use the batch's pinned slots without the lock
        st = self._slots.pop(step, None)
        # a warm-only batch's forward reads its misses where they are; its backward places them
        self.store.staging.use_batch(st, step in self._warm_steps)
        self._warm_steps.discard(step)
        return batch

    def _raise_worker_error(self) -> None:
        err = self._error
        if err is not None:
            self.close()
            if isinstance(err, lmdb.Error):  # a damaged page met by a reader thread
                raise lmdb_error(err, self.store.path) from err
            if isinstance(err, TierstoreError):
                raise err
            raise TierstoreError(f"prefetch pipeline failed: {err!r}") from err

    def _release(self, step: int) -> None:
        """Unpin batch `step` (its backward has run) and hint its rows' next uses."""
        ids = self._window.pop(step, None)
        by_slot, epoch = self._unpin_slots.pop(step, ({}, -1))
        if ids is None:
            return
        store = self.store
        store.staging.drop_batch()  # the batch's rows are about to lose their pins
        if store.device_tier.policy.wants_future or store.host_tier.policy.wants_future:
            with store.lock:  # hints need the rows' slots now
                if store.closed:
                    return
                store.staging.drain_hits()
                store.staging.drain_unpins()
                for table, uniq in ids.items():
                    tab = store.table_record(table)
                    store.staging.pin(tab, uniq, -1)
                    self._hint_next_uses(tab, uniq, step)
        else:  # without the lock: the next locked section (staging, any call) drops the pins
            store.staging.unpin_later((t, u, by_slot[t], epoch) if t in by_slot else (t, u)
                                      for t, u in ids.items())
        self._permits.release()

    def _hint_next_uses(self, tab: Any, uniq: torch.Tensor, step: int) -> None:
        """For rows of batch `step`, send their next use among the staged batches."""
        if not (self.store.device_tier.policy.wants_future or self.store.host_tier.policy.wants_future):
            return
        remaining = uniq
        for later in sorted(k for k in self._window if k > step):
            other = self._window[later].get(tab.spec.name)
            if other is None or remaining.numel() == 0:
                continue
            hit = torch.isin(remaining, other)
            if bool(hit.any()):
                self.store.staging.hint(tab, remaining[hit], torch.full((int(hit.sum()),), later))
                remaining = remaining[~hit]

    def settle(self, timeout: float = 5.0) -> bool:
        """Wait until the pipeline's own work is done for now: the staging thread waits for a
        window slot (or has stopped) and no read it started is running or queued. For a caller
        that times something else in between (a benchmark's interleaved blocks): work left in
        flight would run inside that. Returns False when `timeout` seconds passed first."""
        end = time.perf_counter() + timeout
        while True:
            left = end - time.perf_counter()
            if self._waits() and (self._pool is None or self._pool.wait_idle(max(left, 0.0))) \
                    and self._waits():
                return True
            if left <= 0:
                return False
            time.sleep(0.002)

    def _waits(self) -> bool:
        """Whether the staging thread has stopped or waits for a window slot (none is free)."""
        return self._thread is None or not self._thread.is_alive() or self._permits.blocked()

    def close(self) -> None:
        """Stop the pipeline, join its threads and unpin whatever is still staged.

        Does not wait for a staging thread that is blocked in the batch source's `next()`: that
        thread is a daemon and is left to finish the call, then exits without staging (it
        checks the stop flag, and checks it again under the store lock before any pin). A
        thread busy staging is waited for at most `CLOSE_TIMEOUT_S`.
        """
        if self._closed:
            return
        self._closed = True
        self._finalizer()

    def stop_for_store(self) -> None:
        """The store is closing (its lock held): stop staging and drop the pins, without waiting."""
        self._closed = True
        self._stop.set()
        for _ in range(self.depth + 2):
            self._permits.release()
        if self._pool is not None:  # readers take no store lock: waiting for them is safe
            self._pool.shutdown(wait=True, cancel_futures=True)
        unpin_all(self.store, self._window)

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _stage(self, step: int, batch: Any) -> None:
        """Read a batch's rows ahead and stage it (both phases, one after the other)."""
        self.finish_batch(step, self.prepare_batch(batch))

    def prepare_batch(self, batch: Any) -> Prep:
        """Phase 1: find the batch's rows no cache holds and start reading them (reader threads).

        Runs while the previous batch is staged (`loop.run`): rows that staging brings into a cache
        were read for nothing, and clean rows it evicts are read at staging instead (both rare
        at a steady state, and neither changes a value: see `store.load`).
        """
        store = self.store
        ids = {t: torch.cat(parts).to("cpu", torch.int64)
               for t, parts in jagged_ids(self.extract(batch), self.features).items()}
        removals = store.device_tier.removals if store.device_tier.direct else -1
        if store.staging.holds(ids):  # a direct device cache holds every row: nothing to stage;
            # the step trusts this check while no row has left the cache (`Staged.held`)
            held = {t: Staged.held(i, removals) for t, i in ids.items()}
            nothing: dict = {}
            # the module's step, made ahead on this thread (`prepare_step`: None if it cannot);
            # its ids were just checked when this pipeline reads every table the module does
            ahead = None if self._module is None else self._module.prepare_step(
                self.extract(batch), removals if self._checks_module else None)
            return Prep({}, {}, None, False, {}, {}, StoredReads(store, nothing, self._pool.submit, 1),
                        held, ahead)
        # the step takes its indexes from staging (`Staged`): keep the ids, and on the slab
        # their inverse map too (the sets cache makes it on a CUDA device, by a search there)
        unique_inverse = sorted_unique_each(
            ids, inverse=store.device_cache != "sets" or store.device.type == "cpu")
        per_table = {t: u for t, (u, _) in unique_inverse.items()}
        seen = {t: (ids[t], inv) for t, (_, inv) in unique_inverse.items()}
        with store.lock:
            tabs = {t: store.table_record(t) for t in per_table}
            for t, uniq in per_table.items():
                store.check_ids(tabs[t], uniq)  # validate before anything moves
            # a row not in the write-behind ring has its newest value in LMDB or in a cache; what
            # LMDB holds now stays its newest stored value while every row written back from here
            # on is still in the ring or in the log past this mark, so a copy read now may serve a
            # later miss (store._read_ahead)
            since = store.loader.read_ahead_mark()
            # a snapshot (one C call): the consumer pops released batches without the lock, and a
            # generator over the dict itself raised "dictionary changed size during iteration"
            window_rows = sum(u.numel() for w in list(self._window.values()) for u in w.values())
            batch_rows = sum(u.numel() for u in per_table.values())
            # the window cannot stay cached: staging would only evict rows the running step needs,
            # so this batch gets no pins, and every row the caches may lose by then is read ahead
            warm_only = not store.staging.window_fits(window_rows + batch_rows)
            stats = store.prefetch_stats
            stats.window_rows = max(stats.window_rows, window_rows + batch_rows)
            self.warm_only = warm_only
            ringed = {}
            if warm_only:  # rows in the ring now: copy their newest version, read the rest
                # (only the uncached rest where the device policy admits rows selectively: the
                # caches then keep their rows through warm-only steps)
                selective = store.device_tier.selective
                cold = {}
                for t, uniq in per_table.items():
                    hit, data = store.writeback.lookup(tabs[t].index, uniq, count=False)
                    cold[t] = uniq[~hit]
                    if selective:
                        cold[t] = cold[t][self._uncached(tabs[t], cold[t])]
                    if data.shape[0]:
                        ringed[t] = (uniq[hit].numpy(), data[:, : tabs[t].spec.row_dim].numpy())
            else:  # one probe of every table's rows
                masks = store.cascade.uncached_many([(tabs[t], uniq) for t, uniq in per_table.items()])
                cold = {t: uniq[m] for (t, uniq), m in zip(per_table.items(), masks)}
        # read them ahead, in parallel and without the store lock (page reads hold no GIL)
        reads = StoredReads(store, {t: (tabs[t], rows.numpy()) for t, rows in cold.items()},
                            self._pool.submit,
                            self._pool.part_rows(sum(c.numel() for c in cold.values()), READ_CHUNK),
                            ahead=self.ask_ahead and self._pool.cold)
        return Prep(per_table, tabs, since, warm_only, ringed, cold, reads, seen)

    def prep_bytes(self, prep: Any) -> int:
        """Memory a batch read ahead holds: its ids, and its rows once read (buffers, found)."""
        if isinstance(prep, BaseException):
            return 0
        per_table, tabs, cold, seen = prep.per_table, prep.tabs, prep.cold, prep.seen
        return sum(8 * u.numel() + cold[t].numel() * (4 * tabs[t].spec.row_dim + 9)
                   + sum(8 * x.numel() for x in seen[t] if x is not None) for t, u in per_table.items())

    def keep_ahead(self, pending: deque) -> bool:
        """Whether to read another batch before staging the oldest of `pending` (read ahead,
        not staged): one beyond the oldest while reads are page-cached; while they wait on the
        disk, up to `reads_ahead` until the batches read ahead hold over `read_ahead_bytes` (so
        they hold at most that plus one batch)."""
        if len(pending) <= 1:
            return True
        held = sum(self.prep_bytes(p[2]) for p in pending)
        stats = self.store.prefetch_stats
        stats.reads_ahead_peak = max(stats.reads_ahead_peak, len(pending) - 1)
        stats.read_ahead_bytes_peak = max(stats.read_ahead_bytes_peak, held)
        return self._pool.cold and len(pending) <= self.reads_ahead and held <= self.read_ahead_bytes

    def finish_batch(self, step: int, prep: Prep) -> None:
        """Phase 2: register the rows read ahead and stage the batch (pins, hints) under the lock."""
        store = self.store
        per_table, tabs, since, warm_only, ringed, cold, reads, seen, ahead = prep
        batch_rows = sum(u.numel() for u in per_table.values())
        got, seconds = reads.result()
        stats = store.prefetch_stats
        stats.cold_read_batches += self._pool.cold  # this batch's reads: as the last one decided
        self._pool.observe(sum(c.numel() for c in cold.values()), seconds, reads.cpu_seconds,
                           reads.faults)
        stats.read_seconds += seconds
        if self.delay is not None:
            time.sleep(self.delay())
        with store.lock:
            if store.closed or self._stop.is_set():
                return
            t1 = time.perf_counter()
            for t in per_table:
                rows, data, found = ([cold[t].numpy()], [got[t][0]], [got[t][1]]) if cold[t].numel() \
                    else ([], [], [])
                if t in ringed:  # exact while every row put from `since` on is still in the ring
                    rows.append(ringed[t][0])
                    data.append(ringed[t][1])
                    found.append(np.ones(len(ringed[t][0]), dtype=bool))
                if rows:
                    if t in ringed:  # the ring's rows come after the sorted cold ones: sort all
                        rows_np = np.concatenate(rows)
                        order = np.argsort(rows_np, kind="stable")
                        store.loader.add_read_ahead(t, since, rows_np[order], np.concatenate(data)[order],
                                              np.concatenate(found)[order], keep=self.depth + 2)
                    else:  # the cold rows, in sorted chunks read in order: sorted already
                        # (the reads' own arrays, fresh per batch: kept without a copy)
                        store.loader.add_read_ahead(t, since, rows[0], data[0], found[0],
                                                    keep=self.depth + 2)
            stats.rows_read_ahead_from_ssd += sum(len(c) for c in cold.values())
            if warm_only:  # its misses are served from the read-ahead buffers
                stats.warm_only += 1
                stats.rows_used += batch_rows
                self._window[step] = {}
                self._warm_steps.add(step)
                stats.stage_seconds += time.perf_counter() - t1
                return
            future = store.device_tier.policy.wants_future or store.host_tier.policy.wants_future
            store.staging.drain_hits()
            store.staging.drain_unpins()
            dev = store.device_tier
            epoch = dev.pin_epoch
            slots, by_slot = {}, {}
            # all tables' misses placed at once; device slots, -1 where a row overflowed to host
            # and the slots on the host, read through an event (`tierstore.hostread`)
            on_host: list[torch.Tensor] = []
            staged_all = store.staging.stage_many([(tabs[t], uniq) for t, uniq in per_table.items()],
                                                  host_copies=on_host)
            for (t, uniq), ((d, h, s), staged), sh in zip(per_table.items(), staged_all, on_host):
                on_device = d + h + s == 0 or int(sh.min()) >= 0
                # every row on the device: the step's indexes, made here (`Staged.on_device`)
                slots[t] = Staged.on_device(uniq, sh, seen[t][0], staged, seen[t][1]) \
                    if on_device else Staged(uniq.numpy(), sh.numpy())
                if on_device:  # all on the device: unpin by slot
                    by_slot[t] = staged
                elif not store.host_tier.capacity:  # one cache tier: a row staged nowhere went
                    # to the ring, and its pin went with it
                    by_slot[t] = hostread.to_device(sh[sh >= 0], staged.device)
                stats.rows_used += uniq.numel()
                stats.rows_resident_at_use += d + h
                stats.rows_staged += h + s
                stats.staged_from_host += h
                stats.staged_from_ssd += s
                if not future:
                    continue
                # rows with no earlier use in the window get this step as their next use
                earlier = [w[t] for w in list(self._window.values()) if t in w]  # a snapshot
                fresh = uniq if not earlier else uniq[~torch.isin(uniq, torch.cat(earlier))]
                if fresh.numel():
                    store.staging.hint(tabs[t], fresh, torch.full((fresh.numel(),), step))
            for t, got in seen.items():  # a batch a direct cache held whole: its checked ids
                if isinstance(got, Staged):
                    slots[t] = got
            self._window[step] = per_table
            self._slots[step] = (slots, epoch, ahead)
            self._unpin_slots[step] = (by_slot, epoch)
            stats.stage_seconds += time.perf_counter() - t1

    def _uncached(self, tab: Any, uniq: torch.Tensor) -> torch.Tensor:
        """Mask of rows not in the write-behind ring and in no cache tier."""
        return self.store.cascade.uncached(tab, uniq)


# lifecycle (module functions: the threads and the finalizer never hold the Prefetcher) --------
