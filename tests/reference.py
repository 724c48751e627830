"""A plain in-memory reference: a dict of rows and the same optimizer math."""

from __future__ import annotations

import numpy as np
import torch

from tierstore import TableSpec
from tierstore.fused import BatchUpdate
from tierstore.initializers import name_key


class DictStore:
    """What the store must behave like: a dict (table, row) -> payload, lazily initialized."""

    def __init__(self, specs: list[TableSpec], seed: int = 0, fused: bool = True) -> None:
        self.specs = {s.name: s for s in specs}
        self.seed = seed
        self.fused = fused  # same update math as the store: numba kernels or the torch path
        self.rows: dict[tuple[str, int], torch.Tensor] = {}

    def _payload(self, table: str, row: int) -> torch.Tensor:
        key = (table, row)
        if key not in self.rows:
            spec = self.specs[table]
            p = torch.zeros(spec.payload_dim)
            init = spec.init(name_key(self.seed, table), np.array([row], dtype=np.int64), spec.dim)
            p[: spec.dim] = torch.from_numpy(init[0])
            self.rows[key] = p
        return self.rows[key]

    def read(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        """Embedding values of ids."""
        dim = self.specs[table].dim
        if ids.numel() == 0:
            return torch.empty(0, dim)
        return torch.stack([self._payload(table, int(i))[:dim] for i in ids])

    def payloads(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        """Full payloads (embedding and optimizer state) of ids."""
        return torch.stack([self._payload(table, int(i)) for i in ids])

    def apply(self, table: str, ids: torch.Tensor, grads: torch.Tensor) -> None:
        """Sum duplicate gradients, then one optimizer step on the unique rows."""
        spec = self.specs[table]
        if ids.numel() == 0:
            return
        uniq, inv = torch.unique(ids, sorted=True, return_inverse=True)
        p = torch.stack([self._payload(table, int(i)) for i in uniq]).contiguous()
        BatchUpdate(spec.optimizer, spec.dim, uniq.numel(), inv, grads,
                    use_kernel=self.fused).apply(p, torch.arange(uniq.numel()))
        for i, row in enumerate(uniq.tolist()):
            self.rows[(table, row)] = p[i].clone()
