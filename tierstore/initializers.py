"""Lazy, deterministic row initialization: a pure function of (seed, table, row, column)."""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_INV24 = 1.0 / (1 << 24)
_INV53 = 1.0 / (1 << 53)


def _mix(x: np.ndarray) -> np.ndarray:
    """Apply the splitmix64 finalizer elementwise to a uint64 array (wrapping arithmetic)."""
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


def name_key(seed: int, name: str) -> int:
    """A stable 64-bit key for (seed, table name), the same on every machine."""
    digest = hashlib.blake2b(f"{seed}\x00{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def random_bits(key: int, rows: np.ndarray, cols: int, stream: int = 0) -> np.ndarray:
    """Return uint64 bits [len(rows), cols], a pure function of (key, row, column, stream)."""
    with np.errstate(over="ignore"):
        base = np.uint64(key) ^ (np.uint64(stream) * _M2)
        r = _mix(rows.astype(np.uint64) * _GOLDEN + base)
        c = np.arange(1, cols + 1, dtype=np.uint64) * _GOLDEN
        return _mix(r[:, None] ^ c[None, :])


def uniform01(key: int, rows: np.ndarray, cols: int, stream: int = 0) -> np.ndarray:
    """Return float64 uniforms in [0, 1) with 53 random bits, deterministic per (key, row, col)."""
    bits = random_bits(key, rows, cols, stream) >> np.uint64(11)
    return bits.astype(np.float64) * _INV53


@dataclass(frozen=True)
class Initializer:
    """Base of the lazy initializers: turns (key, row ids) into float32 rows."""

    kind: ClassVar[str] = ""

    def __call__(self, key: int, rows: np.ndarray, dim: int) -> np.ndarray:
        """Return float32 [len(rows), dim] initial values."""
        raise NotImplementedError

    def to_config(self) -> dict:
        """Serialize to a JSON-able dict (stored in the store's metadata)."""
        return {"kind": self.kind, **{k: v for k, v in self.__dict__.items()}}


@dataclass(frozen=True)
class UniformInit(Initializer):
    """Uniform in [-bound, bound]; bound defaults to 1/sqrt(dim)."""

    bound: float | None = None
    kind: ClassVar[str] = "uniform"

    def __call__(self, key: int, rows: np.ndarray, dim: int) -> np.ndarray:
        """Return float32 [len(rows), dim] uniform values."""
        b = self.bound if self.bound is not None else 1.0 / math.sqrt(dim)
        u = uniform01(key, rows, dim)
        return ((2.0 * u - 1.0) * b).astype(np.float32)


@dataclass(frozen=True)
class NormalInit(Initializer):
    """Normal(mean, std) through Box-Muller on two independent uniform streams."""

    std: float = 0.01
    mean: float = 0.0
    kind: ClassVar[str] = "normal"

    def __call__(self, key: int, rows: np.ndarray, dim: int) -> np.ndarray:
        """Return float32 [len(rows), dim] normal values."""
        u1 = 1.0 - uniform01(key, rows, dim, stream=1)  # (0, 1]
        u2 = uniform01(key, rows, dim, stream=2)
        z = np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * math.pi * u2)
        return (self.mean + self.std * z).astype(np.float32)


@dataclass(frozen=True)
class ConstantInit(Initializer):
    """Every value equal to a constant (zeros by default)."""

    value: float = 0.0
    kind: ClassVar[str] = "constant"

    def __call__(self, key: int, rows: np.ndarray, dim: int) -> np.ndarray:
        """Return float32 [len(rows), dim] filled with the constant."""
        return np.full((len(rows), dim), self.value, dtype=np.float32)


@dataclass(frozen=True)
class ColumnSlice(Initializer):
    """Columns [lo, lo + dim) of `base`'s rows of width `full_dim`, then `zeros` zero columns.

    A column shard of a table initializes exactly the columns the whole table would (the
    distributed store's column-wise sharding); `zeros` columns hold state kept as weights.
    """

    base: Initializer = field(default_factory=lambda: UniformInit())
    full_dim: int = 1
    lo: int = 0
    zeros: int = 0
    kind: ClassVar[str] = "column_slice"

    def __post_init__(self) -> None:
        if isinstance(self.base, dict):
            object.__setattr__(self, "base", initializer_from_config(self.base))

    def __call__(self, key: int, rows: np.ndarray, dim: int) -> np.ndarray:
        """Return float32 [len(rows), dim]: the base's columns, then zeros."""
        width = dim - self.zeros
        out = np.zeros((len(rows), dim), dtype=np.float32)
        out[:, :width] = self.base(key, rows, self.full_dim)[:, self.lo : self.lo + width]
        return out

    def to_config(self) -> dict:
        """Serialize to a JSON-able dict (the base nested)."""
        return {"kind": self.kind, "base": self.base.to_config(), "full_dim": self.full_dim,
                "lo": self.lo, "zeros": self.zeros}


INITIALIZERS: dict[str, type[Initializer]] = {
    cls.kind: cls for cls in (UniformInit, NormalInit, ConstantInit, ColumnSlice)
}


def initializer_from_config(cfg: dict) -> Initializer:
    """Rebuild an initializer from `Initializer.to_config()` output."""
    cfg = dict(cfg)
    return INITIALIZERS[cfg.pop("kind")](**cfg)
