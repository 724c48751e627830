"""Row storage precision: float32, or 16-bit weights (float16 / bfloat16) with stochastic rounding.

A row's payload is float32 columns everywhere (slabs, LMDB values, checkpoints), so the tiers
move it as opaque bits. A 16-bit table packs its embedding two values per float32 column
(`ceil(dim / 2)` columns; little-endian: value 2c in the low half of column c), followed by its
optimizer state in float32, as FBGEMM and Meta's Neo keep weights in 16 bits and state in 32.

The math is float32: an update decodes the weights, runs the optimizer exactly as for a float32
table, and encodes the new weights with *stochastic rounding*, which picks one of the two
neighbouring 16-bit values with probability proportional to closeness, so rounding is unbiased
and small updates are not lost. Each value's 16 random bits are the top bits of
`hash(row id, column) + k * 2**64/phi` (wrapping), where `k` is the table's update count (one per
apply call on the table, saved with the store clock): a Weyl sequence in `k` from a hashed
start. So a repeated identical update draws fresh bits every time (it cannot stall), and, as the
sequence is equidistributed with low discrepancy, the rounding errors of a row's successive
updates cancel instead of adding up like a random walk; rows round independently of each other.
The bits are a pure function of the row's id and the call sequence: the same on every tier and
device, and bit-identical for any placement. Without row ids (the codec used on its own), the
start hashes (new value, old value, column) instead. Lazily initialized rows round to nearest.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ._kernels import HAVE_NUMBA

_M1 = -7046029254386353131  # splitmix64 constants as int64
_M2 = -4658895280553007687
_M3 = -7723592293110705685
_GOLDEN = 0x9E3779B97F4A7C15  # 2**64 / phi: spreads consecutive salts over 64 bits


def _wrap(v: int) -> int:
    """A Python int as the int64 it wraps to."""
    v &= 0xFFFFFFFFFFFFFFFF
    return v - (1 << 64) if v >= 1 << 63 else v


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 64-bit avalanche hash of int64 values (wrapping arithmetic)."""
    x = x * _M1
    x = x ^ ((x >> 31) & 0x1FFFFFFFF)
    x = x * _M3
    return x ^ ((x >> 29) & 0x7FFFFFFFF)


class Codec:
    """Float32 weights: the payload holds them as they are."""

    dtype = "float32"
    packed = False

    def cols(self, dim: int) -> int:
        """Float32 columns that hold `dim` weights."""
        return dim

    def decode(self, cols: torch.Tensor, dim: int) -> torch.Tensor:
        """Weights [n, dim] float32 from their payload columns."""
        return cols[:, :dim]

    def encode(self, w: torch.Tensor) -> torch.Tensor:
        """Payload columns for weights, rounded to nearest."""
        return w

    def gather(self, table: torch.Tensor, slots: torch.Tensor, dim: int) -> torch.Tensor:
        """Weights [n, dim] float32 of rows `table[slots]` (copies only the weight columns)."""
        return self.decode(table[:, : self.cols(dim)].index_select(0, slots), dim)

    def encode_stochastic(self, w: torch.Tensor, old_cols: torch.Tensor,
                          keys: torch.Tensor | None = None, update: int = 0,
                          use_kernel: bool = True) -> torch.Tensor:
        """Payload columns for updated weights (float32: exact)."""
        return w


class HalfCodec(Codec):
    """16-bit weights (float16 or bfloat16), two per float32 column, stochastic rounding."""

    packed = True

    def __init__(self, dtype: str, torch_dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.torch_dtype = torch_dtype

    def cols(self, dim: int) -> int:
        """Float32 columns that hold `dim` 16-bit weights."""
        return (dim + 1) // 2

    def decode(self, cols: torch.Tensor, dim: int) -> torch.Tensor:
        """Weights [n, dim] float32 from packed columns."""
        halves = cols[:, : self.cols(dim)].contiguous().view(self.torch_dtype)
        return halves[:, :dim].float()

    def _pack(self, h: torch.Tensor) -> torch.Tensor:
        """[n, dim] 16-bit values -> [n, cols] float32 columns (odd dims padded with zero)."""
        n, dim = h.shape
        if dim % 2:
            h = torch.cat([h, torch.zeros(n, 1, dtype=h.dtype, device=h.device)], dim=1)
        return h.contiguous().view(torch.float32)

    def encode(self, w: torch.Tensor) -> torch.Tensor:
        """Packed columns for weights rounded to nearest (even)."""
        return self._pack(w.to(self.torch_dtype))

    def _bits(self, cols: torch.Tensor, dim: int) -> torch.Tensor:
        """The 16-bit patterns [n, dim] (as int64 in [0, 65535]) held by packed columns."""
        return cols[:, : self.cols(dim)].contiguous().view(torch.int16)[:, :dim].to(torch.int64) & 0xFFFF

    def encode_stochastic(self, w: torch.Tensor, old_cols: torch.Tensor,
                          keys: torch.Tensor | None = None, update: int = 0,
                          use_kernel: bool = True) -> torch.Tensor:
        """Packed columns for updated weights, each rounded up or down at random, unbiased.

        `keys`: the rows' ids int64 [n] (None: hash the values instead); `update`: the table's
        update count, the step of each value's Weyl sequence of random bits. `use_kernel=False`
        takes the torch path on CPU tensors too (the one CUDA runs; the same bits)."""
        step = _wrap(int(update) * _GOLDEN)
        rowh = None if keys is None else _mix(keys.to("cpu", torch.int64) * _M2 + _M3)
        n, dim = w.shape
        w = w.contiguous()
        near = w.to(self.torch_dtype)
        if use_kernel and HAVE_NUMBA and w.device.type == "cpu":  # one pass, not ~25 element-wise ops
            out = torch.zeros((n, 2 * self.cols(dim)), dtype=torch.int16)
            old = old_cols[:, : self.cols(dim)].contiguous().view(torch.int16)
            _sr_kernel(w.numpy(), w.view(torch.int32).numpy(), near.view(torch.int16).numpy(),
                       old.numpy(), out.numpy(), self.dtype == "bfloat16",
                       np.empty(0, np.int64) if rowh is None else rowh.numpy(), step)
            return out.view(torch.float32)
        back = near.float()
        bits = near.view(torch.int16).to(torch.int64) & 0xFFFF
        sign, mag = bits & 0x8000, bits & 0x7FFF
        above = back.abs() > w.abs()  # round-to-nearest went away from zero
        lo_mag = torch.where(above, mag - 1, mag).clamp(min=0)
        hi_mag = torch.where(above, mag, mag + 1)
        lo = self._from_bits(lo_mag).float()
        hi = self._from_bits(hi_mag).float()
        gap = hi - lo
        frac = torch.where(torch.isfinite(gap) & (gap > 0), (w.abs() - lo) / gap, torch.zeros_like(w))
        # 16 random bits per value: a hashed start (row id and column, or the values) plus k steps
        col = torch.arange(dim, device=w.device, dtype=torch.int64)
        if rowh is None:
            old = self._bits(old_cols, dim)
            new = w.view(torch.int32).to(torch.int64)
            start = new * _M2 + old * _M3 + col
        else:
            start = rowh.to(w.device, non_blocking=True)[:, None] + col  # host salt: no blocking copy
        r = ((_mix(start) + step) >> 48) & 0xFFFF
        up = r.to(torch.float32) < frac * 65536.0
        out_bits = torch.where(up, sign | hi_mag, sign | lo_mag)
        exact = (back == w) | ~torch.isfinite(w)
        out_bits = torch.where(exact, bits, out_bits)
        return self._pack(self._from_bits(out_bits))

    def _from_bits(self, bits: torch.Tensor) -> torch.Tensor:
        """16-bit values from their int64-held bit patterns."""
        return bits.to(torch.int32).to(torch.int16).view(self.torch_dtype)


if HAVE_NUMBA:
    import numba

    _TWO = np.array([math.ldexp(1.0, k) for k in range(-25, 7)], dtype=np.float32)  # 2**-25..2**6

    @numba.njit(cache=True, nogil=True, inline="always")
    def _half_value(h, bf16, buf, fbuf):  # pragma: no cover - compiled
        """The float32 value of 16-bit pattern h (bfloat16 or float16), exactly."""
        if bf16:
            buf[0] = np.int32(h << 16)
            return fbuf[0]
        e = (h >> 10) & 0x1F
        m = h & 0x3FF
        if e == 0:
            v = np.float32(m) * _TWO[1]  # 2**-24
        elif e == 31:
            v = np.float32(np.inf) if m == 0 else np.float32(np.nan)
        else:
            v = np.float32(m + 1024) * _TWO[e]  # (1024 + m) * 2**(e - 25)
        return -v if h & 0x8000 else v

    @numba.njit(cache=True, nogil=True)
    def _sr_kernel(x, xbits, near, old, out, bf16, rowh, step):  # pragma: no cover - compiled
        """Stochastic rounding of x [n, dim] to 16 bits; the numba twin of the torch code above."""
        buf = np.empty(1, dtype=np.int32)
        fbuf = buf.view(np.float32)
        scale = np.float32(65536.0)
        for i in range(x.shape[0]):
            for d in range(x.shape[1]):
                w = x[i, d]
                bits = np.int64(near[i, d]) & 0xFFFF
                back = _half_value(bits, bf16, buf, fbuf)
                if back == w or not np.isfinite(w):
                    out[i, d] = near[i, d]
                    continue
                sign = bits & 0x8000
                mag = bits & 0x7FFF
                if abs(back) > abs(w):
                    lo_m, hi_m = max(mag - 1, 0), mag
                else:
                    lo_m, hi_m = mag, mag + 1
                lo = _half_value(lo_m, bf16, buf, fbuf)
                hi = _half_value(hi_m, bf16, buf, fbuf)
                gap = hi - lo
                frac = (abs(w) - lo) / gap if (np.isfinite(gap) and gap > 0) else np.float32(0.0)
                if rowh.shape[0]:
                    h = rowh[i] + d
                else:
                    h = np.int64(xbits[i, d]) * _M2 + (np.int64(old[i, d]) & 0xFFFF) * _M3 + d
                h = h * _M1
                h = h ^ ((h >> 31) & 0x1FFFFFFFF)
                h = h * _M3
                h = h ^ ((h >> 29) & 0x7FFFFFFFF)
                r = ((h + step) >> 48) & 0xFFFF
                res = sign | (hi_m if np.float32(r) < frac * scale else lo_m)
                out[i, d] = np.int16(res)


CODECS: dict[str, Codec] = {
    "float32": Codec(),
    "float16": HalfCodec("float16", torch.float16),
    "bfloat16": HalfCodec("bfloat16", torch.bfloat16),
}
