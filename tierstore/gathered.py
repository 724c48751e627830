"""The value a gather hands to training: a batch's unique rows, inverse map and embeddings."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Gathered:
    """A batch's rows for training: sorted unique ids, inverse map, and their embeddings."""

    unique: torch.Tensor  # int64 [u], sorted (unsorted only inside the module's resident fast path)
    inverse: torch.Tensor  # int64 [n], ids == unique[inverse]
    weights: torch.Tensor  # float32 [u, dim] on the store's device
    slots: torch.Tensor | None = None  # device-tier slots of `unique` when all were resident
    generation: int = -1  # the device tier's generation (its pin epoch when `pinned`) at the gather
    pinned: bool = False  # `slots` hold rows the prefetch pipeline pinned for this batch
    # a warm-only forward's rows [u, width] as it read them (it moved none), and the table's
    # `writes` then: while that holds, the backward updates these instead of fetching again
    payload: torch.Tensor | None = None
    writes: int = -1
