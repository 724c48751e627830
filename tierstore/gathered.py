"""The value a gather hands to training: a batch's unique rows, inverse map and embeddings."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

import tierstore.hostread as hostread


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


@dataclass(frozen=True, eq=False)
class Staged:
    """A table's rows of a batch the prefetch pipeline staged: its sorted unique ids and their
    device slots on the host (-1: not on the device), and, when every row is on the device, the
    step's indexes made at staging: the ids as staged, their inverse map into `rows` and the
    slots, both on the device. A step whose ids equal `ids` then neither deduplicates nor
    searches them (`StagingArea.staged_indexes`), and on CUDA reads nothing on the host."""

    rows: np.ndarray  # int64 [u], sorted
    slots: np.ndarray  # int64 [u]
    ids: torch.Tensor | None = None  # int64 [n] (CPU), the table's ids in the batch's order
    unique: torch.Tensor | None = None  # `rows` as a CPU tensor
    inverse: torch.Tensor | None = None  # int64 [n] on the device: ids == rows[inverse]
    dslots: torch.Tensor | None = None  # int64 [u] on the device
    # a batch a direct cache held whole (nothing staged): the device tier's removal count at
    # which every one of `ids` was held (-1: not such a batch)
    held_at: int = -1

    @classmethod
    def held(cls, ids: torch.Tensor, removals: int) -> Staged:
        """A table's ids a direct cache held whole when its removal count was `removals`."""
        empty = np.empty(0, dtype=np.int64)
        return cls(empty, empty, ids, held_at=removals)

    @classmethod
    def on_device(cls, uniq: torch.Tensor, slots: torch.Tensor, ids: torch.Tensor,
                  dslots: torch.Tensor, inverse: torch.Tensor | None = None) -> Staged:
        """A staged table whose rows are all at `dslots`, with the step's indexes for `ids`:
        `inverse` (host, ids == uniq[inverse]) moved to the device, or, None, searched there."""
        dev = dslots.device
        if inverse is None:
            inverse = torch.searchsorted(hostread.to_device(uniq, dev), hostread.to_device(ids, dev))
        else:
            inverse = hostread.to_device(inverse, dev)
        return cls(uniq.numpy(), slots.numpy(), ids, uniq, inverse, dslots)
