"""The writer's side of read-only serving: publish each flush and keep its state readable.

Readers (tierstore.serving) read the state of the writer's last `flush()` from an LMDB MVCC
snapshot. Between flushes the writer keeps writing rows (evictions, the next flush's chunks),
so for every row first overwritten after a flush the writer keeps the flushed value in an undo
database `u:<table>` (an empty value: the row was not stored at the flush). A reader's row is
then `u:<table>[row]` if present, else `t:<table>[row]`. The flush's last transaction empties
the undo databases and writes the record `published` = {"epoch": k, "covered": true} into the
database `__tierstore_published__` (apart from the metadata, which it leaves as it was).

Undo values cost a read and a write per row, so they are kept only while a reader is
registered: readers hold a shared `flock` on `readers.lock`; the writer tests it (non-blocking)
at each commit. A commit without undo values sets `covered` to false in the same transaction:
readers never take a snapshot whose marker is not covered (they wait for the next flush).
"""

from __future__ import annotations

import fcntl
import json
import os
from itertools import compress, repeat
from operator import not_
from pathlib import Path

READERS_LOCK = "readers.lock"
PUBLISHED = b"published"
PUBLISH_DB = b"__tierstore_published__"
UNDO_PREFIX = "u:"


def undo_name(table: str) -> bytes:
    """Name of a table's undo database."""
    return f"{UNDO_PREFIX}{table}".encode()


class Publisher:
    """Keeps a writer's last flushed state readable by snapshot readers in other processes."""

    def __init__(self, path: Path, env) -> None:
        self.env = env
        self.meta = env.open_db(PUBLISH_DB, create=True)
        with env.begin(db=self.meta) as txn:
            raw = txn.get(PUBLISHED)
        # rows may have been written since the last published flush (none: a new store, or
        # one a crashed writer left uncovered); a covered marker needs no publish until a write
        self._changed = not raw or not json.loads(raw).get("covered", False)
        self._undo: dict[object, object] = {}  # table db handle -> undo db handle
        try:
            self._fd: int | None = os.open(path / READERS_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:
            self._fd = None

    def attach(self, table: str, db) -> None:
        """Create (or open) the undo database of a table the writer just opened."""
        if db not in self._undo:
            self._undo[db] = self.env.open_db(undo_name(table), create=True)

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
        """Inside a write txn of (db, keys, values, unique) parts: keep undo values, or uncover."""
        self._changed = True
        if self.readers_present():
            for db, keys, _vals, _unique in parts:
                undo = self._undo.get(db)
                if undo is not None:
                    self._preserve(txn, db, undo, keys)
            return
        raw = txn.get(PUBLISHED, db=self.meta)
        marker = json.loads(raw) if raw else {"epoch": 0, "covered": True}
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
        """In the flush's last write txn: drop undo values, bump and cover the marker; the epoch.

        None (nothing written) when no row was written since the last publish.
        """
        if not self._changed:
            return None
        raw = txn.get(PUBLISHED, db=self.meta)
        epoch = (json.loads(raw)["epoch"] if raw else 0) + 1
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
