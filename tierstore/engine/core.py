"""The engine: a plan and a backend; one forward and one backward+update call per step.

Rows are read from, and updated in, a payload tensor by slot: the device tier's slab when every
row of the step is resident there, or a payload the store gathered. 16-bit tables are decoded
to float32 for the kernels and re-encoded with stochastic rounding after the update (the same
math as the per-table fused path); every other variant is data of the plan.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from .._kernels import HAVE_NUMBA
from ..config import KERNELS
from ..errors import ConfigError
from ..precision import CODECS
from .numba_backend import NumbaBackend
from .plan import CODECS as CODE_OF
from .plan import Plan, StepBatch, TablePlan

_CODEC_NAMES = {v: k for k, v in CODE_OF.items()}


def interpreting() -> bool:
    """Whether Triton runs its interpreter (TRITON_INTERPRET=1: kernels on CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check_kernels(kernels: str, device: torch.device) -> str:
    """The backend name `kernels` resolves to on `device` ("auto": numba on CPU, triton on CUDA).

    Raises ConfigError for an unknown name, a missing package, or "triton" on a CPU device tier
    without TRITON_INTERPRET=1 (Triton runs CPU tensors only under its interpreter).
    """
    if kernels not in KERNELS:
        raise ConfigError(f"kernels must be one of {KERNELS}, got {kernels!r}")
    name = kernels if kernels != "auto" else ("triton" if device.type == "cuda" else "numba")
    if name == "numba":
        if device.type != "cpu":
            raise ConfigError("kernels='numba' needs a CPU device tier; use 'triton' on CUDA")
        if not HAVE_NUMBA:
            raise ConfigError("kernels='numba' needs the numba package")
        return name
    try:
        import triton  # noqa: F401  (optional dependency: probed here, used by the backend)
    except ImportError:
        raise ConfigError("kernels='triton' needs the triton package "
                          "(it comes with torch's CUDA wheels)") from None
    if device.type == "cpu" and not interpreting():
        raise ConfigError("kernels='triton' with a CPU device tier runs under Triton's interpreter: "
                          "set TRITON_INTERPRET=1 before triton is first imported")
    return name


def make_backend(name: str, plan: Plan):
    """The backend object for a resolved kernels name."""
    if name == "triton":
        from .triton_backend import TritonBackend  # optional: imported only when chosen

        return TritonBackend(plan)
    return NumbaBackend(plan)


@dataclass(eq=False)
class Forward:
    """What a forward keeps for its backward: the arg-max positions of max bags."""

    argmax: torch.Tensor | None


class Engine:
    """One collection's step over rows held by slot in a payload tensor."""

    def __init__(self, plan: Plan, kernels: str = "numba") -> None:
        self.plan = plan
        self.kernels = kernels
        self.backend = make_backend(kernels, plan)

    def forward(self, batch: StepBatch, src: torch.Tensor, slots: torch.Tensor,
                weights: Sequence[torch.Tensor | None] | None = None
                ) -> tuple[torch.Tensor, Forward]:
        """Pooled bags (or per-id rows) of the step, read from `src[slots[u]]`; a table given
        `weights[t]` (float32 [its unique rows, dim]) is read from there instead."""
        work, work_of = self._decoded(batch, src, slots, weights_only=True, given=weights)
        out, argmax = self.backend.forward(batch, src, slots, work, work_of)
        return out, Forward(argmax)

    def keyed_step(self, keys: torch.Tensor, counts: Sequence[int], lengths: torch.Tensor,
                   psw: torch.Tensor | None = None) -> tuple[StepBatch, torch.Tensor]:
        """`Plan.keyed_step`, its rows numbered by the backend (compiled on CUDA)."""
        return self.plan.keyed_step(keys, counts, lengths, psw, rows=self.backend.keyed_rows)

    def backward(self, batch: StepBatch, fwd: Forward, grad_out: torch.Tensor,
                 table: torch.Tensor, slots: torch.Tensor, lo: int = 0, hi: int | None = None,
                 salts: Sequence[tuple[torch.Tensor | None, int]] | None = None,
                 finite: torch.Tensor | None = None) -> None:
        """Sum gradients per unique row and apply each table's optimizer, in place on
        `table[slots[u]]` for u in [lo, hi) (all rows by default). `grad_out` must be finite,
        or `finite` given: a bool tensor on the device, false when it is not, and then no row
        changes (checked by the kernels, or a 16-bit table's rows put back: no host sync). `salts[t]`: a
        16-bit table's row ids and update count, which draw its stochastic rounding's bits
        (`HalfCodec.encode_stochastic`)."""
        hi = batch.n_unique if hi is None else hi
        scale = self.plan.scale(batch)
        if not self.plan.packed:
            self.backend.backward(batch, table, slots, None, None, grad_out, scale, fwd.argmax, lo,
                                  hi, finite)
            return
        if finite is not None:  # 16-bit rows are re-encoded outside the kernel: put them back
            at = slots[lo:hi]
            before = table.index_select(0, at)
        work, work_of = self._decoded(batch, table, slots, weights_only=False, lo=lo, hi=hi)
        self.backend.backward(batch, table, slots, work, work_of, grad_out, scale, fwd.argmax, lo, hi)
        self._encode(batch, table, slots, work, lo, hi, salts)
        if finite is not None:
            table.index_copy_(0, at, torch.where(finite, table.index_select(0, at), before))

    def _packed_ranges(self, batch: StepBatch, lo: int, hi: int
                       ) -> Iterator[tuple[TablePlan, int, int]]:
        for t, tp in enumerate(self.plan.tables):
            a, b = max(batch.u_start[t], lo), min(batch.u_start[t + 1], hi)
            if tp.packed and b > a:
                yield tp, a, b

    def _decoded(self, batch: StepBatch, src: torch.Tensor, slots: torch.Tensor,
                 weights_only: bool, lo: int = 0, hi: int | None = None,
                 given: Sequence[torch.Tensor | None] | None = None
                 ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """16-bit tables' rows decoded to float32 [rows, dim (+ state)] and the tables' `given`
        weights, and each unique row's place there (-1: read the row from `src`); (None, None)
        when every row is read from `src`."""
        given = [None] * len(self.plan.tables) if given is None else list(given)
        if not self.plan.packed and all(w is None for w in given):
            return None, None
        hi = batch.n_unique if hi is None else hi
        ranges = [(tp, a, b) for tp, a, b in self._packed_ranges(batch, lo, hi)
                  if given[self.plan.tables.index(tp)] is None]
        for t, w in enumerate(given):
            a, b = max(batch.u_start[t], lo), min(batch.u_start[t + 1], hi)
            if w is not None and b > a:
                ranges.append((self.plan.tables[t], a, b))
        width = max([tp.dim + (0 if weights_only else tp.state) for tp, _, _ in ranges], default=1)
        total = sum(b - a for _, a, b in ranges)
        dev = src.device
        work = torch.zeros((total, width), dtype=torch.float32, device=dev)
        work_of = torch.full((batch.n_unique,), -1, dtype=torch.int64, device=dev)
        at = 0
        for tp, a, b in ranges:
            t = self.plan.tables.index(tp)
            if given[t] is not None:
                base = batch.u_start[t]
                work[at : at + b - a, : tp.dim] = given[t][a - base : b - base, : tp.dim]
                work_of[a:b] = torch.arange(at, at + b - a, device=dev)
                at += b - a
                continue
            codec = CODECS[_CODEC_NAMES[tp.codec]]
            rows = src.index_select(0, slots[a:b])
            work[at : at + b - a, : tp.dim] = codec.decode(rows[:, : tp.cols], tp.dim)
            if not weights_only:
                work[at : at + b - a, tp.dim : tp.dim + tp.state] = rows[:, tp.cols : tp.cols + tp.state]
            work_of[a:b] = torch.arange(at, at + b - a, device=dev)
            at += b - a
        return work, work_of

    def _encode(self, batch: StepBatch, table: torch.Tensor, slots: torch.Tensor,
                work: torch.Tensor, lo: int, hi: int,
                salts: Sequence[tuple[torch.Tensor | None, int]] | None) -> None:
        """Write updated 16-bit rows back: weights rounded stochastically, state as is."""
        at = 0
        for tp, a, b in self._packed_ranges(batch, lo, hi):
            codec = CODECS[_CODEC_NAMES[tp.codec]]
            s = slots[a:b]
            rows = table.index_select(0, s)[:, : tp.cols + tp.state]
            w = work[at : at + b - a]
            t = self.plan.tables.index(tp)
            keys, count = (None, 0) if salts is None else salts[t]
            if keys is not None:
                keys = keys[a - batch.u_start[t] : b - batch.u_start[t]]
            # the Triton engine rounds with the torch ops CUDA runs (on CPU tensors too: tested)
            rows[:, : tp.cols] = codec.encode_stochastic(w[:, : tp.dim], rows[:, : tp.cols], keys, count,
                                                         use_kernel=self.kernels != "triton")
            rows[:, tp.cols :] = w[:, tp.dim : tp.dim + tp.state]
            table[s, : tp.cols + tp.state] = rows
            at += b - a
