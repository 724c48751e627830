"""Names every part of the LMDB backend shares: file and database names, row keys, read chunks."""

from __future__ import annotations

import numpy as np

from ..errors import StoreCorruptError
from .lmdb_meta import DATA_NAME as DATA_NAME  # re-exported
from .lmdb_meta import META_DB as META_DB  # re-exported

COMPACT_PREFIX = ".compact-"
# keys per C-level read or write loop between checks of the mapped pages: a page fault maps up
# to 16 neighbouring pages (fault-around), so 1,024 random keys can map up to 64 MiB
GET_CHUNK = 1024
_KEY_DTYPE = np.dtype(">u8")  # big-endian: byte order == row id order
_KEY_VOID = np.dtype("V8")  # raw 8-byte records: `.tolist()` gives `bytes` (no NUL stripping)


def encode_keys(rows: np.ndarray) -> list[bytes]:
    """Encode row ids as 8-byte big-endian keys that sort like the ids."""
    # one C pass: a void view's tolist() yields one 8-byte `bytes` per id ("S8" would strip NULs)
    return np.ascontiguousarray(rows, dtype=_KEY_DTYPE).ravel().view(_KEY_VOID).tolist()


def decode_keys(keys: list[bytes], where: str = "a store") -> np.ndarray:
    """Inverse of `encode_keys`; `where` names the store in the error for a damaged key."""
    blob = b"".join(keys)
    if len(blob) != 8 * len(keys):
        raise StoreCorruptError(f"{where}: a stored row key is not 8 bytes long (damaged store)")
    return np.frombuffer(blob, dtype=_KEY_DTYPE).astype(np.int64)
