"""A write-behind log left by a crash (or the format-2 log in the tables' file), folded in at open."""

from __future__ import annotations

import lmdb
import numpy as np

from ...config import TableSpec
from ...errors import LogCorruptError, StoreCorruptError
from ..lmdb_log import DROP_HINT, LOG_DB
from ..record import open_records
from .chunks import CHUNK_MAGIC, _chunk_entries, _chunk_table, _last_versions, parse_entries, table_id
from .marks import check_continues, check_owner, merged_record, record_merged
from .merge import fold


def replay(backend, names: list[str], row_dims: list[int]) -> int:
    """Merge a log left by an earlier run into the tables (the newest version of each row wins).

    Returns the rows written. First a log in the tables' own environment (format 2), then the
    log's environment: its entries past the tables' `merged_through` record are folded in, the
    record moves to the log's last entry, the tables are synced and only then are the log's
    files removed, so a crash at any point replays again.
    """
    ids = np.array([table_id(n) for n in names], dtype=np.uint32)
    total = _replay_legacy(backend, names, row_dims, ids)
    db = backend.log_db(LOG_DB, create=False)
    if db is None:
        backend.drop_log_env()
        return total
    done, mine = merged_record(backend)
    check_owner(backend, mine)
    hint = DROP_HINT.format(backend.log_path)
    try:
        chunks = _chunk_table(backend, backend.log_env(), db)
        if chunks is None:
            raise LogCorruptError(f"write-behind log of {backend.path}: a value is not a chunk "
                                  f"(damaged log){hint}")
        chunks = chunks[chunks[:, 0] + chunks[:, 1] - 1 > done]  # wholly merged: skipped
        check_continues(backend, chunks, done)
        if len(chunks):  # (the tables change only once every chunk read back checked)
            _, rows, _ = fold(backend, db, chunks, names, row_dims, ids,
                              lambda tabs, rows, seqs: (_last_versions(tabs, rows, seqs)
                                                        & (seqs > done), seqs))
            total += rows
    except LogCorruptError:
        raise
    except StoreCorruptError as exc:  # a chunk or a row record of the log: the log is damaged
        raise LogCorruptError(f"{exc}{hint}") from exc
    if len(chunks):
        record_merged(backend, int(chunks[-1, 0] + chunks[-1, 1] - 1), mine)
        backend.sync()
    backend.drop_log_env()
    return total


def replay_stored(backend) -> int:
    """`replay` for a store opened without its specs (export, offline compaction, upgrade): the
    tables' names and row sizes come from its metadata. Returns the rows written."""
    specs = [TableSpec.from_config(backend.get_meta(k)) for k in backend.meta_keys()
             if k.startswith("table:")]
    return replay(backend, [t.name for t in specs], [t.row_dim for t in specs])


def _replay_legacy(backend, names: list[str], row_dims: list[int], ids: np.ndarray) -> int:
    """Merge and drop a log kept in the tables' environment (format 2); rows written."""
    try:
        db = backend.open_named(LOG_DB, create=False)
    except lmdb.NotFoundError:
        return 0
    chunks = _chunk_table(backend, backend.env, db)
    total = 0
    if chunks is None:  # one-row values of logs written before chunks
        total = _replay_values(backend, db, names, row_dims, ids)
    elif len(chunks):  # chunks: merged like a log in use
        _, total, _ = fold(backend, db, chunks, names, row_dims, ids,
                           lambda tabs, rows, seqs: (_last_versions(tabs, rows, seqs), seqs),
                           env=backend.env)
    with backend.env.begin(write=True) as txn:
        txn.drop(db, delete=True)
    backend.sync()
    return total


def _replay_values(backend, db, names: list[str], row_dims: list[int], ids: np.ndarray) -> int:
    """Write the newest rows of a log holding one-row values (written before chunks); rows written."""
    with backend.reading(), backend.env.begin(db=db) as txn:
        vals = []  # one bytes per row, in log order (chunks expanded)
        for v in txn.cursor().iternext(keys=False, values=True):
            v = bytes(v)
            if v[:4] == CHUNK_MAGIC:
                size, count = int.from_bytes(v[4:8], "little"), int.from_bytes(v[8:12], "little")
                blob = _chunk_entries(v, count, size, backend.path)
                vals += blob.view(f"V{size}").ravel().tolist()
            else:  # a one-row value (logs written before chunks)
                vals.append(v)
    keyed = list(parse_entries(vals, ids, row_dims, backend.path))
    keep = np.zeros(len(vals), dtype=bool)  # by log position
    keep[np.concatenate([k[0] for k in keyed])] = _last_versions(
        *(np.concatenate([k[i] for k in keyed]) for i in (1, 2, 0)))
    batches = {}
    total = 0
    for sel, t_, r_, recs in keyed:
        mask = keep[sel]
        for t in np.unique(t_[mask]).tolist():
            pick = mask & (t_ == t)
            data = open_records(names[t], r_[pick], recs[pick], row_dims[t], f"store {backend.path}, ")
            prev = batches.get(names[t])
            batches[names[t]] = (r_[pick], data) if prev is None else \
                (np.concatenate([prev[0], r_[pick]]), np.concatenate([prev[1], data]))
            total += int(pick.sum())
    backend.put(batches)
    return total
