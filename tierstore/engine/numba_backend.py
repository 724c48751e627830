"""The CPU backend: one numba kernel pools every (feature, bag) pair of a step, one updates every
unique row of every table.

The update sums each row's gradient in the per-table path's order and calls its row update
(`tierstore.fused.update_row`, one per optimizer), so a row's bits do not depend on which path or
how many tables shared the call; no fast-math flag is set, so LLVM contracts no multiply-add into an FMA.
"""

from __future__ import annotations

import numpy as np
import torch

from .._kernels import HAVE_NUMBA
from .._parallel import parallel_for
from .plan import Plan, StepBatch, keyed_rows

POOL_CHUNK = 256  # bags per thread, at the least

if HAVE_NUMBA:
    import numba

    from .._kernels import PREFETCH_AHEAD, prefetch_row
    from ..fused import csr_by_group, update_row

    @numba.njit(cache=True, nogil=True, inline="always")
    def _row(src, slots, work, work_of, u):  # pragma: no cover - compiled
        """Unique row u: its decoded copy in `work` (16-bit tables), else its slot of `src`."""
        w = work_of[u] if work_of.shape[0] else -1
        return work[w] if w >= 0 else src[slots[u]]

    @numba.njit(cache=True, nogil=True)
    def forward_kernel(src, slots, work, work_of, inverse, offsets, bag_out, bag_feat, psw,
                       feat_table, feat_col, feat_mode, tab_dim, out, argmax, lo,
                       hi):  # pragma: no cover - compiled
        """Pool bags [lo, hi): sum, mean or max (arg-max positions to `argmax`) of their rows."""
        n_total = inverse.shape[0]
        has_w = psw.shape[0] > 0
        for b in range(lo, hi):
            f = bag_feat[b]
            dim = tab_dim[feat_table[f]]
            col = feat_col[f]
            mode = feat_mode[f]
            acc = out[bag_out[b], col : col + dim]
            p0, p1 = offsets[b], offsets[b + 1]
            for d in range(dim):
                acc[d] = np.float32(0.0)
            if mode == 2:  # max: the first of equal values wins, as torch's
                for d in range(dim):
                    argmax[b, d] = -1
                for p in range(p0, p1):
                    row = _row(src, slots, work, work_of, inverse[p])
                    for d in range(dim):
                        v = row[d]
                        if p == p0 or v > acc[d]:
                            acc[d] = v
                            argmax[b, d] = p
                continue
            for p in range(p0, p1):
                q = p + PREFETCH_AHEAD
                if q < n_total and work_of.shape[0] == 0:
                    prefetch_row(src, slots[inverse[q]])
                row = _row(src, slots, work, work_of, inverse[p])
                if has_w:
                    w = psw[p]
                    for d in range(dim):
                        acc[d] += row[d] * w
                else:
                    for d in range(dim):
                        acc[d] += row[d]
            if mode == 1 and p1 > p0:
                cnt = np.float32(p1 - p0)
                for d in range(dim):
                    acc[d] = acc[d] / cnt

    @numba.njit(cache=True, nogil=True)
    def sum_kernel(src, slots, inverse, offsets, bag_out, bag_feat, feat_table, feat_col,
                   feat_mode, tab_dim, out, lo, hi):  # pragma: no cover - compiled
        """`forward_kernel` for a step of sum and mean bags whose rows are all read from `src`
        with no per-sample weights: the same float32 sums, in a loop LLVM vectorizes."""
        n_total = inverse.shape[0]
        for b in range(lo, hi):
            f = bag_feat[b]
            dim = tab_dim[feat_table[f]]
            col = feat_col[f]
            acc = out[bag_out[b], col : col + dim]
            p0, p1 = offsets[b], offsets[b + 1]
            for d in range(dim):
                acc[d] = np.float32(0.0)
            for p in range(p0, p1):
                q = p + PREFETCH_AHEAD
                if q < n_total:
                    prefetch_row(src, slots[inverse[q]])
                row = src[slots[inverse[p]]]
                for d in range(dim):
                    acc[d] += row[d]
            if feat_mode[f] == 1 and p1 > p0:
                cnt = np.float32(p1 - p0)
                for d in range(dim):
                    acc[d] = acc[d] / cnt

    @numba.njit(cache=True, nogil=True, inline="always")
    def _clipped(x, clip):  # pragma: no cover - compiled
        if x > clip:
            return clip
        if x < -clip:
            return -clip
        return x

    @numba.njit(cache=True, nogil=True)
    def backward_kernel(table, slots, work, work_of, u_table, perm, starts, bag_of, bag_out,
                        bag_feat, grad_out, scale, argmax, feat_col, feat_mode, tab_dim, tab_kind,
                        tab_params, tab_clip, max_dim, lo, hi):  # pragma: no cover - compiled
        """Sum each unique row's gradient over its positions in input order, then update it."""
        g = np.empty(max_dim, dtype=np.float32)
        part = np.empty(8, dtype=np.float32)
        has_scale = scale.shape[0] > 0
        zero = np.float32(0.0)
        for u in range(lo, hi):
            nxt = u + PREFETCH_AHEAD
            if nxt < hi and work_of.shape[0] == 0:
                prefetch_row(table, slots[nxt])
            if starts[u] == starts[u + 1]:  # no position (a keyed batch's spare row): as it is
                continue
            t = u_table[u]
            dim = tab_dim[t]
            clip = tab_clip[t]
            for d in range(dim):
                g[d] = zero
            for k in range(starts[u], starts[u + 1]):
                p = perm[k]
                b = bag_of[p]
                f = bag_feat[b]
                gr = grad_out[bag_out[b], feat_col[f] : feat_col[f] + dim]
                if feat_mode[f] == 2:  # max: only where this position was the arg-max
                    for d in range(dim):
                        g[d] += _clipped(gr[d], clip) if argmax[b, d] == p else zero
                elif has_scale:
                    s = scale[p]
                    for d in range(dim):
                        g[d] += _clipped(gr[d], clip) * s
                else:
                    for d in range(dim):
                        g[d] += _clipped(gr[d], clip)
            update_row(_row(table, slots, work, work_of, u), g, part, dim, tab_kind[t], tab_params[t])

    @numba.njit(cache=True, nogil=True)
    def plain_backward_kernel(table, slots, u_table, perm, starts, bag_of, bag_out, bag_feat,
                              grad_out, feat_col, tab_dim, tab_kind, tab_params, max_dim, lo,
                              hi):  # pragma: no cover - compiled
        """`backward_kernel` for a step with no clip, scale or max bag and every row in `table`:
        the same float32 sums and updates, in loops LLVM vectorizes."""
        g = np.empty(max_dim, dtype=np.float32)
        part = np.empty(8, dtype=np.float32)
        for u in range(lo, hi):
            nxt = u + PREFETCH_AHEAD
            if nxt < hi:
                prefetch_row(table, slots[nxt])
            if starts[u] == starts[u + 1]:
                continue
            t = u_table[u]
            dim = tab_dim[t]
            for d in range(dim):
                g[d] = np.float32(0.0)
            for k in range(starts[u], starts[u + 1]):
                b = bag_of[perm[k]]
                gr = grad_out[bag_out[b], feat_col[bag_feat[b]] : feat_col[bag_feat[b]] + dim]
                for d in range(dim):
                    g[d] += gr[d]
            update_row(table[slots[u]], g, part, dim, tab_kind[t], tab_params[t])

    @numba.njit(cache=True, nogil=True)
    def bag_of_kernel(offsets, out):  # pragma: no cover - compiled
        """out[p] = the bag holding position p (`offsets` has one entry past the last bag)."""
        for b in range(offsets.shape[0] - 1):
            for p in range(offsets[b], offsets[b + 1]):
                out[p] = b


_I64 = np.empty(0, dtype=np.int64)
_F32 = np.empty(0, dtype=np.float32)


def _np(t: torch.Tensor | None, empty: np.ndarray) -> np.ndarray:
    return empty if t is None else t.contiguous().numpy()


class NumbaBackend:
    """Table-batched CPU kernels (numba); one forward and one backward call per step."""

    name = "numba"
    device_type = "cpu"
    keyed_rows = staticmethod(keyed_rows)  # a keyed step's rows: torch ops

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self._arrays = tuple(a.numpy() for a in (plan.feat_table, plan.feat_col, plan.feat_mode,
                                                 plan.tab_dim, plan.tab_kind, plan.tab_params,
                                                 plan.tab_clip))
        self.no_clip = all(t.clip == float("inf") for t in plan.tables)

    def forward(self, batch: StepBatch, src: torch.Tensor, slots: torch.Tensor,
                work: torch.Tensor | None, work_of: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Pooled (or per-id) rows [out_rows, out_width] and the max bags' arg-max positions."""
        ft, fc, fm, td = self._arrays[:4]
        # pooled: every (feature, sample) bag writes all its columns; unpooled rows may be narrower
        alloc = torch.empty if self.plan.pooled else torch.zeros
        out = alloc((batch.out_rows, batch.out_width), dtype=torch.float32)
        argmax = torch.empty((batch.n_bags, self.plan.max_dim) if self.plan.has_max else (0, 0),
                             dtype=torch.int64)
        if work is None and batch.psw is None and not self.plan.has_max:  # sum and mean bags
            sargs = (src.numpy(), slots.numpy(), batch.inverse.numpy(), batch.offsets.numpy(),
                     batch.bag_out.numpy(), batch.bag_feat.numpy(), ft, fc, fm, td, out.numpy())
            parallel_for(lambda lo, hi: sum_kernel(*sargs, lo, hi), batch.n_bags, POOL_CHUNK)
            return out, None
        w = _np(work, np.empty((0, 1), dtype=np.float32))
        args = (src.numpy(), slots.numpy(), w, _np(work_of, _I64), batch.inverse.numpy(),
                batch.offsets.numpy(), batch.bag_out.numpy(), batch.bag_feat.numpy(),
                _np(batch.psw, _F32), ft, fc, fm, td, out.numpy(), argmax.numpy())
        parallel_for(lambda lo, hi: forward_kernel(*args, lo, hi), batch.n_bags, POOL_CHUNK)
        return out, (argmax if self.plan.has_max else None)

    def backward(self, batch: StepBatch, table: torch.Tensor, slots: torch.Tensor,
                 work: torch.Tensor | None, work_of: torch.Tensor | None, grad_out: torch.Tensor,
                 scale: torch.Tensor | None, argmax: torch.Tensor | None, lo: int, hi: int,
                 finite: torch.Tensor | None = None) -> None:
        """Update unique rows [lo, hi) in place: `table[slots[u]]` (or `work[work_of[u]]`);
        none where the bool `finite` is false."""
        if hi <= lo or (finite is not None and not bool(finite)):
            return
        _, fc, fm, td, tk, tp, tc = self._arrays
        if batch.csr is not None:  # a keyed batch's, made with it
            perm, starts, bag_of = (t.numpy() for t in batch.csr)
        else:
            perm, starts = csr_by_group(batch.inverse.numpy(), batch.n_unique)
            bag_of = np.empty(batch.inverse.numel(), dtype=np.int64)
            bag_of_kernel(batch.offsets.numpy(), bag_of)
        if work is None and scale is None and argmax is None and self.no_clip:
            pargs = (table.numpy(), slots.numpy(), batch.u_table.numpy(), perm, starts, bag_of,
                     batch.bag_out.numpy(), batch.bag_feat.numpy(), grad_out.contiguous().numpy(),
                     fc, td, tk, tp, self.plan.max_dim)
            parallel_for(lambda a, b: plain_backward_kernel(*pargs, lo + a, lo + b), hi - lo)
            return
        w = _np(work, np.empty((0, 1), dtype=np.float32))
        args = (table.numpy(), slots.numpy(), w, _np(work_of, _I64), batch.u_table.numpy(), perm,
                starts, bag_of, batch.bag_out.numpy(), batch.bag_feat.numpy(),
                grad_out.contiguous().numpy(), _np(scale, _F32),
                _np(argmax, np.empty((0, 0), dtype=np.int64)), fc, fm, td, tk, tp, tc,
                self.plan.max_dim)
        parallel_for(lambda a, b: backward_kernel(*args, lo + a, lo + b), hi - lo)
