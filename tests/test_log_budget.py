"""The write-behind log's bound for chunked tables (`tierstore/backends/wal/budget.py`): the
largest log the disk budget allows, within its clamps; pure arithmetic, no store."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.profiles import examples
from tierstore.backends.wal import budget
from tierstore.backends.wal.budget import DiskShape, log_bound, merge_start, table_bytes


def _disk(shape: DiskShape, rows: int) -> int:
    """The open store's files with a log of `rows` rows, as the bound counts them."""
    return shape.table_bytes + rows * shape.entry_bytes


shapes = st.builds(
    lambda rows, width, fill, entry_extra, extra: DiskShape(
        rows, rows * 4 * width, int(rows * 4 * width * fill) + extra, 4 * width + entry_extra),
    st.integers(0, 10**11), st.integers(1, 500), st.floats(0.5, 3.0),
    st.integers(0, 64), st.integers(0, 1 << 30))


@settings(max_examples=examples(4), deadline=None)
@given(shapes, st.integers(1, 1 << 26), st.integers(1, 1 << 20),
       st.floats(1.0, 4.0))
def test_the_bound_keeps_the_budget_and_its_clamps(shape, capacity, least, goal):
    """Never above the capacity nor half the rows stored (unless the least wins); never below the
    least (unless the capacity is smaller); above the least, the log fits the budget beside the
    tables; and it is the largest that does (one row more breaks the budget or a clamp)."""
    b = log_bound(shape, capacity, least, goal)
    floor = min(least, capacity)
    assert floor <= b <= capacity
    assert b <= max(floor, shape.stored_rows // budget.MAX_SHARE)
    if b > floor:
        assert _disk(shape, b) <= goal * shape.raw_bytes
    if b < min(capacity, shape.stored_rows // budget.MAX_SHARE):
        assert b <= floor or _disk(shape, b + 1) > goal * shape.raw_bytes
        assert b > floor or _disk(shape, floor + 1) > goal * shape.raw_bytes


@settings(max_examples=examples(2), deadline=None)
@given(st.integers(1, 1 << 26))
def test_the_merge_starts_a_fifth_below_the_bound(bound):
    start = merge_start(bound)
    assert 1 <= start <= bound
    assert bound - start == (bound // budget.MERGE_ROOM if bound > 1 else 0)


@settings(max_examples=examples(2), deadline=None)
@given(st.integers(0, 1 << 40), st.integers(0, 1 << 40), st.integers(0, 1 << 32))
def test_the_tables_bytes_count_the_file_and_the_transient(file_bytes, page_bytes, range_bytes):
    got = table_bytes(file_bytes, page_bytes, range_bytes)
    transient = int(budget.TRANSIENT_RANGES * range_bytes)
    assert range_bytes <= transient <= 2 * range_bytes  # one range twice, and a window's lag
    assert got >= file_bytes and got >= page_bytes + transient
    assert got in (file_bytes, page_bytes + transient)


def _chunked_shape(rows: int, words: int, fill: float, range_rows: int = 1 << 20) -> DiskShape:
    """An 8-table store's shape as `WriteLog.disk_shape` builds it: chunks of `words`-word rows
    (records with their 4-byte check, 8-byte ids, 16-byte heads, two chunks a 4 KiB page) at
    `fill`, ranges of `range_rows`, log entries of a 16-byte header, the words and the check."""
    cap = (2024 - 16) // (8 + 4 * words + 4)
    pages = rows / (2 * cap) / fill
    tables = table_bytes(0, int(pages * 4096), int(min(rows / 8, range_rows) * 4096 / (2 * cap)))
    entry = 16 + 4 * words + 4
    return DiskShape(rows, rows * 4 * words, tables, -(-(-(-(4096 * entry + 32) // 4096) * 4096) // 4096))


def test_wide_rows_get_a_longer_log_than_narrow_ones():
    """The figures of docs/design.md: 8 M rows of 66 words in dense chunks (~1.11x) and 1 M-row
    ranges get a log near half the tables' rows, bounded by the budget; narrow 18-word rows at the
    fill `bench.scale` measured (1.40x the raw rows) get much less."""
    wide = log_bound(_chunked_shape(8 << 20, 66, 1.0), 1 << 26, 1 << 17)
    narrow = log_bound(_chunked_shape(8 << 20, 18, 0.81), 1 << 26, 1 << 17)
    assert 3_900_000 < wide <= 4 << 20  # ~0.5 of the rows: (1.9 - 1.11 - 0.17) / 1.08
    assert narrow < wide / 2
    # larger tables spread the transient ranges thinner: the share grows to the clamp
    assert log_bound(_chunked_shape(64 << 20, 66, 1.0), 1 << 30, 1 << 17) == (64 << 20) // 2
