"""The log's value format: chunks of entries, each entry a table id, a row id and a record."""

from __future__ import annotations

import zlib

import numpy as np

from ...errors import StoreCorruptError

HEADER = 16  # table id u32, pad u32, row id i64
CHUNK_MAGIC = b"TSLC"
CHUNK_HEADER = 16  # magic, entry size u32, count u32, pad u32
_SEQ = np.dtype(">u8")


def table_id(name: str) -> int:
    """The stable 32-bit id of a table in log records."""
    return zlib.crc32(name.encode())


def _seq_keys(seqs: np.ndarray) -> list[bytes]:
    """LMDB keys of chunks: 8-byte big-endian sequence numbers."""
    return np.ascontiguousarray(seqs, dtype=_SEQ).view("V8").tolist()


def _by_chunk(at: np.ndarray, sel: np.ndarray) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """Entries `sel` grouped by their chunk `at[sel]` with one sort: (sel in chunk order, the
    chunks used, bounds), so chunk `used[j]` holds `sel[bounds[j] : bounds[j + 1]]`."""
    sel = sel[np.argsort(at[sel], kind="stable")]
    used, starts = np.unique(at[sel], return_index=True)
    return sel, used, np.append(starts, len(sel)).tolist()


def _chunk_count(val) -> int:
    """Rows in a log value: a chunk's count, or 1 for a one-row value of an older log."""
    head = bytes(val[:CHUNK_HEADER])
    if head[:4] == CHUNK_MAGIC and len(head) == CHUNK_HEADER:
        return int.from_bytes(head[8:12], "little")
    return 1


def _chunk_entries(val, count: int, size: int, path: object) -> np.ndarray:
    """A chunk's entries, uint8 [count, size] (a view of `val`), checked against its header."""
    if val is None:
        raise StoreCorruptError(f"write-behind log of {path}: a chunk is missing")
    arr = np.frombuffer(val, dtype=np.uint8)
    head = arr[:CHUNK_HEADER].tobytes()
    if head[:4] != CHUNK_MAGIC or int.from_bytes(head[4:8], "little") != size or \
            int.from_bytes(head[8:12], "little") != count or len(arr) != CHUNK_HEADER + count * size:
        raise StoreCorruptError(f"write-behind log of {path}: a chunk's header does not match "
                                f"its size (damaged log)")
    return arr[CHUNK_HEADER:].reshape(count, size)


def parse_entries(vals: list, ids: np.ndarray, row_dims: list[int], path: object):
    """Group log values by size: yields (positions, table indexes, row ids, records uint8 [k, 4w+4])."""
    if not vals:
        return
    lens = np.fromiter(map(len, vals), dtype=np.int64, count=len(vals))
    arr = np.empty(len(vals), dtype=object)
    arr[:] = vals
    for size in np.unique(lens).tolist():
        sel = np.flatnonzero(lens == size)
        blob = np.frombuffer(b"".join(arr[sel].tolist()), dtype=np.uint8).reshape(len(sel), size)
        yield parse_blob(sel, blob, ids, row_dims, path)


def parse_blob(sel: np.ndarray, blob: np.ndarray, ids: np.ndarray, row_dims: list[int], path: object):
    """Log entries of one size (uint8 [k, size]) at log positions `sel`: (positions, table
    indexes, row ids, records uint8 [k, 4w+4]); StoreCorruptError for an unknown table or size."""
    size = blob.shape[1]
    order = np.argsort(ids)
    widths = np.array([HEADER + 4 * w + 4 for w in row_dims])
    tid = blob[:, 0:4].copy().view(np.uint32).ravel()
    pos = np.searchsorted(ids[order], tid)
    pos[pos >= len(ids)] = 0
    tabs = order[pos]
    if len(ids) == 0 or (ids[tabs] != tid).any() or (widths[tabs] != size).any():
        raise StoreCorruptError(f"write-behind log of {path}: an entry of an unknown table or "
                                "with the wrong size")
    rows = blob[:, 8:16].copy().view("<i8").ravel()
    # records as uint32 words: picking rows of them copies words, not single bytes
    return sel, tabs.astype(np.int64), rows, blob.view(np.uint32)[:, HEADER // 4 :]


def _chunk_table(backend, env, db) -> np.ndarray | None:
    """(first sequence number, row count, entry size) of every chunk of a log database, in key
    order, from their headers; None when a value is not a chunk."""
    with backend.reading(), env.begin(db=db, buffers=True) as txn:
        heads = [(int.from_bytes(k, "big"), bytes(v[:CHUNK_HEADER]))
                 for k, v in txn.cursor().iternext(keys=True, values=True)]
    if any(h[:4] != CHUNK_MAGIC or len(h) != CHUNK_HEADER for _, h in heads):
        return None
    return np.array([(k, int.from_bytes(h[8:12], "little"), int.from_bytes(h[4:8], "little"))
                     for k, h in heads], dtype=np.int64).reshape(-1, 3)


def _last_versions(tabs: np.ndarray, rows: np.ndarray, seqs: np.ndarray) -> np.ndarray:
    """Mask of the entries that are the last (largest sequence number) of their (table, row)."""
    order = np.lexsort((seqs, rows, tabs))
    last = np.ones(len(order), dtype=bool)
    last[:-1] = (tabs[order][1:] != tabs[order][:-1]) | (rows[order][1:] != rows[order][:-1])
    keep = np.zeros(len(order), dtype=bool)
    keep[order[last]] = True
    return keep
