"""One batch's stored rows read ahead as parallel tasks: the log once for all tables, then LMDB."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

try:  # a thread's own page-fault count (Linux); elsewhere reads are judged by time alone
    import resource
    _RUSAGE_THREAD = getattr(resource, "RUSAGE_THREAD", None)
except ImportError:  # pragma: no cover - not a Unix
    _RUSAGE_THREAD = None

# reads that wait on the disk: a task's rows took more than COLD_ROW_S of wall time each, and its
# thread ran for less than COLD_CPU_SHARE of it. Page-cached reads take ~1-2 us a row and run
# on the CPU throughout; a 4 KiB random read from an SSD takes 50-500 us
COLD_ROW_S = 20e-6
COLD_CPU_SHARE = 0.5
# reads asked ahead take less wall time a row than COLD_ROW_S on a fast disk, and more of it on
# the CPU (the kernel's work to submit each read: ~10 us a row, against ~22 us of wall at 89k
# IOPS on two readers): they stay cold while a row takes more than COLD_STAY_ROW_S and the
# threads wait for a fifth of the time or more. Page-cached reads take ~1-2 us a row on the CPU
COLD_STAY_ROW_S = 5e-6
COLD_STAY_CPU_SHARE = 0.8
# reader threads while reads are cold: enough reads in flight for a disk's queue depth (the
# page reader and py-lmdb release the GIL while they wait on a page fault). 0: off, the default
# until an A/B on a quiet machine shows a gain (BENCHMARKS.md: one run 1.56x slower, one faster)
COLD_READERS = 0
COLD_PART_ROWS = 256  # rows per task while cold, at least: each task is one read in flight
# reads turn cold only if they also faulted pages in from the disk: at least this many major
# page faults a row read. A reader that waits for a core or the GIL on a loaded machine looks
# as slow as one waiting on the disk, but faults nothing (a page-cached table: 0); a cold table
# faults a leaf page or more a row. Asking such reads ahead cost ~8 ms of reader CPU a call in
# the warm steady state (`bench.steady`, cache10: readers 14.1 -> 12.8 ms a step without it)
COLD_FAULTS_A_ROW = 0.05


def _major_faults() -> int | None:
    """This thread's major page faults so far (None where the platform does not count them)."""
    return None if _RUSAGE_THREAD is None else resource.getrusage(_RUSAGE_THREAD).ru_majflt


def _add_faults(a: int | None, b: int | None) -> int | None:
    """A sum of fault counts; None (not counted) when either is."""
    return None if a is None or b is None else a + b


def _timed(fn: Callable, *args: Any) -> tuple[Any, float, float, int | None]:
    """(fn(*args), seconds it took, its thread's CPU seconds, its major page faults or None):
    reader threads time their work."""
    t0, c0, f0 = time.perf_counter(), time.thread_time(), _major_faults()
    out = fn(*args)
    f1 = _major_faults()
    return out, time.perf_counter() - t0, time.thread_time() - c0, \
        None if f0 is None or f1 is None else f1 - f0


class ReaderPool:
    """The pipeline's reader threads: `readers` of them while reads hit the page cache (more only
    queue for cores), and up to `COLD_READERS` while reads wait on the disk, with each batch's
    rows split into as many tasks, so enough reads are in flight to use the disk's queue depth.
    Which it is follows the last batch's reads (`observe`); the cold threads start on first use.
    """

    def __init__(self, readers: int, cold_readers: int | None = None) -> None:
        self.readers = readers
        self.cold_readers = max(readers, COLD_READERS if cold_readers is None else cold_readers)
        self._warm = ThreadPoolExecutor(readers, thread_name_prefix="tierstore-read")
        self._cold = ThreadPoolExecutor(self.cold_readers, thread_name_prefix="tierstore-read-cold") \
            if self.cold_readers > readers else None
        self.cold = False  # the last batch's reads waited on the disk
        self.cold_batches = 0  # batches read on the cold threads
        self._inflight = 0  # tasks submitted and not yet done (`wait_idle`)
        self._done = threading.Condition()

    def submit(self, fn: Callable, *args: Any) -> Future:
        """Run `fn(*args)` on a reader thread (the cold ones while reads are cold)."""
        pool = self._cold if self.cold and self._cold is not None else self._warm
        with self._done:
            self._inflight += 1
        try:
            future = pool.submit(fn, *args)
        except BaseException:  # shut down: nothing was queued
            self._finished(None)
            raise
        future.add_done_callback(self._finished)
        return future

    def _finished(self, _: Future | None) -> None:
        with self._done:
            self._inflight -= 1
            self._done.notify_all()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until no task submitted so far is running or queued; False on timeout."""
        with self._done:
            return self._done.wait_for(lambda: self._inflight <= 0, timeout)

    def part_rows(self, rows: int, warm_part: int) -> int:
        """Rows per task for a batch of `rows` cold rows: `warm_part` while reads hit the page
        cache, else small enough that every cold thread has a task."""
        if not self.cold or self._cold is None:
            return warm_part
        return max(COLD_PART_ROWS, -(-rows // self.cold_readers))

    def observe(self, rows: int, seconds: float, cpu_seconds: float,
                faults: int | None = None) -> None:
        """Learn from a batch's reads (`rows` rows, their tasks' wall and CPU seconds in all,
        and their major page faults, None: not counted). Reads turn cold when they are slow,
        off the CPU, and (where faults are counted) faulted pages in from the disk."""
        if rows <= 0 or seconds <= 0:
            return
        slow, share = (COLD_STAY_ROW_S, COLD_STAY_CPU_SHARE) if self.cold else \
            (COLD_ROW_S, COLD_CPU_SHARE)
        waited = seconds / rows > slow and cpu_seconds < share * seconds
        from_disk = self.cold or faults is None or faults >= COLD_FAULTS_A_ROW * rows
        self.cold = waited and from_disk
        self.cold_batches += self.cold

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        """Stop both sets of threads."""
        self._warm.shutdown(wait=wait, cancel_futures=cancel_futures)
        if self._cold is not None:
            self._cold.shutdown(wait=wait, cancel_futures=cancel_futures)



class StoredReads:
    """Rows of a batch's tables that no cache holds, read below the caches on reader threads.

    A log read visits every chunk holding a wanted entry, and a batch's entries of any one table
    are spread over nearly all of the log: so the log entries of all tables are read together,
    in parts of about `part_rows` entries in sequence order (each part walks its own chunks once),
    and each table's other rows are read from LMDB in parts of `part_rows` rows. An entry merged
    into its table meanwhile is read from the table by the same task. `result()` waits for the
    tasks (each copies what it read into its table's arrays: `_table_part`, `_log_part`) and
    gives each table's rows in the order they were asked for; `ahead`: the reads wait
    on the disk, so each task asks for all its pages first (`LmdbBackend.get`). Start it after the
    read-ahead mark (`store.loader.read_ahead_mark`), like any read the pipeline keeps.
    """

    def __init__(self, store: Any, cold: dict[Any, tuple[Any, np.ndarray]],
                 submit: Callable[..., Future], part_rows: int, ahead: bool = False) -> None:
        self.cold = cold
        self.cpu_seconds = 0.0  # the readers' CPU seconds, set by `result`
        self.faults: int | None = 0  # their major page faults (None: not counted), by `result`
        self._keys = list(cold)  # a log part's entries name their table by position in this list
        # each table's rows in the order asked: every position is written by one read task (the
        # table parts hold the rows the log does not, the log parts the rest)
        self._out = {key: (np.empty((len(rows), tab.spec.row_dim), dtype=np.float32),
                           np.empty(len(rows), dtype=bool)) for key, (tab, rows) in cold.items()}
        # the log lookups that split the rows into parts run on a reader thread too: the
        # staging thread only submits this task (`_plan`), which submits the parts
        self._plan = submit(self._plan_parts, store, submit, part_rows, ahead) \
            if any(len(rows) for _, rows in cold.values()) else None

    def _plan_parts(self, store: Any, submit: Callable[..., Future], part_rows: int, ahead: bool
                    ) -> list[Future]:
        """Look the rows up in the log and submit the read parts (table parts, then log parts)."""
        parts: list[Future] = []
        lkeys, lpos, ltabs, lrows, lseqs = [], [], [], [], []
        for k, key in enumerate(self._keys):
            tab, rows = self.cold[key]
            if not len(rows):
                continue
            seqs = store.log.lookup(tab.index, torch.from_numpy(rows))
            inlog = seqs >= 0
            rest = np.flatnonzero(~inlog)
            for pos in np.array_split(rest, max(1, len(rest) // part_rows)):
                if len(pos):
                    parts.append(submit(_timed, self._table_part, store, key, pos, ahead))
            if inlog.any():
                at = np.flatnonzero(inlog)
                lkeys.append(np.full(len(at), k, dtype=np.int64))
                lpos.append(at)
                ltabs.append(np.full(len(at), tab.index, dtype=np.int64))
                lrows.append(rows[at])
                lseqs.append(seqs[at])
        if lseqs:  # the log entries of all tables, in sequence order: one walk per part
            seqs = np.concatenate(lseqs)
            order = np.argsort(seqs, kind="stable")
            which, pos = np.concatenate(lkeys)[order], np.concatenate(lpos)[order]
            tabs, rows, seqs = np.concatenate(ltabs)[order], np.concatenate(lrows)[order], seqs[order]
            width = store.width
            for sel in np.array_split(np.arange(len(seqs)), max(1, len(seqs) // part_rows)):
                parts.append(submit(_timed, self._log_part, store, which[sel], pos[sel], tabs[sel],
                                    rows[sel], seqs[sel], width))
        return parts

    def _table_part(self, store: Any, key: Any, pos: np.ndarray, ahead: bool) -> None:
        """A reader task: the rows at `pos` of table `key` from LMDB, into its arrays."""
        tab, rows = self.cold[key]
        data, found = store.loader.read_table(tab, rows[pos], ahead)
        dst_data, dst_found = self._out[key]
        dst_data[pos] = data
        dst_found[pos] = found

    def _log_part(self, store: Any, which: np.ndarray, pos: np.ndarray, tabs: np.ndarray,
                  rows: np.ndarray, seqs: np.ndarray, width: int) -> None:
        """A reader task: log entries of any tables (`which`: each one's table, by position in
        `_keys`), into those tables' arrays at `pos`."""
        data, found = store.loader.read_log_entries(tabs, rows, seqs, width)
        for k in np.unique(which).tolist():
            sel = np.flatnonzero(which == k)
            dst_data, dst_found = self._out[self._keys[k]]
            dst_data[pos[sel]] = data[sel, : dst_data.shape[1]]
            dst_found[pos[sel]] = found[sel]

    def result(self) -> tuple[dict[Any, tuple[np.ndarray, np.ndarray]], float]:
        """({key: (rows [n, row_dim], found [n])} in the order asked, reader seconds in all);
        the readers' CPU seconds go to `cpu_seconds`."""
        seconds = 0.0
        self.cpu_seconds = 0.0
        self.faults = 0
        for fut in self._plan.result() if self._plan is not None else []:
            _, sec, cpu, faults = fut.result()
            seconds += sec
            self.cpu_seconds += cpu
            self.faults = _add_faults(self.faults, faults)
        return self._out, seconds
