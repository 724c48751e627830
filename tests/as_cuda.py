"""TIERSTORE_TEST_AS_CUDA=1: a store opened without a device gets the layout a CUDA device
resolves to (two tiers, its default policy, the sets cache) on the CPU, so a CPU run shows which
tests lean on the CPU's layout before a GPU machine runs them with CUDA as the default device.
`tests/conftest.py` applies it to every test; modules whose ranks fork from a preloading server
(`tests/test_distributed.py`) apply it at import, so the ranks run that way too."""

from __future__ import annotations

import os
from collections.abc import Callable

import torch


def wanted() -> bool:
    """Whether TIERSTORE_TEST_AS_CUDA asks for CUDA's layout."""
    return os.environ.get("TIERSTORE_TEST_AS_CUDA", "") not in ("", "0")


def patch(setattr: Callable[[object, str, object], None] = setattr) -> None:
    """Make stores opened without a device take CUDA's layout (`setattr`: a monkeypatch's, to
    undo it after a test, or the builtin for the whole process)."""
    import tierstore.store.handle as handle  # only when asked: conftest stays light

    as_cuda = [False]
    device, layout, cache = handle.resolve_device, handle.resolve_layout, handle._device_cache

    def resolve_device(dev):
        as_cuda[0] = dev is None
        return device(dev)

    setattr(handle, "resolve_device", resolve_device)
    setattr(handle, "resolve_layout", lambda dtype, *a, **k: layout(
        "cuda" if as_cuda[0] else dtype, *a, **k))
    setattr(handle, "_device_cache", lambda name, dev, tables: cache(
        name, torch.device("cuda") if as_cuda[0] else dev, tables))
