"""tierstore: embedding tables far larger than memory over GPU, host and SSD (LMDB) tiers."""

from .admission import Admission, CountAdmission
from .config import StoreConfig, TableSpec
from .errors import (
    CapacityError,
    ConfigError,
    ConfigMismatchError,
    InvalidGradientError,
    InvalidIdsError,
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
from .initializers import ConstantInit, NormalInit, UniformInit
from .optimizers import SGD, Adagrad, Adam, Optimizer, RowWiseAdagrad
from .stats import TierStats
from .store import Gathered, TierStore

__version__ = "0.1.0"

__all__ = [
    "TableSpec", "StoreConfig", "CountAdmission", "Admission", "TierStore", "Gathered", "TierStats",
    "Optimizer", "SGD", "Adagrad", "RowWiseAdagrad", "Adam",
    "UniformInit", "NormalInit", "ConstantInit",
    "TierstoreError", "UnknownTableError", "InvalidIdsError", "ShapeError", "ConfigError",
    "ConfigMismatchError", "StoreLockedError", "StoreCorruptError", "OutOfSpaceError",
    "StoreClosedError", "CapacityError", "InvalidGradientError", "StoreNotFoundError",
    "ReadOnlyError", "SnapshotUnavailableError",
]

from .module import TieredEmbeddingBag, TieredEmbeddingBagCollection  # noqa: E402

__all__ += ["TieredEmbeddingBag", "TieredEmbeddingBagCollection"]

from .sequence import JaggedEmbeddings, TieredEmbedding, TieredEmbeddingCollection  # noqa: E402

__all__ += ["TieredEmbedding", "TieredEmbeddingCollection", "JaggedEmbeddings"]

from .serving import ReadOnlyStore  # noqa: E402

__all__ += ["ReadOnlyStore"]
