"""Fused row optimizers whose state lives inside each row's payload `[embedding | state]`."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import ClassVar

import torch

from .errors import ConfigError


def int_pow(base: float, n: torch.Tensor) -> torch.Tensor:
    """float64 `base ** n` for integer counts `n` by squaring: the bits the compiled kernels
    (numba's `fused.ipow`, the Triton backward) compute, on any device."""
    out = torch.ones(n.shape, dtype=torch.float64, device=n.device)
    b = torch.full(n.shape, float(base), dtype=torch.float64, device=n.device)
    bits = int(n.max()).bit_length() if n.numel() else 0  # one read of the largest count
    for k in range(bits):
        out = torch.where(((n >> k) & 1) == 1, out * b, out)
        b = b * b
    return out


@dataclass(frozen=True)
class Optimizer:
    """Base of the fused optimizers: updates whole payload rows in place from summed gradients."""

    kind: ClassVar[str] = ""

    def state_dim(self, dim: int) -> int:
        """Number of float32 state values stored after the embedding in each row."""
        return 0

    def step(self, payload: torch.Tensor, grad: torch.Tensor, dim: int) -> None:
        """Update `payload[n, dim + state_dim]` in place with `grad[n, dim]` (one row per id)."""
        raise NotImplementedError

    def _decayed(self, w: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        wd = getattr(self, "weight_decay", 0.0)
        return grad.add(w, alpha=wd) if wd else grad

    def to_config(self) -> dict:
        """Serialize to a JSON-able dict (stored in the store's metadata)."""
        return {"kind": self.kind, **asdict(self)}

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            vals = value if isinstance(value, tuple) else (value,)
            if any(not isinstance(v, (int, float)) or not math.isfinite(v) for v in vals):
                raise ConfigError(f"{type(self).__name__}.{name} must be a finite number, got {value!r}")
        if getattr(self, "lr", 0.0) < 0 or getattr(self, "eps", 1.0) < 0:
            raise ConfigError(f"{type(self).__name__}: lr and eps must be >= 0")


@dataclass(frozen=True)
class SGD(Optimizer):
    """Plain SGD: w -= lr * (g + weight_decay * w)."""

    lr: float = 0.01
    weight_decay: float = 0.0
    kind: ClassVar[str] = "sgd"

    def step(self, payload: torch.Tensor, grad: torch.Tensor, dim: int) -> None:
        """Update rows in place."""
        w = payload[:, :dim]
        w.add_(self._decayed(w, grad), alpha=-self.lr)


@dataclass(frozen=True)
class Adagrad(Optimizer):
    """Element-wise Adagrad with torch.optim.Adagrad's update (accumulator starts at 0)."""

    lr: float = 0.01
    eps: float = 1e-10
    weight_decay: float = 0.0
    kind: ClassVar[str] = "adagrad"

    def state_dim(self, dim: int) -> int:
        """One accumulator per element."""
        return dim

    def step(self, payload: torch.Tensor, grad: torch.Tensor, dim: int) -> None:
        """Update rows in place: acc += g*g; w -= lr * g / (sqrt(acc) + eps)."""
        w, acc = payload[:, :dim], payload[:, dim : 2 * dim]
        g = self._decayed(w, grad)
        acc.addcmul_(g, g, value=1)
        std = acc.sqrt().add_(self.eps)
        w.addcdiv_(g, std, value=-self.lr)


@dataclass(frozen=True)
class RowWiseAdagrad(Optimizer):
    """Row-wise Adagrad: one accumulator per row, the mean of the squared gradient."""

    lr: float = 0.01
    eps: float = 1e-10
    weight_decay: float = 0.0
    kind: ClassVar[str] = "rowwise_adagrad"

    def state_dim(self, dim: int) -> int:
        """One accumulator per row."""
        return 1

    def step(self, payload: torch.Tensor, grad: torch.Tensor, dim: int) -> None:
        """Update rows in place: acc += mean(g*g); w -= lr * g / (sqrt(acc) + eps)."""
        w, acc = payload[:, :dim], payload[:, dim : dim + 1]
        g = self._decayed(w, grad)
        acc.add_(g.mul(g).mean(dim=1, keepdim=True))
        w.addcdiv_(g, acc.sqrt().add_(self.eps), value=-self.lr)


@dataclass(frozen=True)
class Adam(Optimizer):
    """Lazy Adam (torch.optim.SparseAdam's update) with a per-row step count."""

    lr: float = 0.001
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    kind: ClassVar[str] = "adam"

    def state_dim(self, dim: int) -> int:
        """First and second moments per element, plus the row's step count."""
        return 2 * dim + 1

    def step(self, payload: torch.Tensor, grad: torch.Tensor, dim: int) -> None:
        """Update rows in place; rows not in the batch keep their moments and step."""
        b1, b2 = self.betas
        w = payload[:, :dim]
        m, v = payload[:, dim : 2 * dim], payload[:, 2 * dim : 3 * dim]
        t = payload[:, 3 * dim : 3 * dim + 1]
        g = self._decayed(w, grad)
        t.add_(1.0)
        m_upd = g.sub(m).mul_(1 - b1)
        v_upd = g.pow(2).sub_(v).mul_(1 - b2)
        m.add_(m_upd)
        v.add_(v_upd)
        n = t.to(torch.int64)
        bc1 = 1 - int_pow(b1, n)
        bc2 = 1 - int_pow(b2, n)
        step_size = (self.lr * bc2.sqrt() / bc1).to(payload.dtype)
        w.sub_(step_size * m.div(v.sqrt().add_(self.eps)))

    def to_config(self) -> dict:
        """Serialize to a JSON-able dict."""
        cfg = super().to_config()
        cfg["betas"] = list(self.betas)
        return cfg


OPTIMIZERS: dict[str, type[Optimizer]] = {
    cls.kind: cls for cls in (SGD, Adagrad, RowWiseAdagrad, Adam)
}


def optimizer_from_config(cfg: dict) -> Optimizer:
    """Rebuild an optimizer from `Optimizer.to_config()` output."""
    cfg = dict(cfg)
    kind = cfg.pop("kind")
    if kind not in OPTIMIZERS:
        raise ConfigError(f"unknown optimizer {kind!r}; known: {sorted(OPTIMIZERS)}")
    if "betas" in cfg:
        cfg["betas"] = tuple(cfg["betas"])
    return OPTIMIZERS[kind](**cfg)
