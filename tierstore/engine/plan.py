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

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..config import TableSpec
from ..errors import ConfigError, ShapeError

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
    rows are numbered table by table: table t holds `u_start[t]:u_start[t + 1]`. A keyed batch
    (`Plan.keyed_step`) numbers them by slot over all tables instead, n of them for n positions,
    the ones past the last distinct slot with no position (the kernels leave such a row alone);
    its `u_start` is (0, ..., 0, n), and no table range of it is read (it has no 16-bit table and
    no weights' gradient).
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
    # a keyed batch's gradient CSR, made with it (`Plan.keyed_step`): positions sorted stably by
    # unique row, each row's start there [u + 1], each position's bag; None: the backend's own
    csr: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def to(self, device: torch.device) -> StepBatch:
        """The same batch with its tensors on `device`."""
        if self.inverse.device == device:
            return self
        nb = True  # host-to-device copies the step does not wait for (no sync)
        return StepBatch(self.inverse.to(device, non_blocking=nb), self.offsets.to(device, non_blocking=nb),
                         self.bag_out.to(device, non_blocking=nb), self.bag_feat.to(device, non_blocking=nb),
                         None if self.psw is None else self.psw.to(device, non_blocking=nb),
                         self.u_table.to(device, non_blocking=nb), self.u_start, self.out_rows,
                         self.out_width, None if self.csr is None else
                         tuple(t.to(device, non_blocking=nb) for t in self.csr))

    @property
    def n_unique(self) -> int:
        """Unique rows over all tables."""
        return self.u_start[-1]

    @property
    def n_bags(self) -> int:
        """Bags over all features."""
        return int(self.bag_out.numel())


KeyedRows = Callable[[torch.Tensor, torch.Tensor, torch.Tensor],
                     tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]


def keyed_rows(sk: torch.Tensor, perm: torch.Tensor, pos_table: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Unique rows of n positions sorted stably by slot (`sk`, `perm`: sorted slots and their
    positions; `pos_table`: each position's table), in torch ops on their device: (each
    position's row [n], each row's slot [n] and table [n], each row's first sorted position
    [n + 1]); the rows past the last distinct slot have slot and table 0 and start at n."""
    n, dev = sk.numel(), sk.device
    head = torch.ones(n, dtype=torch.bool, device=dev)
    if n > 1:
        torch.ne(sk[1:], sk[:-1], out=head[1:])
    useq = torch.cumsum(head, 0) - 1  # the unique row of each sorted position
    inverse = torch.empty(n, dtype=torch.int64, device=dev).index_copy_(0, perm, useq)
    # a row's positions all write its one slot and table (the same values: no race)
    slots = torch.zeros(n, dtype=torch.int64, device=dev).index_copy_(0, useq, sk)
    u_table = torch.zeros(n, dtype=torch.int64, device=dev).index_copy_(
        0, useq, pos_table.index_select(0, perm))
    starts = torch.zeros(n + 1, dtype=torch.int64, device=dev).index_add_(
        0, useq + 1, torch.ones_like(useq)).cumsum(0)
    return inverse, slots, u_table, starts


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
        self._on: dict[torch.device, tuple[torch.Tensor, ...]] = {}

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
        lengths, offsets, bag_out, bag_feat, out_rows = self._device_bags(lengths, n, per_feat.to(**to), dev)
        sizes = torch.tensor([starts[t + 1] - starts[t] for t in range(nt)], dtype=torch.int64)
        u_table = torch.repeat_interleave(torch.arange(nt, device=dev), sizes.to(**to),
                                          output_size=starts[-1])
        w = None if psw is None else psw.detach().to(**to).to(torch.float32).reshape(-1).contiguous()
        return StepBatch(inv, offsets, bag_out, bag_feat, w, u_table, tuple(starts), out_rows,
                         self.out_width)

    def on(self, dev: torch.device) -> tuple[torch.Tensor, ...]:
        """The per-feature and per-table arrays (`feat_table`, `feat_col`, `feat_mode`,
        `tab_dim`, `tab_kind`, `tab_params`, `tab_clip`) on `dev`, copied once per device."""
        got = self._on.get(dev)
        if got is None:  # not blocking: a first step under the sync debug mode must not wait
            got = self._on[dev] = tuple(a.to(dev, non_blocking=True) for a in (
                self.feat_table, self.feat_col, self.feat_mode, self.tab_dim, self.tab_kind,
                self.tab_params, self.tab_clip))
        return got

    def keyed_step(self, keys: torch.Tensor, counts: Sequence[int], lengths: torch.Tensor,
                   psw: torch.Tensor | None = None, rows: KeyedRows | None = None
                   ) -> tuple[StepBatch, torch.Tensor]:
        """Linearize one batch whose ids are already slots, and make its gradient CSR.

        `keys`: every feature's positions as slots of the payload (one space for every table:
        equal slots are one row), feature after feature, `counts[f]` of feature f, on one
        device; `lengths`, `psw` as in `step`. Built with
        fixed-size ops on that device (no host sync): the n positions sorted stably by slot, so
        unique row u is the u-th distinct slot and a row's positions stay in input order (the
        order `step`'s CSR sums them in: the same bits). Returns the batch and each unique
        row's slot [n] (rows past the last distinct slot: 0, never read). `rows`: what numbers
        the sorted positions (`keyed_rows`'s contract; a backend's compiled version).
        """
        if self.packed:
            raise ConfigError("a keyed step needs float32 tables: 16-bit ones are decoded by table")
        dev = keys.device
        to = {"device": dev, "non_blocking": True}
        n, nt = int(keys.numel()), len(self.tables)
        if sum(counts) != n or len(counts) != len(self.features):
            raise ShapeError(f"a keyed step needs one count a feature summing to its {n} keys")
        flat = keys.to(torch.int64)
        per_feat = torch.tensor(counts, dtype=torch.int64).to(**to)
        pos_table = torch.repeat_interleave(self.on(dev)[0], per_feat, output_size=n)
        sk, perm = torch.sort(flat, stable=True)
        inverse, slots, u_table, starts = (rows or keyed_rows)(sk, perm, pos_table)
        lengths, offsets, bag_out, bag_feat, out_rows = self._device_bags(lengths, n, per_feat, dev)
        bag_of = torch.repeat_interleave(torch.arange(lengths.numel(), device=dev), lengths,
                                         output_size=n) if self.pooled else bag_out
        w = None if psw is None else psw.detach().to(**to).to(torch.float32).reshape(-1).contiguous()
        batch_ = StepBatch(inverse, offsets, bag_out, bag_feat, w, u_table, (0,) * nt + (n,),
                           out_rows, self.out_width, (perm, starts, bag_of))
        return batch_, slots

    def _device_bags(self, lengths: torch.Tensor, n: int, per_feat: torch.Tensor, dev: torch.device
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """A batch's bags made on `dev` with fixed-size ops: (lengths there, offsets, each bag's
        output row and feature, output rows); unpooled, one bag a position (`per_feat`: the
        features' position counts, on `dev`)."""
        if not self.pooled:
            offsets = torch.arange(n + 1, dtype=torch.int64, device=dev)
            bag_feat = torch.repeat_interleave(torch.arange(len(self.features), device=dev),
                                               per_feat, output_size=n)
            return lengths, offsets, offsets[:-1], bag_feat, n
        nf = len(self.features)
        lengths = lengths.to(torch.int64).to(device=dev, non_blocking=True)
        batch = lengths.numel() // nf if nf else 0
        offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=dev)
        torch.cumsum(lengths, 0, out=offsets[1:])
        bag_out, bag_feat = self._bags(nf, batch, dev)
        return lengths, offsets, bag_out, bag_feat, batch

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
