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

Chunked tables (format 4, `lmdb_chunked.py`) keep no undo values: the publish transaction copies
each table's manifest `chunks:<table>` into `__tierstore_published__` (the published manifest;
absent: the table had no rows at the flush), and the publisher is the levels' range guard. While
a reader is registered a level never changes a range database a published manifest names: a
rewrite retires it (named in the `retired` record, dropped at the next publish or at a chunk
write that finds no reader), and an in-place update or delete first copies the range into a
fresh database. A chunk write that changes or drops a published range in place anyway (no
reader) uncovers the marker, as a B-tree commit without undo values does. Readers read the
published manifest's ranges (docs/design.md "Serving handles on chunk levels").
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
PUB_MANIFEST = b"chunks:"  # a chunked table's published manifest: "chunks:<table>" in PUBLISH_DB
RETIRED = b"retired"  # range databases replaced since the publish, kept for readers (a JSON list)


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
        self._meta_db = meta_db
        with env.begin() as txn:
            names = [k for k, _ in txn.cursor()]
            raw = txn.get(PUBLISHED, db=self.meta)
            pubs = published_manifests(txn, self.meta, path)
            current = dict(_prefixed(txn, meta_db, PUB_MANIFEST))
            differ = current != dict(_prefixed(txn, self.meta, PUB_MANIFEST))
        # rows may have been written since the last published flush (none: a new store, or
        # one a crashed writer left uncovered); a covered marker needs no publish until a write
        self.path = path
        self._changed = not raw or not parse_marker(raw, self.path).get("covered", False)
        # range databases the published manifests name (kept unchanged while readers read them)
        self._pub_names = {n for m in pubs.values() for n in m["names"] if n is not None}
        self._retired: dict[bytes, object] = {}  # retired range -> its handle, where known
        self._next_names: set[bytes] | None = None  # a publish's, until it commits
        if current and raw and not self._changed and not parse_marker(raw, path).get("chunks"):
            # chunk manifests never published (a store older than published manifests)
            with env.begin(write=True) as txn:
                self._uncover(txn)
        self._changed = self._changed or differ  # chunk writes since the publish: publish again
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
        self._uncover(txn)

    def _uncover(self, txn) -> None:
        """Set the marker's `covered` to false in `txn` (readers wait for the next publish)."""
        raw = txn.get(PUBLISHED, db=self.meta)
        marker = parse_marker(raw, self.path) if raw else {"epoch": 0, "covered": True}
        if marker.get("covered", True):
            marker["covered"] = False
            txn.put(PUBLISHED, json.dumps(marker).encode(), db=self.meta)

    # range guard of chunk levels (chunkmerge.ChunkLevel.guard) ----------------------------------
    def keep(self, name: bytes) -> bool:
        """Whether range database `name` must stay as it is: a published manifest names it and a
        reader is registered."""
        return name in self._pub_names and self.readers_present()

    def retire(self, txn, name: bytes, db) -> None:
        """In the txn that replaces range `name` (kept for readers): name it in `retired`."""
        self._changed = True
        retired = _retired(txn, self.meta, self.path)
        if name not in retired:
            retired.append(name)
        txn.put(RETIRED, json.dumps([n.decode() for n in retired]).encode(), db=self.meta)
        self._retired[name] = db

    def changed(self, txn, name: bytes | None) -> None:
        """In a chunk write txn that changes (or drops) range `name` in place, or only publishes
        fresh ranges (None): uncover where a published range changes; drop the retired ranges
        when no reader is registered."""
        self._changed = True
        if name in self._pub_names:
            self._uncover(txn)
        if self._retired or txn.get(RETIRED, db=self.meta):
            if not self.readers_present():
                if self.drop_retired(txn, keep=set()):
                    self._uncover(txn)

    def readable_ranges(self) -> set[bytes]:
        """The range databases the published manifests name while the marker is covered (a
        reader may read them, even one that outlived a killed writer); else none."""
        with self.env.begin() as txn:
            raw = txn.get(PUBLISHED, db=self.meta)
        covered = bool(raw) and parse_marker(raw, self.path).get("covered", True)
        return set(self._pub_names) if covered else set()

    def drop_retired(self, txn, keep: set[bytes]) -> int:
        """Drop, in write txn `txn`, the retired ranges not in `keep`; returns how many."""
        retired = _retired(txn, self.meta, self.path)
        gone = [n for n in retired if n not in keep]
        for name in gone:
            if txn.get(name) is not None:
                db = self._retired.get(name) or self.env.open_db(name, txn=txn, create=False)
                txn.drop(db, delete=True)
            self._retired.pop(name, None)
        rest = [n for n in retired if n in keep]
        if rest:
            txn.put(RETIRED, json.dumps([n.decode() for n in rest]).encode(), db=self.meta)
        elif retired:
            txn.delete(RETIRED, db=self.meta)
        return len(gone)

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
        self._publish_manifests(txn)
        # "chunks": chunk manifests are published too (a store older than that has none)
        txn.put(PUBLISHED, json.dumps({"epoch": epoch, "covered": True, "chunks": True}).encode(),
                db=self.meta)
        return epoch

    def _publish_manifests(self, txn) -> None:
        """Copy every chunk manifest into the published ones; drop the retired ranges."""
        old = [k for k, _ in _prefixed(txn, self.meta, PUB_MANIFEST)]
        names: set[bytes] = set()
        for key, raw in list(_prefixed(txn, self._meta_db, PUB_MANIFEST)):
            txn.put(key, raw, db=self.meta)
            names.update(n for n in _manifest_names(raw, self.path) if n is not None)
        for key in old:
            if txn.get(key, db=self._meta_db) is None:
                txn.delete(key, db=self.meta)
        self.drop_retired(txn, keep=names)
        self._next_names = names  # kept from `committed()` on (an aborted publish keeps the old)

    @property
    def dirty(self) -> bool:
        """Whether rows were written since the last published flush."""
        return self._changed

    def committed(self) -> None:
        """The publish transaction committed: nothing written since."""
        self._changed = False
        if self._next_names is not None:
            self._pub_names, self._next_names = self._next_names, None

    def close(self) -> None:
        """Release the readers.lock descriptor."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _prefixed(txn, db, prefix: bytes):
    """(key, value) of `db`'s records whose key starts with `prefix`, in key order."""
    cur = txn.cursor(db=db)
    if not cur.set_range(prefix):
        return
    for key, raw in cur:
        if not key.startswith(prefix):
            return
        yield bytes(key), bytes(raw)


def _manifest_names(raw: bytes, path: object) -> list[bytes | None]:
    """The range database names of a manifest record; StoreCorruptError when damaged."""
    try:
        names = json.loads(raw)["names"]
        return [None if n is None else n.encode() for n in names]
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise StoreCorruptError(f"store {path}: a published chunk manifest is damaged") from exc


def _retired(txn, db, path: object) -> list[bytes]:
    """The retired range databases recorded in `txn` (the publish database `db`)."""
    raw = txn.get(RETIRED, db=db)
    if raw is None:
        return []
    try:
        return [n.encode() for n in json.loads(bytes(raw))]
    except (ValueError, TypeError, AttributeError) as exc:
        raise StoreCorruptError(f"store {path}: its retired chunk-range record is damaged") from exc


def published_manifests(txn, db, path: object) -> dict[str, dict]:
    """The published chunk manifests ({table: {"bounds", "names", "counts"}}, names as bytes) in
    `txn`, from the publish database `db`."""
    out = {}
    for key, raw in _prefixed(txn, db, PUB_MANIFEST):
        try:
            rec = json.loads(raw)
            out[key[len(PUB_MANIFEST):].decode()] = {
                "bounds": [int(b) for b in rec["bounds"]], "names": _manifest_names(raw, path),
                "counts": [int(c) for c in rec["counts"]]}
        except (ValueError, KeyError, TypeError) as exc:
            raise StoreCorruptError(f"store {path}: a published chunk manifest is damaged") from exc
    return out
