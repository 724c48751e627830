"""One exception hierarchy for every error tierstore raises on purpose."""

from __future__ import annotations


class TierstoreError(Exception):
    """Root of every error the library raises on purpose."""


class UnknownTableError(TierstoreError, KeyError):
    """A table name that the store does not hold."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else "unknown table"


class InvalidIdsError(TierstoreError, ValueError):
    """Row ids that are negative, out of range, or not an integer tensor."""


class ShapeError(TierstoreError, ValueError):
    """A tensor whose shape or dtype does not match what the call needs."""


class ConfigError(TierstoreError, ValueError):
    """An invalid configuration value (capacity, spec, optimizer, policy...)."""


class ConfigMismatchError(TierstoreError):
    """A store reopened with table specs that differ from the stored ones."""


class StoreLockedError(TierstoreError):
    """The store is already open for writing by another process or handle."""


class StoreCorruptError(TierstoreError):
    """The store's files are unreadable, truncated or inconsistent."""


class LogCorruptError(StoreCorruptError):
    """The write-behind log left by a crash is damaged: the rows written back after the last
    flush are at stake; `TierStore.open(path, damaged_log="last_flush")` opens without them."""


class OutOfSpaceError(TierstoreError, OSError):
    """The disk (or the configured map limit) cannot hold more rows."""


class StoreClosedError(TierstoreError):
    """An operation on a store that has been closed."""


class CapacityError(TierstoreError):
    """Reserved: nothing raises it (a batch larger than every cache goes through LMDB instead).

    Kept exported so code that catches it still imports; new code need not handle it.
    """


class InvalidGradientError(TierstoreError, ValueError):
    """A gradient (or per-sample weight) that holds NaN or Inf; the call changes nothing."""


class StoreNotFoundError(TierstoreError, FileNotFoundError):
    """No tierstore store at the given path (for `TierStore.open`, which needs an existing one)."""


class ReadOnlyError(TierstoreError):
    """A write (apply, flush, checkpoint...) through a read-only handle."""


class SnapshotUnavailableError(TierstoreError):
    """A read-only handle found no flushed state to read within its timeout."""
