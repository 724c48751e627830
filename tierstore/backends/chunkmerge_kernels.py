"""The compiled passes of a page-chunk merge (`chunkmerge.ChunkLevel`, `chunkupdate.py`).

`merge_into` merges a range's old chunks, read in place in the data file's map, with a sorted
batch whose records lie at given addresses, into full chunks (a batch row replaces the old row
of its id; every old chunk's size, count, ids' check and order are verified before any of its
rows is copied; with `verify`, every record copied too); `seal_chunk` writes a chunk's head
(count, capacity, the check over its ids); `open_chunk` checks one in place; `copy_at` and
`i64_at` copy bytes and read a word by address.
"""

from __future__ import annotations

import numpy as np

from .._kernels import HAVE_NUMBA
from .pagechunks import HEAD

# merge_into's state: old chunk, row in it, next batch row, last old id, rows in the open chunk
_C, _CPOS, _I, _LAST, _FILL = range(5)

if HAVE_NUMBA:
    import numba
    from llvmlite import ir
    from numba import types
    from numba.core import cgutils
    from numba.extending import intrinsic

    from .chunk_kernels import AHEAD, prefetch_at, words_at
    from .record import check_row

    @intrinsic
    def copy_at(typingctx, dst, src, n):
        """memcpy of `n` bytes between addresses (of buffers the caller keeps alive, apart)."""
        def codegen(context, builder, sig, args):
            i8p = ir.IntType(8).as_pointer()
            d = builder.inttoptr(args[0], i8p)
            s = builder.inttoptr(args[1], i8p)
            cgutils.raw_memcpy(builder, d, s, args[2], 1)
            return context.get_dummy_value()
        return types.void(types.int64, types.int64, types.int64), codegen

    @intrinsic
    def i64_at(typingctx, addr):
        """The int64 at an address (unaligned: chunk values sit on 2-byte node boundaries)."""
        def codegen(context, builder, sig, args):
            ptr = builder.inttoptr(args[0], ir.IntType(64).as_pointer())
            return builder.load(ptr, align=1)
        return types.int64(types.int64), codegen

    @numba.njit(nogil=True, cache=True)
    def seal_chunk(out, at, fill, cap, rb):  # pragma: no cover - compiled
        """Close the chunk at out[at:] holding `fill` rows: unused slots zeroed, then its head
        (count, capacity, the check over its ids)."""
        ids0 = at + HEAD
        for b in range(ids0 + 8 * fill, ids0 + 8 * cap):
            out[b] = 0
        for b in range(ids0 + 8 * cap + fill * rb, ids0 + cap * (8 + rb)):
            out[b] = 0
        ids = out[ids0 : ids0 + 8 * cap].view(np.int64)
        chk = check_row(np.uint64(ids[0]), ids.view(np.uint32))
        for j in range(4):
            out[at + j] = np.uint8((fill >> (8 * j)) & 0xFF)
            out[at + 4 + j] = np.uint8((cap >> (8 * j)) & 0xFF)
            out[at + 8 + j] = np.uint8((chk >> np.uint32(8 * j)) & np.uint32(0xFF))
            out[at + 12 + j] = 0

    @numba.njit(nogil=True, cache=True)
    def open_chunk(mem, offs, lens, c, cap, vb, last):  # pragma: no cover - compiled
        """Chunk c's row count after checking its size, count, ids' check and id order (all
        above `last`), or -1 when it is damaged."""
        off = offs[c]
        if lens[c] != vb:
            return -1
        count = np.int64(mem[off]) | (np.int64(mem[off + 1]) << 8) | \
            (np.int64(mem[off + 2]) << 16) | (np.int64(mem[off + 3]) << 24)
        if count < 1 or count > cap:
            return -1
        ids = mem[off + HEAD : off + HEAD + 8 * cap].view(np.int64)
        chk = np.uint32(mem[off + 8]) | (np.uint32(mem[off + 9]) << np.uint32(8)) | \
            (np.uint32(mem[off + 10]) << np.uint32(16)) | (np.uint32(mem[off + 11]) << np.uint32(24))
        if check_row(np.uint64(ids[0]), ids.view(np.uint32)) != chk:
            return -1
        prev = last
        for j in range(count):
            if ids[j] <= prev:
                return -1
            prev = ids[j]
        return count

    @numba.njit(nogil=True, cache=True)
    def merge_into(mem, offs, lens, ids, src, hi, cap, w, verify, out, state
                   ):  # pragma: no cover - compiled
        """Merge the old chunks offs[state C:] (values in `mem`) with the batch rows
        ids[state I : hi] (row i's record at address src[i], in buffers the caller keeps in
        place: an array, or the log's chunks in its open read transaction; asked from memory
        `AHEAD` rows before its copy) into whole chunks of `out` (flat,
        `out.size // value bytes` chunks; the first holds state FILL rows already): each id's
        newest record, a batch row before an old one. Stops when `out` is full or both are
        used up; `state` says where it stopped. Returns (chunks sealed, status, at): status 0;
        1 old chunk `at` is damaged (size, count, ids' check or order); 2 the old record of id
        `at` failed its check; 3 batch row `at`'s record failed its check."""
        rb = 4 * (w + 1)
        vb = HEAD + cap * (8 + rb)
        r0 = HEAD + 8 * cap
        m = out.shape[0] // vb
        nc = offs.shape[0]
        c, cpos, i, last, fill = state[0], state[1], state[2], state[3], state[4]
        m_at, o_at = mem.ctypes.data, out.ctypes.data
        oc = 0
        count = 0
        if c < nc:
            count = open_chunk(mem, offs, lens, c, cap, vb, last if cpos == 0 else np.int64(-1))
            if count < 0:
                return 0, 1, c
        status, at = 0, 0
        while oc < m:
            has_old = c < nc
            oid = np.int64(0)
            if has_old:
                oid = i64_at(m_at + offs[c] + HEAD + 8 * cpos)
            if i < hi and (not has_old or ids[i] <= oid):
                x = ids[i]
                if i + AHEAD < hi:  # batch records may lie anywhere (the log's order)
                    for b in range(0, rb + 63, 64):
                        prefetch_at(src[i + AHEAD] + b)
                if verify:
                    rec = numba.carray(words_at(src[i]), w + 1)
                    if check_row(np.uint64(x), rec[:w]) != rec[w]:
                        status, at = 3, i
                        break
                copy_at(o_at + oc * vb + r0 + fill * rb, src[i], rb)
                i += 1
                skip = has_old and oid == x  # the batch's row replaces the old one
            elif has_old:
                x = oid
                osrc = offs[c] + r0 + cpos * rb
                if verify:
                    rec = mem[osrc : osrc + rb].view(np.uint32)
                    if check_row(np.uint64(x), rec[:w]) != rec[w]:
                        status, at = 2, x
                        break
                copy_at(o_at + oc * vb + r0 + fill * rb, m_at + osrc, rb)
                skip = True
            else:
                break
            if skip:  # the old row is consumed
                last = oid
                cpos += 1
                if cpos == count:
                    c += 1
                    cpos = 0
                    if c < nc:
                        count = open_chunk(mem, offs, lens, c, cap, vb, last)
                        if count < 0:
                            status, at = 1, c
                            break
            p = oc * vb + HEAD + 8 * fill
            for b in range(8):
                out[p + b] = np.uint8((x >> (8 * b)) & 0xFF)
            fill += 1
            if fill == cap:
                seal_chunk(out, oc * vb, fill, cap, rb)
                oc += 1
                fill = 0
        state[0], state[1], state[2], state[3], state[4] = c, cpos, i, last, fill
        return oc, status, at
else:  # pragma: no cover - numba is a hard dependency
    copy_at = i64_at = seal_chunk = open_chunk = merge_into = None
