"""The staged misses of a CPU cache tier placed in one compiled pass (`SlabTier.place_misses`).

What `SlabTier.insert_scratch`, `insert` and `insert_scratch` again do for a batch of staged
misses, in the same order and with the same outcome (slots, victims, queue and index state),
without a torch or numpy op a phase: refused rows to free scratch-pad slots, then the rest into
the cache (free slots after the victims of the policy's plain eviction walk: the oldest
unpinned slots of its victim queues), then what the cache could not take to the pad again.
The dirty victims' keys and payloads are copied out for the write-behind ring. The policy's
`on_insert` runs after it (its own kernel): the new slots are not in its queues meanwhile.
"""

from __future__ import annotations

import numba
import numpy as np

import tierstore.policies.queues as q

from .._kernels import PREFETCH_AHEAD, SLOT_BITS, delete_at, home, prefetch, prefetch_row


@numba.njit(cache=True, nogil=True, inline="always")
def _add(table, pos_of, mask, t, r, s):  # pragma: no cover - compiled
    """Index the absent key (t, r) at slot s; returns (tombstone reused, probe distance)."""
    h = home(t, r, mask)
    p = h
    while table[p, 0] >= 0:
        p = (p + 1) & mask
    reused = 1 if table[p, 0] == -2 else 0
    table[p, 0] = (t << SLOT_BITS) | s
    table[p, 1] = r
    pos_of[s] = p
    return reused, (p - h) & mask


@numba.njit(cache=True, nogil=True, inline="always")
def _fill(slab, dirty, pins, payload, i, s):  # pragma: no cover - compiled
    """Row i of the misses into slot s: payload, clean, one pin (its batch's)."""
    for c in range(slab.shape[1]):
        slab[s, c] = payload[i, c]
    dirty[s] = False
    pins[s] = 1


@numba.njit(cache=True, nogil=True, inline="always")
def _to_pad(table, pos_of, mask, slab, dirty, occupied, pins, transient, tabs, rows, payload,
            i, s, staged):  # pragma: no cover - compiled
    """Row i of the misses into pad slot s (indexed, filled, marked transient); returns `_add`'s
    (tombstone reused, probe distance)."""
    reused, d = _add(table, pos_of, mask, tabs[i], rows[i], s)
    _fill(slab, dirty, pins, payload, i, s)
    occupied[s] = True
    transient[s] = True
    staged[i] = s
    return reused, d


@numba.njit(cache=True, nogil=True)
def place_misses(table, pos_of, mask, slab, dirty, occupied, pins, transient,
                 free, nfree, pad, npad, S, cap, vlists,
                 tabs, rows, payload, refused,
                 staged, ev_tabs, ev_rows, ev_payload, ins_slots, ins_pos):  # pragma: no cover
    """Place m staged misses (rows `tabs`/`rows`/`payload`, `refused[i]`: the policy declined
    row i, or an empty mask: none) in the tier; `staged[i]` gets row i's slot or -1.

    `free[:nfree]` and `pad[:npad]` are stacks (top at the end). Returns (nfree, npad, dirty
    victims copied out, victims, cache inserts (their slots and miss positions in
    `ins_slots`/`ins_pos`), pad inserts, tombstones left minus reused, largest probe distance).
    """
    m = rows.shape[0]
    log = np.empty((0, 3), dtype=np.int64)
    nlog = np.zeros(1, dtype=np.int64)
    tombs = 0
    maxd = 0
    npadded = 0
    rest = np.empty(m, dtype=np.int64)  # the rows for the cache, in order
    nrest = 0
    A = PREFETCH_AHEAD
    pos2 = pos_of.reshape(-1, 1)  # 2-D views for the prefetch hints
    for i in range(m):  # refused rows to the pad while it has room
        staged[i] = -1
        if i + A < m and refused.shape[0] and refused[i + A]:
            prefetch(table, home(tabs[i + A], rows[i + A], mask), 0)
        if refused.shape[0] and refused[i] and npad > 0:
            npad -= 1
            reused, d = _to_pad(table, pos_of, mask, slab, dirty, occupied, pins, transient,
                                tabs, rows, payload, i, pad[npad], staged)
            tombs -= reused
            maxd = max(maxd, d)
            npadded += 1
        else:
            rest[nrest] = i
            nrest += 1
    # victims: the oldest unpinned slots of the victim queues, in order (a plain walk)
    need = nrest - nfree
    victims = np.empty(max(need, 0), dtype=np.int64)
    nv = 0
    for j in range(vlists.shape[0]):
        t = cap + vlists[j]
        s = S[t, q.NEXT]
        while s != t and nv < need:
            if pins[s] == 0:
                victims[nv] = s
                nv += 1
            s = S[s, q.NEXT]
    nev = 0
    for k in range(nv):  # out of the index and the queues; dirty ones copied out first
        if k + 2 * A < nv:  # two stages: the victim's position and row, then its entry
            prefetch(pos2, victims[k + 2 * A], 0)
            prefetch_row(slab, victims[k + 2 * A])
        if k + A < nv:
            prefetch(table, pos_of[victims[k + A]], 0)
        s = victims[k]
        p = pos_of[s]
        if dirty[s]:
            ev_tabs[nev] = table[p, 0] >> SLOT_BITS
            ev_rows[nev] = table[p, 1]
            for c in range(ev_payload.shape[1]):
                ev_payload[nev, c] = slab[s, c]
            nev += 1
        pos_of[s] = -1
        tombs += delete_at(table, pos_of, p, mask)
        if S[s, q.LIST] >= 0:
            q.unlink(S, s, log, nlog)
        for c in range(q.FIRST_FREE, S.shape[1]):
            S[s, c] = 0
    fit = min(nrest, nfree + nv)
    top = nfree  # the free stack's top before this loop takes from it
    for k in range(fit):  # the victims' slots first, then free ones
        if k + A < fit:  # the next rows' hash lines and target rows
            prefetch(table, home(tabs[rest[k + A]], rows[rest[k + A]], mask), 0)
            prefetch_row(slab, victims[k + A] if k + A < nv else free[top - 1 - (k + A - nv)])
        i = rest[k]
        if k < nv:
            s = victims[k]
        else:
            nfree -= 1
            s = free[nfree]
            occupied[s] = True
        reused, d = _add(table, pos_of, mask, tabs[i], rows[i], s)
        tombs -= reused
        maxd = max(maxd, d)
        _fill(slab, dirty, pins, payload, i, s)
        staged[i] = s
        ins_slots[k] = s
        ins_pos[k] = i
    for k in range(fit, nrest):  # what the cache could not take: to the pad while it has room
        if npad == 0:
            break
        if k + A < nrest:
            prefetch(table, home(tabs[rest[k + A]], rows[rest[k + A]], mask), 0)
        npad -= 1
        reused, d = _to_pad(table, pos_of, mask, slab, dirty, occupied, pins, transient,
                            tabs, rows, payload, rest[k], pad[npad], staged)
        tombs -= reused
        maxd = max(maxd, d)
        npadded += 1
    return nfree, npad, nev, nv, fit, npadded, tombs, maxd


@numba.njit(cache=True, nogil=True)
def take_pad(expired, pins, transient, marks, cap, table, pos_of, mask, slab, dirty, occupied,
             out_tabs, out_rows, out_payload, out_dirty, out_slots):  # pragma: no cover
    """`SlabTier.take_expired` in one pass: of the pad slots in `expired` still transient and
    unpinned, each once (at its last occurrence, in that order), copy its key, row and dirty
    bit out, drop it from the index and empty it. `marks` is scratch over the staging slots
    (slot - cap). Returns (rows taken, tombstones left)."""
    n = expired.shape[0]
    for i in range(n):
        marks[expired[i] - cap] = i
    k = 0
    tombs = 0
    A = PREFETCH_AHEAD
    pos2 = pos_of.reshape(-1, 1)  # a 2-D view for the prefetch hint
    for i in range(n):
        if i + 2 * A < n:  # two stages: the slot's position and row, then its entry
            prefetch(pos2, expired[i + 2 * A], 0)
            prefetch_row(slab, expired[i + 2 * A])
        if i + A < n and pos_of[expired[i + A]] >= 0:
            prefetch(table, pos_of[expired[i + A]], 0)
        s = expired[i]
        if marks[s - cap] != i or not transient[s] or pins[s] != 0:
            continue
        p = pos_of[s]
        out_tabs[k] = table[p, 0] >> SLOT_BITS
        out_rows[k] = table[p, 1]
        for c in range(slab.shape[1]):
            out_payload[k, c] = slab[s, c]
        out_dirty[k] = dirty[s]
        out_slots[k] = s
        k += 1
        pos_of[s] = -1
        tombs += delete_at(table, pos_of, p, mask)
        dirty[s] = False
        occupied[s] = False
        transient[s] = False
    return k, tombs


@numba.njit(cache=True, nogil=True)
def split_touched(slots, staging, cap, transient, ranked, pad):  # pragma: no cover - compiled
    """`SlabTier.touch`'s split of used slots, in order: those the policy ranks (all, or below
    `cap` when the tier has staging slots) into `ranked`, the scratch pad's into `pad`.
    Returns (ranked count, pad count)."""
    nr = npad = 0
    for i in range(slots.shape[0]):
        s = slots[i]
        if not staging or s < cap:
            ranked[nr] = s
            nr += 1
        if transient[s]:
            pad[npad] = s
            npad += 1
    return nr, npad
