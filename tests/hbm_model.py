"""A dict model of the set-associative cache and random operation sequences for its tests."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from hypothesis import strategies as st

from tierstore.backends.hbm_cache import HbmCache

OPS = ("access", "unpin", "dirty", "remove", "tick")


@dataclass
class Model:
    """What the cache must hold: key -> (payload value, dirty, lock, stamp)."""

    rows: dict[int, list] = field(default_factory=dict)


def ops(max_key: int = 40) -> st.SearchStrategy:
    """Sequences of (op, keys): an access looks keys up, touches and pins the hits, inserts
    the misses pinned; an unpin drops one pin of keys; dirty marks keys; remove empties them."""
    keys = st.lists(st.integers(0, max_key), min_size=0, max_size=12)
    return st.lists(st.tuples(st.sampled_from(OPS), keys), min_size=1, max_size=14)


def expected_choice(cache: HbmCache, model: Model, keys: list[int]) -> list[int]:
    """The slot each absent key takes by the documented rule, computed line by line (a direct
    cache: the key's own line, slot k)."""
    if cache.direct:
        return [k if 0 <= k < cache.capacity else -1 for k in keys]
    taken: dict[int, int] = {}
    out = []
    for k in keys:
        s = int(cache.set_of(torch.tensor([k])))
        lines = []
        for w in range(cache.ways):
            key = int(cache.keys[s, w])
            if key >= 0 and model.rows[key][2] > 0:
                continue  # locked
            order = 0 if key < 0 else max(int(cache.stamp[s, w]), 0) + 1
            lines.append((order, w))
        lines.sort()
        r = taken.get(s, 0)
        taken[s] = r + 1
        out.append(s * cache.ways + lines[r][1] if r < len(lines) else -1)
    return out


def run(cache: HbmCache, sequence: list, check_rule: bool = True) -> Model:
    """Apply `sequence` to `cache` and its dict model, checking them against each other."""
    model = Model()
    for op, ks in sequence:
        uniq = list(dict.fromkeys(ks))
        keys = torch.tensor(uniq, dtype=torch.int64)
        if op == "tick":
            cache.tick()
        elif op == "access":
            slots = cache.lookup(keys)
            for k, s in zip(uniq, slots.tolist()):
                assert (s >= 0) == (k in model.rows), (k, s)
                if s >= 0:
                    assert int(cache.keys.flatten()[s]) == k
            cache.touch(slots)
            cache.pin(slots, 1)
            for k, s in zip(uniq, slots.tolist()):
                if s >= 0:
                    model.rows[k][2] += 1
            miss = [k for k, s in zip(uniq, slots.tolist()) if s < 0]
            want = expected_choice(cache, model, miss) if check_rule else None
            payload = torch.tensor(miss, dtype=torch.float32).unsqueeze(1).repeat(1, cache.width)
            v = cache.insert(torch.tensor(miss, dtype=torch.int64), payload, lock=1)
            if want is not None:
                assert v.slots.tolist() == want
            for i, (k, s, old) in enumerate(zip(miss, v.slots.tolist(), v.keys.tolist())):
                if s < 0:
                    assert old == -1
                    continue
                if old >= 0:  # an unlocked victim leaves with its payload and dirty bit
                    gone = model.rows.pop(old)
                    assert gone[2] == 0, "a locked line was evicted"
                    assert float(v.payload[i, 0]) == gone[0]
                    assert bool(v.dirty[i]) == gone[1]
                model.rows[k] = [float(k), False, 1]
        elif op == "unpin":
            slots = cache.lookup(keys)
            cache.pin(slots, -1)
            for k in uniq:
                if k in model.rows:
                    model.rows[k][2] = max(0, model.rows[k][2] - 1)
        elif op == "dirty":
            cache.mark_dirty(cache.lookup(keys))
            for k in uniq:
                if k in model.rows:
                    model.rows[k][1] = True
        elif op == "remove":
            slots = cache.lookup(keys)
            out = cache.remove(slots)
            for i, k in enumerate(uniq):
                if k in model.rows:
                    gone = model.rows.pop(k)
                    assert int(out.keys[i]) == k and bool(out.dirty[i]) == gone[1]
                else:
                    assert int(out.keys[i]) == -1
        cache.check()
        assert_matches(cache, model)
    return model


def assert_matches(cache: HbmCache, model: Model) -> None:
    """The cache holds exactly the model's keys, with its payloads, dirty bits and locks."""
    keys, slots = cache.resident()
    assert sorted(keys.tolist()) == sorted(model.rows)
    for k, s in zip(keys.tolist(), slots.tolist()):
        value, dirty, lock, *_ = model.rows[k]
        assert float(cache.slab[s, 0]) == value
        assert bool(cache.dirty.flatten()[s]) == dirty
        assert int(cache.lock.flatten()[s]) == lock
