"""The cache layout a store runs with, resolved from what the user gave and the device.

A pure function: the capacities (rows), the policy and staging slots the user named (None: not
named) and the device type in, a `Layout` with the reason for each choice out. The store calls
it once in its constructor; `stats()["layout"]` and `tierstore info` report the result.

What it picks, and why (BENCHMARKS.md, sessions 8, 11, 17, and issue 36):
- On a CPU device the device and host tiers are the same memory, and a second tier only moves
  each missed row twice. Unless the user names a policy, the two capacities become one device
  tier of their sum (`host_rows=0`): the fastest layout measured (1.12-1.19x on the training
  benchmark with the same policy).
- With it the policy is `hlfu` (a count that outlives the slot, TinyLFU admission): with one
  tier and staging slots it ran cache10 at 0.64-0.70x and cache1 at 0.31-0.35x of all-resident,
  against 0.35x / 0.17x for LRU over two tiers.
- Staging slots: hlfu refuses most staged misses, and a staged row must stay pinned in a
  device slot. Unless the user gives `staging_capacity`, the store reserves slots past the
  cache (`staging_reserve`) and the prefetch pipeline activates one per row of its largest
  window (`stats()["prefetch"]["window_rows"]`), up to the reserve. The reserve is at most
  64 MiB and four times the cache (cache1 on the training benchmark staged 2.5x its cache);
  only used slots' rows are written, so a reserved slot costs its bookkeeping (~56 B) until
  the window needs it.
- On CUDA the tiers stay distinct (HBM and pinned DDR), with LRU unless a policy is named.
- Caches that hold every declared row evict nothing: LRU (the cheapest bookkeeping; hlfu's
  made an all-resident step slower) and no staging slots, still one tier on a CPU.
- Default capacities larger than the declared rows are clamped to them, the device tier first
  (a tiny table no longer costs the default 576 MiB of slots and indexes); named ones are kept.
- An explicit choice always wins: a named policy keeps the capacities as given and gets no
  automatic staging slots (`staging_capacity` names them); named staging slots keep their
  number.
"""

from __future__ import annotations

from dataclasses import dataclass

from .policies import make_policy

CPU_POLICY = "hlfu"  # the training benchmark's winner on a CPU device (one tier, staging slots)
DEFAULT_POLICY = "lru"  # a CUDA device's default, and the read-only handles'
# automatic staging slots: at most this many bytes of rows and bookkeeping (the default write
# buffer's size), at most STAGING_CACHE_TIMES the cache's rows, never more than the tables declare
STAGING_RESERVE_BYTES = 64 << 20
STAGING_SLOT_BYTES = 56  # a reserved slot's index entry and bookkeeping, written at creation
STAGING_CACHE_TIMES = 4


@dataclass(frozen=True)
class Layout:
    """The resolved cache layout: tier capacities (rows), policy, staging slots, and why."""

    device_rows: int
    host_rows: int
    policy: str
    staging_rows: int  # slots past the device tier's cache: fixed, or the automatic reserve
    staging_auto: bool  # True: activated from the prefetch window, up to `staging_rows`
    reasons: tuple[str, ...]
    table_rows: int = 0  # the rows the tables declare (not in `as_dict`)

    @property
    def resident(self) -> bool:
        """Whether the caches hold every declared row (nothing is ever evicted)."""
        return self.table_rows > 0 and self.device_rows + self.host_rows >= self.table_rows

    def as_dict(self) -> dict:
        """The layout as plain values (for `stats()` and the store's metadata)."""
        return {"device_rows": self.device_rows, "host_rows": self.host_rows, "policy": self.policy,
                "staging_rows": self.staging_rows, "staging_auto": self.staging_auto,
                "reasons": list(self.reasons)}


def staging_reserve(cache_rows: int, row_bytes: int, table_rows: int) -> int:
    """Automatic staging slots for a cache of `cache_rows`: 64 MiB of slots, at most four times
    the cache and the rows the tables declare."""
    rows = STAGING_RESERVE_BYTES // (max(1, row_bytes) + STAGING_SLOT_BYTES)
    return max(0, min(rows, STAGING_CACHE_TIMES * cache_rows, table_rows))


def resolve_layout(device_type: str, device_rows: int, host_rows: int, policy: str | None,
                   staging_rows: int | None, row_bytes: int, table_rows: int,
                   defaults: tuple[bool, bool] = (False, False)) -> Layout:
    """The layout for these choices (None: not named) on a device of `device_type`.

    `defaults`: whether the device and host capacities are the defaults rather than the user's
    (a default is clamped to the declared rows, the device tier first; a named one is kept).

    Raises `ConfigError` (from the policy registry) for an unknown policy; whether explicit
    staging slots suit the layout is the store's check.
    """
    reasons = []
    cpu = device_type == "cpu"
    given = (device_rows, host_rows)
    if table_rows > 0 and defaults[0]:
        device_rows = min(device_rows, table_rows)
    if table_rows > 0 and defaults[1]:
        host_rows = min(host_rows, max(0, table_rows - device_rows))
    if (device_rows, host_rows) != given:
        reasons.append(f"default capacities clamped to the {table_rows} declared rows (device "
                       f"{device_rows}, host {host_rows}): a slot past them could never be used")
    named = policy is not None
    resident = device_rows + host_rows >= table_rows  # the caches hold every declared row
    if not named and resident:
        policy = DEFAULT_POLICY
        reasons.append(f"policy {policy}: the caches hold every declared row, so nothing is "
                       "evicted and the cheapest bookkeeping wins (no staging slots)")
    elif not named:
        policy = CPU_POLICY if cpu else DEFAULT_POLICY
        reasons.append(f"policy {policy}: the default on a {'CPU' if cpu else device_type} device"
                       + (" (it won the training benchmark with one tier and staging slots)"
                          if cpu else ""))
    else:
        reasons.append(f"policy {policy}: named; capacities kept as given")
    if not named and cpu and host_rows:
        reasons.append(f"one cache tier of {device_rows + host_rows} rows (device "
                       f"{device_rows} + host {host_rows}): on a CPU device both tiers are "
                       "host memory, and a second tier moves each miss twice")
        device_rows, host_rows = device_rows + host_rows, 0
    if not cpu:
        reasons.append(f"{device_type} device: the device tier and the host tier stay distinct")
    selective = make_policy(policy, 0).selective
    if staging_rows is not None:
        if staging_rows:
            reasons.append(f"staging slots: {staging_rows}, named")
        return Layout(device_rows, host_rows, policy, staging_rows, False, tuple(reasons), table_rows)
    if cpu and not named and not resident and selective and not host_rows and device_rows:
        reserve = staging_reserve(device_rows, row_bytes, table_rows)
        reasons.append(f"staging slots: automatic, activated as the prefetch window needs, up to "
                       f"{reserve} rows (64 MiB, at most {STAGING_CACHE_TIMES}x the cache)")
        return Layout(device_rows, host_rows, policy, reserve, True, tuple(reasons), table_rows)
    return Layout(device_rows, host_rows, policy, 0, False, tuple(reasons), table_rows)
