"""One jagged-batch type for every module and pipeline, in TorchRec's layout.

A `JaggedBatch` holds `keys` (feature names), flat `values` (ids), `lengths` with one entry per
(feature, sample), feature-major, and optional per-value `weights`: the layout of TorchRec's
`KeyedJaggedTensor`. `JaggedBatch.of` accepts a KeyedJaggedTensor (TorchRec's own, or any object
with its `keys()`, `values()`, `lengths()`/`offsets()` and `weights_or_none()` methods), a
`(keys, values, lengths)` tuple, or the parts as arguments. `keyed_tensor` builds TorchRec's
`KeyedTensor` for the collections' `output="keyed"` (torchrec is optional).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

import tierstore.validate as validate

from .errors import ConfigError, ShapeError


def _integer(name: str, t: Any) -> None:
    if t is not None and (not isinstance(t, torch.Tensor) or t.is_floating_point()
                          or t.is_complex() or t.dtype == torch.bool):
        raise ShapeError(f"{name} must be an integer tensor, got {getattr(t, 'dtype', type(t).__name__)}")


def either_weights(weights: Any, per_sample_weights: Any) -> Any:
    """The per-id weights given as `weights` (TorchRec's name) or `per_sample_weights`
    (`nn.EmbeddingBag`'s); a ShapeError when both are given."""
    if weights is not None and per_sample_weights is not None:
        raise ShapeError("give weights or per_sample_weights, not both")
    return per_sample_weights if weights is None else weights


def is_keyed_jagged(obj: Any) -> bool:
    """Whether `obj` has a KeyedJaggedTensor's accessors (keys(), values(), lengths or offsets)."""
    return (not isinstance(obj, Mapping) and callable(getattr(obj, "keys", None))
            and callable(getattr(obj, "values", None))
            and (callable(getattr(obj, "lengths", None)) or callable(getattr(obj, "offsets", None))))


class JaggedBatch:
    """A validated jagged batch: keys, values, lengths per (feature, sample) feature-major, weights."""

    __slots__ = ("keys", "values", "lengths", "weights")

    def __init__(self, keys: list[str], values: torch.Tensor, lengths: torch.Tensor,
                 weights: torch.Tensor | None = None) -> None:
        self.keys = list(keys)
        self.values = values
        self.lengths = lengths
        self.weights = weights

    @classmethod
    def of(cls, keys: Any, values: torch.Tensor | None = None, lengths: torch.Tensor | None = None,
           offsets: torch.Tensor | None = None, weights: torch.Tensor | None = None) -> JaggedBatch:
        """A batch from a KeyedJaggedTensor(-like), a (keys, values, lengths) tuple, or its parts."""
        if isinstance(keys, JaggedBatch):
            return keys
        if is_keyed_jagged(keys):
            kjt = keys
            keys, values = list(kjt.keys()), kjt.values()
            lengths = kjt.lengths() if callable(getattr(kjt, "lengths", None)) else None
            if lengths is None:
                offsets = kjt.offsets()
            w = kjt.weights_or_none() if callable(getattr(kjt, "weights_or_none", None)) else None
            weights = w if w is not None else weights
        elif isinstance(keys, Mapping):
            raise ShapeError("a {feature: ids} dict has no bag lengths; pass (keys, values, lengths) "
                             "or a KeyedJaggedTensor")
        elif values is None and isinstance(keys, (tuple, list)) and len(keys) == 3 and \
                not isinstance(keys[0], str):  # a (keys, values, lengths) tuple
            keys, values, lengths = keys[0], torch.as_tensor(keys[1]), torch.as_tensor(keys[2])
        if values is None:
            raise ShapeError("values are required")
        if not isinstance(values, torch.Tensor):
            raise ShapeError(f"values must be a tensor, got {type(values).__name__}")
        keys = list(keys)
        validate.no_meta(values=values, lengths=lengths, offsets=offsets, weights=weights)
        _integer("lengths", lengths)
        _integer("offsets", offsets)
        if lengths is None:
            if offsets is None:
                raise ShapeError("give lengths or offsets")
            lengths = torch.diff(offsets.to("cpu", torch.int64))
        lengths = lengths.to("cpu", torch.int64).reshape(-1)
        lens = lengths.numpy()  # host-side metadata, read without a torch scalar read
        if (lens < 0).any() or int(lens.sum()) != values.numel():
            raise ShapeError("lengths must be >= 0 and sum to len(values)")
        if weights is not None and weights.shape != values.shape:
            raise ShapeError("weights must have the same shape as values")
        return cls(keys, values, lengths, weights)

    def astuple(self) -> tuple[list[str], torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(keys, values, lengths, weights)."""
        return self.keys, self.values, self.lengths, self.weights

    @property
    def batch_size(self) -> int:
        """Samples per feature (`ShapeError` unless lengths hold one entry per (feature, sample))."""
        if len(self.keys) == 0 or self.lengths.numel() % len(self.keys):
            raise ShapeError("lengths must hold one entry per (feature, sample)")
        return self.lengths.numel() // len(self.keys)

    def per_key(self) -> dict[str, torch.Tensor]:
        """Each feature's flat values (views), in key order."""
        self.batch_size  # noqa: B018 (validates the layout)
        counts = self.lengths.view(len(self.keys), -1).sum(1).tolist()
        return dict(zip(self.keys, torch.split(self.values.reshape(-1), counts)))


def torchrec_keyed_tensor() -> type:
    """TorchRec's `KeyedTensor` class (ConfigError when torchrec is not installed)."""
    try:
        from torchrec.sparse.jagged_tensor import KeyedTensor  # optional dependency
    except ImportError as exc:
        raise ConfigError("output='keyed' returns torchrec's KeyedTensor: install torchrec "
                          "(docs/training.md, 'TorchRec')") from exc
    return KeyedTensor


def keyed_tensor(keys: list[str], dims: list[int], values: torch.Tensor) -> Any:
    """TorchRec's KeyedTensor over [batch, sum(dims)] pooled values, one key per feature."""
    return torchrec_keyed_tensor()(keys=list(keys), length_per_key=list(dims), values=values, key_dim=1)
