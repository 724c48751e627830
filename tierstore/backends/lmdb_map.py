"""The SSD tier's memory map: its size, and this process's resident pages of it.

`MemoryMap` is the `LmdbBackend` mixin that grows the map before it fills (up to `map_limit`),
with background readers registered (`reading`) so that a resize waits for them (`_exclusive`),
and that drops the data file's resident pages from the process once they grew by
`map_resident` bytes (`trim_map`; off by default). The module functions measure file-backed
resident bytes and call madvise(2) through libc.
"""

from __future__ import annotations

import ctypes
import os
import sys
from contextlib import contextmanager

import lmdb

from .._memory import libc_madvise
from ..errors import OutOfSpaceError
from .lmdb_common import DATA_NAME

_MADV_DONTNEED = 4


class MemoryMap:
    """The map's size and resident pages (an `LmdbBackend` mixin)."""

    # map size --------------------------------------------------------------------------------
    def used_bytes(self, env: lmdb.Environment | None = None) -> int:
        """Bytes of the map in use (last page number times page size); `env`: the tables' by
        default, or the write-behind log's."""
        env = env or self.env
        info, stat = env.info(), env.stat()
        return (info["last_pgno"] + 1) * stat["psize"]

    def ensure_room(self, incoming: int, env: lmdb.Environment | None = None) -> None:
        env = env or self.env
        need = self.used_bytes(env) + 2 * incoming + (1 << 20)
        if need > env.info()["map_size"]:
            self._grow(incoming, env)

    @contextmanager
    def reading(self):
        """Register a background reader; map resizing waits until no reader is active."""
        with self._io:
            while self._resizing:
                self._io.wait()
            self._readers += 1
        try:
            yield
        finally:
            with self._io:
                self._readers -= 1
                self._io.notify_all()

    def _grow(self, incoming: int, env: lmdb.Environment | None = None) -> None:
        """Grow a map (the tables' by default) with every background reader out."""
        if env is None or env is self.env:
            self.wait_for_copies()  # remapping would invalidate a snapshot being copied
        with self._exclusive():
            self._grow_now(incoming, env)

    def _grow_now(self, incoming: int, env: lmdb.Environment | None = None) -> None:
        env = env or self.env
        cur = env.info()["map_size"]
        new = max(2 * cur, self.used_bytes(env) + 4 * incoming + (1 << 20))
        if self.map_limit is not None:
            if cur >= self.map_limit:
                raise OutOfSpaceError(
                    f"store {self.path} reached its map limit of {self.map_limit} bytes")
            new = min(new, self.map_limit)
        self._map_gen += 1
        try:
            env.set_mapsize(new)
        except lmdb.Error as exc:
            self._raise_io(exc)

    @contextmanager
    def _exclusive(self):
        """Wait until no background reader is active and keep new ones out."""
        with self._io:
            self._resizing = True
            while self._readers:
                self._io.wait()
        try:
            yield
        finally:
            with self._io:
                self._resizing = False
                self._io.notify_all()

    # resident map pages ------------------------------------------------------------------
    def _note_touch(self, *_: object) -> None:
        """Trim the mapping once the process's file-backed resident bytes grew by `map_resident`."""
        if self.map_resident is None:
            return
        if _file_resident() - self._file_base > self.map_resident:
            self.trim_map()

    def trim_map(self) -> int:
        """Drop this process's resident pages of the data file mapping; returns bytes advised.

        The mapping is shared and read-only, so the pages stay in the page cache and a later
        access maps them again (a minor fault); only the process's resident set shrinks.
        Linux only, best effort.
        """
        if self.env is None or not sys.platform.startswith("linux"):
            return 0
        if self._span is None or self._span[0] != self._map_gen:
            self._span = (self._map_gen, self._find_span())
        done = 0
        for lo, hi in self._span[1]:
            if _madvise(lo, hi - lo, _MADV_DONTNEED) == 0:
                done += hi - lo
        if self._pages is not None:  # the page reader's own mapping of the file
            done += self._pages.drop()
        self._file_base = _file_resident()
        return done

    def _find_span(self) -> list[tuple[int, int]]:
        """Address ranges of this environment's data file mapping, from /proc/self/maps."""
        target = os.path.realpath(self.path / DATA_NAME)
        size = self.env.info()["map_size"]  # our mapping is exactly the map size
        try:
            with open("/proc/self/maps") as f:
                spans = [line.split(None, 5) for line in f if line.rstrip().endswith(DATA_NAME)]
        except OSError:
            return []
        out = []
        for parts in spans:
            if len(parts) < 6 or parts[5].strip() != target:
                continue
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if hi - lo == size:
                out.append((lo, hi))
        return out


def _file_resident() -> int:
    """File-backed resident bytes of this process (Linux /proc/self/statm "shared"), else 0.

    This counts every mapped file page (libraries too); the kernel's fault-around maps up to
    16 neighbouring page-cache pages per fault, so it is measured, not estimated from rows.
    """
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[2]) * _PAGESIZE
    except (OSError, ValueError, IndexError):
        return 0


_PAGESIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _madvise(addr: int, length: int, advice: int) -> int:
    """libc madvise(2); -1 when unavailable."""
    fn = libc_madvise()
    return -1 if fn is None else int(fn(ctypes.c_void_p(addr), ctypes.c_size_t(length), advice))
