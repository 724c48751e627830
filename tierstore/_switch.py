"""The interpreter's thread switch interval while stores run their background threads.

An open store runs a writer and a log merger, and a prefetch pipeline adds its staging and
reader threads. Those threads hold the GIL in bursts of Python between their LMDB and torch
calls. The training thread gives the GIL up around every torch op, and each time it wants it
back it may wait a whole switch interval (5 ms by default) for a busy thread to let go. Lowering
the interval to 1 ms while a store is open made `bench.steady`'s steps with one hlfu tier
1.05-1.1x faster on 2 cores (means of 6 runs each at cache10, 3-4 at cache1); LRU with two tiers,
the resident step and `bench.training` did not move beyond noise (BENCHMARKS.md, session 16).

The interval is process-wide, so a store changes it only from the interpreter's default, and puts
the old value back when the last open store closes, unless someone changed it meanwhile.
`TIERSTORE_SWITCH_INTERVAL` sets the value (seconds), or `keep` leaves the interval alone.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import weakref
from collections.abc import Iterator

from .errors import ConfigError

PYTHON_DEFAULT = 0.005  # sys.getswitchinterval() of a fresh interpreter
STORE_DEFAULT = 0.001  # while a store is open (the fastest in BENCHMARKS.md, session 16)
ENV = "TIERSTORE_SWITCH_INTERVAL"


def configured() -> float | None:
    """The interval stores ask for: `TIERSTORE_SWITCH_INTERVAL` or 1 ms; None: keep it."""
    text = os.environ.get(ENV, "").strip().lower()
    if not text:
        return STORE_DEFAULT
    if text in ("keep", "none", "off"):
        return None
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value < 1:  # NaN fails this too
        raise ConfigError(f"{ENV} must be seconds in (0, 1) or 'keep', got {text!r}")
    return value


class SwitchInterval:
    """The stores that want a shorter switch interval: the first sets it, the last one closed restores it.

    Holders are kept weakly and count while their `closed` is false, so a store that was
    dropped or abandoned without `close()` (a simulated kill in the tests) stops counting too;
    the interval is put back at the next `acquire` or `release` after that.

    Walking the holders can run the garbage collector, and with it a dropped store's `__del__`,
    which closes the store and calls `release` on this thread while it is inside a call here. Such
    a nested `release` returns at once (its holder's `closed` is already set, so the walk in
    progress or the next one drops it) instead of waiting on the lock this thread holds.
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._inside = threading.local()  # .active: this thread is in a call that walks the holders
        self._holders: weakref.WeakSet = weakref.WeakSet()
        # the interval we set, as the interpreter reports it (None: we changed nothing); we only
        # ever replace the interpreter's default, so that is what goes back
        self._ours: float | None = None

    @property
    def users(self) -> int:
        """Holders still open."""
        with self._walking():
            return self._prune()

    @contextlib.contextmanager
    def _walking(self) -> Iterator[None]:
        with self._lock:
            self._inside.active = True
            try:
                yield
            finally:
                self._inside.active = False

    def _prune(self) -> int:
        for h in [h for h in list(self._holders) if getattr(h, "closed", False)]:
            self._holders.discard(h)
        return len(self._holders)

    def acquire(self, holder: object, want: float | None) -> None:
        """Count `holder`; the first sets `want` if the interval is still the interpreter's default."""
        with self._walking():
            first = self._prune() == 0
            if first:
                self._restore()  # what a holder abandoned since the last call left set
            self._holders.add(holder)
            if not first or want is None:
                return
            if sys.getswitchinterval() == PYTHON_DEFAULT and want != PYTHON_DEFAULT:
                sys.setswitchinterval(want)
                self._ours = sys.getswitchinterval()

    def release(self, holder: object) -> None:
        """Stop counting `holder`; the last puts back the interval it replaced, unless changed since."""
        if getattr(self._inside, "active", False):  # a finalizer run by this thread's own walk
            return
        with self._walking():
            self._holders.discard(holder)
            if self._prune() == 0:
                self._restore()

    def _restore(self) -> None:
        if self._ours is not None and sys.getswitchinterval() == self._ours:
            sys.setswitchinterval(PYTHON_DEFAULT)
        self._ours = None


STORES = SwitchInterval()  # the one every TierStore uses
