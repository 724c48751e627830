"""The writer's side of read-only serving: publish each flush and keep its state readable.

Readers (tierstore.serving) read the state of the writer's last `flush()` from an LMDB MVCC
snapshot. Between flushes the writer keeps changing the environment in the background:

- the write-behind writer appends evicted rows to the log database (the `wal` package): those are newer
  than the flush, and readers never read the log;
- it merges the log into the tables when the log is 3/4 full: those commits overwrite flushed
  rows, so for every row first overwritten after a flush the writer keeps the flushed value in an
  undo database `u:<table>` (an empty value: the row was not stored at the flush).

`flush()` publishes inside its quiesce block, after the whole log was merged and while the writer
thread is held: at that moment the tables hold exactly the flushed state and the log is empty.
Its publish transaction empties the undo databases and writes `published` = {"epoch": k,
"covered": true} into `__tierstore_published__`. A reader's row is then `u:<table>[row]` if
present, else `t:<table>[row]`: the flushed state, whatever the writer merged since.

Undo values cost a read and a write per row, so they are kept only while a reader is
registered: readers hold a shared `flock` on `readers.lock`; the writer tests it (non-blocking)
inside each table commit. A commit without undo values sets `covered` to false in the same
transaction: readers never take a snapshot whose marker is not covered (they wait for the next
flush). Any code that changes a table's rows must do it through `LmdbBackend._commit` (which
calls `before_commit`) so that this holds.

A reader in the writer's own process borrows the writer's environment (py-lmdb allows one per
file in a process). It must never open a database handle itself: on a writable environment that
takes a write transaction, which waits for the background writer. So the publisher opens the
handle of every database a reader needs up front (`handles`), before any background thread runs.
"""

from __future__ import annotations

import fcntl
import json
import os
from itertools import compress, repeat
from operator import not_
from pathlib import Path

from ..errors import StoreCorruptError

READERS_LOCK = "readers.lock"
PUBLISHED = b"published"
PUBLISH_DB = b"__tierstore_published__"
UNDO_PREFIX = "u:"


def undo_name(table: str) -> bytes:
    """Name of a table's undo database."""
    return f"{UNDO_PREFIX}{table}".encode()


def parse_marker(raw, path: object) -> dict:
    """The published marker ({"epoch": int, "covered": bool}) of a store; StoreCorruptError when damaged."""
    try:
        marker = json.loads(bytes(raw))
    except ValueError:
        marker = None
    if not isinstance(marker, dict) or isinstance(marker.get("epoch"), bool) or \
            not isinstance(marker.get("epoch"), int) or not isinstance(marker.get("covered", True), bool):
        raise StoreCorruptError(f"store {path}: its published-state marker is damaged")
    return marker


class Publisher:
    """Keeps a writer's last flushed state readable by snapshot readers (any process)."""

    def __init__(self, path: Path, env, meta_db, meta_name: bytes) -> None:
        self.env = env
        self.meta = env.open_db(PUBLISH_DB, create=True)
        # every database a borrowing reader may need, opened now (see the module docstring)
        self.handles: dict[bytes, object] = {meta_name: meta_db, PUBLISH_DB: self.meta}
        with env.begin() as txn:
            names = [k for k, _ in txn.cursor()]
            raw = txn.get(PUBLISHED, db=self.meta)
        # rows may have been written since the last published flush (none: a new store, or
        # one a crashed writer left uncovered); a covered marker needs no publish until a write
        self.path = path
        self._changed = not raw or not parse_marker(raw, self.path).get("covered", False)
        self._undo: dict[object, object] = {}  # table db handle -> undo db handle
        for name in names:
            if name.startswith(b"t:"):
                self.attach(name[2:].decode(), env.open_db(name, create=False))
        try:
            self._fd: int | None = os.open(path / READERS_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:
            self._fd = None

    def attach(self, table: str, db) -> None:
        """Register a table's database handle and create (or open) its undo database."""
        if db not in self._undo:
            self._undo[db] = self.env.open_db(undo_name(table), create=True)
            self.handles[f"t:{table}".encode()] = db
            self.handles[undo_name(table)] = self._undo[db]

    def readers_present(self) -> bool:
        """Whether a reader holds `readers.lock` (never blocks: a non-blocking test)."""
        if self._fd is None:
            return False
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return True
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        return False

    def before_commit(self, txn, parts: list) -> None:
        """Inside a table write txn of (db, keys, ...) parts: keep undo values, or uncover."""
        self._changed = True
        if self.readers_present():
            for db, keys, *_ in parts:
                undo = self._undo.get(db)
                if undo is not None:
                    self._preserve(txn, db, undo, keys)
            return
        raw = txn.get(PUBLISHED, db=self.meta)
        marker = parse_marker(raw, self.path) if raw else {"epoch": 0, "covered": True}
        if marker.get("covered", True):
            marker["covered"] = False
            txn.put(PUBLISHED, json.dumps(marker).encode(), db=self.meta)

    @staticmethod
    def _preserve(txn, db, undo, keys: list[bytes]) -> None:
        """Copy the current values of keys not yet in the undo db there (b"" for absent rows)."""
        ucur = txn.cursor(db=undo)
        need = list(compress(keys, map(not_, map(ucur.set_key, keys))))  # C-level loops
        if need:
            mcur = txn.cursor(db=db)
            ucur.putmulti(zip(need, map(mcur.get, need, repeat(b""))))

    def publish(self, txn) -> int | None:
        """In the flush's publish txn: drop undo values, bump and cover the marker; the epoch.

        None (nothing written) when no row was written since the last publish.
        """
        if not self._changed:
            return None
        raw = txn.get(PUBLISHED, db=self.meta)
        epoch = (parse_marker(raw, self.path)["epoch"] if raw else 0) + 1
        for undo in self._undo.values():
            txn.drop(undo, delete=False)
        txn.put(PUBLISHED, json.dumps({"epoch": epoch, "covered": True}).encode(), db=self.meta)
        return epoch

    @property
    def changed(self) -> bool:
        """Whether rows were written since the last published flush."""
        return self._changed

    def committed(self) -> None:
        """The publish transaction committed: nothing written since."""
        self._changed = False

    def close(self) -> None:
        """Release the readers.lock descriptor."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
