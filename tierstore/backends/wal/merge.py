"""The merge of log entries into the tables: the newest versions, key-sorted, in pieces."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ...errors import StoreCorruptError
from ..record import open_records
from .chunks import HEADER, _by_chunk, _chunk_entries, _seq_keys, parse_blob

MERGE_ROWS = 131072  # rows per piece of a merge's key-sorted writes (bounds its memory)


def fold(backend, db, chunks: np.ndarray, names: list[str], row_dims: list[int], ids: np.ndarray,
         newest: Callable, env=None) -> tuple[int, int, tuple[np.ndarray, np.ndarray]]:
    """Write the newest versions held by these log chunks (first, count, entry size) into the
    tables, in key order; returns (bytes written, rows written, what `newest` gave for them).

    The whole merge is sorted by (table, row) before anything is written, so each leaf page of a
    table is rewritten once per merge however many of its rows the merge holds; the records are
    gathered from the mapped chunks in pieces of at most `MERGE_ROWS` rows of one table, so the
    merge's memory is its keys (~40 bytes a row) plus one piece. `newest(tabs, rows, seqs)` gives
    (mask of the entries to write, a per-entry value returned with those entries). `env` is the
    environment holding `db` (None: the log's own; the tables' for a log of format 2).
    """
    keys = _seq_keys(chunks[:, 0])
    path = backend.path

    def headers(vals):  # table, row and sequence number of every entry: headers only
        out = []
        for v, (first, count, size) in zip(vals, chunks.tolist()):
            blob = _chunk_entries(v, count, size, path)
            _, tabs, rows, _ = parse_blob(None, blob, ids, row_dims, path)
            out.append((tabs, rows, np.arange(first, first + count, dtype=np.int64)))
        return [np.concatenate(c) for c in zip(*out)]

    tabs, rows, seqs = backend.log_chunks(db, keys, headers, env)
    keep, extra = newest(tabs, rows, seqs)
    sel = np.flatnonzero(keep)
    out = len(sel), (extra[sel], seqs[sel])
    written = 0
    chunked = np.array([backend.is_chunked(n) for n in names], dtype=bool)
    if chunked.any():  # format 4: each chunked table's rows in one merge
        mine = chunked[tabs[sel]]
        if mine.any():
            part = sel[mine]
            written = _fold_into_chunks(backend, db, chunks, names, row_dims, tabs[part],
                                        rows[part], seqs[part], env)
        sel = sel[~mine]  # the rest: tables kept as B-trees (rows too wide for a chunk)
    # key order: by table, then row (row ids are < 2**63; one argsort per table present)
    by_tab = sel[np.argsort(tabs[sel], kind="stable")]
    tcuts = np.flatnonzero(np.diff(tabs[by_tab])) + 1
    order = np.concatenate([part[np.argsort(rows[part])] for part in np.split(by_tab, tcuts)]) \
        if len(by_tab) else by_tab
    cuts = np.flatnonzero(np.diff(tabs[order])) + 1  # one table per piece, then MERGE_ROWS each
    # no edges when every entry was superseded by a later one: nothing to write
    edges = np.concatenate([[0], cuts, [len(order)]]).tolist() if len(order) else []
    for lo, end in zip(edges[:-1], edges[1:]):
        t = int(tabs[order[lo]])
        for a in range(lo, end, MERGE_ROWS):
            part = order[a : min(a + MERGE_ROWS, end)]
            recs = _gather(backend, db, chunks, seqs[part], HEADER + 4 * row_dims[t] + 4, path, env)
            open_records(names[t], rows[part], recs, row_dims[t], f"store {path}, ")  # verified
            written += backend.put({names[t]: (rows[part], recs)}, sealed=True)
    return written, *out


def _fold_into_chunks(backend, db, chunks: np.ndarray, names: list[str], row_dims: list[int],
                      tabs: np.ndarray, rows: np.ndarray, seqs: np.ndarray, env=None) -> int:
    """`fold` into chunked tables: per table, its newest entries sorted by row and merged in
    one `chunk_merge_gather`, the records copied once from the log's map (inside one read of
    the log) into the rewritten ranges; returns bytes written (records and ids)."""
    path = backend.path
    at = np.searchsorted(chunks[:, 0], seqs, side="right") - 1  # each entry's chunk
    row_in = seqs - chunks[at, 0]  # and its row there
    present = np.unique(tabs).tolist()
    for t in present:  # the map grows first: growing waits for readers, and the merge is one
        backend.chunk_room(names[t], row_dims[t], int(np.count_nonzero(tabs == t)))

    def merge(vals):
        arrays = []
        for v, (_, count, size) in zip(vals, chunks.tolist()):
            arrays.append(_chunk_entries(v, count, size, path).view(np.uint32))
        for t in present:
            mine = np.flatnonzero(tabs == t)
            mine = mine[np.argsort(rows[mine])]  # distinct (each key's newest): any sort, the
            # fastest (5x a stable one on random ids; the level refuses ids out of order)
            # the chunks of this table's entry size (a chunk holds entries of one size)
            same = np.flatnonzero(chunks[:, 2] == HEADER + 4 * row_dims[t] + 4)
            renum = np.full(len(chunks), -1, dtype=np.int64)
            renum[same] = np.arange(len(same))
            backend.chunk_merge_gather(names[t], row_dims[t], rows[mine], [arrays[c] for c in same],
                                       renum[at[mine]], row_in[mine], HEADER // 4)

    backend.log_chunks(db, _seq_keys(chunks[:, 0]), merge, env)
    return int(sum((4 * row_dims[t] + 4 + 8) * int(np.count_nonzero(tabs == t)) for t in present))


def _gather(backend, db, chunks: np.ndarray, seqs: np.ndarray, size: int, path: object,
            env=None) -> np.ndarray:
    """Records (uint8 [n, size - HEADER]) of log entries by sequence number, copied out of the map."""
    at = np.searchsorted(chunks[:, 0], seqs, side="right") - 1
    by, used, bounds = _by_chunk(at, np.arange(len(seqs)))
    out = np.empty((len(seqs), size - HEADER), dtype=np.uint8)

    def copy(vals):
        for i, (c, v) in enumerate(zip(used.tolist(), vals)):
            blob = _chunk_entries(v, int(chunks[c, 1]), int(chunks[c, 2]), path)
            if blob.shape[1] != size:
                raise StoreCorruptError(f"write-behind log of {path}: an entry has the wrong size")
            mine = by[bounds[i] : bounds[i + 1]]
            out[mine] = blob[seqs[mine] - chunks[c, 0], HEADER:]

    backend.log_chunks(db, _seq_keys(chunks[used, 0]), copy, env)
    return out
