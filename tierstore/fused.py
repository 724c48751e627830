"""Fused gradient aggregation + optimizer update, in place on a tier's rows.

One numba kernel per optimizer walks the unique rows of a batch; for each it sums the gradients
of its positions in input order (a CSR built by a stable counting sort: deterministic, no
atomics) and updates the row's embedding and optimizer state in place. Each row's arithmetic is
the same wherever the row lives (a device slab, a host slab, or a gathered payload tensor), so
results never depend on placement. The pure-torch path (segment sum, then `Optimizer.step` on a
gathered copy) serves CUDA tensors and machines without numba; tests compare the two.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from ._kernels import HAVE_NUMBA
from ._parallel import parallel_for
from .optimizers import Optimizer
from .precision import CODECS

POOL_CHUNK = 256  # bags per thread, at the least

if HAVE_NUMBA:
    import numba

    from ._kernels import PREFETCH_AHEAD, prefetch_row

    @numba.njit(cache=True, nogil=True, inline="always")
    def _prefetch_next(table, slots, u):  # pragma: no cover - compiled
        """Prefetch the row that unique index u + PREFETCH_AHEAD will update."""
        nxt = u + PREFETCH_AHEAD
        if nxt < slots.shape[0]:
            prefetch_row(table, slots[nxt])

    @numba.njit(cache=True, nogil=True)
    def csr_by_group(inverse, n_groups):  # pragma: no cover - compiled
        """Stable counting sort of positions by group: (perm, starts)."""
        starts = np.zeros(n_groups + 1, dtype=np.int64)
        for i in range(inverse.shape[0]):
            starts[inverse[i] + 1] += 1
        for g in range(n_groups):
            starts[g + 1] += starts[g]
        fill = starts[:-1].copy()
        perm = np.empty(inverse.shape[0], dtype=np.int64)
        for i in range(inverse.shape[0]):
            g = inverse[i]
            perm[fill[g]] = i
            fill[g] += 1
        return perm, starts

    @numba.njit(cache=True, nogil=True, inline="always")
    def _sum_grad(g, u, perm, starts, bag_of, grad_out, scale, dim):  # pragma: no cover
        for d in range(dim):
            g[d] = np.float32(0.0)
        for k in range(starts[u], starts[u + 1]):
            p = perm[k]
            b = bag_of[p] if bag_of.shape[0] else p
            if scale.shape[0]:
                s = scale[p]
                for d in range(dim):
                    g[d] += grad_out[b, d] * s
            else:
                for d in range(dim):
                    g[d] += grad_out[b, d]

    @numba.njit(cache=True, nogil=True, inline="always")
    def _sum_squares(g, dim, part):  # pragma: no cover - compiled
        """Sum of g[d]**2 in a fixed order: 8 lane partial sums (d mod 8), then a fixed tree.

        A plain running sum is a chain of dependent adds that cannot be vectorized without
        reordering it; this order is written out, so it is the same on every machine.
        """
        for j in range(8):
            part[j] = np.float32(0.0)
        full = dim - dim % 8
        for base in range(0, full, 8):
            for j in range(8):
                part[j] += g[base + j] * g[base + j]
        for d in range(full, dim):
            part[d - full] += g[d] * g[d]
        return ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]))

    # One row update per optimizer: payload row `row` ([weights | state]) from its summed
    # gradient g; the engine's kernel and the per-table kernel below both call these.
    @numba.njit(cache=True, nogil=True, inline="always")
    def sgd_row(row, g, dim, params):  # pragma: no cover - compiled
        lr, wd = np.float32(params[0]), np.float32(params[1])
        for d in range(dim):
            row[d] = row[d] - lr * (g[d] + wd * row[d])

    @numba.njit(cache=True, nogil=True, inline="always")
    def adagrad_row(row, g, dim, params):  # pragma: no cover - compiled
        lr, eps, wd = np.float32(params[0]), np.float32(params[1]), np.float32(params[2])
        for d in range(dim):
            gd = g[d] + wd * row[d]
            acc = row[dim + d] + gd * gd
            row[dim + d] = acc
            row[d] = row[d] - lr * gd / (np.sqrt(acc) + eps)

    @numba.njit(cache=True, nogil=True, inline="always")
    def rowwise_adagrad_row(row, g, part, dim, params):  # pragma: no cover - compiled
        """Row-wise Adagrad; g gets the weight decay added in place, `part` is 8 floats of scratch."""
        lr, eps, wd = np.float32(params[0]), np.float32(params[1]), np.float32(params[2])
        inv_dim = np.float32(1.0) / np.float32(dim)
        for d in range(dim):
            g[d] = g[d] + wd * row[d]
        sq = _sum_squares(g, dim, part)
        acc = row[dim] + sq * inv_dim
        row[dim] = acc
        mult = lr / (np.sqrt(acc) + eps)
        for d in range(dim):
            row[d] = row[d] - mult * g[d]

    @numba.njit(cache=True, nogil=True, inline="always")
    def ipow(b, n):  # pragma: no cover - compiled
        """b**n for an integer n >= 0 by squaring (float64 multiplies only: the same bits on
        every device, unlike libm's and CUDA's `pow`)."""
        out = 1.0
        while n > 0:
            if n & 1:
                out = out * b
            b = b * b
            n >>= 1
        return out

    @numba.njit(cache=True, nogil=True, inline="always")
    def adam_row(row, g, dim, params):  # pragma: no cover - compiled
        lr, b1, b2 = params[0], params[1], params[2]
        eps, wd = np.float32(params[3]), np.float32(params[4])
        one_b1, one_b2 = np.float32(1.0 - b1), np.float32(1.0 - b2)
        t = row[3 * dim] + np.float32(1.0)
        row[3 * dim] = t
        n = np.int64(t)  # a whole count (float32 holds every count up to 2**24 exactly)
        step = np.float32(lr * np.sqrt(1.0 - ipow(b2, n)) / (1.0 - ipow(b1, n)))
        for d in range(dim):
            gd = g[d] + wd * row[d]
            m = row[dim + d] + (gd - row[dim + d]) * one_b1
            v = row[2 * dim + d] + (gd * gd - row[2 * dim + d]) * one_b2
            row[dim + d] = m
            row[2 * dim + d] = v
            row[d] = row[d] - step * (m / (np.sqrt(v) + eps))

    @numba.njit(cache=True, nogil=True, inline="always")
    def update_row(row, g, part, dim, kind, params):  # pragma: no cover - compiled
        """One optimizer step of payload row `row` (kind: `KERNELS`' code of the optimizer)."""
        if kind == 0:
            sgd_row(row, g, dim, params)
        elif kind == 1:
            adagrad_row(row, g, dim, params)
        elif kind == 2:
            rowwise_adagrad_row(row, g, part, dim, params)
        else:
            adam_row(row, g, dim, params)

    @numba.njit(cache=True, nogil=True)
    def update_kernel(table, slots, dim, kind, perm, starts, bag_of, grad_out, scale, params, lo,
                      hi):  # pragma: no cover - compiled
        """Unique rows [lo, hi): sum each one's gradient in input order, then update it."""
        g = np.empty(dim, dtype=np.float32)
        part = np.empty(8, dtype=np.float32)
        for u in range(lo, hi):
            _prefetch_next(table, slots, u)
            _sum_grad(g, u, perm, starts, bag_of, grad_out, scale, dim)
            update_row(table[slots[u]], g, part, dim, kind, params)

    @numba.njit(cache=True, nogil=True)
    def summed_kernel(perm, starts, bag_of, grad_out, scale, dim):  # pragma: no cover - compiled
        """Each unique row's gradient [u, dim], its positions' rows summed in input order."""
        n_u = starts.shape[0] - 1
        out = np.empty((n_u, dim), dtype=np.float32)
        for u in range(n_u):
            _sum_grad(out[u], u, perm, starts, bag_of, grad_out, scale, dim)
        return out

    @numba.njit(cache=True, nogil=True)
    def pool_kernel(table, rows, inverse, offsets, n_total, dim, psw, mean, out, lo,
                    hi):  # pragma: no cover
        """out[b] = (weighted) sum or mean of rows `table[rows[inverse[p]]]` over bag b's positions."""
        bags = offsets.shape[0]
        has_w = psw.shape[0] > 0
        for b in range(lo, hi):
            lo = offsets[b]
            hi = offsets[b + 1] if b + 1 < bags else n_total
            acc = out[b]
            for d in range(dim):
                acc[d] = np.float32(0.0)
            for p in range(lo, hi):
                q = p + PREFETCH_AHEAD
                if q < n_total:
                    prefetch_row(table, rows[inverse[q]])
                src = table[rows[inverse[p]]]
                if has_w:
                    w = psw[p]
                    for d in range(dim):
                        acc[d] += src[d] * w
                else:
                    for d in range(dim):
                        acc[d] += src[d]
            if mean and hi > lo:
                cnt = np.float32(hi - lo)
                for d in range(dim):
                    acc[d] = acc[d] / cnt

    @numba.njit(cache=True, nogil=True)
    def bag_of_kernel(offsets, n_total, out):  # pragma: no cover - compiled
        """out[p] = the bag holding position p (offsets start each bag; the last ends at n_total)."""
        bags = offsets.shape[0]
        for b in range(bags):
            hi = offsets[b + 1] if b + 1 < bags else n_total
            for p in range(offsets[b], hi):
                out[p] = b

# the code `update_row` dispatches on, per optimizer kind (the engine's plan uses the same)
KERNELS = {"sgd": 0, "adagrad": 1, "rowwise_adagrad": 2, "adam": 3} if HAVE_NUMBA else {}


def pool(table: torch.Tensor, rows: torch.Tensor, inverse: torch.Tensor, offsets: torch.Tensor,
         dim: int, psw: torch.Tensor | None, mean: bool) -> torch.Tensor:
    """Pooled bags [len(offsets), dim] from rows of `table` (the numba kernel; CPU tensors)."""
    out = torch.empty((offsets.numel(), dim), dtype=torch.float32)
    args = (table.numpy(), rows.numpy(), inverse.numpy(), offsets.numpy(), inverse.numel(), dim,
            np.empty(0, dtype=np.float32) if psw is None else psw.contiguous().numpy(), mean,
            out.numpy())
    parallel_for(lambda lo, hi: pool_kernel(*args, lo, hi), offsets.numel(), POOL_CHUNK)
    return out


def bag_positions(offsets: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(bag of each of the n positions, length of each bag) for CPU offsets starting at 0."""
    lengths = torch.diff(offsets, append=torch.tensor([n], dtype=offsets.dtype))
    if HAVE_NUMBA:
        bag_of = torch.empty(n, dtype=torch.int64)
        bag_of_kernel(offsets.numpy(), n, bag_of.numpy())
        return bag_of, lengths
    return torch.repeat_interleave(torch.arange(offsets.numel()), lengths), lengths


def segment_sum(values: torch.Tensor, inverse: torch.Tensor, n: int) -> torch.Tensor:
    """Sum rows of `values` by group id `inverse` in a fixed, input-order sequence (no atomics)."""
    order = torch.argsort(inverse, stable=True)
    counts = torch.bincount(inverse, minlength=n)
    return torch.segment_reduce(values.index_select(0, order), "sum", lengths=counts, unsafe=True)


@functools.lru_cache(maxsize=256)
def _params(opt: Optimizer) -> np.ndarray:
    """Hyperparameters in the order the optimizer's kernel reads them."""
    cfg = opt.to_config()
    order = {"sgd": ("lr", "weight_decay"), "adagrad": ("lr", "eps", "weight_decay"),
             "rowwise_adagrad": ("lr", "eps", "weight_decay")}
    if opt.kind == "adam":
        b1, b2 = cfg["betas"]
        return np.array([cfg["lr"], b1, b2, cfg["eps"], cfg["weight_decay"]], dtype=np.float64)
    return np.array([cfg[k] for k in order[opt.kind]], dtype=np.float64)


@dataclass
class BatchUpdate:
    """One optimizer step for a batch's unique rows, from per-position gradient rows.

    Position p of the batch belongs to unique row `inverse[p]` and takes gradient row
    `grad_out[bag_of[p]] * scale[p]` (`bag_of=None`: row p itself; `scale=None`: 1).
    """

    optimizer: Optimizer
    dim: int
    n_unique: int
    inverse: torch.Tensor
    grad_out: torch.Tensor
    bag_of: torch.Tensor | None = None
    scale: torch.Tensor | None = None
    use_kernel: bool = True
    dtype: str = "float32"  # the table's weight storage (tierstore.precision)
    update_count: int = 0  # 16-bit tables: the table's update count (stochastic rounding)
    keys: torch.Tensor | None = None  # 16-bit tables: the ids of the n_unique rows

    def __post_init__(self) -> None:
        self._csr = None
        self.codec = CODECS[self.dtype]

    def apply_on_host(self, table: torch.Tensor, slots: torch.Tensor) -> None:
        """`apply` through a host copy of the rows (what a CUDA table's update runs)."""
        at = slots.to(table.device)
        rows = table.index_select(0, at).cpu()
        self.apply(rows, torch.arange(rows.shape[0]))
        table.index_copy_(0, at, rows.to(table.device))

    def _host_kernel(self) -> bool:
        """Whether the compiled kernels can run this update on the host."""
        return bool(self.use_kernel and self.optimizer.kind in KERNELS  # (empty without numba)
                    and all(t is None or t.device.type == "cpu"
                            for t in (self.grad_out, self.inverse, self.bag_of, self.scale)))

    def kernel_for(self, table: torch.Tensor) -> int | None:
        """The optimizer's code for `update_kernel` on `table`, or None for the torch path."""
        if not (self.use_kernel and table.device.type == "cpu" and self.grad_out.device.type == "cpu"):
            return None
        return KERNELS.get(self.optimizer.kind)

    def apply(self, table: torch.Tensor, slots: torch.Tensor) -> None:
        """Update rows `table[slots[u]]` (u = unique index) in place.

        Rows on another device (CUDA) are updated on the host by the same kernel and copied
        back: the torch ops there reduce in another order and may contract to FMA, so the
        bits would depend on where the rows live (this path reads back anyway; the staged
        step's update is the engine's, which is exact on the device)."""
        if table.device.type != "cpu" and self._host_kernel():
            self.apply_on_host(table, slots)
            return
        if self.codec.packed:
            self._apply_packed(table, slots)
            return
        kernel = self.kernel_for(table)
        if kernel is None:
            self._apply_torch(table, slots)
            return
        self._run_kernel(kernel, table, slots)

    def _run_kernel(self, kind: int, table: torch.Tensor, slots: torch.Tensor) -> None:
        """Run `update_kernel` for the optimizer over the unique rows, split over threads."""
        if self._csr is None:
            self._csr = csr_by_group(self.inverse.numpy(), self.n_unique)
        perm, starts = self._csr
        empty_i = np.empty(0, dtype=np.int64)
        empty_f = np.empty(0, dtype=np.float32)
        args = (table.numpy(), slots.numpy(), self.dim, kind, perm, starts,
                empty_i if self.bag_of is None else self.bag_of.numpy(),
                self.grad_out.contiguous().numpy(),
                empty_f if self.scale is None else self.scale.contiguous().numpy(),
                _params(self.optimizer))
        parallel_for(lambda lo, hi: update_kernel(*args, lo, hi), slots.numel())

    def _apply_packed(self, table: torch.Tensor, slots: torch.Tensor) -> None:
        """16-bit weights: decode to a float32 payload, update it as usual, re-encode (rounded)."""
        dim, state = self.dim, self.optimizer.state_dim(self.dim)
        wc = self.codec.cols(dim)
        rows = table.index_select(0, slots)[:, : wc + state]
        work = torch.empty((slots.numel(), dim + state), dtype=torch.float32, device=table.device)
        work[:, :dim] = self.codec.decode(rows[:, :wc], dim)
        work[:, dim:] = rows[:, wc:]
        kernel = self.kernel_for(work)
        if kernel is None:
            self._apply_torch(work, torch.arange(slots.numel(), device=work.device))
        else:
            self._run_kernel(kernel, work, torch.arange(slots.numel()))
        rows[:, :wc] = self.codec.encode_stochastic(work[:, :dim], rows[:, :wc], self.keys,
                                                    self.update_count)
        rows[:, wc:] = work[:, dim:]
        table[slots, : wc + state] = rows

    def summed_grads(self) -> torch.Tensor:
        """Gradient per unique row, summed in input order (the torch path)."""
        g = self.grad_out if self.bag_of is None else self.grad_out.index_select(0, self.bag_of)
        if self.scale is not None:
            g = g * self.scale.unsqueeze(1)
        return segment_sum(g, self.inverse, self.n_unique)

    def _apply_torch(self, table: torch.Tensor, slots: torch.Tensor) -> None:
        pdim = self.dim + self.optimizer.state_dim(self.dim)
        grads = self.summed_grads().to(table.device)
        slots = slots.to(table.device)
        p = table.index_select(0, slots)[:, :pdim].contiguous()
        self.optimizer.step(p, grads, self.dim)
        table[slots, :pdim] = p
