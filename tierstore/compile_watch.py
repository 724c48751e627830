"""Announce and time numba's compilation of kernels at their first use.

Every kernel is compiled with `cache=True`, so only a process that finds no cached copy (the
first run after an install or an upgrade; where the package directory is not writable numba
keeps its cache in the user's cache directory) compiles: several seconds on a small machine.
`CompileWatch` listens to numba's `numba:compile` event, which fires for real compilations only
(not for loads from the cache): it announces the first one once and adds up their wall time, so
a trainer can show that time apart from its stall.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from ._kernels import HAVE_NUMBA

if HAVE_NUMBA:
    from numba.core import event as _event

    _Listener = _event.Listener
else:  # pragma: no cover
    _event = None
    _Listener = object

ANNOUNCEMENT = "compiling kernels (first use; numba caches them for later runs) ..."


def _stderr(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


class CompileWatch(_Listener):  # type: ignore[misc,valid-type]
    """Seconds spent compiling numba kernels (outermost compilations, any thread) while installed."""

    def __init__(self, announce: Callable[[str], None] | None = _stderr) -> None:
        super().__init__()
        self.announce = announce
        self.seconds = 0.0  # finished compilations
        self.count = 0
        self._announced = False
        self._mu = threading.Lock()
        self._local = threading.local()  # per thread: nesting depth and start time

    def on_start(self, event: object) -> None:
        """A compilation began (nested ones are part of the outermost)."""
        depth = getattr(self._local, "depth", 0)
        self._local.depth = depth + 1
        if depth == 0:
            self._local.t0 = time.perf_counter()
            with self._mu:
                first, self._announced = not self._announced, True
            if first and self.announce is not None:
                self.announce(ANNOUNCEMENT)

    def on_end(self, event: object) -> None:
        """A compilation ended."""
        self._local.depth -= 1
        if self._local.depth == 0:
            dt = time.perf_counter() - self._local.t0
            with self._mu:
                self.seconds += dt
                self.count += 1


@contextmanager
def watch_compilation(announce: Callable[[str], None] | None = _stderr) -> Iterator[CompileWatch]:
    """Install a CompileWatch for the block (a watch that sees nothing without numba)."""
    watch = CompileWatch(announce)
    if _event is None:  # pragma: no cover
        yield watch
        return
    _event.register("numba:compile", watch)
    try:
        yield watch
    finally:
        _event.unregister("numba:compile", watch)
