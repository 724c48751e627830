"""A pretend CUDA device on the CPU: tensors marked as device-resident, and the host reads of them
that would synchronize (or fail) on a real device.

`DeviceTaint` is a `TorchFunctionMode` (per thread). Tensors it is told about (`mark`), the
outputs of any torch call with a marked input, tensors moved with `.to(..., non_blocking=True)`
(the library's host-to-device moves) and what `tierstore.hostread.to_device` returns count as on
the device; `hostread.to_host` (patched by `watching_hostread`) is the one sanctioned way back.
A host read of a marked tensor is recorded in `reads`: `.item()`, `bool()`, `int()`, `.tolist()`,
`.numpy()`, `.cpu()`, a blocking `.to("cpu")`, `nonzero`, `unique`, `masked_select`, `bincount`,
`repeat_interleave` without `output_size`, `equal`, indexing by a boolean mask, a Python
value put at an index (`x[i] = 0`: a blocking copy to the device), and the other blocking
copies to the device: `.to(device)` of a host tensor without `non_blocking`, `copy_` from the
host into a device tensor, `torch.tensor(..., device=)` (`Rows.to(device)`, non-blocking on
CUDA, marks what it moves even where the CPU moves nothing). On a CUDA
device each of these waits for the device (CUDA's sync debug mode raises on them) or, for
`.numpy()`, fails.
"""

from __future__ import annotations

import contextlib
import threading
import traceback
import weakref
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

import tierstore.hostread as hostread
from tierstore.backends.slab import Rows

T = torch.Tensor
_READS = {T.item, T.tolist, T.numpy, T.__bool__, T.__int__, T.__index__, T.__float__, T.cpu,
          torch.nonzero, T.nonzero, torch.argwhere, T.argwhere, torch.unique, T.unique,
          torch.unique_consecutive, T.unique_consecutive, torch.masked_select, T.masked_select,
          torch.bincount, T.bincount, torch.equal, T.equal, torch.allclose, T.allclose}
_REPEAT = {torch.repeat_interleave, T.repeat_interleave}
_INDEX = {T.__getitem__, T.__setitem__, T.index_put_, T.index_put}
_DEVICE_GET = T.device.__get__
DEPTH = 2  # library frames named per read


def _tensors(obj: object) -> list[torch.Tensor]:
    return [x for x in tree_flatten(obj)[0] if isinstance(x, torch.Tensor)]


def _has_mask(index: object) -> bool:
    return any(t.dtype == torch.bool and t.dim() > 0 for t in _tensors(index))


def _to_cpu(args: tuple, kwargs: dict) -> bool:
    """Whether a `.to(...)` call names the CPU as its target device."""
    return _target(args, kwargs) is not None and torch.device(_target(args, kwargs)).type == "cpu"


def _target(args: tuple, kwargs: dict) -> object:
    """The device a `.to(...)` call names (None: none, or another tensor's)."""
    for a in (*args[1:], kwargs.get("device")):
        if isinstance(a, (str, torch.device)):
            return a
        if isinstance(a, torch.Tensor):
            return None
    return None


class DeviceTaint(TorchFunctionMode):
    """Marks device-resident tensors on the CPU and records host reads of them."""

    def __init__(self) -> None:
        super().__init__()
        self.marked: dict[int, weakref.ref] = {}  # by id: a tensor's == is elementwise
        self.reads: list[str] = []
        self.devices: dict[int, object] = {}  # device objects that name the pretend device

    def add_device(self, *devices: object) -> None:
        """Count these `torch.device` objects (by identity) as naming the pretend device."""
        for d in devices:
            self.devices[id(d)] = d

    def is_device(self, device: object) -> bool:
        """Whether `device` is one of the objects that name the pretend device."""
        return device is not None and self.devices.get(id(device)) is device

    def mark(self, *tensors: torch.Tensor) -> None:
        """Count these tensors as on the device."""
        for t in tensors:
            self.marked[id(t)] = weakref.ref(t)

    def on_device(self, t: object) -> bool:
        """Whether `t` counts as device-resident."""
        if not isinstance(t, torch.Tensor):
            return False
        ref = self.marked.get(id(t))
        return ref is not None and ref() is t

    def _read(self, what: str) -> None:
        where = [f"{f.filename.rsplit('/', 2)[-2:]}:{f.lineno} {f.name}"
                 for f in traceback.extract_stack()[:-2] if "/tierstore/" in f.filename][-DEPTH:]
        self.reads.append(f"{what} at {where}")

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = _tensors((args, kwargs))
        marked = any(self.on_device(t) for t in inputs)
        name = getattr(func, "__name__", str(func))
        if marked:
            if func in _READS:
                self._read(name)
            elif func in _REPEAT and kwargs.get("output_size") is None:
                self._read(f"{name} without output_size")
            elif func in _INDEX and len(args) > 1 and _has_mask(args[1]):
                self._read(f"{name} by a boolean mask")
            elif func is T.__setitem__ and self.on_device(args[0]) and len(args) > 2 \
                    and not isinstance(args[2], torch.Tensor):
                # the Python value becomes a host tensor copied over blocking (a sync on CUDA)
                self._read("__setitem__ of a Python value")
            elif func is T.to and self.on_device(args[0]) and _to_cpu(args, kwargs) \
                    and not kwargs.get("non_blocking", False) \
                    and not self.is_device(_target(args, kwargs)):
                self._read("to(cpu)")
            elif func is T.copy_ and self.on_device(args[0]) and not self.on_device(args[1]) \
                    and not (args[2] if len(args) > 2 else kwargs.get("non_blocking", False)):
                self._read("blocking copy_ from the host")  # CUDA's debug mode flags it
        # a host tensor copied to the device blocking: CUDA waits for the copy (the debug mode
        # flags it), e.g. `.to(device)` without non_blocking, or `torch.tensor(..., device=)`
        to_dev = func is T.to and self.is_device(_target(args, kwargs)) and not self.on_device(args[0])
        if to_dev and not kwargs.get("non_blocking", False):
            self._read("blocking to(device)")
        elif func in (torch.tensor, torch.as_tensor) and self.is_device(kwargs.get("device")) \
                and not inputs:
            self._read(f"{name}(..., device=) from host values")
        out = func(*args, **kwargs)
        if marked and self.on_device(args[0]) and (func is T.cpu or (
                func is T.to and _to_cpu(args, kwargs) and not self.is_device(_target(args, kwargs)))):
            # a copy to the host: on the CPU the same tensor comes back; a fresh alias, unmarked
            return out.view(out.shape) if out is args[0] else out
        if func == _DEVICE_GET:  # a marked tensor's `.device` names the pretend device
            if marked:
                self.add_device(out)
            return out
        if func in _READS and func not in (torch.nonzero, T.nonzero, torch.argwhere, T.argwhere,
                                           torch.unique, T.unique, torch.masked_select,
                                           T.masked_select, torch.bincount, T.bincount):
            return out  # host values (or the same tensor, as the CPU sees it)
        # a move to the device, or a non-blocking move (a host-to-device copy here: a read back
        # must block)
        moved = to_dev or (func is T.to and bool(kwargs.get("non_blocking", False)))
        if marked or moved:
            self.mark(*_tensors(out))
        return out


@contextlib.contextmanager
def watching_hostread(modes: dict[int, DeviceTaint]) -> Iterator[None]:
    """Patch `tierstore.hostread` so that `to_device` marks and `to_host` unmarks, for the mode
    of the calling thread (`modes`: thread id -> mode)."""
    to_host, to_device = hostread.to_host, hostread.to_device

    def host(*tensors):
        mode = modes.get(threading.get_ident())
        if mode is None:
            return to_host(*tensors)
        with torch._C.DisableTorchFunction():  # the copies are not device calls
            return [t.clone() if mode.on_device(t) else t for t in tensors]

    def device(t, dev):
        mode = modes.get(threading.get_ident())
        if mode is None:
            return to_device(t, dev)
        with torch._C.DisableTorchFunction():  # a move, not a read
            out = to_device(t, dev)
            if mode.is_device(dev) and not mode.on_device(t):
                out = t.view(t.shape)  # a tensor of its own to mark (the CPU moves nothing)
        if mode.is_device(dev):
            mode.mark(out)
        return out

    rows_to = Rows.to

    def rows_device(self, dev):  # `Rows.to(device)` moves every part non-blocking on CUDA
        out = rows_to(self, dev)
        mode = modes.get(threading.get_ident())
        if mode is not None and mode.is_device(dev):
            parts = [t for t in (out.tabs, out.rows, out.payload, out.dirty, out.pins) if t is not None]
            if out is self:  # the CPU moved nothing: views of their own to mark
                with torch._C.DisableTorchFunction():
                    parts = [t.view(t.shape) for t in parts]
                out = Rows(*parts[:4], parts[4] if self.pins is not None else None)
            mode.mark(*parts)
        return out

    hostread.to_host, hostread.to_device = host, device
    Rows.to = rows_device
    try:
        yield
    finally:
        hostread.to_host, hostread.to_device = to_host, to_device
        Rows.to = rows_to
