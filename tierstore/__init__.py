"""tierstore: embedding tables far larger than memory over GPU, host and SSD (LMDB) tiers.

The public names below are imported on first use (PEP 562), so `import tierstore` and the
`tierstore` command's help and `info` do not pay for importing torch and numba.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._version import __version__ as __version__
from .errors import (
    CapacityError,
    ConfigError,
    ConfigMismatchError,
    InvalidGradientError,
    InvalidIdsError,
    LogCorruptError,
    OutOfSpaceError,
    ReadOnlyError,
    ShapeError,
    SnapshotUnavailableError,
    StoreClosedError,
    StoreCorruptError,
    StoreLockedError,
    StoreNotFoundError,
    TierstoreError,
    UnknownTableError,
)

# public name -> the submodule that defines it
_LAZY = {
    "TableSpec": "config", "StoreConfig": "config",
    "Admission": "admission", "CountAdmission": "admission",
    "ConstantInit": "initializers", "NormalInit": "initializers", "UniformInit": "initializers",
    "Optimizer": "optimizers", "SGD": "optimizers", "Adagrad": "optimizers",
    "RowWiseAdagrad": "optimizers", "Adam": "optimizers",
    "TierStats": "stats",
    "Gathered": "store", "TierStore": "store",
    "TieredEmbeddingBag": "module", "TieredEmbeddingBagCollection": "module",
    "TieredEmbedding": "sequence", "TieredEmbeddingCollection": "sequence",
    "JaggedEmbeddings": "sequence",
    "ReadOnlyStore": "serving",
    "Prefetcher": "prefetch",
    "EmbeddingBagConfig": "embedding_configs", "JaggedBatch": "jagged",
}

__all__ = [
    "TableSpec", "StoreConfig", "CountAdmission", "Admission", "TierStore", "Gathered", "TierStats",
    "Optimizer", "SGD", "Adagrad", "RowWiseAdagrad", "Adam",
    "UniformInit", "NormalInit", "ConstantInit",
    "TierstoreError", "UnknownTableError", "InvalidIdsError", "ShapeError", "ConfigError",
    "ConfigMismatchError", "StoreLockedError", "StoreCorruptError", "OutOfSpaceError",
    "StoreClosedError", "CapacityError", "InvalidGradientError", "StoreNotFoundError",
    "ReadOnlyError", "SnapshotUnavailableError", "LogCorruptError",
    "TieredEmbeddingBag", "TieredEmbeddingBagCollection",
    "TieredEmbedding", "TieredEmbeddingCollection", "JaggedEmbeddings",
    "ReadOnlyStore", "Prefetcher", "EmbeddingBagConfig", "JaggedBatch",
]

if TYPE_CHECKING:
    from .admission import Admission, CountAdmission
    from .config import StoreConfig, TableSpec
    from .embedding_configs import EmbeddingBagConfig
    from .initializers import ConstantInit, NormalInit, UniformInit
    from .jagged import JaggedBatch
    from .module import TieredEmbeddingBag, TieredEmbeddingBagCollection
    from .optimizers import SGD, Adagrad, Adam, Optimizer, RowWiseAdagrad
    from .prefetch import Prefetcher
    from .sequence import JaggedEmbeddings, TieredEmbedding, TieredEmbeddingCollection
    from .serving import ReadOnlyStore
    from .stats import TierStats
    from .store import Gathered, TierStore


def __getattr__(name: str) -> Any:
    """A public name, or a submodule, imported on first access."""
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    elif not name.startswith("__"):
        try:
            value = importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
