"""TorchRec-style table configs: `EmbeddingBagConfig` (name, rows, dim, feature names, pooling)
plus the store's own fields (optimizer, init, dtype, ttl).

`TieredEmbeddingBagCollection(store, [configs])` and `TieredEmbeddingBagCollection.from_configs`
take a list of them, or of TorchRec's own `torchrec.EmbeddingBagConfig` (read by its field
names, so torchrec need not be installed to use this module).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .config import TableSpec
from .errors import ConfigError
from .initializers import Initializer, UniformInit
from .optimizers import Optimizer

# TorchRec's DataType names -> the store's row dtypes
_DTYPES = {"FP32": "float32", "FP16": "float16", "BF16": "bfloat16"}
_POOLING = {"SUM": "sum", "MEAN": "mean", "MAX": "max"}


@dataclass(frozen=True)
class EmbeddingBagConfig:
    """One table as TorchRec's `EmbeddingBagConfig` describes it, plus its optimizer and storage."""

    num_embeddings: int
    embedding_dim: int
    name: str
    feature_names: list[str] = field(default_factory=list)
    pooling: str = "sum"
    optimizer: Optimizer | None = None  # None: the `optimizer` given to `table_spec` (SGD if none)
    init: Initializer | None = None  # None: uniform in [weight_init_min, weight_init_max] if set
    weight_init_min: float | None = None
    weight_init_max: float | None = None
    dtype: str = "float32"
    ttl: int | None = None


def _pooling(config: Any) -> str:
    """'sum' / 'mean' / 'max' of a config (ours: a string; TorchRec's: a PoolingType)."""
    p = getattr(config, "pooling", "sum")
    name = str(getattr(p, "value", p)).upper()
    if name not in _POOLING:
        raise ConfigError(f"table {getattr(config, 'name', '?')!r}: pooling {p!r} is not one of "
                          f"{sorted(_POOLING.values())}")
    return _POOLING[name]


def _init(config: Any) -> Initializer:
    init = getattr(config, "init", None)
    if init is not None:
        return init
    lo, hi = getattr(config, "weight_init_min", None), getattr(config, "weight_init_max", None)
    if lo is None and hi is None:
        return UniformInit()
    if lo is None or hi is None or lo != -hi:
        raise ConfigError(f"table {config.name!r}: weight_init_min/max must be set together and "
                          f"symmetric (uniform in [-b, b]), got [{lo}, {hi}]; or pass init=")
    return UniformInit(bound=float(hi))


def _dtype(config: Any) -> str:
    if isinstance(getattr(config, "dtype", None), str):
        return config.dtype
    data_type = getattr(config, "data_type", None)  # TorchRec's DataType
    if data_type is None:
        return "float32"
    name = str(getattr(data_type, "value", data_type)).upper()
    if name not in _DTYPES:
        raise ConfigError(f"table {config.name!r}: data_type {data_type!r} is not one of "
                          f"{sorted(_DTYPES)}")
    return _DTYPES[name]


def table_spec(config: Any, optimizer: Optimizer | None = None) -> TableSpec:
    """The store's TableSpec of a config (ours or TorchRec's); `optimizer` when it names none."""
    for attr in ("name", "num_embeddings", "embedding_dim"):
        if not hasattr(config, attr):
            raise ConfigError(f"a table config needs name, num_embeddings and embedding_dim; "
                              f"{config!r} has no {attr}")
    opt = getattr(config, "optimizer", None) or optimizer
    kwargs = {"optimizer": opt} if opt is not None else {}
    return TableSpec(config.name, config.num_embeddings, config.embedding_dim, init=_init(config),
                     dtype=_dtype(config), ttl=getattr(config, "ttl", None), **kwargs)


def is_table_config(obj: Any) -> bool:
    """Whether `obj` looks like an EmbeddingBagConfig (ours or TorchRec's)."""
    return all(hasattr(obj, a) for a in ("name", "num_embeddings", "embedding_dim", "feature_names"))


def config_features(configs: Sequence[Any]) -> dict[str, str]:
    """feature -> table of configs (a config without feature names has one, named after it)."""
    out: dict[str, str] = {}
    for c in configs:
        for f in list(c.feature_names) or [c.name]:
            if f in out:
                raise ConfigError(f"feature {f!r} is listed by tables {out[f]!r} and {c.name!r}")
            out[f] = c.name
    return out


def config_pooling(configs: Sequence[Any]) -> str:
    """The one pooling mode of configs (a collection pools every table alike)."""
    modes = {_pooling(c) for c in configs}
    if len(modes) > 1:
        raise ConfigError(f"the tables ask for different poolings {sorted(modes)}; a collection "
                          f"pools every table alike: build one collection per pooling")
    return modes.pop()
