"""One batch's stored rows read ahead as parallel tasks: the log once for all tables, then LMDB."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import numpy as np
import torch


def _timed(fn: Callable, *args: Any) -> tuple[Any, float]:
    """(fn(*args), seconds it took): reader threads time their own work."""
    t0 = time.perf_counter()
    return fn(*args), time.perf_counter() - t0


class StoredReads:
    """Rows of a batch's tables that no cache holds, read below the caches on reader threads.

    A log read visits every chunk holding a wanted entry, and a batch's entries of any one table
    are spread over nearly all of the log: so the log entries of all tables are read together,
    in parts of about `part_rows` entries in sequence order (each part walks its own chunks once),
    and each table's other rows are read from LMDB in parts of `part_rows` rows. An entry merged
    into its table meanwhile is read from the table by the same task. `result()` waits for the
    tasks and gives each table's rows in the order they were asked for. Start it after the
    read-ahead mark (`store.read_ahead_mark`), like any read the pipeline keeps.
    """

    def __init__(self, store: Any, cold: dict[Any, tuple[Any, np.ndarray]],
                 submit: Callable[..., Future], part_rows: int) -> None:
        self.cold = cold
        self._keys = list(cold)  # a log part's entries name their table by position in this list
        self._table_parts: list[tuple[Any, np.ndarray, Future]] = []
        self._log_parts: list[tuple[np.ndarray, np.ndarray, Future]] = []
        lkeys, lpos, ltabs, lrows, lseqs = [], [], [], [], []
        for k, key in enumerate(self._keys):
            tab, rows = cold[key]
            if not len(rows):
                continue
            seqs = store.log.lookup(tab.index, torch.from_numpy(rows))
            inlog = seqs >= 0
            rest = np.flatnonzero(~inlog)
            for pos in np.array_split(rest, max(1, len(rest) // part_rows)):
                if len(pos):
                    self._table_parts.append(
                        (key, pos, submit(_timed, store.read_table, tab, rows[pos])))
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
                self._log_parts.append(
                    (which[sel], pos[sel],
                     submit(_timed, store.read_log_entries, tabs[sel], rows[sel], seqs[sel], width)))

    def result(self) -> tuple[dict[Any, tuple[np.ndarray, np.ndarray]], float]:
        """({key: (rows [n, row_dim], found [n])} in the order asked, reader seconds in all)."""
        out = {}
        for key, (tab, rows) in self.cold.items():
            w = tab.spec.row_dim
            out[key] = (np.zeros((len(rows), w), dtype=np.float32), np.zeros(len(rows), dtype=bool))
        seconds = 0.0
        for key, pos, fut in self._table_parts:
            (data, found), sec = fut.result()
            out[key][0][pos] = data
            out[key][1][pos] = found
            seconds += sec
        for which, pos, fut in self._log_parts:
            (data, found), sec = fut.result()
            seconds += sec
            for k in np.unique(which).tolist():
                sel = np.flatnonzero(which == k)
                dst_data, dst_found = out[self._keys[k]]
                dst_data[pos[sel]] = data[sel, : dst_data.shape[1]]
                dst_found[pos[sel]] = found[sel]
        return out, seconds
