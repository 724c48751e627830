"""The CUDA backend: the engine's forward and backward as Triton kernels.

The same kernels run on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1), where the
tests check them against the numba backend bit for bit. Bits match because every float32
operation is the numba kernels' in the same order: sums run position by position, rounding is
explicit (`div_rn`, `sqrt_rn`, not the approximate CUDA instructions), row-wise Adagrad's sum
of squares keeps its 8-lane order, and fp fusion is off at launch (no FMA contraction). Adam's
step size is computed in the kernel in float64 with the power `b ** count` taken by squaring
(multiplies only), as numba's kernel does: libm's `pow` and CUDA's may differ in the last bits
(the cross-device test held Adam to 2 float32 ulps for it), so neither backend calls `pow`.

No host synchronization: the gradient's CSR (a stable sort of positions by unique row, counts
by scatter-add) and each position's bag (`searchsorted`) are computed with device ops whose
output sizes the host already knows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._triton import launching
from .plan import Plan, StepBatch


@triton.jit
def _forward_kernel(src, src_stride, slots, work, work_stride, work_of, inverse, offsets, bag_out,
                    bag_feat, psw, feat_table, feat_col, feat_mode, tab_dim, out, out_stride,
                    argmax, am_stride, HAS_WORK: tl.constexpr, HAS_PSW: tl.constexpr,
                    HAS_MAX: tl.constexpr, BLOCK_D: tl.constexpr):
    b = tl.program_id(0)
    f = tl.load(bag_feat + b)
    dim = tl.load(tab_dim + tl.load(feat_table + f))
    col = tl.load(feat_col + f)
    mode = tl.load(feat_mode + f)
    r = tl.load(bag_out + b)
    p0 = tl.load(offsets + b)
    p1 = tl.load(offsets + b + 1)
    d = tl.arange(0, BLOCK_D)
    dm = d < dim
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    mx = tl.zeros([BLOCK_D], dtype=tl.float32)
    am = tl.full([BLOCK_D], -1, dtype=tl.int64)
    for p in range(p0, p1):
        u = tl.load(inverse + p)
        s = tl.load(slots + u)
        if HAS_WORK:
            w = tl.load(work_of + u)
            if w >= 0:
                row = tl.load(work + w * work_stride + d, mask=dm, other=0.0)
            else:
                row = tl.load(src + s * src_stride + d, mask=dm, other=0.0)
        else:
            row = tl.load(src + s * src_stride + d, mask=dm, other=0.0)
        if HAS_PSW:
            acc += row * tl.load(psw + p)
        else:
            acc += row
        if HAS_MAX:
            take = (p == p0) | (row > mx)
            mx = tl.where(take, row, mx)
            am = tl.where(take, p, am)
    cnt = (p1 - p0).to(tl.float32)
    res = tl.where((mode == 1) & (p1 > p0), tl.div_rn(acc, tl.maximum(cnt, 1.0)), acc)
    if HAS_MAX:
        res = tl.where(mode == 2, mx, res)
        if mode == 2:
            tl.store(argmax + b * am_stride + d, am, mask=dm)
    tl.store(out + r * out_stride + col + d, res, mask=dm)


@triton.jit
def _backward_kernel(table, tab_stride, slots, work, work_stride, work_of, u_table, perm, starts,
                     goff, sscale, bag_of, bag_feat, grad_out, argmax, am_stride,
                     feat_mode, tab_dim, tab_kind, tab_params, tab_clip, lo, finite,
                     HAS_WORK: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_MAX: tl.constexpr,
                     HAS_FLAG: tl.constexpr, NCH: tl.constexpr, KB: tl.constexpr):
    u = lo + tl.program_id(0)
    t = tl.load(u_table + u)
    dim = tl.load(tab_dim + t)
    clip = tl.load(tab_clip + t)
    rr = tl.arange(0, NCH)[:, None]
    cc = tl.arange(0, 8)[None, :]
    d = rr * 8 + cc  # [NCH, 8]: lane d % 8, the order of row-wise Adagrad's sum of squares
    dm = d < dim
    g = tl.zeros([NCH, 8], dtype=tl.float32)
    # positions k in [k0, k1) of this row, in position order: `goff[k]` is the start of its
    # gradient row in `grad_out`, `sscale[k]` its scale (both laid out by the host in this order)
    k0 = tl.load(starts + u)
    k1 = tl.load(starts + u + 1)
    # a row with no position (a keyed batch's spare rows) is left as it is, and so is every
    # row when the device flag `finite` says the gradient was not (a check with no host sync)
    live = k1 > k0
    if HAS_FLAG:
        live = live & (tl.load(finite) != 0)
    dm = d < tl.where(live, dim, 0)
    if k1 - k0 <= KB:  # most rows: one position after another
        for k in range(k0, k1):
            gr = tl.load(grad_out + tl.load(goff + k) + d, mask=dm, other=0.0)
            gr = tl.minimum(tl.maximum(gr, -clip), clip)
            if HAS_SCALE:
                gr = gr * tl.load(sscale + k)
            if HAS_MAX:
                p = tl.load(perm + k)
                b = tl.load(bag_of + p)
                sel = tl.load(argmax + b * am_stride + d, mask=dm, other=-1) == p
                gr = tl.where((tl.load(feat_mode + tl.load(bag_feat + b)) != 2) | sel, gr, 0.0)
            g += gr
    else:
        # a hot row (Zipf's head): its positions KB at a time, their gradient rows loaded
        # together, then added one by one in position order. Picking position i of a block
        # adds zeros to it (exact), and a masked position adds +0.0, which leaves `g` as it is
        # (`g` starts at +0.0, so it is never -0.0)
        kk = tl.arange(0, KB)
        k3 = kk[:, None, None]
        d3 = d[None, :, :]
        m3 = dm[None, :, :]
        for kb in range(k0, k1, KB):
            ks = kb + kk
            km = ks < k1
            ok = km[:, None, None] & m3
            at = tl.load(goff + ks, mask=km, other=0)
            gr = tl.load(grad_out + at[:, None, None] + d3, mask=ok, other=0.0)
            gr = tl.minimum(tl.maximum(gr, -clip), clip)
            if HAS_SCALE:
                gr = gr * tl.load(sscale + ks, mask=km, other=0.0)[:, None, None]
            if HAS_MAX:
                p = tl.load(perm + ks, mask=km, other=0)
                b = tl.load(bag_of + p, mask=km, other=0)
                sel = tl.load(argmax + b[:, None, None] * am_stride + d3, mask=ok, other=-1) \
                    == p[:, None, None]
                pooled = tl.load(feat_mode + tl.load(bag_feat + b, mask=km, other=0), mask=km,
                                 other=0) != 2
                gr = tl.where(pooled[:, None, None] | sel, gr, 0.0)
            for i in tl.static_range(KB):
                g += tl.sum(tl.where(k3 == i, gr, 0.0), axis=0)
    s = tl.load(slots + u)
    base = table + s * tab_stride
    if HAS_WORK:
        w_at = tl.load(work_of + u)
        if w_at >= 0:
            base = work + w_at * work_stride
    kind = tl.load(tab_kind + t)
    w = tl.load(base + d, mask=dm, other=0.0)
    if kind == 0:  # sgd
        lr = tl.load(tab_params + t * 5).to(tl.float32)
        wd = tl.load(tab_params + t * 5 + 1).to(tl.float32)
        tl.store(base + d, w - lr * (g + wd * w), mask=dm)
    elif kind == 1:  # adagrad
        lr = tl.load(tab_params + t * 5).to(tl.float32)
        eps = tl.load(tab_params + t * 5 + 1).to(tl.float32)
        wd = tl.load(tab_params + t * 5 + 2).to(tl.float32)
        gd = g + wd * w
        acc = tl.load(base + dim + d, mask=dm, other=0.0) + gd * gd
        tl.store(base + dim + d, acc, mask=dm)
        tl.store(base + d, w - tl.div_rn(lr * gd, tl.sqrt_rn(acc) + eps), mask=dm)
    elif kind == 2:  # rowwise_adagrad
        lr = tl.load(tab_params + t * 5).to(tl.float32)
        eps = tl.load(tab_params + t * 5 + 1).to(tl.float32)
        wd = tl.load(tab_params + t * 5 + 2).to(tl.float32)
        gd = g + wd * w
        sq = tl.where(dm, gd * gd, 0.0)
        part = tl.zeros([8], dtype=tl.float32)
        for i in tl.static_range(NCH):  # lane sums in order of d (picking a row is exact)
            part += tl.sum(tl.where(rr == i, sq, 0.0), axis=0)
        lane = tl.arange(0, 8)
        p_0 = tl.sum(tl.where(lane == 0, part, 0.0))
        p_1 = tl.sum(tl.where(lane == 1, part, 0.0))
        p_2 = tl.sum(tl.where(lane == 2, part, 0.0))
        p_3 = tl.sum(tl.where(lane == 3, part, 0.0))
        p_4 = tl.sum(tl.where(lane == 4, part, 0.0))
        p_5 = tl.sum(tl.where(lane == 5, part, 0.0))
        p_6 = tl.sum(tl.where(lane == 6, part, 0.0))
        p_7 = tl.sum(tl.where(lane == 7, part, 0.0))
        total = ((p_0 + p_1) + (p_2 + p_3)) + ((p_4 + p_5) + (p_6 + p_7))
        inv_dim = tl.div_rn(tl.full([], 1.0, tl.float32), dim.to(tl.float32))
        acc = tl.load(base + dim, mask=live, other=0.0) + total * inv_dim
        tl.store(base + dim, acc, mask=live)
        mult = tl.div_rn(lr, tl.sqrt_rn(acc) + eps)
        tl.store(base + d, w - mult * gd, mask=dm)
    else:  # adam
        lr64 = tl.load(tab_params + t * 5)
        b1 = tl.load(tab_params + t * 5 + 1)
        b2 = tl.load(tab_params + t * 5 + 2)
        eps = tl.load(tab_params + t * 5 + 3).to(tl.float32)
        wd = tl.load(tab_params + t * 5 + 4).to(tl.float32)
        one_b1 = (1.0 - b1).to(tl.float32)
        one_b2 = (1.0 - b2).to(tl.float32)
        count = tl.load(base + 3 * dim, mask=live, other=0.0) + 1.0
        tl.store(base + 3 * dim, count, mask=live)
        # the step size in float64 as numba's `fused.adam_row`: b ** count by squaring (IEEE
        # multiplies, the same bits on any device; `pow` differs between libm and CUDA)
        n = count.to(tl.int64)
        p1 = tl.full([], 1.0, tl.float64)
        p2 = tl.full([], 1.0, tl.float64)
        x1 = b1
        x2 = b2
        while n > 0:
            odd = (n & 1) == 1
            p1 = tl.where(odd, p1 * x1, p1)
            p2 = tl.where(odd, p2 * x2, p2)
            x1 = x1 * x1
            x2 = x2 * x2
            n = n >> 1
        # float64 `/` and `sqrt` compile to div.rn.f64 / sqrt.rn.f64 (checked on the PTX)
        step = (lr64 * tl.sqrt(1.0 - p2) / (1.0 - p1)).to(tl.float32)
        gd = g + wd * w
        m0 = tl.load(base + dim + d, mask=dm, other=0.0)
        v0 = tl.load(base + 2 * dim + d, mask=dm, other=0.0)
        m = m0 + (gd - m0) * one_b1
        v = v0 + (gd * gd - v0) * one_b2
        tl.store(base + dim + d, m, mask=dm)
        tl.store(base + 2 * dim + d, v, mask=dm)
        tl.store(base + d, w - step * tl.div_rn(m, tl.sqrt_rn(v) + eps), mask=dm)


@triton.jit
def _heads_kernel(sk, head, n, BLOCK: tl.constexpr):
    """head[i] = 1 where sorted position i starts a run of equal slots, else 0."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    cur = tl.load(sk + i, mask=m, other=0)
    prev = tl.load(sk + i - 1, mask=m & (i > 0), other=0)
    tl.store(head + i, ((i == 0) | (cur != prev)).to(tl.int64), mask=m)


@triton.jit
def _keyed_rows_kernel(sk, perm, pos_table, useq, inverse, slots, u_table, starts, n,
                       BLOCK: tl.constexpr):
    """`plan.keyed_rows` from the heads' inclusive running count `useq`: each position's row,
    a head's row gets its slot, table and start; rows past the last (i >= count) get 0, 0, n."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    count = tl.load(useq + n - 1)
    u = tl.load(useq + i, mask=m, other=1) - 1
    p = tl.load(perm + i, mask=m, other=0)
    tl.store(inverse + p, u, mask=m)
    k = tl.load(sk + i, mask=m, other=0)
    prev = tl.load(sk + i - 1, mask=m & (i > 0), other=0)
    h = m & ((i == 0) | (k != prev))
    tl.store(slots + u, k, mask=h)
    tl.store(u_table + u, tl.load(pos_table + p, mask=h, other=0), mask=h)
    tl.store(starts + u, i, mask=h)
    spare = m & (i >= count)
    zero = tl.zeros([BLOCK], dtype=tl.int64)
    tl.store(slots + i, zero, mask=spare)
    tl.store(u_table + i, zero, mask=spare)
    tl.store(starts + i, zero + n, mask=spare)
    tl.store(starts + i + 1, zero + n, mask=m & (i == n - 1))


ROWS_BLOCK = 1024  # sorted positions a program of the keyed rows' kernels takes


def keyed_rows(sk: torch.Tensor, perm: torch.Tensor, pos_table: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`plan.keyed_rows` in two kernels and a running sum (its ~15 torch ops), the same integers."""
    n = sk.numel()
    if n == 0:
        return sk.new_empty(0), sk.new_empty(0), sk.new_empty(0), sk.new_zeros(1)
    # made from `sk` (its device and dtype): what the kernels write counts as on its device
    head, inverse, slots, u_table = (sk.new_empty(n) for _ in range(4))
    starts = sk.new_empty(n + 1)
    grid = (triton.cdiv(n, ROWS_BLOCK),)
    with launching():
        _heads_kernel[grid](sk, head, n, BLOCK=ROWS_BLOCK)
        useq = torch.cumsum(head, 0)
        _keyed_rows_kernel[grid](sk, perm, pos_table.contiguous(), useq, inverse, slots, u_table,
                                 starts, n, BLOCK=ROWS_BLOCK)
    return inverse, slots, u_table, starts


KB = 16  # positions of a unique row the backward loads at once (a hot row: 1/16 the chain)


def _row_warps(dim: int) -> int:
    """Warps a backward program (one unique row) runs on: one up to dim 64, as FBGEMM's warp a
    row; its sums across lanes (the row-wise Adagrad lanes, a hot row's blocks) then stay in
    the warp, with no shared memory or barrier. The bits do not depend on it: those sums pick
    one value among zeros."""
    return 1 if dim <= 64 else 2 if dim <= 128 else 4


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


class TritonBackend:
    """Table-batched Triton kernels (CUDA, or the interpreter on CPU tensors)."""

    name = "triton"
    keyed_rows = staticmethod(keyed_rows)  # a keyed step's rows: two kernels

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self._dummy: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def _arrays(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """The plan's per-feature and per-table arrays on `device` (copied once per device)."""
        return self.plan.on(device)

    def _dummies(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """A float32 and an int64 placeholder on `device` for pointers a variant does not read
        (made once: not two allocations and fills a call)."""
        got = self._dummy.get(device)
        if got is None:
            got = self._dummy[device] = (torch.zeros(1, dtype=torch.float32, device=device),
                                         torch.zeros(1, dtype=torch.int64, device=device))
        return got

    def forward(self, batch: StepBatch, src: torch.Tensor, slots: torch.Tensor,
                work: torch.Tensor | None, work_of: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Pooled (or per-id) rows [out_rows, out_width] and the max bags' arg-max positions."""
        dev = src.device
        ft, fc, fm, td = self._arrays(dev)[:4]
        out = torch.zeros((batch.out_rows, batch.out_width), dtype=torch.float32, device=dev)
        has_max = self.plan.has_max
        argmax = torch.empty((batch.n_bags, self.plan.max_dim) if has_max else (1, 1),
                             dtype=torch.int64, device=dev)
        dummy_f, dummy_i = self._dummies(dev)
        wk = work if work is not None else dummy_f.view(1, 1)
        if batch.n_bags:
            with launching():
                _forward_kernel[(batch.n_bags,)](
                    src, src.stride(0), slots, wk, wk.stride(0),
                    work_of if work_of is not None else dummy_i, batch.inverse, batch.offsets,
                    batch.bag_out, batch.bag_feat, batch.psw if batch.psw is not None else dummy_f,
                    ft, fc, fm, td, out, out.stride(0), argmax, argmax.stride(0),
                    HAS_WORK=work is not None, HAS_PSW=batch.psw is not None, HAS_MAX=has_max,
                    BLOCK_D=_pow2(self.plan.max_dim), enable_fp_fusion=False,
                    num_warps=max(1, min(4, _pow2(self.plan.max_dim) // 32)))  # a lane a column
        return out, (argmax if has_max else None)

    def csr(self, batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(positions sorted stably by unique row, each row's start there, each position's bag),
        with no host synchronization (a keyed batch's, made with it)."""
        if batch.csr is not None:
            return batch.csr
        inv = batch.inverse
        dev = inv.device
        perm = torch.sort(inv, stable=True).indices
        counts = torch.zeros(batch.n_unique + 1, dtype=torch.int64, device=dev)
        counts.scatter_add_(0, inv + 1, torch.ones_like(inv))
        starts = torch.cumsum(counts, 0)
        pos = torch.arange(inv.numel(), dtype=torch.int64, device=dev)
        bag_of = torch.searchsorted(batch.offsets[1:], pos, right=True)
        return perm, starts, bag_of

    def backward(self, batch: StepBatch, table: torch.Tensor, slots: torch.Tensor,
                 work: torch.Tensor | None, work_of: torch.Tensor | None, grad_out: torch.Tensor,
                 scale: torch.Tensor | None, argmax: torch.Tensor | None, lo: int, hi: int,
                 finite: torch.Tensor | None = None) -> None:
        """Update unique rows [lo, hi) in place: `table[slots[u]]` (or `work[work_of[u]]`);
        none where the device bool `finite` is false."""
        if hi <= lo:
            return
        dev = table.device
        _, fc, fm, td, tk, tp, tc = self._arrays(dev)
        perm, starts, bag_of = self.csr(batch)
        dummy_f, dummy_i = self._dummies(dev)
        wk = work if work is not None else dummy_f.view(1, 1)
        am = argmax if argmax is not None else dummy_i.view(1, 1)
        grad_out = grad_out.contiguous()
        # each position's gradient row and scale, in the kernel's (row, position) order: the
        # loop over a row's positions then reads two values a position, not a chain of five
        goff = (batch.bag_out.index_select(0, bag_of) * grad_out.stride(0)
                + fc.index_select(0, batch.bag_feat.index_select(0, bag_of))).index_select(0, perm)
        sscale = scale.index_select(0, perm) if scale is not None else dummy_f
        with launching():
            _backward_kernel[(hi - lo,)](
                table, table.stride(0), slots, wk, wk.stride(0),
                work_of if work_of is not None else dummy_i, batch.u_table, perm, starts, goff,
                sscale, bag_of, batch.bag_feat, grad_out, am, am.stride(0), fm, td, tk, tp, tc, lo,
                finite if finite is not None else dummy_i,
                HAS_WORK=work is not None, HAS_SCALE=scale is not None,
                HAS_MAX=argmax is not None, HAS_FLAG=finite is not None,
                NCH=max(1, _pow2(self.plan.max_dim) // 8), KB=KB,
                enable_fp_fusion=False, num_warps=_row_warps(self.plan.max_dim))
