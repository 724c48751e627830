"""TierStore's rows cached nowhere: from the write-behind ring, read-ahead buffers, the log or LMDB."""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ._kernels import HAVE_NUMBA

if HAVE_NUMBA:
    from ._kernels import sorted_gather  # the read-ahead buffers' search-and-copy

if TYPE_CHECKING:
    from .backends.lmdb_backend import LmdbBackend
    from .backends.wal import WriteLog
    from .backends.writeback import WriteBehind
    from .expiry import Expiry
    from .stats import PrefetchStats, SsdStats
    from .store import _Table


class RowLoader:
    """The read path below the caches (any thread for `read_stored`; the rest with the store lock).

    It reads through the write-behind ring (`writeback`), the prefetch pipeline's read-ahead
    buffers, the write-behind log and the LMDB tables (`backend`); rows stamped before their
    table's expiry cutoff (`expiry`) read as missing, and rows stored nowhere as their lazy init.
    """

    def __init__(self, backend: LmdbBackend, writeback: WriteBehind, log: WriteLog, expiry: Expiry,
                 width: int, ssd_stats: SsdStats, prefetch_stats: PrefetchStats) -> None:
        self.backend = backend
        self.writeback = writeback
        self.log = log
        self.expiry = expiry
        self.width = width
        self.ssd_stats = ssd_stats
        self.prefetch_stats = prefetch_stats
        # read-ahead buffers of the prefetch pipeline: table -> [(mark at read, rows, payload, found)]
        self.readahead: dict[str, list[tuple[Any, np.ndarray, np.ndarray, np.ndarray]]] = {}
        # seconds spent reading LMDB inside the store, on the main (training) thread and on others
        self.io_seconds = {"training": 0.0, "background": 0.0}

    def clear_read_ahead(self) -> None:
        """Drop every read-ahead buffer (the store closes)."""
        self.readahead.clear()

    def load(self, tab: _Table, rows: torch.Tensor) -> torch.Tensor:
        """Rows cached nowhere: from the write-behind ring, a read-ahead buffer, or LMDB; [n, width].

        Rows never written are lazily initialized. The ring holds the newest version of every
        row written back recently; a read-ahead buffer holds rows the prefetch pipeline read from
        LMDB when they were in no cache and not in the ring, valid while every row written
        since is still in the ring (so any newer version would have been found there).
        """
        return self.load_many([(tab, rows)])[0]

    def load_many(self, items: list[tuple[_Table, torch.Tensor]]) -> list[torch.Tensor]:
        """`load` of several tables' rows at once: [n, width] per (table, rows), in order.

        The rows no ring or read-ahead buffer holds are read below with one pass over the log
        for all tables (a log read walks every chunk holding a wanted entry, and a few rows of
        each table are spread over most of the log), then table by table from LMDB.
        """
        parts = []  # per item: (rows_np, data, found, known)
        for tab, rows in items:
            spec = tab.spec
            rows_np = rows.numpy()
            n = len(rows_np)
            data = np.zeros((n, spec.row_dim), dtype=np.float32)
            found = np.zeros(n, dtype=bool)
            known = np.zeros(n, dtype=bool)
            if n and self.writeback.tail:
                self.writeback.gather_into(tab.index, rows_np, data, found, known)
            ahead = self.readahead.get(spec.name)
            if ahead and not known.all():
                self._read_ahead(tab, ahead, rows_np, data, found, known)
            parts.append((rows_np, data, found, known))
        self._read_needed(items, parts)
        out = []
        for (tab, _), (rows_np, data, found, _) in zip(items, parts):
            spec = tab.spec
            if self.expiry.cutoffs:  # rows stamped below their table's expiry cutoff read as missing
                data, found = self.expiry.stale_mask(tab.index, data, found, spec.stamp_col)
            if int(np.count_nonzero(found)) < len(rows_np):
                lazy = ~found
                init = spec.init(tab.key, rows_np[lazy], spec.dim)
                data[lazy, : spec.weight_cols] = spec.codec.encode(torch.from_numpy(init)).numpy() \
                    if spec.codec.packed else init
            got = torch.from_numpy(data)
            if spec.row_dim < self.width:  # narrower table: zero tail columns
                got = torch.nn.functional.pad(got, (0, self.width - spec.row_dim))
            out.append(got)
        return out

    def _read_needed(self, items: list[tuple[_Table, torch.Tensor]], parts: list) -> None:
        """Read the rows `load_many` found in no ring or buffer (`known` False) into `parts`:
        the log's entries of all tables in one read, the rest from each table in LMDB."""
        t0 = time.perf_counter()
        need = [np.flatnonzero(~known) for _, _, _, known in parts]
        if not any(len(x) for x in need):
            return
        lkeys, lpos, ltabs, lrows, lseqs, rest = [], [], [], [], [], []
        for k, ((tab, _), (rows_np, _, _, _), at) in enumerate(zip(items, parts, need)):
            seqs = self.log.lookup(tab.index, torch.from_numpy(rows_np[at])) if len(at) else at
            inlog = seqs >= 0
            rest.append(at[~inlog])
            if inlog.any():
                lkeys.append(np.full(int(np.count_nonzero(inlog)), k, dtype=np.int64))
                lpos.append(at[inlog])
                ltabs.append(np.full(len(lpos[-1]), tab.index, dtype=np.int64))
                lrows.append(rows_np[at[inlog]])
                lseqs.append(seqs[inlog])
        if lseqs:  # one pass over the log's chunks for every table's entries
            which, pos = np.concatenate(lkeys), np.concatenate(lpos)
            ldata, lfound = self.read_log_entries(np.concatenate(ltabs), np.concatenate(lrows),
                                                  np.concatenate(lseqs), self.width)
            for k in np.unique(which).tolist():
                sel = np.flatnonzero(which == k)
                (_, data, found, _), w = parts[k], items[k][0].spec.row_dim
                data[pos[sel]] = ldata[sel, :w]
                found[pos[sel]] = lfound[sel]
        for (tab, _), (rows_np, data, found, _), at in zip(items, parts, rest):
            if len(at):
                data[at], found[at] = self.read_table(tab, rows_np[at])
        side = "training" if threading.current_thread() is threading.main_thread() else "background"
        self.io_seconds[side] += time.perf_counter() - t0
        st = self.ssd_stats
        for (tab, _), (_, _, found, _), at in zip(items, parts, need):
            nfound = int(np.count_nonzero(found[at]))
            st.lookups += len(at)
            st.hits += nfound
            st.misses += len(at) - nfound
            st.bytes_read += nfound * (tab.spec.row_dim + 1) * 4

    def read_ahead_mark(self) -> tuple[int, int]:
        """What a read-ahead starting now must remember: (ring tail, log's next sequence number)."""
        with self.log.lock:
            return self.writeback.tail, self.log.next

    def _read_ahead(self, tab: _Table, buffers: list, rows_np: np.ndarray, data: np.ndarray,
                    found: np.ndarray, known: np.ndarray) -> None:
        """Fill rows not yet known from the prefetch pipeline's still-current read-ahead buffers.

        A buffer read after mark (ring tail, log sequence) holds each row's newest version unless
        the row was written back after the mark. Such a row is still in the ring (looked up
        before this), or it left the ring for the log, where it has a sequence number at or past
        the mark's: those rows are read again. Once a merge has taken log entries past the mark
        (the log index no longer shows them), the buffer serves only while the ring has not
        wrapped since the mark. A mark of the ring tail alone (an int) means the latter rule.
        """
        wb = self.writeback
        todo = np.flatnonzero(~known)  # positions still unknown: each buffer searches only these
        # newest first: staging loads the rows its own batch just read, so the newest buffer
        # serves nearly all of them and the older ones search only the few left (any current
        # buffer holds the same newest values, so the order changes no value)
        for since, brows, bdata, bfound in reversed(buffers):
            tail, lseq = since if isinstance(since, tuple) else (since, None)
            wrapped = not wb.still_current(tail)
            if (wrapped and lseq is None) or not len(brows):
                continue
            if not wrapped and HAVE_NUMBA:  # the common case: one compiled pass
                left, f = sorted_gather(brows, bdata, bfound, rows_np, todo, data, found, known)
                self._count_read_ahead(len(todo) - len(left), int(f))
                todo = left
                if not len(todo):
                    return
                continue
            want = rows_np[todo]
            pos = np.searchsorted(brows, want)
            pos[pos >= len(brows)] = 0
            hit = brows[pos] == want
            if hit.any() and wrapped:  # rows written back after the mark are in the log past it
                idx = np.flatnonzero(hit)
                seqs = self.log.lookup(tab.index, torch.from_numpy(want[idx]))
                if self.log.merged > lseq:  # after the lookup: entries past the mark were merged
                    continue
                hit[idx[seqs >= lseq]] = False  # read again
            if hit.any():
                at, src = todo[hit], pos[hit]
                data[at] = bdata[src]
                found[at] = bfound[src]
                known[at] = True
                todo = todo[~hit]
                self._count_read_ahead(len(at), int(np.count_nonzero(bfound[src])))
            if not len(todo):
                return

    def _count_read_ahead(self, k: int, f: int) -> None:
        """Count `k` rows served from read-ahead buffers, `f` of them found in LMDB: read by the
        pipeline's threads, counted at use."""
        st = self.ssd_stats
        st.lookups += k
        st.hits += f
        st.misses += k - f
        self.prefetch_stats.rows_read_ahead += k

    def add_read_ahead(self, table: str, since: int | tuple[int, int], rows: np.ndarray,
                        data: np.ndarray, found: np.ndarray, keep: int) -> None:
        """Register rows the prefetch pipeline read from LMDB (sorted); keeps the newest `keep` buffers."""
        bufs = self.readahead.setdefault(table, [])
        bufs.append((since, rows, data, found))
        del bufs[:-keep]

    def read_stored(self, tab: _Table, rows_np: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Stored rows (log first, then the table): (rows [n, row_dim], found [n]); any thread."""
        spec = tab.spec
        seqs = self.log.lookup(tab.index, torch.from_numpy(rows_np))
        inlog = seqs >= 0
        if not inlog.any():
            return self.read_table(tab, rows_np)
        data = np.zeros((len(rows_np), spec.row_dim), dtype=np.float32)
        found = np.zeros(len(rows_np), dtype=bool)
        idx = np.flatnonzero(inlog)
        data[idx], found[idx] = self.read_log_entries(
            np.full(len(idx), tab.index, dtype=np.int64), rows_np[idx], seqs[idx], spec.row_dim)
        rest = np.flatnonzero(~inlog)
        if len(rest):
            data[rest], found[rest] = self.read_table(tab, rows_np[rest])
        return data, found

    def read_table(self, tab: _Table, rows_np: np.ndarray,
                   ahead: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """Rows of one table in LMDB: (rows [n, row_dim], found [n]); any thread. `ahead`: the
        reads wait on the disk: ask for all their pages first (`LmdbBackend.get`)."""
        return self.backend.get(tab.spec.name, rows_np, tab.spec.row_dim, ahead)

    def read_log_entries(self, tabs: np.ndarray, rows: np.ndarray, seqs: np.ndarray,
                          width: int) -> tuple[np.ndarray, np.ndarray]:
        """Log versions of rows of any tables (table indexes, row ids, sequence numbers from
        `log.lookup`): (rows [n, width], found [n]); any thread. Entries merged into their
        tables meanwhile are read from the tables."""
        log = self.log
        data, found = log.read_entries(tabs, rows, seqs, width)
        merged = np.flatnonzero(~found)
        for t in np.unique(tabs[merged]).tolist():
            sel = merged[tabs[merged] == t]
            w = log.row_dims[t]
            got, gfound = self.backend.get(log.names[t], rows[sel], w)
            data[sel, :w] = got
            found[sel] = gfound
        return data, found
