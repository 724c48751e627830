"""Prefetch for a sharded collection: exchange upcoming batches' ids ahead; owners stage their rows."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from ..errors import ConfigError, TierstoreError
from ..jagged import JaggedBatch
from .comm import guarded

if TYPE_CHECKING:
    from .module import ShardedEmbeddingBagCollection

_END = object()


class ShardedPrefetcher:
    """Iterate over this rank's batches while the owners of the next `depth` batches' rows stage them.

    A background thread reads each upcoming batch, sends its unique ids to their owners on the
    store's prefetch process group (so it never interleaves with a step's collectives), and each
    owner brings the rows it will serve up its tiers and pins them until that batch has run.
    Every rank must iterate over the same number of batches (as with DDP).
    """

    def __init__(self, ebc: ShardedEmbeddingBagCollection, batches: Iterable[Any], depth: int = 2,
                 *, extract: Callable[[Any], Any] | None = None, **_ignored: Any) -> None:
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 0:
            raise ConfigError(f"depth must be an int >= 0, got {depth!r}")
        self.ebc = ebc
        self.store = ebc.store
        self.local = ebc.store.local
        self.depth = depth
        self.extract = extract or (lambda b: b)
        self._source = iter(batches)
        self._window: dict[int, dict[str, torch.Tensor]] = {}
        self._consumed = -1
        self._closed = False
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._ready: queue.Queue = queue.Queue()
        self._permits = threading.Semaphore(depth + 1)
        self._thread: threading.Thread | None = None
        if depth > 0:
            self._thread = threading.Thread(target=self._run, name="tierstore-sharded-prefetch",
                                            daemon=True)
            self._thread.start()

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        if self._closed:
            raise StopIteration
        self._release(self._consumed)
        stats = self.local.prefetch_stats
        if self.depth == 0:
            try:
                batch = next(self._source)
            except StopIteration:
                self.close()
                raise
            self._consumed += 1
            stats.batches += 1
            return batch
        t0 = time.perf_counter()
        item = self._ready.get()
        stats.stall_seconds += time.perf_counter() - t0
        if item is _END:
            err = self._error
            self.close()
            if err is not None:
                if isinstance(err, TierstoreError):
                    raise err
                raise TierstoreError(f"sharded prefetch failed: {err!r}") from err
            raise StopIteration
        step, batch = item
        self._consumed = step
        stats.batches += 1
        return batch

    def _release(self, step: int) -> None:
        """Unpin the rows this rank staged, as an owner, for batch `step`."""
        staged = self._window.pop(step, None)
        if staged is None:
            return
        local = self.local
        with local.lock:
            if not local.closed:
                for table, uniq in staged.items():
                    local.staging.pin(local.table_record(table), uniq, -1)
        self._permits.release()

    def close(self) -> None:
        """Stop the pipeline, join its thread and unpin whatever is still staged."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        for _ in range(self.depth + 2):
            self._permits.release()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        for step in sorted(self._window):
            self._release(step)

    def __enter__(self) -> ShardedPrefetcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # staging side ---------------------------------------------------------------------------
    def _run(self) -> None:
        step = self._consumed
        try:
            for batch in self._source:
                self._permits.acquire()
                if self._stop.is_set():
                    return
                step += 1
                self._stage(step, batch)
                self._ready.put((step, batch))
        except BaseException as exc:  # surfaced to the consumer
            self._error = exc
        finally:
            self._ready.put(_END)

    def _stage(self, step: int, batch: Any) -> None:
        store, comm, world = self.store, self.store.prefetch_comm, self.store.world_size
        _, tables = guarded(comm, "prefetch:validate", lambda: self.ebc.split_batch(
            JaggedBatch.of(self.extract(batch)), None, None, None, None))
        sizes = torch.zeros(world, len(tables), dtype=torch.int64)
        send = []
        for j, (table, ids, _, _) in enumerate(tables):
            uniq = torch.unique(ids)
            placement = store.plan.placement(table)
            if placement.kind in ("row", "table"):
                own = store.plan.owners(table, uniq)
                order = torch.argsort(own, stable=True)
                sizes[:, j] = torch.bincount(own, minlength=world)
                send.append(uniq.index_select(0, order).split(sizes[:, j].tolist()))
                continue
            # column shards and data-parallel replicas serve every id of the global batch
            targets = set(placement.shards) if placement.kind == "column" else set(range(world))
            sizes[:, j] = torch.tensor([uniq.numel() if o in targets else 0 for o in range(world)])
            send.append([uniq if o in targets else uniq[:0] for o in range(world)])
        recv = comm.exchange_sizes("prefetch:sizes", sizes)
        flat = torch.cat([send[j][o] for o in range(world) for j in range(len(tables))] or
                         [torch.empty(0, dtype=torch.int64)])
        got = comm.exchange("prefetch:ids", flat, sizes.sum(1).tolist(), recv.sum(1).tolist())
        pieces = got.split(recv.reshape(-1).tolist())  # [source rank][table], row-major
        local = self.local
        staged: dict[str, torch.Tensor] = {}
        with local.lock:
            if local.closed or self._stop.is_set():
                return
            mine = {t: torch.unique(torch.cat([pieces[r * len(tables) + j] for r in range(world)]))
                    for j, (t, *_) in enumerate(tables)}
            window_rows = sum(u.numel() for w in self._window.values() for u in w.values())
            batch_rows = sum(u.numel() for u in mine.values())
            cache_rows = local.device_tier.capacity + local.host_tier.capacity
            stats = local.prefetch_stats
            if 2 * (window_rows + batch_rows) > cache_rows:
                stats.warm_only += 1  # the window cannot stay cached: do not evict the step's rows
            else:
                todo = [(t, uniq) for t, uniq in mine.items() if uniq.numel()]
                done = local.staging.stage_many([(local.table_record(t), uniq) for t, uniq in todo])
                for (t, uniq), ((d, h, s), _) in zip(todo, done):  # one placement for all tables
                    stats.rows_used += uniq.numel()
                    stats.rows_resident_at_use += d + h
                    stats.rows_staged += h + s
                    stats.staged_from_host += h
                    stats.staged_from_ssd += s
                    staged[t] = uniq
            self._window[step] = staged

