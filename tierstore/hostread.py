"""Device tensors read on the host without a call that CUDA's sync debug mode flags.

`torch.cuda.set_sync_debug_mode("error")` is process-wide: while a training step runs under it,
any thread's `.cpu()`, `.item()`, `bool()`, `nonzero` or blocking host-to-device copy raises. The
prefetch pipeline's staging thread reads lookups and victims of the device tier back to the
host while the training thread runs its (sync-free) staged step, so those reads go through
`to_host`: a non-blocking copy into pinned memory, then a wait on a CUDA event, which the
debug mode does not flag. The wait is real (the staging thread blocks until the device got
there); the training thread does not. Host-to-device copies on those paths pass
`non_blocking=True` (pageable sources are staged by the driver before the call returns).
"""

from __future__ import annotations

import torch


def to_host(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """The tensors on the CPU: CPU ones as they are, CUDA ones copied into pinned memory and
    waited for through one event (one wait for all of them)."""
    out = list(tensors)
    pending = False
    for i, t in enumerate(tensors):
        if t.device.type == "cpu":
            continue
        if t.device.type != "cuda":
            out[i] = t.cpu()
            continue
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        out[i] = host
        pending = True
    if pending:
        done = torch.cuda.Event()
        done.record()
        done.synchronize()
    return out


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` on `device`; a host-to-device copy does not block (nor trip the debug mode)."""
    return t.to(device, non_blocking=t.device.type == "cpu" and device.type != "cpu")
