"""What a module over store tables puts in `state_dict()`: how to find its tables, never their rows.

The tables can hold 10^11 rows, so a module's state is a pointer: the store's path, its identity
(a random id recorded when the store was created, kept by checkpoints and restores), its clock
(`TierStore.advance`; the trainer advances it once a step) and the specs of the tables the module
reads. `load_state_dict` checks that pointer against the module's own store and raises
`ConfigMismatchError` when it is another store, other tables, or the same store at another
clock (its rows are not the ones the state_dict was saved with). The rows themselves are saved
by `store.checkpoint()` and come back with `TierStore.restore()` (docs/persistence.md).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from .errors import ConfigMismatchError

STATE_FORMAT = "tierstore.module"
STATE_VERSION = 1
_STRUCTURE = ("num_rows", "dim", "dtype")  # what makes a table another table


def _structure(cfg: dict) -> dict:
    return {**{k: cfg.get(k) for k in _STRUCTURE}, "optimizer": (cfg.get("optimizer") or {}).get("kind")}


def store_state(store: Any, tables: list[str]) -> dict:
    """The module's extra state: the store's path, id and clock, and its tables' specs."""
    specs = store.table_specs
    return {"format": STATE_FORMAT, "version": STATE_VERSION, "path": str(store.path),
            "store_id": getattr(store, "store_id", None), "clock": int(getattr(store, "clock", 0)),
            "tables": {t: specs[t].to_config() for t in tables}}


def check_store_state(store: Any, state: Any, tables: list[str], who: str) -> None:
    """Raise ConfigMismatchError unless `state` (from `store_state`) describes this store now."""
    if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
        raise ConfigMismatchError(f"{who}: the state_dict entry is not a tierstore module's state")
    saved_at = f"saved from store {state.get('path')!r} at clock {state.get('clock')}"
    sid, mine = state.get("store_id"), getattr(store, "store_id", None)
    if sid is not None and mine is not None and sid != mine:
        raise ConfigMismatchError(
            f"{who}: the state_dict was {saved_at} (store id {sid}); this module's store "
            f"{str(store.path)!r} is another store (id {mine}). Build the module over that store, "
            f"or over a restore of its checkpoint (TierStore.restore)")
    saved = state.get("tables") or {}
    if sorted(saved) != sorted(tables):
        raise ConfigMismatchError(f"{who}: the state_dict holds tables {sorted(saved)}, this module "
                                  f"reads {sorted(tables)}")
    specs = store.table_specs
    for t in tables:
        was, now = _structure(saved[t]), _structure(specs[t].to_config())
        if was != now:
            raise ConfigMismatchError(f"{who}: table {t!r} was {was} when the state_dict was "
                                      f"{saved_at}; the store's is {now}")
    clock = int(getattr(store, "clock", 0))
    if state.get("clock") != clock:
        raise ConfigMismatchError(
            f"{who}: the state_dict was {saved_at}; the store {str(store.path)!r} is at clock "
            f"{clock}, so its rows are not the ones saved with it. Restore the store from the "
            f"checkpoint taken with the state_dict (TierStore.restore)")


def tables_repr(store: Any, tables: list[str]) -> str:
    """'name: rows x dim optimizer' for each table (what `repr` of a module shows)."""
    specs = store.table_specs
    return ", ".join(f"{t}: {specs[t].num_rows} x {specs[t].dim} {specs[t].optimizer.kind}"
                     for t in tables)


# forwards with autograd on, over tables with a ttl, after which a clock still at 0 is reported
STILL_CLOCK_FORWARDS = 1000


def _check_clock(module: Any, args: Any) -> None:
    module.check_clock()


class StoreBacked:
    """Mixin for nn.Modules over store tables: a truthful state_dict entry and repr.

    Subclasses set `self.store` and `self.features` ({feature: table}), or override
    `_state_tables()`.
    """

    store: Any
    features: dict[str, str]
    _forwards = 0
    _clock_warned = False

    def watch_clock(self) -> None:
        """Warn once if this module trains tables with a ttl while the store's clock stays 0.

        The clock is advanced by whoever defines a training step: `integration.train` calls
        `store.advance()` once per step; a loop of your own must too (docs/admission.md, "The
        clock"). A module cannot tell steps apart: several modules may share a store, gradients
        may accumulate over several backwards, and a module rebuilt on resume would shift the
        count, so it never advances the clock itself.
        """
        self.register_forward_pre_hook(_check_clock)

    def check_clock(self) -> None:
        """Count a forward; at the STILL_CLOCK_FORWARDS-th with autograd on, warn if tables with
        a ttl train while the store's clock is still 0 (once)."""
        if self._clock_warned or not torch.is_grad_enabled():
            return
        self._forwards += 1
        if self._forwards < STILL_CLOCK_FORWARDS:
            return
        self._clock_warned = True
        store = self.store
        ttl = [t for t in self._state_tables() if store.table_specs[t].ttl is not None]
        if ttl and int(getattr(store, "clock", 1)) == 0 and not getattr(store, "readonly", False):
            warnings.warn(f"tables {ttl} have a ttl, but the store's clock is still 0 after "
                          f"{self._forwards} training forwards: rows expire by that clock only. "
                          f"Call store.advance() once per training step (integration.train "
                          f"does)", stacklevel=3)

    def _state_tables(self) -> list[str]:
        return list(dict.fromkeys(self.features.values()))

    def get_extra_state(self) -> dict:
        """The `_extra_state` entry of `state_dict()`: where the tables are (see module docs)."""
        return store_state(self.store, self._state_tables())

    def set_extra_state(self, state: Any) -> None:
        """Check a loaded `_extra_state` against this module's store (ConfigMismatchError)."""
        check_store_state(self.store, state, self._state_tables(), type(self).__name__)

    def extra_repr(self) -> str:
        """The store's path and the module's tables."""
        return f"store={str(self.store.path)!r}, tables=[{tables_repr(self.store, self._state_tables())}]"
