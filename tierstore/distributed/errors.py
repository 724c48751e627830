"""Errors of the sharded store (rooted at TierstoreError like every other)."""

from __future__ import annotations

from ..errors import TierstoreError


class DistributedError(TierstoreError):
    """A collective operation failed, or another rank reported an error."""


class RankFailureError(DistributedError):
    """A peer rank died or stopped answering within the configured timeout."""
