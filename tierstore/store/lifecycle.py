"""TierStore's lifecycle: flush, checkpoint and restore, close, and closing stores left open at exit."""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import weakref
from typing import TYPE_CHECKING, Any

import lmdb
import numpy as np
import torch

import tierstore._switch as _switch
import tierstore.persistence as persistence

from ..errors import OutOfSpaceError
from .core import FLUSH_CHUNK, _locked

if TYPE_CHECKING:
    from .handle import TierStore

_OPEN_STORES: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _close_open_stores() -> None:
    """Flush and close stores still open at exit, before the interpreter tears torch down."""
    for store in list(_OPEN_STORES):
        try:
            store.close()
        except Exception:
            pass


class StoreLifecycle:
    """Flushing a store down to disk, snapshotting it, and releasing it."""

    @_locked
    def flush(self) -> None:
        """Write every dirty cached row to LMDB and sync it to disk.

        Rows go down in transactions of at most `FLUSH_CHUNK` rows, so flushing a large cache
        needs bounded extra memory; the flush is acknowledged (durable) when it returns.
        """
        self.check_live()
        self._hand_down_dirty()
        with self.quiesce_writer():  # drain the ring, fold the whole log into the tables
            self.backend.publish()  # readers (tierstore.serving) now see this flush
        self._save_records()
        self.backend.sync()
        self.expiry.flushed()  # rows below durable ttl cutoffs may now leave LMDB

    @_locked
    def hold_for_snapshot(self) -> int:
        """A checkpoint's pause: every dirty cached row handed down to the write-behind log, the
        ring drained, the store's own records saved, and the log's merges held at its end (the
        snapshot's point). Returns that point for `snapshot_at`, which the copying thread calls;
        the training thread goes on meanwhile (its writes land in the log past the point). The
        two go together (`persistence.start_checkpoint` pairs them): until `snapshot_at` runs,
        merges stay held, and a log that fills up makes the writer, then writes, wait."""
        self.check_live()
        self.log.wait_thawed()  # one snapshot at a time
        self._hand_down_dirty()
        self.writeback.drain()
        self._save_records()
        return self.log.freeze()

    def _hand_down_dirty(self) -> None:
        """Every dirty cached row to the write-behind ring, in chunks of `FLUSH_CHUNK` rows."""
        for tier in (self.device_tier, self.host_tier):
            for slots, rows in tier.dirty_chunks(FLUSH_CHUNK):
                self.cascade.write_down(rows.to(torch.device("cpu")))
                tier.dirty[slots] = False

    def _save_records(self) -> None:
        """The store's own records beside its rows: admission sketches, expiry cutoffs, clock."""
        for adm in self.gate.states.values():  # the sketches go down with the rows they gate
            adm.save(self.backend)
        self.expiry.save(self.backend)  # and the expiry cutoffs
        self._save_clock()

    def snapshot_at(self, mark: int) -> lmdb.Transaction:
        """The state as of `hold_for_snapshot` (which returned `mark`), on the copying thread and
        without the store lock: the log below `mark` merged into the tables, published to
        serving readers and synced, then a read transaction. The hold ends here, also on error."""
        try:
            with self.log.merging:  # no other merge until the snapshot is taken
                self._add_written(self.log.merge_below(mark))
                self.backend.publish()  # readers (tierstore.serving) now see this checkpoint
                self.backend.sync()
                return self.backend.snapshot()
        finally:
            self.log.thaw()

    @_locked
    def close(self) -> None:
        """Flush dirty rows and release the store (idempotent).

        A close that runs out of space (`OutOfSpaceError`) loses nothing and leaves the store
        open: raise `map_limit` (or free disk space), then call `close()` (or `flush()`) again.
        """
        if self.closed:
            return
        for pf in list(self.prefetchers):  # abandoned or still running pipelines: stop them
            pf.stop_for_store()
        self.expiry.close()
        try:
            self.flush()
            self.expiry.finish()  # rows below durable ttl cutoffs the deleter did not reach
        except OutOfSpaceError:  # nothing is lost and the store stays open: raise map_limit
            raise  # (or free space), then close() or flush() again
        except BaseException:
            self._teardown()
            raise
        self._teardown()

    def _teardown(self) -> None:
        """Release the store's threads, files and lock (the end of `close`)."""
        self.closed = True
        try:
            _switch.STORES.release(self)
            self.log.stop_merger()
            self.writeback.close()
            self.loader.clear_read_ahead()
        finally:
            self.backend.close()
            self.gate.close()

    def __enter__(self) -> TierStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # best effort: never lose acknowledged writes to GC order
        try:
            if not getattr(self, "closed", True) and not sys.is_finalizing():
                self.close()
        except Exception:
            pass

    def checkpoint(self, dest: str | os.PathLike, *, step: int | None = None,
                   extra: dict | None = None, overwrite: bool = False) -> dict:
        """Flush, then write a consistent snapshot of every table to `dest`; returns the manifest."""
        return persistence.checkpoint(self, dest, step=step, extra=extra, overwrite=overwrite)

    @classmethod
    def restore(cls, dest: str | os.PathLike, path: str | os.PathLike,
                **open_kwargs: Any) -> TierStore:
        """Replace the store at `path` with the checkpoint `dest` and open it (kwargs as __init__).

        `tables` and `seed` default to the checkpoint's; the checkpoint is verified while it is
        copied, and on any error the store at `path` is left as it was.
        """
        tables, seed = persistence.restore_files(dest, path, seed=open_kwargs.pop("seed", None),
                                                 tables=open_kwargs.pop("tables", None))
        return cls(path, tables, seed=seed, **open_kwargs)

    def _write_rows(self, tabs: np.ndarray, rows: np.ndarray, payload: np.ndarray) -> int:
        """The writer thread's sink: append rows to the write-behind log; wake the merger when large."""
        log = self.log
        written = log.append(tabs, rows, payload)  # merges inline only when the log is full
        if log.wants_merge():  # the merger folds the older half into the tables, sorted
            log.request_merge()
        self.ssd_stats.bytes_written += written
        return written

    def _add_written(self, nbytes: int) -> None:
        """Count bytes the background merger wrote."""
        self.ssd_stats.bytes_written += nbytes

    @contextlib.contextmanager
    def quiesce_writer(self):
        """Drain the write-behind ring, merge the log, and keep the writer idle inside the block."""
        self.writeback.drain()
        self.log.wait_thawed()  # a checkpoint's snapshot first: the whole log is merged here
        with self.log.merging, self.writeback.cv:  # no background merge runs meanwhile
            self.ssd_stats.bytes_written += self.log.merge()
            yield


def _weak_context(method):
    """A context factory calling a bound method held weakly (a no-op context once it is gone)."""
    ref = weakref.WeakMethod(method)

    def context():
        m = ref()
        return m() if m is not None else contextlib.nullcontext()

    return context
