"""The write-behind log: rows appended in arrival order to a log database in its own LMDB env.

The writer thread appends each batch it takes from the write-behind ring to the database
`__tierstore_log__` of the log's environment (`<store>/wlog/`, `lmdb_log.py`; `MDB_APPEND`:
full pages, no random B-tree update), then folds the oldest part of the log into the tables in
large key-sorted batches (`merge`), so each leaf page of a table absorbs many rows at once.

Every row has a sequence number. The log stores rows in *chunks*: one LMDB value of up to
`CHUNK_ROWS` consecutive rows of one entry size, under the 8-byte big-endian sequence number of
its first row. A chunk is `CHUNK_MAGIC | entry size (u32) | count (u32) | 0 (u32)` and then
`count` entries of `table id (u32, crc32 of the table name) | 0 (u32) | row id (i64) | record`,
the record being the table's stored row format (row words and checksum, `record.py`). Chunks
make an append, a merge's read and its delete a handful of LMDB calls and byte copies instead of
one Python object and B-tree operation per row (values this large live in LMDB's overflow pages,
written whole). An in-memory hash index maps each (table, row) with a version in the log to the
sequence number of its newest version; it holds at most `capacity` entries (the log is merged
before it holds more), so its memory is bounded by the log's size.

The two environments share no transaction, so every merge records in the tables' environment
the sequence number it merged through (`MERGED_KEY`) after its rows and before it deletes its
chunks, and sequence numbers never restart below that record. On open, a log left by a crash is
merged into the tables before anything else (`replay`): entries at or below the record are
already in the tables and skipped (after an OS crash the log's unsynced file may come back
older than the tables), a merge that was cut short is simply done again (rows are idempotent),
and the log's files are removed once the tables hold it all. Replay first checks that the log
is the tables' own: both carry the store's identity (a random id in the `MERGED_KEY` record,
copied into the log's environment at open), and the log's chunks are contiguous and start at
or below the record plus one (a log starting past it was merged into another copy of the
tables). A store of format version 2 kept its log inside the tables' environment; `replay`
merges and drops that one too (the conversion to format 3 needs nothing else).

The package: `chunks` (the log's value format), `writelog` (`WriteLog`: appends, the index, the
background merger), `merge` (`fold`: log entries into the tables, key-sorted), `marks` (the
tables' record of the log merged through, the store's identity, the pairing checks) and
`replay` (a crash-left log, or the format-2 log, folded in at open).
"""

from ..lmdb_log import LOG_DB
from .chunks import HEADER, table_id
from .marks import MERGED_KEY, merged_through, record_merged, store_identity
from .replay import replay, replay_stored
from .writelog import WriteLog

__all__ = ["HEADER", "LOG_DB", "MERGED_KEY", "WriteLog", "merged_through", "record_merged", "replay",
           "replay_stored", "store_identity", "table_id"]
