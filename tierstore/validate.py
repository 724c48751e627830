"""Checks of user input that run before any kernel or write: indexes, gradients, devices.

Each check is one vectorized pass (or a few) over the call's tensors; a bad input raises a
`TierstoreError` subclass and nothing has changed yet. The kernels downstream trust what passes
here (they index without bounds checks), so no input may reach them unchecked.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import torch

from ._kernels import HAVE_NUMBA
from .config import TableSpec
from .errors import ConfigError, InvalidGradientError, InvalidIdsError, ShapeError

BAG_MODES = ("sum", "mean")
INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)  # ids may be these


def not_meta(t: torch.Tensor, what: str, error: type[Exception] = ShapeError) -> None:
    """Refuse a tensor without data (the `meta` device) with a clear error."""
    if t.device.type == "meta":
        raise error(f"{what} is on the 'meta' device (a tensor without data)")


def no_meta(**tensors: Any) -> None:
    """`not_meta` for each named tensor argument that is a tensor (ids get InvalidIdsError)."""
    for name, t in tensors.items():
        if isinstance(t, torch.Tensor):
            not_meta(t, name, InvalidIdsError if name in ("input", "values") else ShapeError)


def index_tensor(t: Any, what: str) -> torch.Tensor:
    """A 1-D integer tensor with data, as int64 on the CPU."""
    if not isinstance(t, torch.Tensor):
        raise ShapeError(f"{what} must be a torch tensor, got {type(t).__name__}")
    not_meta(t, what, InvalidIdsError)
    if t.dtype not in INT_DTYPES:
        raise InvalidIdsError(f"{what} must be an integer tensor, got dtype {t.dtype}")
    if t.dim() != 1:
        raise ShapeError(f"{what} must be 1-D, got shape {tuple(t.shape)}")
    return t.to(device="cpu", dtype=torch.int64)


def row_ids(spec: TableSpec, ids: Any) -> torch.Tensor:
    """A table's row ids (any integer array-like, 1-D) as int64 on the CPU, each in range."""
    if not isinstance(ids, torch.Tensor):
        try:
            ids = torch.as_tensor(np.asarray(ids))
        except (TypeError, ValueError, RuntimeError) as exc:
            raise InvalidIdsError(f"ids must be an integer tensor: {exc}") from exc
    not_meta(ids, "ids", InvalidIdsError)
    if ids.dtype not in INT_DTYPES:
        raise InvalidIdsError(f"ids must be an integer tensor, got dtype {ids.dtype}")
    if ids.dim() != 1:
        raise ShapeError(f"ids must be 1-D, got shape {tuple(ids.shape)}")
    if ids.dtype != torch.int64 or ids.device.type != "cpu":
        ids = ids.to(device="cpu", dtype=torch.int64)
    if ids.numel():
        arr = ids.numpy()  # numpy reductions cost less per call than torch ops
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi >= spec.num_rows:
            raise InvalidIdsError(f"row id {lo if lo < 0 else hi} out of range for table "
                                  f"{spec.name!r} (num_rows={spec.num_rows})")
    return ids


if HAVE_NUMBA:
    import numba

    # reassociation lets the sum vectorize; no `nnan`/`ninf` flag, so NaN and Inf keep their
    # meaning: v * 0 is 0 for a finite v and NaN for NaN or +-Inf, so the sum is 0 iff all are
    @numba.njit(cache=True, nogil=True, fastmath={"reassoc", "nsz", "arcp", "contract"})
    def _finite_kernel(a):  # pragma: no cover - compiled
        s = np.float32(0.0)
        for i in range(a.shape[0]):
            s += a[i] * np.float32(0.0)
        return s == 0


def all_finite(t: torch.Tensor) -> bool:
    """Whether every value of a float tensor is finite, in one pass without a temporary.

    On the CPU a numba reduction (or numpy's isfinite without numba); `torch.isfinite(t).all()`
    costs ~40x more per value on a CPU float32 tensor here (see bench.gradcheck).
    """
    if t.device.type == "cpu" and t.dtype == torch.float32:
        a = t.detach().numpy().reshape(-1)
        return bool(_finite_kernel(a)) if HAVE_NUMBA else bool(np.isfinite(a).all())
    return bool(torch.isfinite(t).all())


def gradients(spec: TableSpec, grads: torch.Tensor, what: str = "gradient") -> torch.Tensor:
    """Refuse NaN/Inf in a float32 gradient (one pass); clamp it to the table's `clip` if set."""
    not_meta(grads, what)
    if grads.numel() and not all_finite(grads):
        bad = int((~torch.isfinite(grads)).sum())
        raise InvalidGradientError(
            f"{what} for table {spec.name!r} holds {bad} NaN/Inf value(s); nothing was updated")
    if spec.clip is not None:
        grads = grads.clamp(-spec.clip, spec.clip)
    return grads


def bags(spec: TableSpec, unique: torch.Tensor, inverse: Any, offsets: Any, grad_out: Any,
         per_sample_weights: Any, mode: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                     torch.Tensor | None]:
    """Check `apply_bags` input; returns (inverse, offsets, grad_out, weights) ready for the kernel.

    `unique` has already passed the id checks (range, dtype). Checked here: `unique` holds no
    repeat; `inverse` indexes `unique`; `offsets` start at 0, never decrease and end within
    `inverse`; `grad_out` is [bags, dim] and finite; weights (if any) match `inverse` and are
    finite; `mode` is "sum" or "mean". Nothing is written before this returns.
    """
    if not isinstance(mode, str) or mode not in BAG_MODES:
        raise ConfigError(f"mode must be one of {BAG_MODES}, got {mode!r}")
    inverse = index_tensor(inverse, "inverse")
    offsets = index_tensor(offsets, "offsets")
    u, n, b = unique.numel(), inverse.numel(), offsets.numel()
    if u > 1:
        srt = unique if bool((unique[1:] > unique[:-1]).all()) else torch.sort(unique).values
        if bool((srt[1:] == srt[:-1]).any()):
            raise InvalidIdsError("unique holds a repeated id; pass the ids `gather` returned")
    if n:
        lo, hi = int(inverse.min()), int(inverse.max())
        if lo < 0 or hi >= u:
            raise InvalidIdsError(f"inverse holds {lo if lo < 0 else hi}, outside [0, {u})")
        if b == 0:
            raise ShapeError(f"offsets is empty but inverse holds {n} positions")
    if b:
        if int(offsets[0]) != 0 or int(offsets[-1]) > n or \
                (b > 1 and bool((offsets[1:] < offsets[:-1]).any())):
            raise ShapeError(f"offsets must start at 0, never decrease and end <= {n} "
                             "(the length of inverse)")
    if not isinstance(grad_out, torch.Tensor) or not grad_out.is_floating_point():
        raise ShapeError("grad_out must be a floating-point tensor")
    not_meta(grad_out, "grad_out")
    if tuple(grad_out.shape) != (b, spec.dim):
        raise ShapeError(f"grad_out must have shape ({b}, {spec.dim}) for table {spec.name!r}, "
                         f"got {tuple(grad_out.shape)}")
    grad_out = gradients(spec, grad_out.detach().to(dtype=torch.float32), "grad_out")
    psw = per_sample_weights
    if psw is not None:
        if not isinstance(psw, torch.Tensor) or not psw.is_floating_point():
            raise ShapeError("per_sample_weights must be a floating-point tensor or None")
        not_meta(psw, "per_sample_weights")
        if psw.numel() != n:
            raise ShapeError(f"per_sample_weights holds {psw.numel()} values, inverse {n}")
        if n and not all_finite(psw):
            raise InvalidGradientError("per_sample_weights hold NaN/Inf; nothing was updated")
    return inverse, offsets, grad_out, psw


def json_extra(extra: Any) -> dict:
    """A checkpoint's `extra`: a dict that JSON can write (checked before any flush or copy)."""
    if extra is None:
        return {}
    if not isinstance(extra, dict):
        raise ConfigError(f"extra must be a dict or None, got {type(extra).__name__}")
    try:
        json.dumps(extra, allow_nan=False, sort_keys=True)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"checkpoint extra must be JSON-serializable: {exc}") from exc
    return extra


def bag_gradients(spec: TableSpec, grad_out: torch.Tensor, psw: torch.Tensor | None
                  ) -> torch.Tensor:
    """The module's backward: refuse NaN/Inf in `grad_out` or the per-sample weights; clip."""
    if psw is not None and psw.numel() and not all_finite(psw):
        raise InvalidGradientError("per_sample_weights hold NaN/Inf; nothing was updated")
    return gradients(spec, grad_out.detach().to(dtype=torch.float32), "grad_out")
