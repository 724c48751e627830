"""TierStore's logical clock: advancing it, expiring rows by it, stamping updated rows with it."""

from __future__ import annotations

import torch

import tierstore.expiry as _exp

from ..errors import ConfigError
from .core import CLOCK_MAX, _locked, _Table


class StoreClock:
    """The store clock (`advance`), expiry of rows by their age on it (`expire`), the rows' stamps."""

    @_locked
    def advance(self, steps: int = 1) -> int:
        """Move the store's logical clock forward (the trainer calls this once per step); returns it.

        Every row update records the clock as the row's last-update stamp (kept with the row in
        every tier and on disk); the clock is saved by `flush()`, `checkpoint()` and `close()`.
        """
        self.check_live()
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ConfigError(f"steps must be an int >= 0, got {steps!r}")
        if self.clock + steps > CLOCK_MAX:
            raise ConfigError(f"the store clock cannot pass {CLOCK_MAX} (at {self.clock})")
        self.clock += steps
        self.expiry.on_advance()  # tables with a ttl: expire at fixed clock points
        self._rows_may_change()
        return self.clock

    @_locked
    def expire(self, table: str | None = None, older_than: int = 0) -> dict[str, int]:
        """Delete rows (of `table`, or all) last updated more than `older_than` clock steps ago.

        They leave the caches and LMDB and read as freshly initialized; durable on return.
        Returns rows deleted from LMDB per table. `tierstore compact` reclaims the disk.
        """
        self.check_live()
        self._rows_may_change()
        return _exp.expire(self, table, older_than)

    def _rows_may_change(self) -> None:
        """Invalidate every gathered copy of rows (the clock or expiry may change how rows read)."""
        for tab in self.tables.values():
            tab.writes += 1

    def clock_value(self) -> torch.Tensor:
        """The clock as a 0-d float32 tensor holding its int32 bits (the stamp column's value)."""
        return torch.tensor(self.clock, dtype=torch.int32).view(torch.float32)

    def stamp(self, tab: _Table, target: torch.Tensor, slots: torch.Tensor) -> None:
        """Record the clock as the last-update stamp of updated rows `target[slots]` (and count
        the update in the table's `writes`)."""
        self.stamp_many([tab], target, [slots])

    def stamp_many(self, tabs: list[_Table], target: torch.Tensor, slots: list[torch.Tensor],
                   finite: torch.Tensor | None = None) -> None:
        """`stamp` of several tables' rows: one write per stamp column, not one per table.
        The same tensor given for several tables (all their rows, with one stamp column) is
        written once. `finite`: a bool tensor on the target's device; where false, the stamps
        stay (a discarded update, `BagPaths`), with no host sync."""
        by_col: dict[int, list[torch.Tensor]] = {}
        for tab, s in zip(tabs, slots):
            tab.writes += 1
            parts = by_col.setdefault(tab.spec.stamp_col, [])
            if not any(p is s for p in parts):
                parts.append(s)
        value = self.clock_value().to(target.device, non_blocking=True)
        for col, parts in by_col.items():  # index_copy_ of the value broadcast: index_fill_ with
            at = parts[0] if len(parts) == 1 else torch.cat(parts)  # a tensor value reads it back
            stamps = target[:, col]
            new = value.expand(at.numel())
            if finite is not None:
                new = torch.where(finite, new, stamps.index_select(0, at))
            stamps.index_copy_(0, at, new)

    def count_update(self, tab: _Table) -> int:
        """Count an update call on `tab`; a 16-bit table's count salts its stochastic rounding."""
        if not tab.spec.codec.packed:
            return 0
        tab.updates += 1
        return tab.updates

    def _clock_record(self) -> dict:
        """The saved clock: its value and the 16-bit tables' update counts."""
        updates = {t.spec.name: t.updates for t in self.tables.values() if t.updates}
        return {"value": self.clock, "updates": updates} if updates else {"value": self.clock}

    def _load_clock(self, record: dict) -> None:
        """Set the clock and the tables' update counts from a saved record."""
        self.clock = int(record.get("value", 0))
        for name, n in (record.get("updates") or {}).items():
            if name in self.tables:
                self.tables[name].updates = int(n)
        self._clock_saved = self._clock_record()

    def _save_clock(self) -> None:
        """Persist the logical clock (with the next sync) when it moved since the last save."""
        record = self._clock_record()
        if record != self._clock_saved:
            self.backend.put_meta({"clock": record})
            self._clock_saved = record
