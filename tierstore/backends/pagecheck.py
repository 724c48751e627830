"""A structural check of an LMDB data file's B-trees, read from the file (never through LMDB).

LMDB does not checksum its pages and trusts them: a zeroed page reached by `mdb_cursor_next`
aborts the process (`Assertion 'IS_LEAF(mp)' failed`), and a flipped byte in a leaf's node
pointers or `mp_lower` silently hides keys. `check_file` walks every tree of a closed file (the
free-page tree, the main tree and each named database) from its newest meta page and checks
each page it reaches:

- the page number it carries, its flags (branch, leaf or overflow: we write nothing else), its
  `mp_lower`/`mp_upper` bounds, that every node pointer lies in the node area and that the nodes
  tile that area exactly (LMDB keeps them packed), and node sizes within the page;
- keys strictly increasing within a page and within the bounds its parent's separators give;
- every leaf at the tree's recorded depth, each page reached once, page numbers below the
  meta page's last page, overflow runs inside the file;
- per tree, the branch, leaf and overflow page counts and the entry count against its record.

Damage is a `StoreCorruptError` naming the page. The walk reads the file with `pread`-like
slices of a mapping no longer than the file, so a truncated or damaged file cannot crash it.
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np

from ..errors import StoreCorruptError

MAGIC = 0xBEEFC0DE
P_BRANCH, P_LEAF, P_OVERFLOW, P_META = 0x01, 0x02, 0x04, 0x08
_IGNORED = 0x10 | 0x4000 | 0x8000  # P_DIRTY, P_LOOSE, P_KEEP: bookkeeping, not structure
F_BIGDATA, F_SUBDATA = 0x01, 0x02
INTEGERKEY = 0x08
P_INVALID = (1 << 64) - 1
_HEAD = struct.Struct("<QHHHH")  # mp_pgno, mp_pad, mp_flags, mp_lower, mp_upper
_DB = struct.Struct("<IHHQQQQQ")  # md_pad, md_flags, md_depth, branch, leaf, overflow, entries, root
_META = 16  # MDB_meta's offset in a meta page: magic u32, version u32, address, mapsize, dbs[2]...


class _Walk:
    """One walk over a file's trees (see the module docstring)."""

    def __init__(self, mem: memoryview, psize: int, last: int, where: str,
                 progress: Callable[[int], None] | None) -> None:
        self.mem, self.psize, self.last, self.where = mem, psize, last, where
        self.seen = np.zeros(last + 1, dtype=bool)
        self.seen[:2] = True  # the meta pages
        self.progress = progress
        self.pages = 2
        self.dbs: dict[str, dict[str, int]] = {}
        self.kinds = np.zeros(last + 1, dtype=np.int8)  # 0 unreached, then P_BRANCH/LEAF/OVERFLOW
        self.kinds[:2] = P_META

    def fail(self, pg: int, db: str, why: str) -> None:
        raise StoreCorruptError(f"{self.where}: page {pg} (database {db}) is damaged: {why}")

    def visit(self, pg: int, db: str, count: int = 1) -> None:
        if pg < 2 or pg + count - 1 > self.last:
            self.fail(pg, db, f"page number out of range (the file holds pages 0..{self.last})")
        if self.seen[pg: pg + count].any():
            self.fail(pg, db, "page reached twice (a cycle or a shared page)")
        self.seen[pg: pg + count] = True
        self.pages += count
        if self.progress is not None:
            self.progress(count)

    def tree(self, rec: tuple, db: str) -> dict[str, int]:
        """Walk one database from its record; returns its page and entry counts."""
        _, flags, depth, nbranch, nleaf, nover, entries, root = rec
        got = {"branch": 0, "leaf": 0, "overflow": 0, "entries": 0}
        if root == P_INVALID:
            if entries or depth:
                self.fail(0, db, f"an empty database records {entries} entries, depth {depth}")
            return got
        integer = bool(flags & INTEGERKEY)
        stack = [(root, 1, None, None)]  # page, depth, lower key bound (incl.), upper (excl.)
        while stack:
            pg, d, lo, hi = stack.pop()
            kids = self.page(pg, db, d, depth, lo, hi, integer, got)
            stack.extend(kids)
        want = {"branch": nbranch, "leaf": nleaf, "overflow": nover, "entries": entries}
        if got != want:
            self.fail(root, db, f"the tree holds {got}, its record says {want}")
        return got

    def page(self, pg: int, db: str, d: int, depth: int, lo, hi, integer: bool,
             got: dict[str, int]) -> list:
        """Check one branch or leaf page; the children to walk (branch) or [] (leaf)."""
        self.visit(pg, db)
        psize, mem = self.psize, self.mem
        base = pg * psize
        own, _, flags, lower, upper = _HEAD.unpack_from(mem, base)
        flags &= ~_IGNORED
        self.kinds[pg] = flags if flags in (P_BRANCH, P_LEAF) else 0
        if own != pg:
            self.fail(pg, db, f"it carries page number {own}")
        if flags not in (P_BRANCH, P_LEAF):
            self.fail(pg, db, f"flags {flags:#x} where a branch or leaf page belongs")
        if (flags == P_LEAF) != (d == depth):
            self.fail(pg, db, f"a {'leaf' if flags == P_LEAF else 'branch'} page at depth {d} of "
                              f"{depth}")
        if not (16 <= lower <= upper <= psize) or (lower - 16) % 2:
            self.fail(pg, db, f"mp_lower {lower} / mp_upper {upper} out of bounds")
        n = (lower - 16) // 2
        if n == 0:
            self.fail(pg, db, "no node")
        page = np.frombuffer(mem, dtype=np.uint8, count=psize, offset=base)
        ptr = page[16: 16 + 2 * n].view("<u2").astype(np.int64)
        if (ptr < upper).any() or (ptr > psize - 8).any():
            self.fail(pg, db, "a node pointer outside the node area")
        head = page[ptr[:, None] + np.arange(8)].astype(np.int64)
        ksize = head[:, 6] | (head[:, 7] << 8)
        nflags = head[:, 4] | (head[:, 5] << 8)
        if flags == P_LEAF:
            dsize = head[:, 0] | (head[:, 1] << 8) | (head[:, 2] << 16) | (head[:, 3] << 24)
            big = (nflags & F_BIGDATA) != 0
            body = ksize + np.where(big, 8, dsize)
        else:
            body = ksize
        size = (8 + body + 1) & ~1
        order = np.argsort(ptr)
        ends = ptr[order] + size[order]
        if ends[-1] > psize or (ends[:-1] > ptr[order][1:]).any() or int(size.sum()) != psize - upper:
            self.fail(pg, db, "nodes overlap or do not fill the node area (mp_upper "
                              f"{upper}, {n} nodes)")
        first = 1 if flags == P_BRANCH else 0  # a branch's node 0 key is ignored by searches
        if (ksize[first:] == 8).all():  # our tables and logs: 8-byte keys, compared as numbers
            raw = page[ptr[first:, None] + np.arange(8, 16)].copy()
            ks = raw.view("<u8" if integer else ">u8").ravel()
            if (ks[1:] <= ks[:-1]).any():
                self.fail(pg, db, "keys not strictly increasing")
            order_keys = [None] * first + ks.tolist()
        else:
            keys = [bytes(page[p + 8: p + 8 + k]) for p, k in zip(ptr.tolist(), ksize.tolist())]
            if integer:
                if any(len(k) not in (4, 8) for k in keys[first:]):
                    self.fail(pg, db, "an integer key of a size other than 4 or 8")
                order_keys = [int.from_bytes(k, "little") for k in keys]
            else:
                order_keys = keys
            if any(a >= b for a, b in zip(order_keys[first:], order_keys[first + 1:])):
                self.fail(pg, db, "keys not strictly increasing")
        if n > first:
            k0, k1 = order_keys[first], order_keys[-1]
            if type(k0) is not type(lo if lo is not None else k0) or \
                    type(k1) is not type(hi if hi is not None else k1):
                self.fail(pg, db, "keys of another kind than its parent's")
            if (lo is not None and k0 < lo) or (hi is not None and k1 >= hi):
                self.fail(pg, db, "a key outside the range its parent gives the page")
        if flags == P_BRANCH:
            got["branch"] += 1
            kids = []
            child = (head[:, 0] | (head[:, 1] << 8) | (head[:, 2] << 16) | (head[:, 3] << 24)
                     | (head[:, 4] << 32) | (head[:, 5] << 40)).tolist()
            for i in range(n):
                klo = lo if i == 0 else order_keys[i]
                khi = hi if i == n - 1 else order_keys[i + 1]
                kids.append((child[i], d + 1, klo, khi))
            return kids
        got["leaf"] += 1
        got["entries"] += n
        for i in np.flatnonzero(big).tolist():
            p = int(ptr[i]) + 8 + int(ksize[i])
            ov = int.from_bytes(bytes(page[p: p + 8]), "little")
            got["overflow"] += self.overflow(ov, int(dsize[i]), db)
        for i in np.flatnonzero((nflags & F_SUBDATA) != 0).tolist():
            if dsize[i] != _DB.size or big[i]:
                self.fail(pg, db, "a sub-database record of the wrong size")
            p = int(ptr[i]) + 8 + int(ksize[i])
            p0 = int(ptr[i]) + 8
            name = bytes(page[p0: p0 + int(ksize[i])]).decode("utf-8", "replace")
            self.dbs[name] = self.tree(_DB.unpack_from(bytes(page[p: p + _DB.size])), name)
        return []

    def overflow(self, pg: int, dsize: int, db: str) -> int:
        """Check an overflow run holding a value of `dsize` bytes; returns its page count."""
        if pg < 2 or pg > self.last:
            self.fail(pg, db, "an overflow page number out of range")
        base = pg * self.psize
        own, _, flags = struct.unpack_from("<QHH", self.mem, base)
        count = struct.unpack_from("<I", self.mem, base + 12)[0]
        if own != pg or (flags & ~_IGNORED) != P_OVERFLOW:
            self.fail(pg, db, f"not an overflow page (number {own}, flags {flags:#x})")
        if count < 1 or 16 + dsize > count * self.psize:
            self.fail(pg, db, f"an overflow run of {count} pages for a {dsize}-byte value")
        self.visit(pg, db, count)
        self.kinds[pg] = P_OVERFLOW
        return count


def _meta(mem: memoryview, psize: int, n: int) -> tuple[int, int, tuple, tuple]:
    """(txn id, last page, free db record, main db record) of meta page `n`."""
    base = n * psize + _META
    magic, version = struct.unpack_from("<II", mem, base)
    if magic != MAGIC or version != 1:
        raise ValueError(f"meta page {n} has magic {magic:#x}, version {version}")
    free = _DB.unpack_from(mem, base + 24)
    main = _DB.unpack_from(mem, base + 24 + _DB.size)
    last, txnid = struct.unpack_from("<QQ", mem, base + 24 + 2 * _DB.size)
    return txnid, last, free, main


def page_size(data: str | os.PathLike) -> int:
    """The page size recorded in an LMDB file's first meta page (4096 when unreadable)."""
    try:
        with open(data, "rb") as f:
            head = f.read(_META + 24 + 4)
        return struct.unpack_from("<I", head, _META + 24)[0] or 4096
    except (OSError, struct.error):
        return 4096


def check_file(data: str | os.PathLike, where: str,
               progress: Callable[[int], None] | None = None) -> dict:
    """Walk every tree of LMDB file `data` (closed, or not written meanwhile); StoreCorruptError
    naming the page on damage. Returns {"pages", "last_page", "databases": {name: counts},
    "kinds": int8 per page (P_META, P_BRANCH, P_LEAF, the first page of an overflow run
    P_OVERFLOW, 0: a free page or an overflow run's later page)}.

    `progress(pages)` is called as pages are checked (the walk covers about `last_page` pages).
    """
    data = Path(data)
    try:
        size = data.stat().st_size
    except OSError as exc:
        raise StoreCorruptError(f"{where}: cannot read {data.name}: {exc}") from exc
    psize = page_size(data)
    if psize < 512 or psize & (psize - 1) or size < 2 * psize:
        raise StoreCorruptError(f"{where}: {data.name} is truncated or not an LMDB file "
                                f"({size} bytes)")
    with open(data, "rb") as f:
        mm = mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ)
    try:
        mem = memoryview(mm)
        try:
            metas = sorted((_meta(mem, psize, n) for n in (0, 1)), reverse=True)
        except ValueError as exc:
            raise StoreCorruptError(f"{where}: {data.name}: {exc}") from None
        _, last, free, main = metas[0]
        if (last + 1) * psize > size:
            raise StoreCorruptError(f"{where}: {data.name} is truncated ({size} bytes, its meta "
                                    f"page needs {(last + 1) * psize})")
        walk = _Walk(mem, psize, last, f"{where}: {data.name}", progress)
        walk.dbs["(free pages)"] = walk.tree(free, "(free pages)")
        walk.dbs["(main)"] = walk.tree(main, "(main)")
        out = {"pages": walk.pages, "last_page": last, "databases": walk.dbs,
               "kinds": walk.kinds}
        del walk, mem
        return out
    finally:
        try:
            mm.close()
        except BufferError:  # a numpy view still alive on an error path: the GC unmaps it
            pass
