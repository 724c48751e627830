"""The tables' record of the log: merged through which entry, the store's identity, pairing checks."""

from __future__ import annotations

import uuid

import numpy as np

from ...errors import LogCorruptError, StoreCorruptError
from ..lmdb_log import DROP_HINT

MERGED_KEY = "log"  # metadata record of the tables: {"merged_through": int, "store": 32 hex digits}


def merged_record(backend) -> tuple[int, str | None]:
    """(the last sequence number the tables hold the log through, -1 when none; the store's
    identity, None for a store made before identities); StoreCorruptError when damaged."""
    rec = backend.get_meta(MERGED_KEY) or {}
    through, owner = rec.get("merged_through", -1), rec.get("store")
    if isinstance(through, bool) or not isinstance(through, int) or through < -1 or (
            owner is not None and not (isinstance(owner, str) and len(owner) == 32
                                       and all(c in "0123456789abcdef" for c in owner))):
        raise StoreCorruptError(f"store {backend.path}: metadata record {MERGED_KEY!r} is damaged")
    return through, owner


def merged_through(backend) -> int:
    """The last sequence number the tables hold the log through (-1 when none was recorded)."""
    return merged_record(backend)[0]


def store_identity(backend) -> str | None:
    """The store's identity, which its log carries too (None for a store that never had one)."""
    return merged_record(backend)[1]


def record_merged(backend, last: int, owner: str | None) -> None:
    """Record in the tables' environment that they hold the log through sequence number `last`
    (and the store's identity `owner`, kept in the same record)."""
    rec = {"merged_through": int(last)}
    if owner is not None:
        rec["store"] = owner
    backend.put_meta({MERGED_KEY: rec})


def own_log(backend) -> str:
    """Give the store an identity if it has none (stores made before identities) and write it
    into the log's environment, so a replay can tell its log from another store's."""
    through, owner = merged_record(backend)
    if owner is None:
        owner = uuid.uuid4().hex
        record_merged(backend, through, owner)
    if backend.log_owner() != owner:
        backend.set_log_owner(owner)
    return owner


def check_owner(backend, mine: str | None) -> None:
    """StoreCorruptError when the log's environment names another store than the tables'."""
    owner = backend.log_owner()
    if owner is not None and mine is not None and owner != mine:
        raise LogCorruptError(f"write-behind log of {backend.path}: it belongs to another store "
                                f"(store {owner}; these tables are store {mine})"
                                f"{DROP_HINT.format(backend.log_path)}")


def check_continues(backend, chunks: np.ndarray, done: int) -> None:
    """StoreCorruptError unless the log's chunks past `done` are contiguous and continue the tables.

    A merge records its last sequence number in the tables before it deletes its chunks, so
    the unmerged part of a consistent pair's log starts at or below `done + 1` (chunks wholly at
    or below `done` are left out: a log whose removal failed after a replay keeps them, and new
    entries then start at `done + 1`). A log starting past it was
    merged into a tables file that is not this one: data.mdb was put back from an older copy,
    or an OS crash lost the tables' writes since their last sync but not the log's deletes.
    Replaying it would mix two states, missing the rows merged in between.
    """
    if not len(chunks):
        return
    where = f"write-behind log of {backend.path}"
    hint = DROP_HINT.format(backend.log_path)
    ends = chunks[:, 0] + chunks[:, 1]
    gap = np.flatnonzero(chunks[1:, 0] != ends[:-1])
    if gap.size:
        raise LogCorruptError(f"{where}: entries {int(ends[gap[0]])} to "
                                f"{int(chunks[gap[0] + 1, 0]) - 1} are missing (damaged log){hint}")
    if int(chunks[0, 0]) > done + 1:
        raise LogCorruptError(
            f"{where}: it starts at entry {int(chunks[0, 0])}, but the tables hold the log only "
            f"through entry {done}: the entries in between were merged into another tables "
            f"file (data.mdb replaced by an older copy, or its writes lost in an OS crash){hint}")
