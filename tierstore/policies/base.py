"""The policy protocol: a policy ranks eviction victims among a tier's slots; the tier evicts."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import ClassVar

import numpy as np
import torch

import tierstore.policies.queues as q

INT64_MAX = torch.iinfo(torch.int64).max


def as_numpy(slots: torch.Tensor | np.ndarray) -> np.ndarray:
    """Slot indices as a contiguous int64 numpy array on the CPU."""
    if isinstance(slots, torch.Tensor):
        slots = slots.detach().to("cpu", torch.int64).numpy()
    return np.ascontiguousarray(slots, dtype=np.int64)


_H1 = np.int64(-7046029254386353131)
_H2 = np.int64(-4658895280553007687)


def key_hash_np(tabs: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """A non-zero 64-bit hash of each (table, row) key, for policies that remember keys."""
    t = np.broadcast_to(np.asarray(tabs, dtype=np.int64), np.shape(rows))
    h = np.asarray(rows, dtype=np.int64) * _H1 + t * _H2
    h ^= h >> 31
    return h | 1


def key_hash(tabs: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """`key_hash_np` of key tensors (any device), as a CPU int64 tensor."""
    return torch.from_numpy(key_hash_np(tabs.detach().cpu().numpy(), rows.detach().cpu().numpy()))


@dataclass(frozen=True)
class Evictable:
    """Which slots a policy may pick, as cheap per-slot checks instead of a full mask.

    A slot may be evicted when `pins[s] == 0`, `not protected[s]` and `not skip[s]`; an empty
    array means "no such check". The arrays are CPU numpy views owned by the caller and are
    valid only during the `victims` call.
    """

    pins: np.ndarray = field(default_factory=lambda: q.NO_I32)
    protected: np.ndarray = field(default_factory=lambda: q.NO_BOOL)
    skip: np.ndarray = field(default_factory=lambda: q.NO_BOOL)

    @staticmethod
    def from_mask(mask: torch.Tensor) -> Evictable:
        """Checks equivalent to a bool mask of evictable slots (O(capacity): for tests)."""
        return Evictable(protected=np.ascontiguousarray(~mask.detach().cpu().numpy()))

    def with_skip(self, skip: np.ndarray) -> Evictable:
        """The same checks, also refusing slots where `skip` is True."""
        return replace(self, skip=skip)

    def allows(self, slots: np.ndarray) -> np.ndarray:
        """Vectorized check of a batch of slots."""
        ok = np.ones(slots.size, dtype=np.bool_)
        if self.pins.size:
            ok &= self.pins[slots] == 0
        if self.protected.size:
            ok &= ~self.protected[slots]
        if self.skip.size:
            ok &= ~self.skip[slots]
        return ok


def as_evictable(evictable: Evictable | torch.Tensor) -> Evictable:
    """Accept the tier's `Evictable` or a bool mask of evictable slots."""
    return evictable if isinstance(evictable, Evictable) else Evictable.from_mask(evictable)


class Policy:
    """Base class of the tier eviction policies; state is per slot and owned by the policy.

    The tier calls `on_hit` / `on_insert` with batches of slot indices (int64, in access
    order; policies with `wants_keys` also get each inserted row's 64-bit key hash),
    `victims(n, evictable)` to peek at up to `n` slots it should evict next (a pure query:
    state does not change; fewer than `n` only when fewer are evictable), then `on_evict`
    for the slots it really evicted (the peek's victims, or a prefix of them), or
    `on_remove` for slots it emptied for another reason (a row moving to another tier).
    `on_future` hands look-ahead hints (the step of each slot's next known use) to policies
    that want them; others ignore it. Victim selection costs O(n + slots skipped), never
    O(capacity) (except Belady/Lookahead's farthest-use stage, see docs/policies.md).
    """

    name: ClassVar[str] = ""
    wants_future: ClassVar[bool] = False  # True for policies that use `on_future` hints
    wants_keys: ClassVar[bool] = False  # True for policies that use key hashes (ghosts, sketch)

    def __init__(self, capacity: int, device: torch.device | str = "cpu") -> None:
        self.capacity = int(capacity)
        self.device = torch.device(device)

    def on_hit(self, slots: torch.Tensor) -> None:
        """Record accesses to resident slots, in order."""

    def on_insert(self, slots: torch.Tensor, keys: torch.Tensor | None = None) -> None:
        """Record newly filled slots, in order (with their rows' key hashes if wanted)."""

    def on_evict(self, slots: torch.Tensor) -> None:
        """Apply the eviction of slots a `victims` peek returned (in order, or a prefix)."""

    def on_remove(self, slots: torch.Tensor) -> None:
        """Forget slots emptied for another reason than eviction; default: as evicted."""
        self.on_evict(slots)

    def on_future(self, slots: torch.Tensor, next_use: torch.Tensor) -> None:
        """Receive the next known use (a step number) of slots; default: ignore."""

    def follow(self, upper: Policy) -> None:
        """Called on the lower tier's policy with the upper tier's (rows move down between
        them); default: nothing. A policy that ranks rows by their accesses can read the upper
        tier's record of them, since a row arriving from above is not an access."""

    def on_use(self, slots: torch.Tensor) -> None:
        """Staged slots were used by the step they were staged for; default: ignore.

        Staging already reported this access (`on_hit` or `on_insert`) when it pinned the rows,
        so the access is not counted again; a policy holding hints of that use drops them here.
        The store calls it only on a policy that `wants_future` (hints).
        """

    @property
    def selective(self) -> bool:
        """Whether this policy may refuse rows arriving by a miss (it overrides `admit`)."""
        return type(self).admit is not Policy.admit

    def admit(self, keys: torch.Tensor) -> torch.Tensor | None:
        """Which rows arriving by a miss (their key hashes) may displace a cached row; None: all.

        Asked by a warm-only step's backward (`TierCascade._access`: a rejected row goes on to
        the write-behind ring) and by staging with one cache tier (`StagingArea._refused`: a
        rejected row waits in the scratch pad); either way the policy records a rejected row's
        access itself. Default: every row is admitted.
        """
        return None

    def on_pass(self, keys: torch.Tensor) -> None:
        """Accesses of rows the tier holds outside the policy (its scratch pad, see
        `SlabTier.insert_scratch`), by key hash; default: ignore."""

    def victims(self, n: int, evictable: Evictable | torch.Tensor) -> torch.Tensor:
        """Return up to `n` distinct slots to evict among the evictable resident ones."""
        raise NotImplementedError

    def check(self) -> None:
        """Raise AssertionError if the policy's internal invariants do not hold."""

    def _empty(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.int64, device=self.device)

    def _out(self, arr: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(arr, dtype=np.int64)).to(self.device)


class QueuePolicy(Policy):
    """A policy kept as linked slot queues (see `queues`) and driven by numba kernels.

    Subclasses set `lists` and `columns`, update the queues in `on_hit` / `on_insert`, and
    either list `victim_lists` (victims are the oldest allowed slots of those queues, in
    order, and evicting changes nothing else) or implement `_walk`, the eviction walk that
    may move slots between queues (CLOCK's second chance, S3-FIFO's promotion, ...). A peek
    runs `_walk` under the undo log and rolls it back; `on_evict` replays it for real with
    "allowed" meaning "one of the evicted slots", so both see the same decisions.
    """

    lists: ClassVar[int] = 1
    columns: ClassVar[int] = 0
    extra_globals: ClassVar[int] = 2  # the policy's own globals after the queue lengths
    victim_lists: ClassVar[tuple[int, ...]] = (0,)

    def __init__(self, capacity: int, device: torch.device | str = "cpu") -> None:
        super().__init__(capacity, device)
        self.state = q.new_state(self.capacity, self.lists, self.columns, self.extra_globals)
        self._scratch_mark = np.zeros(self.capacity, dtype=np.bool_)
        self._scratch_log = np.empty((4096, 3), dtype=np.int64)
        self._victim_lists = np.array(self.victim_lists, dtype=np.int64)

    @property
    def plain_victims(self) -> bool:
        """Whether victims are the oldest allowed slots of `victim_lists`, in order, and an
        eviction only unlinks them (no walk of its own, so no eviction hook runs): a caller may
        then run that walk inside its own kernel (`SlabTier.place_misses`)."""
        t = type(self)
        return (t.walk is QueuePolicy.walk and t.on_evict is QueuePolicy.on_evict
                and t.on_remove is QueuePolicy.on_remove)

    @property
    def victim_order(self) -> np.ndarray:
        """`victim_lists` as an int64 array, in walk order."""
        return self._victim_lists

    @property
    def g(self) -> np.ndarray:
        """The globals row: queue lengths, then the policy's own globals."""
        return self.state[-1]

    def walk(self, n: int, mode: int, ev: Evictable, mark: np.ndarray, out: np.ndarray,
              origin: np.ndarray, log: np.ndarray, nlog: np.ndarray) -> tuple[int, bool]:
        """Run the eviction walk for up to `n` victims; return (found, finished)."""
        raise NotImplementedError

    def _evicted(self, slots: np.ndarray, origin: np.ndarray) -> None:
        """Hook after a real eviction walk: `origin[i]` is the queue `slots[i]` left."""

    def victims(self, n: int, evictable: Evictable | torch.Tensor) -> torch.Tensor:
        """The next (up to) n victims the policy's eviction walk reaches; a pure peek."""
        if n <= 0 or self.capacity == 0:
            return self._empty()
        ev = as_evictable(evictable)
        out = np.empty(n, dtype=np.int64)
        if type(self).walk is QueuePolicy.walk:
            k = q.first_allowed(self.state, self.capacity, self._victim_lists, n,
                                ev.pins, ev.protected, ev.skip, out)
            return self._out(out[:k])
        origin = np.empty(n, dtype=np.int64)
        while True:
            nlog = np.zeros(1, dtype=np.int64)
            k, done = self.walk(n, 0, ev, self._scratch_mark, out, origin,
                                 self._scratch_log, nlog)
            q.rollback(self.state, self._scratch_log, int(nlog[0]))
            if done:
                return self._out(out[:k])
            self._scratch_log = np.empty((2 * self._scratch_log.shape[0], 3), dtype=np.int64)

    def on_evict(self, slots: torch.Tensor) -> None:
        """Replay the eviction walk that chose these slots, then forget them."""
        s = as_numpy(slots)
        if s.size == 0:
            return
        if type(self).walk is QueuePolicy.walk:
            self.on_remove(slots)
            return
        mark = self._scratch_mark
        mark[s] = True
        out = np.empty(s.size, dtype=np.int64)
        origin = np.empty(s.size, dtype=np.int64)
        try:
            k, _ = self.walk(s.size, 1, Evictable(), mark, out, origin, q.EMPTY_LOG,
                              np.zeros(1, dtype=np.int64))
        finally:
            mark[s] = False
        self._evicted(out[:k], origin[:k])
        self.state[out[:k], q.FIRST_FREE:] = 0
        if k < s.size:  # not what a peek returned: plain removals
            self.on_remove(torch.from_numpy(s[self.state[s, q.LIST] >= 0]))

    def on_remove(self, slots: torch.Tensor) -> None:
        """Take slots out of their queues without moving any other slot."""
        s = as_numpy(slots)
        if s.size:
            q.unlink_many(self.state, s)
            self.state[s, q.FIRST_FREE:] = 0

    def queue_of(self, slots: torch.Tensor) -> torch.Tensor:
        """The queue each slot is in (-1: none), for tests and diagnostics."""
        return torch.from_numpy(self.state[as_numpy(slots), q.LIST].copy())

    def resident(self) -> int:
        """Number of slots in the policy's queues."""
        return int(self.g[: self.lists].sum())

    def check(self) -> None:
        """Queue lengths match the queues; every queued slot is listed once."""
        seen = np.zeros(self.capacity, dtype=np.int64)
        for lst in range(self.lists):
            order = q.queue_order(self.state, self.capacity, lst)
            assert order.size == self.g[lst]
            assert bool((self.state[order, q.LIST] == lst).all())
            seen[order] += 1
        assert int(seen.max(initial=0)) <= 1
        assert int((self.state[: self.capacity, q.LIST] >= 0).sum()) == int(seen.sum())
