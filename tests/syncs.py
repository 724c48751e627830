"""A dispatch mode that counts the aten calls which would make a CUDA host wait."""

from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode

SYNCING = ("_local_scalar_dense", "nonzero", "unique", "item")


class SyncCounter(TorchDispatchMode):
    """Counts aten calls that make a CUDA host wait (scalar reads, data-dependent shapes, copies
    to the host, a Python value put at tensor indices)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__ if hasattr(func, "__name__") else str(func)
        kwargs = kwargs or {}
        to_host = "_to_copy" in name and str(kwargs.get("device", "")) == "cpu"
        # `x[i] = True`: the Python value becomes a host tensor that CUDA copies over blocking
        scalar_put = name.startswith("index_put") and len(args) > 2 and getattr(args[2], "ndim", 1) == 0
        if any(s in name for s in SYNCING) or to_host or scalar_put:
            self.calls.append(name)
        return func(*args, **kwargs)
