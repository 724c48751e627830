"""Compaction of the SSD tier's file: rewrite every database in key order, in full pages.

`Compaction` is the `LmdbBackend` mixin that estimates a store's compacted size and swaps a
compacted copy of its file in atomically (`compact`, also at close); `write_compact` streams the
databases seen by a read transaction into a fresh file (compaction and checkpoints), and
`fsync_path` makes a file or directory durable.
"""

from __future__ import annotations

import errno
import math
import os
import shutil
import uuid
from collections.abc import Callable
from itertools import islice
from pathlib import Path

import lmdb

from ..errors import OutOfSpaceError, TierstoreError
from .lmdb_common import COMPACT_PREFIX, DATA_NAME, META_DB

COPY_CHUNK = 16384  # rows per transaction when rewriting a database in key order


class Compaction:
    """Compaction of the environment's file (an `LmdbBackend` mixin)."""

    def _named_dbs(self) -> dict[bytes, object]:
        """Handles of every named database (metadata and tables), opened before any snapshot."""
        with self.env.begin() as txn:
            names = [k for k, _ in txn.cursor()]
        out: dict[bytes, object] = {}
        for name in names:
            if name == META_DB:
                out[name] = self._meta
            elif name.startswith(b"t:"):
                table = name[2:].decode()
                self.open_tables([table])
                if table in self._dbs:
                    out[name] = self._dbs[table]
            else:  # not ours: copied as is
                out[name] = self.open_named(name, create=False)
        return out

    def estimate_compact_bytes(self) -> int:
        """Estimated size of the file after `compact()`: every database in full pages."""
        psize = self.env.stat()["psize"]
        pages = 4  # two meta pages, the main database, slack
        dbs = self._named_dbs()
        with self.env.begin() as txn:
            for db in dbs.values():
                st = txn.stat(db)
                have = st["branch_pages"] + st["leaf_pages"] + st["overflow_pages"]
                cur = txn.cursor(db=db)
                if not st["entries"] or st["overflow_pages"] or not cur.first():
                    pages += have
                    continue
                node = 8 + len(cur.key()) + len(cur.value())
                per_page = max(1, (psize - 16) // (node + node % 2 + 2))
                leaves = math.ceil(st["entries"] / per_page)
                pages += min(have, leaves + math.ceil(leaves / 100) + st["depth"])
        return pages * psize

    def compact(self, *, reopen: bool = True,
                progress: Callable[[int], None] | None = None) -> tuple[int, int]:
        """Rewrite the file in key order (full pages, no free pages) and swap it in atomically.

        The new file is written next to the old one, fsynced, and renamed over it; a crash at
        any point leaves the old file or the new one, both complete. Returns (bytes before,
        bytes after): before is the file once the write-behind ring is drained and the log
        merged (an earlier size would leave out rows still in the ring). `progress` gets the
        rows copied after each chunk.
        """
        if self.readonly:
            raise TierstoreError(f"store {self.path} is open read-only; cannot compact it")
        self.wait_for_copies()
        with self.quiesce(), self._exclusive():
            self.sync()
            before = self.data_bytes()
            tables = list(self._dbs)
            dbs = self._named_dbs()
            tmp = self.path / f"{COMPACT_PREFIX}{uuid.uuid4().hex[:8]}"
            tmp.mkdir()
            try:
                txn = self.env.begin()
                try:
                    write_compact(txn, dbs, tmp, progress=self._note_touch if progress is None
                                  else _both(self._note_touch, progress))
                finally:
                    txn.abort()
                self.trim_map()
                self.env.close()
                self.env = None
                self._dbs = {}
                # the old file's reader table goes first: a reader opening meanwhile pairs the old
                # file (no longer written) or the new one with a fresh table (docs/serving.md)
                (self.path / "lock.mdb").unlink(missing_ok=True)
                os.replace(tmp / DATA_NAME, self.path / DATA_NAME)
                fsync_path(self.path)
            except lmdb.Error as exc:
                self._raise_io(exc)
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise OutOfSpaceError(f"store {self.path}: out of space compacting: {exc}") from exc
                raise TierstoreError(f"store {self.path}: cannot compact: {exc}") from exc
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
                if self.env is None and reopen:
                    self._open_env()
                    self.open_tables(tables)
        return before, self.data_bytes()


def _both(a: Callable[[int], None], b: Callable[[int], None]) -> Callable[[int], None]:
    def call(n: int) -> None:
        a(n)
        b(n)
    return call


def fsync_path(path: Path) -> None:
    """fsync a file or directory."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_compact(txn: lmdb.Transaction, dbs: dict[bytes, object], dest: Path,
                  chunk: int = COPY_CHUNK, progress: Callable[[int], None] | None = None) -> None:
    """Write the named databases seen by read txn `txn` into a fresh file dest/data.mdb.

    Each database is streamed in key order and appended (`MDB_APPEND`), so every page is full
    and the file has no free pages. The file is synced before this returns. `progress` gets
    the rows copied after each chunk.
    """
    need = 1 << 20
    for db in dbs.values():
        st = txn.stat(db)
        need += (st["branch_pages"] + st["leaf_pages"] + st["overflow_pages"]) * st["psize"]
    env = lmdb.open(str(dest), map_size=need + need // 8 + (16 << 20), max_dbs=len(dbs) + 2,
                    subdir=True, lock=False, sync=False, metasync=False, readahead=False,
                    meminit=False)
    try:
        for name, db in dbs.items():
            flags = db.flags(txn)
            out = env.open_db(name, create=True, dupsort=flags.get("dupsort", False),
                              integerkey=flags.get("integerkey", False))
            it = txn.cursor(db=db).iternext(keys=True, values=True)
            while items := list(islice(it, chunk)):  # the iteration runs in C
                while True:
                    try:
                        with env.begin(write=True, db=out) as w:
                            w.cursor().putmulti(items, append=True)
                        break
                    except lmdb.MapFullError:
                        env.set_mapsize(2 * env.info()["map_size"])
                if progress is not None:
                    progress(len(items))
        env.sync(True)
    finally:
        env.close()
    fsync_path(dest / DATA_NAME)
