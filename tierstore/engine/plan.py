"""A collection's step, linearized: its tables and features as one id space for one kernel call.

The plan is fixed when a module is built: per table its dim, row storage (float32 or 16-bit),
optimizer and its hyperparameters, gradient clip; per feature its table, its output columns and
its pooling mode. `Plan.step` turns one batch into `StepBatch`, the flat tensors the backends
read: one position per id over all features, one bag per (feature, sample), and one unique row
per distinct (table, row) key, numbered table by table. Every variant (mean, max, per-sample
weights, 16-bit rows, clip, optimizers) is data of the plan, so a backend has one forward and
one backward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..config import TableSpec
from ..errors import ConfigError

MODES = {"sum": 0, "mean": 1, "max": 2}
SUM, MEAN, MAX = 0, 1, 2
KINDS = {"sgd": 0, "adagrad": 1, "rowwise_adagrad": 2, "adam": 3}
CODECS = {"float32": 0, "float16": 1, "bfloat16": 2}
N_PARAMS = 5  # hyperparameters per table, in the order the kernels read them


def optimizer_params(spec: TableSpec) -> np.ndarray:
    """A table's optimizer hyperparameters as float64 [N_PARAMS] (kernel order, zero-padded)."""
    cfg = spec.optimizer.to_config()
    kind = spec.optimizer.kind
    if kind == "adam":
        b1, b2 = cfg["betas"]
        vals = [cfg["lr"], b1, b2, cfg["eps"], cfg["weight_decay"]]
    elif kind == "sgd":
        vals = [cfg["lr"], cfg["weight_decay"]]
    else:
        vals = [cfg["lr"], cfg["eps"], cfg["weight_decay"]]
    out = np.zeros(N_PARAMS, dtype=np.float64)
    out[: len(vals)] = vals
    return out


@dataclass(frozen=True)
class TablePlan:
    """One table's part of the plan."""

    name: str
    dim: int
    kind: int  # KINDS
    codec: int  # CODECS
    state: int  # optimizer state floats after the weights
    cols: int  # float32 payload columns holding the weights (dim, or ceil(dim / 2) when 16-bit)
    params: tuple[float, ...]
    clip: float  # inf: no clip

    @classmethod
    def of(cls, spec: TableSpec) -> TablePlan:
        """The plan of a table from its spec."""
        return cls(spec.name, spec.dim, KINDS[spec.optimizer.kind], CODECS[spec.dtype],
                   spec.optimizer.state_dim(spec.dim), spec.codec.cols(spec.dim),
                   tuple(optimizer_params(spec).tolist()),
                   float("inf") if spec.clip is None else float(np.float32(spec.clip)))

    @property
    def packed(self) -> bool:
        """16-bit weights (decoded to float32 for the math, re-encoded with stochastic rounding)."""
        return self.codec != 0


@dataclass(frozen=True)
class FeaturePlan:
    """One feature: the table it reads, its first output column, and its pooling mode."""

    name: str
    table: int
    col: int
    mode: int  # MODES


@dataclass(frozen=True, eq=False)
class StepBatch:
    """One step's linearized input (CPU int64/float32 tensors, or on the device tier's device).

    Position p (an id of some feature) reads unique row `inverse[p]`; bag b pools positions
    `offsets[b]:offsets[b + 1]` into output row `bag_out[b]` at its feature's columns. Unique
    rows are numbered table by table: table t holds `u_start[t]:u_start[t + 1]`.
    """

    inverse: torch.Tensor  # int64 [n]
    offsets: torch.Tensor  # int64 [bags + 1]
    bag_out: torch.Tensor  # int64 [bags]
    bag_feat: torch.Tensor  # int64 [bags]
    psw: torch.Tensor | None  # float32 [n]
    u_table: torch.Tensor  # int64 [u]
    u_start: tuple[int, ...]  # [tables + 1]
    out_rows: int
    out_width: int

    def to(self, device: torch.device) -> StepBatch:
        """The same batch with its tensors on `device`."""
        if self.inverse.device == device:
            return self
        nb = True  # host-to-device copies the step does not wait for (no sync)
        return StepBatch(self.inverse.to(device, non_blocking=nb), self.offsets.to(device, non_blocking=nb),
                         self.bag_out.to(device, non_blocking=nb), self.bag_feat.to(device, non_blocking=nb),
                         None if self.psw is None else self.psw.to(device, non_blocking=nb),
                         self.u_table.to(device, non_blocking=nb), self.u_start, self.out_rows,
                         self.out_width)

    @property
    def n_unique(self) -> int:
        """Unique rows over all tables."""
        return self.u_start[-1]

    @property
    def n_bags(self) -> int:
        """Bags over all features."""
        return int(self.bag_out.numel())


class Plan:
    """Tables and features of a collection laid out for the engine (see the module docstring)."""

    def __init__(self, specs: Sequence[TableSpec], features: Sequence[tuple[str, str, str]],
                 pooled: bool = True) -> None:
        """`features`: (feature, table, mode) in output order; `pooled=False`: one row per id."""
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ConfigError("a plan's tables must be distinct")
        self.tables = tuple(TablePlan.of(s) for s in specs)
        pos = {n: i for i, n in enumerate(names)}
        feats, col = [], 0
        for fname, tname, mode in features:
            if tname not in pos:
                raise ConfigError(f"feature {fname!r} reads table {tname!r}, not in the plan")
            if mode not in MODES:
                raise ConfigError(f"mode must be one of {tuple(MODES)}, got {mode!r}")
            feats.append(FeaturePlan(fname, pos[tname], col if pooled else 0, MODES[mode]))
            if pooled:
                col += self.tables[pos[tname]].dim
        self.features = tuple(feats)
        self.pooled = pooled
        self.max_dim = max(t.dim for t in self.tables)
        self.out_width = col if pooled else self.max_dim
        self.has_max = any(f.mode == MAX for f in self.features)
        self.packed = any(t.packed for t in self.tables)
        self.has_mean = any(f.mode == MEAN for f in self.features)
        self.has_adam = any(t.kind == KINDS["adam"] for t in self.tables)
        # per-feature and per-table arrays the kernels index (CPU; backends move them)
        self.feat_table = torch.tensor([f.table for f in self.features], dtype=torch.int64)
        self.feat_col = torch.tensor([f.col for f in self.features], dtype=torch.int64)
        self.feat_mode = torch.tensor([f.mode for f in self.features], dtype=torch.int64)
        self.tab_dim = torch.tensor([t.dim for t in self.tables], dtype=torch.int64)
        self.tab_kind = torch.tensor([t.kind for t in self.tables], dtype=torch.int64)
        self.tab_state = torch.tensor([t.state for t in self.tables], dtype=torch.int64)
        self.tab_params = torch.tensor([t.params for t in self.tables], dtype=torch.float64)
        self.tab_clip = torch.tensor([t.clip for t in self.tables], dtype=torch.float32)
        self._bag_cache: tuple[int, torch.Tensor, torch.Tensor, dict] | None = None

    def step(self, inverse: Sequence[torch.Tensor], n_unique: Sequence[int],
             lengths: torch.Tensor, psw: torch.Tensor | None = None) -> StepBatch:
        """Linearize one batch.

        `inverse[f]`: feature f's ids as indexes into its table's unique rows (feature order);
        `n_unique[t]`: unique rows of table t; `lengths`: ids per bag, feature-major
        [features * batch] (pooled), ignored for an unpooled plan (one bag per id); `psw`:
        per-position weights over all features' positions, or None.
        """
        starts = [0]
        for n in n_unique:
            starts.append(starts[-1] + int(n))
        counts = [int(i.numel()) for i in inverse]
        n = sum(counts)
        dev = next((i.device for i in inverse if i.device.type != "cpu"), torch.device("cpu"))
        if dev.type != "cpu":  # indexes made on the device (staging): the batch is built there
            return self._step_on(dev, inverse, starts, counts, lengths, psw)
        inv = torch.empty(n, dtype=torch.int64)
        at = 0
        for f, i in enumerate(inverse):  # each feature's indexes, shifted to its table's rows
            torch.add(i.to("cpu", torch.int64), starts[self.features[f].table],
                      out=inv[at : at + counts[f]])
            at += counts[f]
        if self.pooled:
            nf = len(self.features)
            lengths = lengths.to("cpu", torch.int64)
            batch = lengths.numel() // nf if nf else 0
            offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
            torch.cumsum(lengths, 0, out=offsets[1:])
            bag_out, bag_feat = self._bags(nf, batch)
            out_rows = batch
        else:
            offsets = torch.arange(n + 1, dtype=torch.int64)
            bag_out = torch.arange(n, dtype=torch.int64)
            bag_feat = torch.repeat_interleave(torch.arange(len(self.features)),
                                               torch.tensor(counts, dtype=torch.int64))
            out_rows = n
        u_table = torch.empty(starts[-1], dtype=torch.int64)
        for t in range(len(self.tables)):
            u_table[starts[t] : starts[t + 1]] = t
        w = None if psw is None else psw.detach().to("cpu", torch.float32).reshape(-1).contiguous()
        return StepBatch(inv, offsets, bag_out, bag_feat, w, u_table, tuple(starts), out_rows,
                         self.out_width)

    def _step_on(self, dev: torch.device, inverse: Sequence[torch.Tensor], starts: list[int],
                 counts: list[int], lengths: torch.Tensor, psw: torch.Tensor | None) -> StepBatch:
        """`step` for indexes already on a device: the same integers, built there by fixed-size
        ops (sizes from the host's counts), so nothing is read back and no index crosses."""
        to = {"device": dev, "non_blocking": True}
        n, nt = sum(counts), len(self.tables)
        shift = torch.tensor([starts[f.table] for f in self.features], dtype=torch.int64)
        per_feat = torch.tensor(counts, dtype=torch.int64)
        # each position's table start, added to its feature's indexes
        inv = torch.cat([i.to(**to).to(torch.int64) for i in inverse]) + torch.repeat_interleave(
            shift.to(**to), per_feat.to(**to), output_size=n)
        if self.pooled:
            nf = len(self.features)
            lengths = lengths.to(torch.int64).to(**to)
            batch = lengths.numel() // nf if nf else 0
            offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=dev)
            torch.cumsum(lengths, 0, out=offsets[1:])
            bag_out, bag_feat = self._bags(nf, batch, dev)
            out_rows = batch
        else:
            offsets = torch.arange(n + 1, dtype=torch.int64, device=dev)
            bag_out = offsets[:-1]
            bag_feat = torch.repeat_interleave(torch.arange(len(self.features), device=dev),
                                               per_feat.to(**to), output_size=n)
            out_rows = n
        sizes = torch.tensor([starts[t + 1] - starts[t] for t in range(nt)], dtype=torch.int64)
        u_table = torch.repeat_interleave(torch.arange(nt, device=dev), sizes.to(**to),
                                          output_size=starts[-1])
        w = None if psw is None else psw.detach().to(**to).to(torch.float32).reshape(-1).contiguous()
        return StepBatch(inv, offsets, bag_out, bag_feat, w, u_table, tuple(starts), out_rows,
                         self.out_width)

    def _bags(self, nf: int, batch: int, dev: torch.device | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each pooled bag's output row and feature (read-only; kept for the latest batch size)."""
        got = self._bag_cache
        if got is None or got[0] != batch:
            got = (batch, torch.arange(batch, dtype=torch.int64).repeat(nf),
                   torch.arange(nf, dtype=torch.int64).repeat_interleave(batch), {})
            self._bag_cache = got
        if dev is None or dev.type == "cpu":
            return got[1], got[2]
        on = got[3].get(dev)
        if on is None:  # copied once per batch size and device
            on = got[3][dev] = (got[1].to(dev, non_blocking=True), got[2].to(dev, non_blocking=True))
        return on

    def scale(self, batch: StepBatch) -> torch.Tensor | None:
        """Per-position gradient scale: 1/len for mean bags (float32, as the fused path), times
        the per-sample weights; None when every position's scale is 1."""
        if not self.has_mean:
            return batch.psw
        offsets = batch.offsets
        dev = offsets.device
        lengths = offsets[1:] - offsets[:-1]
        pos = torch.arange(batch.inverse.numel(), dtype=torch.int64, device=dev)
        bag_of = torch.searchsorted(offsets[1:], pos, right=True)  # no host sync, unlike repeat
        inv_len = 1.0 / lengths.clamp(min=1).to(torch.float32)
        mean_bag = self.feat_mode.to(dev, non_blocking=True).index_select(0, batch.bag_feat) == MEAN
        per_bag = torch.where(mean_bag, inv_len, torch.ones_like(inv_len))
        scale = per_bag.index_select(0, bag_of)
        return scale if batch.psw is None else scale * batch.psw
