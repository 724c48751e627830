"""Eviction policies for the host and device tiers, registered in one place."""

from __future__ import annotations

import torch

from ..errors import ConfigError
from .arc import ARC
from .base import Evictable, Policy, QueuePolicy
from .belady import Belady
from .clock import Clock
from .fifo import FIFO
from .hlfu import HistoryLFU
from .lfu import LFU
from .lookahead import Lookahead
from .lru import LRU
from .s3fifo import S3FIFO
from .sieve import Sieve
from .wtinylfu import WTinyLFU

POLICIES: dict[str, type[Policy]] = {
    LRU.name: LRU,
    LFU.name: LFU,
    HistoryLFU.name: HistoryLFU,
    FIFO.name: FIFO,
    Clock.name: Clock,
    S3FIFO.name: S3FIFO,
    Sieve.name: Sieve,
    Belady.name: Belady,
    Lookahead.name: Lookahead,
    WTinyLFU.name: WTinyLFU,
    ARC.name: ARC,
}


def make_policy(name: str, capacity: int, device: torch.device | str = "cpu") -> Policy:
    """Build the registered policy `name` for a tier of `capacity` slots.

    `lookahead:NAME` (or `belady:NAME`) picks the policy that ranks slots with no known next use.
    """
    if not isinstance(name, str):
        raise ConfigError(f"policy name must be a string, got {name!r}")
    base, _, arg = name.lower().partition(":")
    cls = POLICIES.get(base)
    if cls is None:
        raise ConfigError(f"unknown policy {name!r}; known: {sorted(POLICIES)}")
    if arg:
        if not issubclass(cls, Lookahead):
            raise ConfigError(f"policy {base!r} takes no argument, got {name!r}")
        if arg.partition(":")[0] not in POLICIES or arg.partition(":")[0] in (base, "belady"):
            raise ConfigError(f"unknown fallback policy {arg!r} in {name!r}")
        return cls(capacity, device, fallback=make_policy(arg, capacity, device))
    return cls(capacity, device)


__all__ = [
    "ARC",
    "FIFO",
    "HistoryLFU",
    "LFU",
    "LRU",
    "POLICIES",
    "S3FIFO",
    "Belady",
    "Clock",
    "Evictable",
    "Lookahead",
    "Policy",
    "QueuePolicy",
    "Sieve",
    "WTinyLFU",
    "make_policy",
]
