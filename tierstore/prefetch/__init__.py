"""The look-ahead prefetch pipeline."""

from .pipeline import Prefetcher

__all__ = ["Prefetcher"]
