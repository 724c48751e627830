"""Column-wise row-wise Adagrad: the row's mean squared gradient taken across column shards.

Row-wise Adagrad's accumulator needs the whole row's gradient: `acc += mean(g**2)`. A column
shard stores its columns' weights plus the row's accumulator as one extra weight column of a
local SGD(lr=1) table, so the store moves and checkpoints them together. Its backward:

1. sum each unique row's gradient over its positions in global order (the fused kernel's order);
2. add weight decay, giving this shard's columns of `g`;
3. exchange those columns with the table's other shards (the extra collective, `bwd:colsq`),
   so every shard holds the whole `g` and sums its squares in the fused kernel's order (eight
   lanes by column mod 8, then a fixed tree);
4. apply `[mult * g_s | -sq / dim]` through SGD(lr=1): `w - mult*g` and `acc + sq/dim`, the
   same float32 operations as the single-process kernel, so the result is bit-identical.
"""

from __future__ import annotations

import numpy as np
import torch

from .._kernels import HAVE_NUMBA
from ..fused import BatchUpdate, bag_positions
from ..optimizers import SGD, RowWiseAdagrad

LOCAL_OPTIMIZER = SGD(lr=1.0)

if HAVE_NUMBA:
    from ..fused import csr_by_group, summed_kernel


def summed_grads(inverse: torch.Tensor, n_unique: int, offsets: torch.Tensor,
                 grad_out: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """[n_unique, dim]: each unique row's gradient, summed as the fused optimizer sums it."""
    n = inverse.numel()
    bag_of, _ = bag_positions(offsets, n)
    grad_out = grad_out.contiguous()
    if not HAVE_NUMBA:  # the torch path sums as the single process's torch path does
        upd = BatchUpdate(RowWiseAdagrad(), grad_out.shape[1], n_unique, inverse, grad_out, bag_of,
                          scale, use_kernel=False)
        return upd.summed_grads()
    perm, starts = csr_by_group(inverse.numpy(), n_unique)
    sc = np.empty(0, dtype=np.float32) if scale is None else scale.contiguous().numpy()
    return torch.from_numpy(summed_kernel(perm, starts, bag_of.numpy(), grad_out.numpy(), sc,
                                    grad_out.shape[1]))


def sum_squares(g: torch.Tensor) -> torch.Tensor:
    """Per-row sum of g**2 in the fused kernel's order: 8 lanes (column mod 8), then a fixed tree."""
    n, dim = g.shape
    sq = g * g
    part = torch.zeros(n, 8, dtype=torch.float32)
    full = dim - dim % 8
    for base in range(0, full, 8):
        part += sq[:, base : base + 8]
    if dim > full:
        part[:, : dim - full] += sq[:, full:]
    p = part.unbind(1)
    return ((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7]))


def decayed(opt: RowWiseAdagrad, g: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """g + weight_decay * w in float32, as the kernel adds it."""
    return g + np.float32(opt.weight_decay) * w


def local_grads(opt: RowWiseAdagrad, g_full: torch.Tensor, lo: int, width: int,
                acc: torch.Tensor) -> torch.Tensor:
    """The SGD(lr=1) gradient [u, width + 1] that performs row-wise Adagrad's update on a shard."""
    dim = g_full.shape[1]
    inv_dim = np.float32(1.0) / np.float32(dim)
    step = sum_squares(g_full).numpy() * inv_dim
    new_acc = acc.numpy() + step
    # numpy's float32 sqrt is correctly rounded, as the kernel's; torch's vectorized one is not
    mult = np.float32(opt.lr) / (np.sqrt(new_acc) + np.float32(opt.eps))
    out = torch.empty(g_full.shape[0], width + 1, dtype=torch.float32)
    out[:, :width] = torch.from_numpy(mult).unsqueeze(1) * g_full[:, lo : lo + width]
    out[:, width] = torch.from_numpy(-step)
    return out
