"""PyTorch modules over the tiered store: TieredEmbeddingBag and TieredEmbeddingBagCollection."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

import tierstore.validate as validate

from .config import TableSpec
from .embedding_configs import config_features, config_pooling, is_table_config, table_spec
from .errors import ConfigError, ShapeError, StoreClosedError, TierstoreError, UnknownTableError
from .jagged import JaggedBatch, either_weights, keyed_tensor, torchrec_keyed_tensor
from .module_state import StoreBacked
from .optimizers import Optimizer
from .steps import EngineStep, ReadOnlyRows, anchor, engine_for, prepare_direct
from .store import TierStore

MODES = ("sum", "mean", "max")
OUTPUTS = ("tensor", "dict", "keyed")  # what a collection returns
_OUTPUT_ALIASES = {"keyed_tensor": "keyed", "KeyedTensor": "keyed"}


def store_table(store: Any, table: str) -> TableSpec:
    """The spec of a store's table; UnknownTableError (StoreClosedError when closed) otherwise."""
    if getattr(store, "closed", False):
        raise StoreClosedError(f"store {store.path} is closed")
    specs = store.table_specs
    if table not in specs:
        raise UnknownTableError(f"unknown table {table!r}; this store has {sorted(specs)}")
    return specs[table]


def _normalize(input: torch.Tensor, offsets: torch.Tensor | None,
               per_sample_weights: torch.Tensor | None, include_last_offset: bool = False
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """torch.nn.EmbeddingBag's input conventions -> (flat ids, ids per bag, flat weights)."""
    validate.no_meta(input=input, offsets=offsets, per_sample_weights=per_sample_weights)
    if input.dim() == 2:
        if offsets is not None:
            raise ShapeError("offsets must be None when input is 2-D")
        b, length = input.shape
        lengths = torch.full((b,), length, dtype=torch.int64)
        input = input.reshape(-1)
        if per_sample_weights is not None:
            per_sample_weights = per_sample_weights.reshape(-1)
    elif input.dim() == 1:
        if offsets is None or offsets.dim() != 1:
            raise ShapeError("1-D input needs 1-D offsets (the start of each bag)")
        if offsets.is_floating_point() or offsets.is_complex():
            raise ShapeError(f"offsets must be an integer tensor, got dtype {offsets.dtype}")
        offsets = offsets.to(device="cpu", dtype=torch.int64)
        if include_last_offset and offsets.numel() == 0:
            raise ShapeError("include_last_offset=True needs offsets ending with len(input)")
        if offsets.numel() and (int(offsets[0]) != 0 or bool((offsets.diff() < 0).any())
                                or int(offsets[-1]) > input.numel()):
            raise ShapeError("offsets must start at 0, be non-decreasing and <= len(input)")
        if include_last_offset:  # the last entry ends the last bag
            end = int(offsets[-1])
            lengths = offsets.diff()
            input = input[:end]
        else:
            lengths = torch.diff(offsets, append=torch.tensor([input.numel()]))
    else:
        raise ShapeError(f"input must be 1-D or 2-D, got shape {tuple(input.shape)}")
    if per_sample_weights is not None:
        if include_last_offset and input.dim() == 1 and per_sample_weights.dim() == 1:
            per_sample_weights = per_sample_weights[: input.numel()]
        if per_sample_weights.shape != input.shape:
            raise ShapeError("per_sample_weights must have the same shape as input")
    return input, lengths, per_sample_weights


def _drop_padding(ids: torch.Tensor, lengths: torch.Tensor, psw: torch.Tensor | None,
                  padding_idx: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Remove the positions holding `padding_idx` (they pool nothing and get no gradient)."""
    keep = ids != padding_idx
    if bool(keep.all()):
        return ids, lengths, psw
    bag_of = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    kept = torch.bincount(bag_of[keep.cpu()], minlength=lengths.numel())
    return ids[keep], kept, None if psw is None else psw[keep]


def pool_bags(store: Any, features: list[tuple[str, str, str]], ids: list[torch.Tensor],
              lengths: torch.Tensor, psw: torch.Tensor | None) -> torch.Tensor:
    """Pooled bags [batch, sum of dims] of (feature, table, mode) features in one engine step:
    `ids[f]` the flat ids of feature f, `lengths` ids per bag, feature-major."""
    if store.readonly:  # a ReadOnlyStore: pool the published rows
        return _pool_read_only(store, features, ids, lengths, psw)
    return EngineStep.apply(anchor(), psw, store, engine_for(store, features), ids, lengths)


def read_only_rows(store: Any, table: str, ids: torch.Tensor) -> torch.Tensor:
    """[n, dim] rows of a `ReadOnlyStore`; a backward through them raises ReadOnlyError."""
    return ReadOnlyRows.apply(anchor(), store, table, ids)


def _pool_read_only(store: Any, features: list[tuple[str, str, str]], ids: list[torch.Tensor],
                    lengths: torch.Tensor, psw: torch.Tensor | None) -> torch.Tensor:
    nf = len(features)
    batch = lengths.numel() // nf
    outs, at = [], 0
    for f, (_, table, mode) in enumerate(features):
        ln = lengths[f * batch : (f + 1) * batch]
        n = int(ids[f].numel())
        rows = ReadOnlyRows.apply(anchor(), store, table, ids[f])
        offs = torch.zeros(batch, dtype=torch.int64)
        torch.cumsum(ln[:-1], 0, out=offs[1:])
        w = None if psw is None else psw[at : at + n].to(rows.device, rows.dtype)
        outs.append(torch.nn.functional.embedding_bag(
            torch.arange(n, device=rows.device), rows, offs.to(rows.device), mode=mode,
            per_sample_weights=w))
        at += n
    return torch.cat(outs, dim=1)


class TieredEmbeddingBag(StoreBacked, nn.Module):
    """Like torch.nn.EmbeddingBag over one store table; backward updates rows in the store.

    `mode` "sum", "mean" or "max" (its gradient goes to each bag's arg-max row, as torch's);
    positions holding `padding_idx` pool nothing and get no update (a negative one counts from
    `num_rows`); `include_last_offset=True` takes offsets with one entry past the last bag.
    """

    def __init__(self, store: Any, table: str, mode: str = "sum", padding_idx: int | None = None,
                 include_last_offset: bool = False) -> None:
        super().__init__()
        if mode not in MODES:
            raise ConfigError(f"mode must be one of {MODES}, got {mode!r}")
        spec = store_table(store, table)
        if padding_idx is not None:
            if isinstance(padding_idx, bool) or not isinstance(padding_idx, int) or \
                    not -spec.num_rows <= padding_idx < spec.num_rows:
                raise ConfigError(f"padding_idx must be an int in [-{spec.num_rows}, "
                                  f"{spec.num_rows}), got {padding_idx!r}")
            if padding_idx < 0:
                padding_idx += spec.num_rows
        self.store = store
        self.watch_clock()  # warns when tables with a ttl train on a clock nobody advances
        self.table = table
        self.mode = mode
        self.padding_idx = padding_idx
        self.include_last_offset = bool(include_last_offset)
        self.embedding_dim = spec.dim
        self.num_embeddings = spec.num_rows
        self.features = {table: table}  # for Prefetcher(module, ...): batches keyed by table

    def forward(self, input: torch.Tensor, offsets: torch.Tensor | None = None,
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        """Pooled embeddings [bags, dim] with nn.EmbeddingBag's conventions."""
        ids, lengths, psw = _normalize(input, offsets, per_sample_weights, self.include_last_offset)
        if psw is not None and self.mode != "sum":
            raise ConfigError("per_sample_weights are only supported with mode='sum'")
        if self.padding_idx is not None:
            ids, lengths, psw = _drop_padding(ids, lengths, psw, self.padding_idx)
        return pool_bags(self.store, [(self.table, self.table, self.mode)], [ids], lengths, psw)

    def _state_tables(self) -> list[str]:
        return [self.table]

    def extra_repr(self) -> str:
        """The store's path, the table and the mode."""
        return f"{super().extra_repr()}, mode={self.mode!r}"


def _pool(store: Any, table: str, ids: torch.Tensor, offsets: torch.Tensor,
          psw: torch.Tensor | None, mode: str) -> torch.Tensor:
    """Pooled bags of one table's ids (bags start at `offsets`), through the engine."""
    offsets = offsets.to("cpu", torch.int64)
    lengths = torch.diff(offsets, append=torch.tensor([ids.numel()]))
    return pool_bags(store, [(table, table, mode)], [ids], lengths, psw)


class TieredEmbeddingBagCollection(StoreBacked, nn.Module):
    """Many features over many store tables (features may share a table), jagged input.

    `features` maps feature name -> table name (a list of table names means one feature per
    table, named after it). Input is TorchRec's jagged layout: keys, values, and lengths (or
    offsets) with one entry per (feature, sample), feature-major; a `KeyedJaggedTensor` works
    too (TorchRec's own, or duck-typed). `features` may also be a list of table configs
    (`tierstore.EmbeddingBagConfig` or TorchRec's; their pooling sets `mode`), also given as
    `tables=` like TorchRec's EmbeddingBagCollection. `output`:
    "tensor" ([batch, sum of dims] in feature order), "dict" ({feature: [batch, dim]}) or
    "keyed" (TorchRec's `KeyedTensor`; needs torchrec).
    """

    def __init__(self, store: TierStore, features: Mapping[str, str] | Sequence[Any] | None = None,
                 mode: str | None = None, output: str = "tensor", *,
                 tables: Sequence[Any] | None = None) -> None:
        super().__init__()
        if (features is None) == (tables is None):
            raise ConfigError("give features (a {feature: table} map or table names) or tables "
                              "(EmbeddingBagConfigs, as TorchRec's EmbeddingBagCollection takes)")
        features = tables if features is None else features
        output = _OUTPUT_ALIASES.get(output, output)
        configs = not isinstance(features, Mapping) and bool(features) and \
            all(is_table_config(f) for f in features)
        mode = mode or (config_pooling(features) if configs else "sum")
        if mode not in MODES:
            raise ConfigError(f"mode must be one of {MODES}, got {mode!r}")
        if output not in OUTPUTS:
            raise ConfigError(f"output must be one of {OUTPUTS}, got {output!r}")
        if output == "keyed":
            torchrec_keyed_tensor()  # ConfigError now, not at the first batch, without torchrec
        if isinstance(features, Mapping):
            feats = dict(features)
        elif configs:  # EmbeddingBagConfigs (ours or TorchRec's)
            feats = config_features(features)
        else:  # table names (one feature each) or (feature, table) pairs
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
        self.mode = mode
        self.output = output
        self.features = feats
        self.feature_names = list(feats)
        self.dims = [store.table_specs[t].dim for t in feats.values()]

    def forward(self, keys: Any, values: torch.Tensor | None = None,
                lengths: torch.Tensor | None = None, offsets: torch.Tensor | None = None,
                weights: torch.Tensor | None = None, as_dict: bool = False,
                per_sample_weights: torch.Tensor | None = None
                ) -> torch.Tensor | dict[str, torch.Tensor]:
        """Pooled embeddings of every feature: [batch, sum of dims] or {feature: [batch, dim]}."""
        weights = either_weights(weights, per_sample_weights)  # nn.EmbeddingBag's name too
        ids, lengths, psw = self._inputs(JaggedBatch.of(keys, values, lengths, offsets, weights))
        pooled = pool_bags(self.store, self._plan(), ids, lengths, psw)
        if as_dict or self.output == "dict":
            out, at = {}, 0
            for f, d in zip(self.feature_names, self.dims):
                out[f] = pooled[:, at : at + d]
                at += d
            return out
        return keyed_tensor(self.feature_names, self.dims, pooled) if self.output == "keyed" else pooled

    def _plan(self) -> list[tuple[str, str, str]]:
        """(feature, table, mode) of every feature, in the output's order."""
        return [(f, t, self.mode) for f, t in self.features.items()]

    def _inputs(self, jb: JaggedBatch) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor | None]:
        """A batch's ids by feature (the plan's order), its lengths feature-major in that order,
        and its per-sample weights (None without); raises on input this collection cannot take."""
        keys, values, lengths, weights = jb.astuple()
        if len(keys) == 0 or lengths.numel() % len(keys):
            raise ShapeError("lengths must hold one entry per (feature, sample)")
        missing = [f for f in self.feature_names if f not in keys]
        if missing:
            raise ShapeError(f"input lacks features {missing}")
        if weights is not None and self.mode != "sum":
            raise ConfigError("weights are only supported with mode='sum'")
        batch = lengths.numel() // len(keys)
        starts = [0, *lengths.numpy().cumsum().tolist()]  # host-side metadata (CPU lengths)
        kpos = {k: i for i, k in enumerate(keys)}
        ids, lens, wparts = [], [], []
        for f in self.feature_names:  # the plan's order: one engine step for every feature
            i = kpos[f]
            lo, hi = int(starts[i * batch]), int(starts[(i + 1) * batch])
            ids.append(values[lo:hi])
            lens.append(lengths[i * batch : (i + 1) * batch])
            if weights is not None:
                wparts.append(weights[lo:hi])
        return ids, torch.cat(lens), torch.cat(wparts) if weights is not None else None

    def prepare_step(self, sparse: Any, held_at: int | None = None) -> Any:
        """Make a batch's step ahead, for the prefetch pipeline's thread: on a store whose
        device cache holds every row (`device_direct`), its rows' slots on the device and its
        keyed batch; the forward of exactly this input then starts from them. Returns what was
        made, or None (a batch with per-sample weights, other stores, input the forward will
        refuse: the forward does it all itself). `held_at`: the cache's removal count at which
        the caller found every id of this batch held (its ids are then not checked again)."""
        if self.store.readonly or not self.store.device_tier.direct:
            return None
        try:
            ids, lengths, psw = self._inputs(JaggedBatch.of(sparse))
        except TierstoreError:  # the forward raises it in its turn
            return None
        if psw is not None:
            return None
        return prepare_direct(self.store, engine_for(self.store, self._plan()), ids, lengths, held_at)

    def extra_repr(self) -> str:
        """The store's path, tables, features, mode and output."""
        return (f"{super().extra_repr()}, features={self.features}, mode={self.mode!r}, "
                f"output={self.output!r}")

    @classmethod
    def from_configs(cls, path: str | os.PathLike, tables: Sequence[Any], *,
                     optimizer: Optimizer | None = None, output: str = "tensor",
                     **store_options: Any) -> TieredEmbeddingBagCollection:
        """A collection over `TierStore(path, specs, **store_options)` from EmbeddingBagConfigs.

        `tables` are `tierstore.EmbeddingBagConfig`s or TorchRec's (`optimizer` for those that
        name none). The store is `collection.store`; close it when done.
        """
        store = TierStore(path, [table_spec(c, optimizer) for c in tables], **store_options)
        try:
            return cls(store, tables, output=output)
        except BaseException:
            store.close()
            raise
