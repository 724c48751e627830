"""Belady's MIN: evict the slot whose next use lies farthest in the future (the offline optimum)."""

from __future__ import annotations

from .lookahead import Lookahead


class Belady(Lookahead):
    """The offline optimum; needs every next use, given through `on_future` (see Lookahead).

    It is `Lookahead` with an unbounded window: the caller hints the next use of every row
    it serves (a row never used again gets no hint), so unhinted slots are dead and go first,
    least recently used first.
    """

    name = "belady"
