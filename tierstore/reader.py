"""The read interface a writable store and a read-only handle share, so any module runs over either."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from .config import TableSpec


@runtime_checkable
class RowReader(Protocol):
    """What reading rows takes: `TierStore` and `ReadOnlyStore` both are one (`readonly` tells them apart).

    A module (bags, sequences, the sharded collection) looks rows up through this interface only:
    `table_record` resolves a table name, `check_ids` validates a batch of ids against it, and
    `read` returns rows [n, dim] on `device`. A `readonly` reader refuses every update with
    `ReadOnlyError`.
    """

    path: Path
    device: torch.device
    readonly: bool
    closed: bool

    @property
    def table_specs(self) -> dict[str, TableSpec]:
        """The specs of the tables this handle serves."""
        ...

    @property
    def store_id(self) -> str | None:
        """The store's identity (what a model's state_dict records)."""
        ...

    def read(self, table: str, ids: Any) -> torch.Tensor:
        """Rows [n, dim] of `ids` (int64) of `table`, on `device`."""
        ...

    def table_record(self, table: str) -> Any:
        """The table's record (`UnknownTableError` for an unknown name)."""
        ...

    def check_ids(self, tab: Any, ids: Any) -> torch.Tensor:
        """`ids` as an int64 CPU tensor, checked against the table (`InvalidIdsError`)."""
        ...

    def check_live(self) -> None:
        """Raise `StoreClosedError` once the handle is closed."""
        ...

    def stats(self) -> dict[str, Any]:
        """Counters of the handle's tiers."""
        ...

    def close(self) -> None:
        """Release the handle (idempotent)."""
        ...
