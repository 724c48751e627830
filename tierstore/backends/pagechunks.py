"""Page-sized sorted chunks: the unit of format 4's levels, sized for the cold regime.

A level (a table's base, or one of its runs) is an LMDB database of chunks written in id order
with `MDB_APPEND`. Each chunk holds up to `capacity(record_bytes)` consecutive rows under the
8-byte big-endian id of its first row; every chunk's value has the same size, at most
`VALUE_MAX` bytes, so two of them and their nodes fill a 4 KiB leaf page and no value goes to
overflow pages:

    head (16 bytes: count u32, capacity u32, check of the ids u32, 0 u32) | ids int64 [capacity]
    | records [capacity] (the tables' own: row words, then their checksum; `record.py`)

Why pages and not `runs.py`'s 4,096-row chunks (docs/design.md, "Format 4, corrected"): a
table of 10^11 rows lives mostly on the disk, where a row read is one random page read. A row
of a B-tree entry, or of a page-sized chunk, is found through branch pages that stay cached and
one leaf page; a row of a 1 MB chunk costs a binary search over its id array (3-4 more pages)
before its record's page. Page-sized chunks keep the one read, and pack denser than one B-tree
entry a row (no node header or key a row: 14 rows of 272 bytes a page, 50 of 72 bytes against
41 as entries), with one LMDB put per chunk, not per row.

A lookup walks the B-tree with the page reader (`PageReader.floor_spans`: the chunk under the
greatest key <= the id) and searches the chunk in place, in numba: the chunk's count and ids
checked (their own checksum: a damaged id would hide its row), the record's checksum verified
by `record.open_records` as for any stored row.
"""

from __future__ import annotations

import lmdb
import numpy as np

from .._kernels import HAVE_NUMBA
from ..errors import StoreCorruptError, TierstoreError
from .lmdb_common import encode_keys
from .pages import PageReader
from .record import open_records, row_checks

VALUE_MAX = 2024  # (4096 - 16-byte page header) / 2, less a node's 8-byte header and 8-byte key
HEAD = 16
TXN_CHUNKS = 8192  # chunks a write transaction (~16 MB)


ROW_WORDS_MAX = (VALUE_MAX - HEAD - 8 - 4) // 4  # the widest row (float32 words) a chunk holds


def fits(record_bytes: int) -> bool:
    """Whether a chunk holds at least one record of `record_bytes` bytes."""
    return (VALUE_MAX - HEAD) // (8 + int(record_bytes)) >= 1


def capacity(record_bytes: int) -> int:
    """Rows a chunk holds for records of `record_bytes` bytes."""
    cap = (VALUE_MAX - HEAD) // (8 + int(record_bytes))
    if cap < 1:
        raise TierstoreError(f"records of {record_bytes} bytes do not fit a page-sized chunk")
    return cap


def value_bytes(record_bytes: int) -> int:
    """Every chunk value's size for records of `record_bytes` bytes."""
    return HEAD + capacity(record_bytes) * (8 + int(record_bytes))


def ids_check(ids: np.ndarray) -> np.ndarray:
    """The check word of each row of chunk ids ([c, capacity] int64, unused tail zeros): the
    records' own checksum over the ids' words, keyed by the first id."""
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    return row_checks(ids[:, 0], ids.view(np.uint32))


def pack(ids: np.ndarray, records: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sorted rows (ids int64 [n], strictly increasing, >= 0; records uint8 [n, record bytes])
    as chunks: (first ids int64 [c], values uint8 [c, value bytes])."""
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    n = len(ids)
    if records.ndim != 2 or records.shape[0] != n:
        raise TierstoreError(f"chunk records are [n, bytes], got {records.shape} for {n} ids")
    rb = records.shape[1]
    cap = capacity(rb)
    if n and (int(ids[0]) < 0 or (n > 1 and not bool(np.all(ids[1:] > ids[:-1])))):
        raise TierstoreError("chunk ids must be non-negative and increasing")
    c = -(-n // cap)
    full, rest = divmod(n, cap)
    vals = np.zeros((c, value_bytes(rb)), dtype=np.uint8)
    # each row copied once, straight into its chunk's value (unused tail slots stay zero)
    pid = vals[:, HEAD : HEAD + 8 * cap].view(np.int64)
    prec = vals[:, HEAD + 8 * cap :].reshape(c, cap, rb)
    pid[:full] = ids[: full * cap].reshape(full, cap)
    prec[:full] = records[: full * cap].reshape(full, cap, rb)
    if rest:
        pid[full, :rest] = ids[full * cap :]
        prec[full, :rest] = records[full * cap :]
    head = vals[:, :HEAD].view(np.uint32)
    head[:, 0] = cap
    if rest:
        head[-1, 0] = rest
    head[:, 1] = cap
    head[:, 2] = ids_check(pid)
    return pid[:, 0].copy(), vals


def write(env: lmdb.Environment, db: object, ids: np.ndarray, records: np.ndarray,
          txn_chunks: int = TXN_CHUNKS) -> int:
    """Append sorted rows as chunks to `db` (empty, or holding only smaller ids), `txn_chunks`
    chunks a write transaction; returns the chunks written."""
    firsts, vals = pack(ids, records)
    keys = encode_keys(firsts)
    for lo in range(0, len(keys), txn_chunks):
        part = list(zip(keys[lo : lo + txn_chunks], vals[lo : lo + txn_chunks]))
        with env.begin(write=True, db=db) as txn:
            _, added = txn.cursor().putmulti(part, append=True)
            if added != len(part):
                raise TierstoreError("a chunk was refused: its database holds larger ids")
    return len(keys)


if HAVE_NUMBA:
    import numba

    from .chunk_kernels import prefetch_at
    from .record import check_row

    SEARCH_AHEAD = 8  # keys ahead whose chunk head and ids a search asks for
    RECORD_AHEAD = 4  # keys ahead whose record a search finds and asks for

    @numba.njit(nogil=True, cache=True, inline="always")
    def _find(mem, off, cap, want):  # pragma: no cover - compiled
        """The slot of id `want` in the chunk at `off` (-1: absent), or -2: its count is out of
        range."""
        count = np.int64(mem[off]) | (np.int64(mem[off + 1]) << 8) | \
            (np.int64(mem[off + 2]) << 16) | (np.int64(mem[off + 3]) << 24)
        if count < 1 or count > cap:
            return -2
        ids = mem[off + HEAD : off + HEAD + 8 * cap].view(np.int64)
        lo, hi = 0, count - 1
        while lo <= hi:
            mid = (lo + hi) >> 1
            v = ids[mid]
            if v == want:
                return mid
            if v < want:
                lo = mid + 1
            else:
                hi = mid - 1
        return -1

    @numba.njit(nogil=True, cache=True)
    def _search(mem, offs, lens, keys, cap, rb, vb, out, found):  # pragma: no cover - compiled
        """Each key's record out of its chunk (at offs[i]) into out[i]: 0, or 1 + the index of
        the key whose chunk is damaged (its size, count or ids' check).

        Three stages a key apart in time, so that its misses overlap other keys' work: its
        chunk's head and ids asked for (`SEARCH_AHEAD` keys ahead), its id searched and its
        record's lines asked for (`RECORD_AHEAD` keys ahead), its record copied."""
        base = mem.ctypes.data
        n = keys.shape[0]
        slot = np.full(RECORD_AHEAD, -1, dtype=np.int64)  # a ring of the searched keys' slots
        for t in range(n + RECORD_AHEAD):
            a = t + SEARCH_AHEAD - RECORD_AHEAD
            if a < n and offs[a] >= 0:  # a later key's head and ids
                ahead = base + offs[a]
                prefetch_at(ahead)
                prefetch_at(ahead + 64)
                prefetch_at(ahead + 128)
            j = t  # the key searched now, its record asked for
            if j < n:
                s = -1
                off = offs[j]
                if off >= 0:
                    if lens[j] != vb:
                        return 1 + j
                    s = _find(mem, off, cap, np.int64(keys[j]))
                    if s == -2:
                        return 1 + j
                    if s >= 0:
                        at = base + off + HEAD + 8 * cap + s * rb
                        for b in range(0, rb + 63, 64):
                            prefetch_at(at + b)
                slot[j % RECORD_AHEAD] = s
            i = t - RECORD_AHEAD + 1  # the key whose record is copied now
            if i < 0 or (i >= n):
                continue
            s = slot[i % RECORD_AHEAD]
            off = offs[i]
            if off < 0:
                continue
            if s >= 0:  # found: its record carries its own checksum (checked by the caller)
                at = off + HEAD + 8 * cap + s * rb
                out[i, :] = mem[at : at + rb]
                found[i] = True
                continue
            # absent: the ids must be the chunk's own (a damaged id could hide its row)
            ids = mem[off + HEAD : off + HEAD + 8 * cap].view(np.int64)
            chk = np.uint32(mem[off + 8]) | (np.uint32(mem[off + 9]) << np.uint32(8)) | \
                (np.uint32(mem[off + 10]) << np.uint32(16)) | (np.uint32(mem[off + 11]) << np.uint32(24))
            if check_row(np.uint64(ids[0]), ids.view(np.uint32)) != chk:
                return 1 + i
        return 0


def lookup(reader: PageReader, txn: lmdb.Transaction, db_name: bytes, table: str,
           ids: np.ndarray, row_dim: int, where: str = "") -> tuple[np.ndarray, np.ndarray] | None:
    """(rows float32 [n, row_dim], found bool [n]) of sorted, distinct `ids` in the level named
    `db_name`, read in the open transaction `txn` (its pages stay put while it is open); every
    record's checksum verified (damage: a `StoreCorruptError` whose message starts with `where`,
    e.g. "store PATH, "). None: the page walk met a layout it does not read."""
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    rb = 4 * int(row_dim) + 4
    n = len(ids)
    spans = reader.floor_spans(txn.get(db_name), ids.astype(np.uint64))
    if spans is None:
        return None
    mem, offs, lens = spans
    recs = np.empty((n, rb), dtype=np.uint8)
    found = np.zeros(n, dtype=bool)
    bad = _search(mem, offs, lens, ids, capacity(rb), rb, value_bytes(rb), recs, found)
    if bad:
        raise StoreCorruptError(f"{where}table {table!r}: the chunk holding row {int(ids[bad - 1])} is "
                                f"damaged (its size, count or ids)")
    if found.all():  # (the common case: no masked copies)
        return open_records(table, ids, recs.ravel(), int(row_dim), f"{where}chunk, "), found
    rows = np.zeros((n, int(row_dim)), dtype=np.float32)
    if found.any():
        rows[found] = open_records(table, ids[found], recs[found], int(row_dim), f"{where}chunk, ")
    return rows, found
