"""Random jagged batches of three features for the staged and direct step tests."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch


def feature_batches(n: int, keys: Sequence[str], batch: int = 6, seed: int = 2, rows: int = 500,
                    max_len: int = 4) -> Iterator[tuple[tuple, torch.Tensor]]:
    """`n` batches of ((keys, values, lengths), dense weight [batch, 20]): each feature's bags
    hold 0..max_len-1 ids below `rows`."""
    g = torch.Generator().manual_seed(seed)
    nf = len(keys)
    for _ in range(n):
        lengths = torch.randint(0, max_len, (nf * batch,), generator=g)
        parts = [torch.randint(0, rows, (int(lengths[i * batch:(i + 1) * batch].sum()),), generator=g)
                 for i in range(nf)]
        yield (list(keys), torch.cat(parts), lengths), torch.randn(batch, 20, generator=g)
