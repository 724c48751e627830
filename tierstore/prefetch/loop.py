"""The pipeline's staging thread: its loop over the source, the window's free slots it waits
for, and the stop that wakes and joins it (`Prefetcher` builds them and owns their state)."""

from __future__ import annotations

import queue
import threading
import weakref
from collections import deque
from collections.abc import Iterator
from typing import Any

from ..errors import TierstoreError
from ..store import TierStore
from .reads import ReaderPool

END = object()  # the source is exhausted (or failed): what the staging thread hands over last
CLOSE_TIMEOUT_S = 2.0  # how long close() waits for the staging thread before leaving it (daemon)


class Permits:
    """The window's free slots: a counting semaphore that also tells whether its taker (the
    staging thread) waits on it with none free, so `Prefetcher.settle` knows it is idle."""

    def __init__(self, value: int) -> None:
        self._cv = threading.Condition()
        self._value = value
        self._waiting = 0

    def acquire(self) -> None:
        """Take a slot, waiting until one is free."""
        with self._cv:
            self._waiting += 1
            try:
                while self._value == 0:
                    self._cv.wait()
                self._value -= 1
            finally:
                self._waiting -= 1

    def release(self) -> None:
        """Free a slot (wakes a waiting taker)."""
        with self._cv:
            self._value += 1
            self._cv.notify()

    def blocked(self) -> bool:
        """Whether a taker waits and no slot is free (it stays so until the next release)."""
        with self._cv:
            return self._waiting > 0 and self._value == 0


def run(ref: weakref.ref, source: Iterator[Any], permits: Permits,
         stop: threading.Event, ready: queue.Queue, errbox: list,
         in_source: threading.Event) -> None:
    """The staging loop. While the window stays cached, read ahead: take batch i+1 from the
    source and start reading its rows, then wait for a window slot, stage batch i and hand it
    over (reads overlap staging); while reads wait on the disk, keep several batches read ahead
    (`Prefetcher.keep_ahead`). In warm-only mode a batch is read ahead right before it is
    handed over, after its window slot: its buffers must outlive the ring's turnover until use.
    An error of the source is raised after the batches taken before it."""
    step = -1
    pending: deque = deque()  # (step, batch, prep) read ahead, not yet staged, oldest first

    def prepare(pf, batch):
        try:
            return pf.prepare_batch(batch)
        except TierstoreError as exc:  # bad ids: raised in turn, after earlier batches
            return exc

    def finish(pf, item):
        if isinstance(item[2], BaseException):
            raise item[2]
        pf.finish_batch(item[0], item[2])
        ready.put((item[0], item[1]))

    try:
        while not stop.is_set():
            in_source.set()
            failed = None
            try:
                batch = next(source)
            except StopIteration:
                batch = END
            except Exception as exc:  # raised to the consumer after the batches read ahead
                batch, failed = END, exc
            finally:
                in_source.clear()
            pf = ref()
            if pf is None:  # abandoned: its finalizer stops the rest
                return
            try:
                ahead = batch is not END and not pf.warm_only
                if ahead:
                    step += 1
                    pending.append((step, batch, prepare(pf, batch)))
                # stage the oldest batches read ahead: all of them at the end or before a
                # warm-only batch, else while the look-ahead holds enough
                while pending and (not ahead or not pf.keep_ahead(pending)):
                    permits.acquire()
                    if stop.is_set():
                        return
                    finish(pf, pending.popleft())
                if failed is not None:
                    raise failed
                if batch is END:
                    return
                if ahead:
                    continue
                step += 1
                permits.acquire()
                if stop.is_set():
                    return
                finish(pf, (step, batch, prepare(pf, batch)))
            finally:
                del pf  # the last reference may go here: the finalizer then runs in this thread
    except BaseException as exc:  # surfaced to the consumer
        errbox.append(exc)
    finally:
        ready.put(END)


def unpin_all(store: TierStore, window: dict) -> None:
    """Unpin every staged batch still in `window` (under the store lock)."""
    store.staging.drop_batch()
    with store.lock:
        steps = sorted(window)
        if not store.closed:
            store.staging.drain_hits()
            store.staging.drain_unpins()
            store.device_tier.pin_epoch += 1  # pins dropped wholesale: staged slots are void
            for step in steps:
                for table, uniq in window[step].items():
                    store.staging.pin(store.table_record(table), uniq, -1)
        window.clear()


def shutdown(store: TierStore, window: dict, stop: threading.Event,
              permits: Permits, depth: int, pool: ReaderPool | None,
              thread: threading.Thread | None, in_source: threading.Event) -> None:
    """Stop a pipeline: wake and join its threads (bounded), then unpin its window."""
    stop.set()
    for _ in range(depth + 2):
        permits.release()
    if thread is not None and thread is not threading.current_thread():
        thread.join(0.05 if in_source.is_set() else CLOSE_TIMEOUT_S)  # never wait on the source
    if pool is not None:
        pool.shutdown(wait=True, cancel_futures=True)
    unpin_all(store, window)
