"""Unpooled (sequence) embeddings over the tiered store: TieredEmbedding and TieredEmbeddingCollection.

One embedding per id, no pooling: `nn.Embedding`'s and TorchRec's `EmbeddingCollection`'s
conventions. The backward pass runs the table's fused optimizer in place, exactly as the bag
modules do (each id is a bag of one), so results are bit-identical for every placement.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from .errors import ConfigError, InvalidIdsError, ShapeError
from .jagged import JaggedBatch
from .module import read_only_rows, store_table
from .module_state import StoreBacked
from .steps import EngineStep, anchor, engine_for


def _lookup(store: Any, table: str, ids: torch.Tensor) -> torch.Tensor:
    """[n, dim] rows of 1-D ids through the autograd function (a leaf anchor triggers backward)."""
    if store.readonly:  # a ReadOnlyStore: serve the published rows
        return read_only_rows(store, table, ids)
    return _rows(store, [(table, table, "sum")], [ids])


def _rows(store: Any, features: list[tuple[str, str, str]], ids: list[torch.Tensor]) -> torch.Tensor:
    """[total ids, widest dim] rows of every feature's ids in one engine step."""
    eng = engine_for(store, features, pooled=False)
    return EngineStep.apply(anchor(), None, store, eng, ids, torch.empty(0, dtype=torch.int64))


def _dim(store: Any, table: str) -> int:
    return store_table(store, table).dim


class TieredEmbedding(StoreBacked, nn.Module):
    """Like torch.nn.Embedding over one store table; backward updates rows in the store.

    Ids of any shape give `[..., dim]`. Positions holding `padding_idx` read as zeros and their
    row gets no update. Unlike nn.Embedding, a negative `padding_idx` is refused: on a hashed
    table of 10^11 rows, "-5" would silently freeze row `num_rows - 5`, a real row.
    """

    def __init__(self, store: Any, table: str, padding_idx: int | None = None) -> None:
        super().__init__()
        self.embedding_dim = _dim(store, table)
        self.num_embeddings = store.table_specs[table].num_rows
        if padding_idx is not None:
            if isinstance(padding_idx, bool) or not isinstance(padding_idx, int) or \
                    not 0 <= padding_idx < self.num_embeddings:
                raise ConfigError(f"padding_idx must be an int in [0, {self.num_embeddings}) "
                                  f"(a row id), got {padding_idx!r}")
        self.store = store
        self.watch_clock()  # warns when tables with a ttl train on a clock nobody advances
        self.table = table
        self.padding_idx = padding_idx
        self.features = {table: table}  # for Prefetcher(module, ...): batches keyed by table

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """Embeddings `[*input.shape, dim]` with nn.Embedding's conventions."""
        if not isinstance(input, torch.Tensor):
            raise InvalidIdsError("input must be an integer tensor")
        flat = input.reshape(-1)
        out_shape = (*input.shape, self.embedding_dim)
        if self.padding_idx is None:
            return _lookup(self.store, self.table, flat).reshape(out_shape)
        keep = flat != self.padding_idx
        if bool(keep.all()):
            return _lookup(self.store, self.table, flat).reshape(out_shape)
        pos = torch.nonzero(keep).flatten()
        rows = _lookup(self.store, self.table, flat.index_select(0, pos))
        out = rows.new_zeros((flat.numel(), self.embedding_dim))
        out = out.index_copy(0, pos.to(out.device), rows)  # differentiable: padding gets no grad
        return out.reshape(out_shape)


class JaggedEmbeddings:
    """One feature's sequence embeddings: values [n_ids, dim] and lengths [batch] (JaggedTensor-like)."""

    def __init__(self, values: torch.Tensor, lengths: torch.Tensor) -> None:
        self._values = values
        self._lengths = lengths

    def values(self) -> torch.Tensor:
        """The embeddings of every id of the feature, sample after sample: [n_ids, dim]."""
        return self._values

    def lengths(self) -> torch.Tensor:
        """Ids per sample: [batch] int64."""
        return self._lengths

    def offsets(self) -> torch.Tensor:
        """Start of each sample's rows in `values()`, plus the total: [batch + 1] int64."""
        out = torch.zeros(self._lengths.numel() + 1, dtype=torch.int64)
        torch.cumsum(self._lengths, 0, out=out[1:])
        return out

    def split(self) -> list[torch.Tensor]:
        """Per-sample [length, dim] tensors."""
        return list(torch.split(self._values, self._lengths.tolist()))

    def __iter__(self) -> Iterator[torch.Tensor]:  # `values, lengths = out[feature]`
        return iter((self._values, self._lengths))

    def __repr__(self) -> str:
        return f"JaggedEmbeddings(values={tuple(self._values.shape)}, lengths={self._lengths.numel()})"


class TieredEmbeddingCollection(StoreBacked, nn.Module):
    """Many sequence features over store tables, TorchRec EmbeddingCollection style.

    `features` maps feature name -> table name (or is a list of table names, one feature
    each). Input: keys, values, lengths (or offsets), feature-major, or a KeyedJaggedTensor.
    Output: {feature: JaggedEmbeddings(values [n_ids, dim], lengths [batch])}. Features sharing a
    table share one gather and one optimizer step per batch.
    """

    def __init__(self, store: Any, features: Mapping[str, str] | Sequence[str]) -> None:
        super().__init__()
        if isinstance(features, Mapping):
            feats = dict(features)
        else:
            feats = dict(f if isinstance(f, (tuple, list)) else (f, f) for f in features)
        if not feats:
            raise ConfigError("features must not be empty")
        for feature, table in feats.items():
            store_table(store, table)
            known = store.feature_tables.setdefault(feature, table)
            if known != table:
                store.feature_tables[feature] = None  # two collections disagree: no default
        self.store = store
        self.watch_clock()  # warns when tables with a ttl train on a clock nobody advances
        self.features = feats
        self.feature_names = list(feats)
        self.dims = {f: store.table_specs[t].dim for f, t in feats.items()}

    def forward(self, keys: Any, values: torch.Tensor | None = None,
                lengths: torch.Tensor | None = None, offsets: torch.Tensor | None = None
                ) -> dict[str, JaggedEmbeddings]:
        """{feature: JaggedEmbeddings} for every feature of this collection."""
        keys, values, lengths, _ = JaggedBatch.of(keys, values, lengths, offsets).astuple()
        if len(keys) == 0 or lengths.numel() % len(keys):
            raise ShapeError("lengths must hold one entry per (feature, sample)")
        missing = [f for f in self.feature_names if f not in keys]
        if missing:
            raise ShapeError(f"input lacks features {missing}")
        batch = lengths.numel() // len(keys)
        starts = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
        torch.cumsum(lengths, 0, out=starts[1:])
        kpos = {k: i for i, k in enumerate(keys)}
        spans = [(int(starts[kpos[f] * batch]), int(starts[(kpos[f] + 1) * batch]))
                 for f in self.feature_names]
        ids = [values[lo:hi] for lo, hi in spans]
        if self.store.readonly:
            rows = [_lookup(self.store, self.features[f], i) for f, i in zip(self.feature_names, ids)]
        else:  # one engine step for every feature
            flat = _rows(self.store, [(f, self.features[f], "sum") for f in self.feature_names], ids)
            rows, at = [], 0
            for f, i in zip(self.feature_names, ids):
                rows.append(flat[at : at + i.numel(), : self.dims[f]])
                at += i.numel()
        out: dict[str, JaggedEmbeddings] = {}
        for f, r in zip(self.feature_names, rows):
            i = kpos[f]
            out[f] = JaggedEmbeddings(r, lengths[i * batch : (i + 1) * batch])
        return {f: out[f] for f in self.feature_names}
