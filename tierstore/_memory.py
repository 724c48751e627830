"""Large host tensors backed by transparent huge pages, where the kernel allows it.

Cache slabs and hash indexes are read at random, one row per lookup; with 4 KiB pages nearly
every access also misses the TLB. Linux's transparent huge pages (2 MiB) remove most of those
misses. With THP in "madvise" mode (a common default) memory must ask for them, which
`madvise(MADV_HUGEPAGE)` does before the first touch. Elsewhere this is a plain allocation.
"""

from __future__ import annotations

import ctypes
import functools
import sys

import torch

MADV_HUGEPAGE = 14
HUGE = 2 << 20
MIN_BYTES = 8 << 20  # below this the TLB covers the tensor anyway


@functools.cache
def libc_madvise():
    """libc's madvise(2) as a ctypes function (looked up once), or None where libc has none."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):  # pragma: no cover
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_MADVISE = libc_madvise() if sys.platform.startswith("linux") else None  # huge pages: Linux only


def advise_huge(t: torch.Tensor) -> bool:
    """Ask for huge pages under an untouched CPU tensor's whole 2 MiB pages; True if granted."""
    nbytes = t.numel() * t.element_size()
    if _MADVISE is None or t.device.type != "cpu" or nbytes < MIN_BYTES:
        return False
    start = (t.data_ptr() + HUGE - 1) & ~(HUGE - 1)
    end = (t.data_ptr() + nbytes) & ~(HUGE - 1)
    return end > start and _MADVISE(start, end - start, MADV_HUGEPAGE) == 0


def full(shape: tuple[int, ...] | int, value: float | int, dtype: torch.dtype,
         device: torch.device | str = "cpu", rows: int | None = None) -> torch.Tensor:
    """`torch.full`, on huge pages when the tensor is large and on the CPU. With `rows`, only
    the first `rows` rows are filled: the rest is left unwritten (a reserve whose pages cost
    no memory until the caller writes them)."""
    t = torch.empty(shape, dtype=dtype, device=device)
    advise_huge(t)
    if rows is not None and rows < t.shape[0]:
        t[:rows].fill_(value)
        return t
    return t.fill_(value)
