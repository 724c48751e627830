"""PyTorch modules over the tiered store: TieredEmbeddingBag and TieredEmbeddingBagCollection."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

import tierstore.validate as validate

from .admission import pool_masked
from .embedding_configs import config_features, config_pooling, is_table_config, table_spec
from .errors import ConfigError, ReadOnlyError, ShapeError
from .jagged import JaggedBatch, keyed_tensor, torchrec_keyed_tensor
from .module_state import StoreBacked
from .optimizers import Optimizer
from .store import TierStore

MODES = ("sum", "mean")
OUTPUTS = ("tensor", "dict", "keyed")  # what a collection returns
_OUTPUT_ALIASES = {"keyed_tensor": "keyed", "KeyedTensor": "keyed"}


class _TieredBags(torch.autograd.Function):
    """Pooled bags over store rows; backward applies the table's fused optimizer in place."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, psw: torch.Tensor | None, store: TierStore,
                table: str, ids: torch.Tensor, offsets: torch.Tensor, mode: str) -> torch.Tensor:
        need_weights = bool(ctx.needs_input_grad[1])
        tab = store.table_record(table)
        ids = store.check_ids(tab, ids)
        # lock-free on the slots the pipeline pinned for this batch (not with admission: its
        # sketch counts under the lock)
        done = None if tab.spec.admission is not None else \
            store.pool_pinned(tab, ids, offsets, psw, mode, need_weights)
        if done is not None:
            out, g = done
        else:
            with store.exclusive():
                store.check_live()
                tab = store.table_record(table)
                store.record_access(table, ids)
                mask = store.admit_mask(tab, ids)
                if mask is not None:  # some ids not admitted yet: they pool their initial rows
                    out, g = pool_masked(store, tab, ids, mask, offsets, psw, mode)
                else:
                    out, g = store.pool_forward(tab, ids, offsets, psw, mode, need_weights)
        ctx.save_for_backward(psw, offsets)
        ctx.mode, ctx.store, ctx.table, ctx.gathered = mode, store, table, g
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor):  # type: ignore[override]
        psw, offsets = ctx.saved_tensors
        store, g = ctx.store, ctx.gathered
        ctx.gathered = None
        tab = store.table_record(ctx.table)
        grad_out = validate.bag_gradients(tab.spec, grad_out, psw).contiguous()
        if not store.apply_pinned(tab, g, offsets, grad_out, psw, ctx.mode):  # lock-free
            with store.exclusive():
                store.check_live()
                tab = store.table_record(ctx.table)
                store.apply_bag_grads(tab, g, offsets, grad_out, psw, ctx.mode)
        g_psw = None
        if psw is not None and ctx.needs_input_grad[1]:
            n = g.inverse.numel()
            dev = g.weights.device
            offs = offsets.to(dev)
            lengths = torch.diff(offs, append=torch.tensor([n], device=dev))
            bag_of = torch.repeat_interleave(torch.arange(offs.numel(), device=dev), lengths)
            rows = g.weights.index_select(0, g.inverse.to(dev))
            g_psw = (grad_out.to(dev).index_select(0, bag_of) * rows).sum(1).to(psw.device)
        return None, g_psw, None, None, None, None, None


def _normalize(input: torch.Tensor, offsets: torch.Tensor | None,
               per_sample_weights: torch.Tensor | None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """torch.nn.EmbeddingBag's input conventions -> (flat ids, offsets, flat weights)."""
    validate.no_meta(input=input, offsets=offsets, per_sample_weights=per_sample_weights)
    if input.dim() == 2:
        if offsets is not None:
            raise ShapeError("offsets must be None when input is 2-D")
        b, length = input.shape
        offsets = torch.arange(b, dtype=torch.int64) * length
        input = input.reshape(-1)
        if per_sample_weights is not None:
            per_sample_weights = per_sample_weights.reshape(-1)
    elif input.dim() == 1:
        if offsets is None or offsets.dim() != 1:
            raise ShapeError("1-D input needs 1-D offsets (the start of each bag)")
        offsets = offsets.to(device="cpu", dtype=torch.int64)
        if offsets.numel() and (int(offsets[0]) != 0 or bool((offsets.diff() < 0).any())
                                or int(offsets[-1]) > input.numel()):
            raise ShapeError("offsets must start at 0, be non-decreasing and <= len(input)")
    else:
        raise ShapeError(f"input must be 1-D or 2-D, got shape {tuple(input.shape)}")
    if per_sample_weights is not None and per_sample_weights.shape != input.shape:
        raise ShapeError("per_sample_weights must have the same shape as input")
    return input, offsets, per_sample_weights


class TieredEmbeddingBag(StoreBacked, nn.Module):
    """Like torch.nn.EmbeddingBag over one store table; backward updates rows in the store."""

    def __init__(self, store: TierStore, table: str, mode: str = "sum") -> None:
        super().__init__()
        if mode not in MODES:
            raise ConfigError(f"mode must be one of {MODES}, got {mode!r}")
        self.store = store
        self.watch_clock()  # warns when tables with a ttl train on a clock nobody advances
        self.table = table
        self.mode = mode
        self.embedding_dim = store.table_specs[table].dim if table in store.table_specs else None
        if self.embedding_dim is None:
            store.table_record(table)  # raises UnknownTableError

    def forward(self, input: torch.Tensor, offsets: torch.Tensor | None = None,
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        """Pooled embeddings [bags, dim] with nn.EmbeddingBag's conventions."""
        ids, offsets, psw = _normalize(input, offsets, per_sample_weights)
        if psw is not None and self.mode != "sum":
            raise ConfigError("per_sample_weights are only supported with mode='sum'")
        return _pool(self.store, self.table, ids, offsets, psw, self.mode)

    def _state_tables(self) -> list[str]:
        return [self.table]

    def extra_repr(self) -> str:
        """The store's path, the table and the mode."""
        return f"{super().extra_repr()}, mode={self.mode!r}"


class _ReadOnlyRows(torch.autograd.Function):
    """Rows of flat ids from a read-only handle (inference); backward raises ReadOnlyError."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, store: Any, table: str,
                ids: torch.Tensor) -> torch.Tensor:
        ctx.path = store.path
        return store.read(table, ids)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor):  # type: ignore[override]
        raise ReadOnlyError(f"store {ctx.path} is open read-only: training through it is not allowed")


def read_only_rows(store: Any, table: str, ids: torch.Tensor) -> torch.Tensor:
    """[n, dim] rows of a `ReadOnlyStore`; a backward through them raises ReadOnlyError."""
    anchor = torch.empty(0, requires_grad=torch.is_grad_enabled())
    return _ReadOnlyRows.apply(anchor, store, table, ids)


def _pool(store: TierStore, table: str, ids: torch.Tensor, offsets: torch.Tensor,
          psw: torch.Tensor | None, mode: str) -> torch.Tensor:
    if store.readonly:  # a ReadOnlyStore: pool its published rows
        rows = read_only_rows(store, table, ids)
        return F.embedding_bag(torch.arange(ids.numel(), device=rows.device), rows,
                               offsets.to(rows.device), mode=mode, per_sample_weights=psw)
    # a leaf that requires grad, so autograd runs our backward (which updates the store)
    anchor = torch.empty(0, requires_grad=torch.is_grad_enabled())
    return _TieredBags.apply(anchor, psw, store, table, ids, offsets.to("cpu", torch.int64), mode)


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
            store.table_record(table)
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
        self._by_table: dict[str, list[str]] = {}
        for f, t in feats.items():
            self._by_table.setdefault(t, []).append(f)

    def forward(self, keys: Any, values: torch.Tensor | None = None,
                lengths: torch.Tensor | None = None, offsets: torch.Tensor | None = None,
                weights: torch.Tensor | None = None, as_dict: bool = False
                ) -> torch.Tensor | dict[str, torch.Tensor]:
        """Pooled embeddings of every feature: [batch, sum of dims] or {feature: [batch, dim]}."""
        keys, values, lengths, weights = JaggedBatch.of(keys, values, lengths, offsets, weights).astuple()
        if len(keys) == 0 or lengths.numel() % len(keys):
            raise ShapeError("lengths must hold one entry per (feature, sample)")
        missing = [f for f in self.feature_names if f not in keys]
        if missing:
            raise ShapeError(f"input lacks features {missing}")
        if weights is not None and self.mode != "sum":
            raise ConfigError("weights are only supported with mode='sum'")
        batch = lengths.numel() // len(keys)
        starts = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
        torch.cumsum(lengths, 0, out=starts[1:])
        kpos = {k: i for i, k in enumerate(keys)}
        out: dict[str, torch.Tensor] = {}
        for table, feats in self._by_table.items():
            # one gather and one optimizer step per table, however many features share it
            parts, lens, wparts = [], [], []
            for f in feats:
                i = kpos[f]
                lo, hi = int(starts[i * batch]), int(starts[(i + 1) * batch])
                parts.append(values[lo:hi])
                lens.append(lengths[i * batch : (i + 1) * batch])
                if weights is not None:
                    wparts.append(weights[lo:hi])
            ids = torch.cat(parts)
            ln = torch.cat(lens)
            offs = torch.zeros(ln.numel(), dtype=torch.int64)
            torch.cumsum(ln[:-1], 0, out=offs[1:])
            psw = torch.cat(wparts) if weights is not None else None
            pooled = _pool(self.store, table, ids, offs, psw, self.mode)
            for j, f in enumerate(feats):
                out[f] = pooled[j * batch : (j + 1) * batch]
        if as_dict or self.output == "dict":
            return {f: out[f] for f in self.feature_names}
        pooled = torch.cat([out[f] for f in self.feature_names], dim=1)
        return keyed_tensor(self.feature_names, self.dims, pooled) if self.output == "keyed" else pooled

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
