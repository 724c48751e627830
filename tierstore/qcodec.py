"""Row-wise int8/int4 codes: quantize and dequantize rows (the format `tierstore.quantize` exports)."""

from __future__ import annotations

import numpy as np

from .errors import ConfigError

BITS = {"int8": 8, "int4": 4}


def _check_dtype(dtype: str) -> int:
    if dtype not in BITS:
        raise ConfigError(f"quantized dtype must be one of {sorted(BITS)}, got {dtype!r}")
    return BITS[dtype]


def code_bytes(dim: int, dtype: str) -> int:
    """Bytes of one row's codes."""
    bits = _check_dtype(dtype)
    return dim if bits == 8 else (dim + 1) // 2


def stored_width(dim: int, dtype: str) -> int:
    """Float32 columns per stored row: scale, bias and the codes padded to 4 bytes."""
    return 2 + (code_bytes(dim, dtype) + 3) // 4


def quantize(w: np.ndarray, dtype: str) -> np.ndarray:
    """Rows [n, dim] float32 -> stored rows [n, stored_width] float32 (bytes in float32 columns)."""
    bits = _check_dtype(dtype)
    w = np.ascontiguousarray(w, dtype=np.float32)
    n, dim = w.shape
    levels = (1 << bits) - 1
    lo = w.min(axis=1) if dim else np.zeros(n, np.float32)
    hi = w.max(axis=1) if dim else np.zeros(n, np.float32)
    scale = ((hi - lo) / np.float32(levels)).astype(np.float32)
    safe = np.where(scale > 0, scale, np.float32(1.0))
    codes = np.clip(np.rint((w - lo[:, None]) / safe[:, None]), 0, levels).astype(np.uint8)
    if bits == 4:
        if dim % 2:
            codes = np.pad(codes, ((0, 0), (0, 1)))
        codes = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    width = stored_width(dim, dtype)
    out = np.zeros((n, width * 4), dtype=np.uint8)
    out[:, 0:4] = scale.view(np.uint8).reshape(n, 4)
    out[:, 4:8] = lo.astype(np.float32).view(np.uint8).reshape(n, 4)
    out[:, 8 : 8 + codes.shape[1]] = codes
    return out.view(np.float32)


def dequantize(stored: np.ndarray, dim: int, dtype: str) -> np.ndarray:
    """Stored rows [n, stored_width] -> float32 weights [n, dim]."""
    bits = _check_dtype(dtype)
    raw = np.ascontiguousarray(stored, dtype=np.float32).view(np.uint8)
    n = raw.shape[0]
    scale = raw[:, 0:4].copy().view(np.float32).reshape(n)
    bias = raw[:, 4:8].copy().view(np.float32).reshape(n)
    codes = raw[:, 8 : 8 + code_bytes(dim, dtype)]
    if bits == 4:
        codes = np.stack([codes & 0x0F, codes >> 4], axis=2).reshape(n, -1)[:, :dim]
    return (bias[:, None] + scale[:, None] * codes.astype(np.float32)).astype(np.float32)
