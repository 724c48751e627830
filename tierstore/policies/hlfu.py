"""History LFU: evict the slot whose key a long-memory frequency sketch counts least.

Plain LFU forgets a row's count when the row leaves the tier, so a row of middling frequency
re-enters at one access and is evicted again before its next use. On a skewed, stationary
workload (a recommendation model's ids) the rows at the cache's edge are used once every
hundred steps or so: only a memory of their past uses, kept while they are out of the tier, can
tell them from the long tail. This policy keeps that memory in a blocked count-min sketch (one
64-byte line per key, four counters saturating at 7 in it, conservative update) and ages it slowly:
every `aging_period x capacity` accesses all counters are halved, and so are the counts of the
cached slots.

A cached slot sits in the queue of its count (1..7: the sketch's estimate at its last access);
queues are kept in access order, so the victims are the smallest (count, last access) pairs, the
same order as LFU's. Hits and inserts cost O(1) each (one sketch line, one queue move);
victims cost O(n + pinned slots skipped); an aging pass re-sorts the cached slots by
(halved count, last access), O(capacity log capacity) once every `aging_period x capacity`
accesses.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

import tierstore.policies.queues as q

from .._kernels import prefetch
from .base import Policy, QueuePolicy, as_numpy

MAX_COUNT = 7  # counts saturate here (measured: 7 loses ~2% of the hits 15 keeps); queue c - 1 holds count c
_KEY, _STAMP = q.FIRST_FREE, q.FIRST_FREE + 1
_CLOCK = MAX_COUNT  # the one global after the queue lengths: the access clock (8 words a row)
_M1 = np.int64(-4658895280553007687)
_M2 = np.int64(-7723592293110705685)
_NO_KEYS = np.empty(0, dtype=np.int64)


@numba.njit(cache=True, nogil=True, inline="always")
def _mix(h):  # pragma: no cover - compiled
    """A well-mixed 64-bit value of key hash `h`: low bits pick the line, high bits the counters."""
    x = h * _M1
    x ^= x >> 29
    x *= _M2
    return x ^ (x >> 32)


@numba.njit(cache=True, nogil=True, inline="always")
def _least(lines, line, x):  # pragma: no cover - compiled
    """The smallest of the four counters of mixed hash `x` in its line."""
    est = MAX_COUNT
    for r in range(4):  # four counters of the line, at 6-bit positions taken from the hash
        c = lines[line, (x >> (40 + 6 * r)) & 63]
        if c < est:
            est = c
    return est


@numba.njit(cache=True, nogil=True, inline="always")
def _count(lines, h):  # pragma: no cover - compiled
    """Count one access of key hash `h` (conservative update); return the new estimate."""
    x = _mix(h)
    line = x & (lines.shape[0] - 1)
    est = _least(lines, line, x)
    if est < MAX_COUNT:
        for r in range(4):
            p = (x >> (40 + 6 * r)) & 63
            if lines[line, p] == est:
                lines[line, p] = est + 1
        est += 1
    return est


@numba.njit(cache=True, nogil=True, inline="always")
def _estimate(lines, h):  # pragma: no cover - compiled
    """The sketch's count of key hash `h`, at least 1 (a cached row was accessed), no update."""
    x = _mix(h)
    return max(_least(lines, x & (lines.shape[0] - 1), x), 1)


@numba.njit(cache=True, nogil=True)
def _access(S, cap, lines, slots, keys, count):  # pragma: no cover - compiled
    """Count each access (or, with `count` False, only read the sketch) and move its slot to
    the end of its count's queue; with `keys` (inserts) the slots are new and take those key
    hashes. Returns the accesses counted."""
    log = np.empty((0, 3), dtype=np.int64)
    nlog = np.zeros(1, dtype=np.int64)
    g = S.shape[0] - 1
    n = slots.shape[0]
    done = 0
    for i in range(n):
        q.ahead(S, slots, i, n)
        if i + q.AHEAD < n:  # the sketch line of a later access (its slot's row is loaded by now)
            h = keys[i + q.AHEAD] if keys.shape[0] else S[slots[i + q.AHEAD], _KEY]
            prefetch(lines, _mix(h) & (lines.shape[0] - 1), 0)
        s = slots[i]
        if keys.shape[0]:
            S[s, _KEY] = keys[i]
        elif S[s, q.LIST] < 0:  # not cached (a hit told after the slot left): ignore
            continue
        c = _count(lines, S[s, _KEY]) if count else _estimate(lines, S[s, _KEY])
        if S[s, q.LIST] >= 0:
            q.unlink(S, s, log, nlog)
        q.push(S, cap, c - 1, s, log, nlog)
        S[g, _CLOCK] += 1
        S[s, _STAMP] = S[g, _CLOCK]
        done += 1
    return done


@numba.njit(cache=True, nogil=True)
def _requeue(S, cap, slots, lists):  # pragma: no cover - compiled
    """Empty every queue, then append `slots[i]` to queue `lists[i]`, in order."""
    log = np.empty((0, 3), dtype=np.int64)
    nlog = np.zeros(1, dtype=np.int64)
    g = S.shape[0] - 1
    for lst in range(MAX_COUNT):
        t = cap + lst
        S[t, q.PREV] = S[t, q.NEXT] = t
        S[g, lst] = 0
    for i in range(slots.shape[0]):
        S[slots[i], q.LIST] = -1
    for i in range(slots.shape[0]):
        q.push(S, cap, lists[i], slots[i], log, nlog)


@numba.njit(cache=True, nogil=True)
def _admit(S, lines, keys, out):  # pragma: no cover - compiled
    """TinyLFU's test: admit a key whose count after this access exceeds the lowest cached
    count; a rejected key's access is counted here (an admitted one's by its insert)."""
    g = S.shape[0] - 1
    floor = MAX_COUNT
    for lst in range(MAX_COUNT):
        if S[g, lst] > 0:
            floor = lst + 1
            break
    n = keys.shape[0]
    for i in range(n):
        if i + q.AHEAD < n:
            prefetch(lines, _mix(keys[i + q.AHEAD]) & (lines.shape[0] - 1), 0)
        x = _mix(keys[i])
        after = min(_least(lines, x & (lines.shape[0] - 1), x) + 1, MAX_COUNT)
        out[i] = after > floor
        if not out[i]:
            _count(lines, keys[i])


@numba.njit(cache=True, nogil=True)
def _count_all(lines, keys):  # pragma: no cover - compiled
    """Count one access of each key hash."""
    n = keys.shape[0]
    for i in range(n):
        if i + q.AHEAD < n:
            prefetch(lines, _mix(keys[i + q.AHEAD]) & (lines.shape[0] - 1), 0)
        _count(lines, keys[i])


class HistoryLFU(QueuePolicy):
    """LFU over a slowly aged frequency sketch that remembers rows after they leave the tier."""

    name = "hlfu"
    lists = MAX_COUNT
    columns = 2
    extra_globals = 1  # the clock; accesses since the last aging are `since`, off the array
    victim_lists = tuple(range(MAX_COUNT))
    wants_keys = True
    aging_period = 32  # halve every 32 x capacity accesses (docs/policies.md: "History LFU")
    sketch_bytes_per_slot = 16

    def __init__(self, capacity: int, device: torch.device | str = "cpu") -> None:
        super().__init__(capacity, device)
        self.sketch = self.new_sketch(self.capacity)
        self.period = max(1, self.aging_period * self.capacity)
        self.since = 0  # accesses counted since the last aging
        self.agings = 0
        self.upper: HistoryLFU | None = None  # the tier above, whose sketch this one reads

    @classmethod
    def new_sketch(cls, capacity: int) -> np.ndarray:
        """A zeroed count sketch for a tier of `capacity` slots: a power of two of 64-byte lines."""
        nbytes = max(4096, capacity * cls.sketch_bytes_per_slot)
        return np.zeros((1 << (nbytes // 64 - 1).bit_length(), 64), dtype=np.uint8)

    def follow(self, upper: Policy) -> None:
        """Below another History LFU tier, rank by its sketch: the rows arriving here are that
        tier's victims, and a move down is not an access, so this tier counts nothing itself."""
        if isinstance(upper, HistoryLFU) and upper is not self and upper.capacity > 0:
            self.upper = upper
            self.sketch = upper.sketch  # the same array: the upper tier's updates and agings
            self.agings = upper.agings

    def on_hit(self, slots: torch.Tensor) -> None:
        """Count the accesses; each slot moves to the newest end of its new count's queue."""
        self.since += _access(self.state, self.capacity, self.sketch, as_numpy(slots), _NO_KEYS,
                              self.upper is None)
        self._maybe_age()

    def on_insert(self, slots: torch.Tensor, keys: torch.Tensor | None = None) -> None:
        """New slots take their key's remembered count (plus this access, unless the row
        arrives from the tier above, whose sketch counted its accesses)."""
        s = as_numpy(slots)
        k = as_numpy(keys) if keys is not None else s + 1  # no keys: each slot is its own key
        self.since += _access(self.state, self.capacity, self.sketch, s, k, self.upper is None)
        self._maybe_age()

    def admit(self, keys: torch.Tensor) -> torch.Tensor | None:
        """Rows whose count, with this access, beats the lowest cached count (TinyLFU); a
        rejected row's access is counted all the same. Below another tier: every row."""
        if self.upper is not None:
            return None
        k = as_numpy(keys)
        out = np.empty(k.shape[0], dtype=np.bool_)
        _admit(self.state, self.sketch, k, out)
        self.since += int(np.count_nonzero(~out))
        self._maybe_age()
        return torch.from_numpy(out)

    def on_pass(self, keys: torch.Tensor) -> None:
        """Count accesses of rows held outside the queues (the tier's scratch pad)."""
        if self.upper is not None:
            return
        k = as_numpy(keys)
        _count_all(self.sketch, k)
        self.since += k.shape[0]
        self._maybe_age()

    def _maybe_age(self) -> None:
        """Halve the sketch and the cached counts once `period` accesses were counted (below
        another tier: the cached counts, once that tier has halved the shared sketch)."""
        if self.upper is not None:
            if self.upper.agings == self.agings:
                return
            self.agings = self.upper.agings
        else:
            if self.since < self.period:
                return
            self.since = 0
            self.sketch >>= 1
            self.agings += 1
        slots = np.concatenate([q.queue_order(self.state, self.capacity, lst)
                                for lst in range(MAX_COUNT)])
        if slots.size == 0:
            return
        lists = np.maximum((self.state[slots, q.LIST] + 1) >> 1, 1) - 1  # count c -> max(c // 2, 1)
        order = np.argsort(self.state[slots, _STAMP], kind="stable")
        order = order[np.argsort(lists[order], kind="stable")]
        _requeue(self.state, self.capacity, slots[order], lists[order])

    def counts(self, slots: torch.Tensor) -> torch.Tensor:
        """The count each slot is ranked by (0 if not cached), for tests and diagnostics."""
        return torch.from_numpy(self.state[as_numpy(slots), q.LIST] + 1)

    def check(self) -> None:
        """Queues are consistent and in access order."""
        super().check()
        for lst in range(MAX_COUNT):
            stamps = self.state[q.queue_order(self.state, self.capacity, lst), _STAMP]
            assert bool((np.diff(stamps) > 0).all())
