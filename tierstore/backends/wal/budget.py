"""The write-behind log's bound for page-chunk tables: the largest log the disk goal allows.

A chunked table's merge rewrites every range its batch touches, so a merge of `N` log rows into
tables of `T` rows copies about `T` rows: the cost a row fed falls as the log grows (`T / N`).
What bounds the log is the disk: while the store is open its two files (the tables' and the
log's) must stay within `DISK_BUDGET` times the stored rows' payload bytes. The bound is the
largest log whose entries fit beside the tables' pages and a merge's transient extra (one range
exists twice while it is rewritten; the next one reuses its pages a window later: about one
range), clamped to the log's capacity (its in-memory index) and to half the rows stored (the
merge's cost a row fed is then mostly the log's own rows). docs/design.md, "The log bounded by the
disk budget".
"""

from __future__ import annotations

from dataclasses import dataclass

DISK_BUDGET = 1.9  # the open store's files over the stored rows' payload bytes (the goal 2, less a margin)
MAX_SHARE = 2  # the log holds at most 1 row for every MAX_SHARE rows stored
MERGE_ROOM = 5  # the background merge starts 1 / MERGE_ROOM below the bound: room for appends
TRANSIENT_RANGES = 1.25  # ranges a merge adds to the file: the one written (and a window's lag)


@dataclass(frozen=True)
class DiskShape:
    """What the log's bound is computed from: the chunked tables as they stand."""

    stored_rows: int  # rows the tables store
    raw_bytes: int  # their payload bytes (rows x row_dim x 4): what the budget is a multiple of
    table_bytes: int  # the tables' file: the larger of its size and its pages plus the transient
    entry_bytes: int  # bytes a log entry takes in the log's file (header, payload, check)


def log_bound(shape: DiskShape, capacity: int, least: int, budget: float = DISK_BUDGET) -> int:
    """The most rows the log may hold: the largest log with `shape.table_bytes + rows *
    shape.entry_bytes <= budget * shape.raw_bytes`, at most `shape.stored_rows // MAX_SHARE` and
    `capacity`, and at least `least` (a store too small for the budget merges at `least` rows;
    never above `capacity`)."""
    room = int(budget * shape.raw_bytes) - shape.table_bytes  # whole bytes: exact from here
    rows = room // max(1, shape.entry_bytes) if room > 0 else 0
    rows = min(rows, shape.stored_rows // MAX_SHARE)
    return max(min(least, capacity), min(rows, capacity))


def merge_start(bound: int) -> int:
    """The log's size at which the background merge starts, for a log bounded at `bound` rows:
    `1 / MERGE_ROOM` below it, the room the writer appends into while a merge runs."""
    return max(1, bound - bound // MERGE_ROOM)


def table_bytes(file_bytes: int, page_bytes: int, range_bytes: int) -> int:
    """The tables' file as the next merge leaves it, at least: its size now (a file never
    shrinks), and the tables' pages plus the merge's transient (`TRANSIENT_RANGES` of the
    largest range's bytes)."""
    return max(int(file_bytes), int(page_bytes) + int(TRANSIENT_RANGES * int(range_bytes)))
