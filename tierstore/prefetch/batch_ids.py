"""A batch's ids per table, as the pipeline stages them: the jagged forms a batch comes in, and
each table's sorted unique ids (with their inverse map for the step's indexes)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .._parallel import PARALLEL_IDS, parallel_for
from ..errors import ShapeError
from ..index import sorted_dedup, sorted_unique
from ..jagged import JaggedBatch, is_keyed_jagged


def jagged_ids(sparse: Any, features: Mapping[str, str] | None) -> dict[str, list[torch.Tensor]]:
    """Table -> id tensors of a jagged batch (KeyedJaggedTensor-like, (keys, values, lengths), dict)."""
    if isinstance(sparse, Mapping):
        items = [(k, torch.as_tensor(v)) for k, v in sparse.items()]
    elif is_keyed_jagged(sparse) or (isinstance(sparse, (tuple, list)) and len(sparse) == 3):
        items = list(JaggedBatch.of(sparse).per_key().items())
    else:
        raise ShapeError("a batch must be jagged (keys, values, lengths), a KeyedJaggedTensor, "
                         "or a {feature: ids} dict; pass extract= to pick it out of the batch")
    out: dict[str, list[torch.Tensor]] = {}
    for key, ids in items:
        table = features.get(key, key) if features else key
        out.setdefault(table, []).append(ids.reshape(-1))
    return out


def sorted_unique_each(ids: dict[str, torch.Tensor], inverse: bool = False
                        ) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
    """Each table's sorted unique ids, and with `inverse` their inverse map (ids ==
    uniq[inverse], else None); a large batch's tables on several threads (the dedup and the
    sort release the GIL; torch's thread count bounds them, as for the kernels).
    (Handing half the tables to an idle reader thread measured slower: the staging thread
    waited 1.7 ms a batch for the reader to get a core, against 0.5 ms of work.)"""
    items = list(ids.items())
    out: list[tuple[torch.Tensor, torch.Tensor | None] | None] = [None] * len(items)

    def work(lo: int, hi: int) -> None:
        for k in range(lo, hi):
            out[k] = sorted_dedup(items[k][1]) if inverse else (sorted_unique(items[k][1]), None)

    if sum(i.numel() for _, i in items) >= PARALLEL_IDS:
        parallel_for(work, len(items), min_chunk=1)
    else:
        work(0, len(items))
    return {t: u for (t, _), u in zip(items, out)}
