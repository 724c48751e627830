"""The stored row record (format v2): `[payload | stamp] float32 words` then a 32-bit check word.

A table's row in LMDB (and in the write-behind log) is its `row_dim` float32 columns (the
embedding, the optimizer state, and the last-update stamp as int32 bits in the last column)
followed by a 32-bit checksum of the row id and those words. Every read from disk verifies it,
so a flipped bit or a row stored under the wrong key is a `StoreCorruptError`, never a silently
different value.

The checksum is a 4-lane multiply-rotate hash over 32-bit words with a final avalanche (in the
spirit of xxHash64, written here): ~20 ns for a 65-word row in numba, vectorized over rows in
numpy when numba is missing. It detects damage; it is not a cryptographic signature.
"""

from __future__ import annotations

import numpy as np

from .._kernels import HAVE_NUMBA
from ..errors import StoreCorruptError

CHECK_BYTES = 4
_P1 = np.uint64(0x9E3779B185EBCA87)
_P2 = np.uint64(0xC2B2AE3D27D4EB4F)
_P3 = np.uint64(0x165667B19E3779F9)
_P4 = np.uint64(0x85EBCA77C2B2AE63)
_SEED = np.uint64(0x7469657273746F72)  # "tierstor"


def _rotl_np(x: np.ndarray, r: int) -> np.ndarray:
    return (x << np.uint64(r)) | (x >> np.uint64(64 - r))


def _checks_numpy(keys: np.ndarray, words: np.ndarray) -> np.ndarray:
    """Reference checksums (numpy, vectorized over rows): uint32 [n]."""
    n, w = words.shape
    k = keys.astype(np.uint64)
    with np.errstate(over="ignore"):
        acc = [(_SEED + k * _P1 + np.uint64(j) * _P4) for j in range(4)]
        for j in range(w):
            lane = j & 3
            acc[lane] = _rotl_np(acc[lane] + words[:, j].astype(np.uint64) * _P2, 31) * _P1
        h = _rotl_np(acc[0], 1) + _rotl_np(acc[1], 7) + _rotl_np(acc[2], 12) + _rotl_np(acc[3], 18)
        h ^= np.uint64(w)
        h ^= h >> np.uint64(33)
        h *= _P2
        h ^= h >> np.uint64(29)
        h *= _P3
        h ^= h >> np.uint64(32)
    return (h & np.uint64(0xFFFFFFFF)).astype(np.uint32)


if HAVE_NUMBA:
    import numba

    @numba.njit(inline="always")
    def _rotl(x, r):  # pragma: no cover - compiled
        return (x << np.uint64(r)) | (x >> np.uint64(64 - r))

    @numba.njit(inline="always")
    def check_row(key, words):  # pragma: no cover - compiled
        """The checksum (uint32) of one row's words (uint32 [w], any stride) under id `key` (uint64)."""
        w = len(words)
        a0 = _SEED + key * _P1
        a1 = a0 + _P4
        a2 = a0 + np.uint64(2) * _P4
        a3 = a0 + np.uint64(3) * _P4
        j = 0
        while j + 4 <= w:
            a0 = _rotl(a0 + np.uint64(words[j]) * _P2, 31) * _P1
            a1 = _rotl(a1 + np.uint64(words[j + 1]) * _P2, 31) * _P1
            a2 = _rotl(a2 + np.uint64(words[j + 2]) * _P2, 31) * _P1
            a3 = _rotl(a3 + np.uint64(words[j + 3]) * _P2, 31) * _P1
            j += 4
        if j < w:
            a0 = _rotl(a0 + np.uint64(words[j]) * _P2, 31) * _P1
        if j + 1 < w:
            a1 = _rotl(a1 + np.uint64(words[j + 1]) * _P2, 31) * _P1
        if j + 2 < w:
            a2 = _rotl(a2 + np.uint64(words[j + 2]) * _P2, 31) * _P1
        h = _rotl(a0, 1) + _rotl(a1, 7) + _rotl(a2, 12) + _rotl(a3, 18)
        h ^= np.uint64(w)
        h ^= h >> np.uint64(33)
        h *= _P2
        h ^= h >> np.uint64(29)
        h *= _P3
        h ^= h >> np.uint64(32)
        return np.uint32(h & np.uint64(0xFFFFFFFF))

    @numba.njit(nogil=True, cache=True)
    def _checks_kernel(keys, words, out):  # pragma: no cover - compiled
        for i in range(words.shape[0]):
            out[i] = check_row(np.uint64(keys[i]), words[i])


def row_checks(keys: np.ndarray, words: np.ndarray) -> np.ndarray:
    """Checksums (uint32 [n]) of rows `words` (uint32 [n, w]) stored under row ids `keys`."""
    keys = np.ascontiguousarray(keys, dtype=np.int64)
    if not HAVE_NUMBA:
        return _checks_numpy(keys, words)
    out = np.empty(len(keys), dtype=np.uint32)
    if len(keys):
        _checks_kernel(keys.view(np.uint64), words, out)
    return out


def seal(keys: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Records for rows float32 [n, w] under ids `keys`: uint8 [n, 4w + 4] (row words, then check)."""
    n, w = rows.shape
    out = np.empty((n, w + 1), dtype=np.uint32)
    out[:, :w] = rows.view(np.uint32)
    out[:, w] = row_checks(keys, out[:, :w])
    return out.view(np.uint8)


def open_records(table: str, keys: np.ndarray, blob: np.ndarray, w: int, where: str = "") -> np.ndarray:
    """Verify records (uint8 [n, 4w + 4] or flat) under ids `keys`; returns their rows float32 [n, w].

    Raises StoreCorruptError naming the table and the first damaged row (after `where`, e.g. the
    store's path).
    """
    n = len(keys)
    nbytes = blob.nbytes if isinstance(blob, np.ndarray) else len(blob)
    if nbytes != n * (w + 1) * 4:  # checked first: a damaged length need not be whole words
        raise StoreCorruptError(
            f"{where}table {table!r}: stored rows have the wrong size (expected {4 * w + CHECK_BYTES} "
            f"bytes per row)")
    words = np.frombuffer(blob, dtype=np.uint32) if not isinstance(blob, np.ndarray) \
        else blob.reshape(-1).view(np.uint32)
    words = words.reshape(n, w + 1)
    body = words[:, :w]
    bad = np.flatnonzero(row_checks(keys, body) != words[:, w])
    if bad.size:
        raise StoreCorruptError(
            f"{where}table {table!r}: row {int(keys[bad[0]])} failed its checksum ({bad.size} damaged "
            f"row(s) in this read); the store file is damaged")
    return body.view(np.float32)


def open_values(table: str, rows: np.ndarray, order: np.ndarray, vals: list, hit: np.ndarray,
                out: np.ndarray, found: np.ndarray, where: str = "") -> None:
    """Verify and decode stored values read in key order into `out` / `found` (in place).

    `vals[i]` is the value of row `rows[order[i]]`; `hit[i]` says which values count as stored
    (an empty value the caller counts as stored fails the size check). `out` is [n, w] float32.
    """
    nhit = int(np.count_nonzero(hit))
    if not nhit:
        return
    dest = order if nhit == len(order) else order[hit]
    blob = np.frombuffer(b"".join(filter(None, vals)), dtype=np.uint8)  # the stored ones, in order
    out[dest] = open_records(table, rows[dest], blob, out.shape[1], where)
    found[dest] = True
