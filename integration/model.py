"""A DLRM-style model: bottom MLP, tiered embeddings, pairwise dot interaction, top MLP."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from tierstore import TieredEmbeddingBagCollection
from tierstore.errors import ConfigError


def mlp(sizes: Sequence[int], last_relu: bool) -> nn.Sequential:
    """Linear layers with ReLU between them (and after the last one when `last_relu`)."""
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2 or last_relu:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DLRM(nn.Module):
    """DLRM: dense -> bottom MLP; sparse -> tiered embedding bags; dot interaction; top MLP -> logit."""

    def __init__(self, embeddings: TieredEmbeddingBagCollection, num_dense: int = 13,
                 bottom: Sequence[int] = (64, 32), top: Sequence[int] = (128, 64)) -> None:
        super().__init__()
        dims = set(embeddings.dims)
        if len(dims) != 1:
            raise ConfigError(f"DLRM's dot interaction needs one embedding dim, got {sorted(dims)}")
        dim = dims.pop()
        self.embeddings = embeddings
        self.bottom = mlp([num_dense, *bottom, dim], last_relu=True)
        n = len(embeddings.feature_names) + 1
        rows, cols = torch.tril_indices(n, n, offset=-1)
        self.register_buffer("_li", rows, persistent=False)
        self.register_buffer("_lj", cols, persistent=False)
        self.top = mlp([dim + rows.numel(), *top, 1], last_relu=False)
        self.dim = dim

    def interact(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        """[B, dim] and [B, F*dim] -> [B, dim + F(F+1)/2]: the dense vector and all pairwise dots."""
        t = torch.cat([dense.unsqueeze(1), sparse.view(dense.shape[0], -1, self.dim)], dim=1)
        z = torch.bmm(t, t.transpose(1, 2))
        return torch.cat([dense, z[:, self._li, self._lj]], dim=1)

    def forward(self, dense: torch.Tensor, keys: Sequence[str], values: torch.Tensor,
                lengths: torch.Tensor) -> torch.Tensor:
        """Logits [B] for dense features [B, num_dense] and jagged categorical ids."""
        x = self.bottom(dense)
        e = self.embeddings(keys, values, lengths)
        return self.top(self.interact(x, e)).squeeze(1)
