"""Independent references, written from published definitions rather than from the library.

- `reference_step`: the fused optimizers' math in float64 numpy, from the definitions of
  torch.optim.SGD / torch.optim.Adagrad (Duchi et al. 2011) with `weight_decay` as an L2 term
  added to the gradient, FBGEMM's row-wise Adagrad (one accumulator per row: the mean of the
  squared gradient), and torch.optim.SparseAdam's lazy Adam (Kingma & Ba 2015, Algorithm 1 with
  the bias corrections folded into the step size) plus the same L2 term.
- `splitmix64` / `lazy_init`: the lazy initializer in plain Python integers, from the splitmix64
  finalizer (Steele, Lea & Flood 2014; constants from Vigna's reference code) and the scheme the
  initializer module documents (blake2b table key, golden-ratio row and column mixing).
- `sr_bfloat16`: stochastic rounding of a float32 to bfloat16 with the documented bits (a
  Weyl sequence in the table's update count from a hash of row id and column), in Python ints.
- `py_lru` / `py_lfu` / `py_fifo` / `py_belady`: the textbook cache policies over a list.
- `DictStore`: what the store must behave like - a dict of rows - whose updates are the library's
  (so placement is checked bit for bit) and are cross-checked at every step against
  `reference_step` (so a wrong formula applied everywhere still fails).
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict

import numpy as np
import torch

from tierstore import TableSpec
from tierstore.fused import BatchUpdate

MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15  # 2**64 / phi, the splitmix64 increment
SPLITMIX_M1 = 0xBF58476D1CE4E5B9
SPLITMIX_M2 = 0x94D049BB133111EB

# Tolerance of one float32 step against the float64 reference: a few float32 ulps of the values.
STEP_RTOL, STEP_ATOL = 1e-5, 1e-6


# optimizers ------------------------------------------------------------------------------------
def state_dim(kind: str, dim: int) -> int:
    """Optimizer state floats stored after the embedding, per the optimizers' documentation."""
    return {"sgd": 0, "adagrad": dim, "rowwise_adagrad": 1, "adam": 2 * dim + 1}[kind]


def reference_step(cfg: dict, payload: np.ndarray, grad: np.ndarray, dim: int) -> np.ndarray:
    """One optimizer step on payload rows `[w | state]` (float64), for summed gradients `grad`."""
    p = np.array(payload, dtype=np.float64, copy=True)
    g = np.asarray(grad, dtype=np.float64)
    kind, lr, wd = cfg["kind"], cfg["lr"], cfg.get("weight_decay", 0.0)
    w = p[:, :dim]
    g = g + wd * w  # L2 weight decay, as torch.optim's `weight_decay`
    if kind == "sgd":
        p[:, :dim] = w - lr * g
    elif kind == "adagrad":
        acc = p[:, dim : 2 * dim] + g * g
        p[:, dim : 2 * dim] = acc
        p[:, :dim] = w - lr * g / (np.sqrt(acc) + cfg["eps"])
    elif kind == "rowwise_adagrad":
        acc = p[:, dim : dim + 1] + (g * g).mean(axis=1, keepdims=True)
        p[:, dim : dim + 1] = acc
        p[:, :dim] = w - lr * g / (np.sqrt(acc) + cfg["eps"])
    elif kind == "adam":
        b1, b2 = cfg["betas"]
        m = b1 * p[:, dim : 2 * dim] + (1 - b1) * g
        v = b2 * p[:, 2 * dim : 3 * dim] + (1 - b2) * g * g
        t = p[:, 3 * dim : 3 * dim + 1] + 1
        step = lr * np.sqrt(1 - b2**t) / (1 - b1**t)
        p[:, dim : 2 * dim], p[:, 2 * dim : 3 * dim], p[:, 3 * dim : 3 * dim + 1] = m, v, t
        p[:, :dim] = w - step * m / (np.sqrt(v) + cfg["eps"])
    else:
        raise KeyError(kind)
    return p


def summed_by_id(ids: torch.Tensor, grads: torch.Tensor) -> tuple[list[int], np.ndarray]:
    """Sorted unique ids and the float64 sum of each id's gradient rows."""
    acc: dict[int, np.ndarray] = {}
    for i, g in zip(ids.tolist(), grads.double().numpy()):
        acc[i] = acc[i] + g if i in acc else g.copy()
    keys = sorted(acc)
    return keys, np.stack([acc[k] for k in keys]) if keys else np.zeros((0, grads.shape[1]))


# lazy initializer --------------------------------------------------------------------------
def splitmix64(x: int) -> int:
    """The splitmix64 finalizer on a 64-bit integer."""
    x &= MASK64
    x = ((x ^ (x >> 30)) * SPLITMIX_M1) & MASK64
    x = ((x ^ (x >> 27)) * SPLITMIX_M2) & MASK64
    return x ^ (x >> 31)


def table_key(seed: int, name: str) -> int:
    """The 64-bit key of (seed, table): blake2b-64 of "seed\\0name", little-endian."""
    return int.from_bytes(hashlib.blake2b(f"{seed}\x00{name}".encode(), digest_size=8).digest(), "little")


def uniform01(key: int, row: int, col: int, stream: int = 0) -> float:
    """A uniform in [0, 1) with 53 bits: splitmix64(splitmix64(row*G + key') ^ (col+1)*G)."""
    base = key ^ ((stream * SPLITMIX_M2) & MASK64)
    r = splitmix64(row * GOLDEN + base)
    bits = splitmix64(r ^ (((col + 1) * GOLDEN) & MASK64))
    return (bits >> 11) * 2.0**-53


def lazy_uniform(seed: int, table: str, row: int, col: int, dim: int, bound: float | None = None) -> float:
    """UniformInit's value: (2u - 1) * bound, bound = 1/sqrt(dim) by default, as float32."""
    b = bound if bound is not None else 1.0 / math.sqrt(dim)
    return float(np.float32((2.0 * uniform01(table_key(seed, table), row, col) - 1.0) * b))


def lazy_normal(seed: int, table: str, row: int, col: int, std: float, mean: float = 0.0) -> float:
    """NormalInit's value: Box-Muller on uniform streams 1 and 2, as float32."""
    key = table_key(seed, table)
    u1 = 1.0 - uniform01(key, row, col, 1)
    u2 = uniform01(key, row, col, 2)
    return float(np.float32(mean + std * math.sqrt(-2.0 * math.log(u1)) * math.cos(2.0 * math.pi * u2)))


def lazy_row(spec: TableSpec, seed: int, row: int) -> np.ndarray:
    """The float32 initial embedding of one row, from the definitions above."""
    init = spec.init.to_config()
    kind = init["kind"]
    if kind == "uniform":
        vals = [lazy_uniform(seed, spec.name, row, c, spec.dim, init["bound"]) for c in range(spec.dim)]
    elif kind == "normal":
        vals = [lazy_normal(seed, spec.name, row, c, init["std"], init["mean"]) for c in range(spec.dim)]
    elif kind == "constant":
        vals = [init["value"]] * spec.dim
    else:
        raise KeyError(kind)
    return np.array(vals, dtype=np.float32)


# cache policies ----------------------------------------------------------------------------
# stochastic rounding --------------------------------------------------------------------------
SR_M1 = GOLDEN  # the mix: x * M1, x ^= x >> 31, x * M2, x ^= x >> 29 (64-bit, logical shifts)
SR_M2 = 0x94D049BB133111EB
SR_ROW = 0xBF58476D1CE4E5B9  # a row's start: mix(id * SR_ROW + SR_M2)


def sr_mix(x: int) -> int:
    """The 64-bit hash precision.py documents for rounding bits."""
    x = (x * SR_M1) & MASK64
    x ^= x >> 31
    x = (x * SR_M2) & MASK64
    return x ^ (x >> 29)


def sr_bfloat16(x: float, row: int, col: int, update: int) -> int:
    """The bfloat16 bit pattern (0..65535) that the rule rounds float32 `x` to."""
    bits = int(np.array([x], np.float32).view(np.uint32)[0])
    sign, mag = bits & 0x80000000, bits & 0x7FFFFFFF
    if mag & 0xFFFF == 0 or mag >= 0x7F800000:  # representable, or not finite: round to nearest
        return int(torch.tensor([x], dtype=torch.float32).to(torch.bfloat16).view(torch.int16)) & 0xFFFF
    lo = mag >> 16  # truncation toward zero: the neighbour below |x|
    lo_v = float(np.array([lo << 16], np.uint32).view(np.float32)[0])
    hi_v = float(np.array([(lo + 1) << 16], np.uint32).view(np.float32)[0])
    frac = (abs(x) - lo_v) / (hi_v - lo_v)  # exact in float64
    h = sr_mix((sr_mix(row * SR_ROW + SR_M2) + col) & MASK64)
    r = ((h + update * GOLDEN) & MASK64) >> 48
    return (sign >> 16) | (lo + 1 if r < frac * 65536.0 else lo)


def py_lru(keys: list, cap: int) -> int:
    """Misses of LRU: a hit moves the key to the front; a miss evicts the least recent."""
    od: OrderedDict = OrderedDict()
    misses = 0
    for k in keys:
        if k in od:
            od.move_to_end(k)
            continue
        misses += 1
        if cap == 0:
            continue
        if len(od) >= cap:
            od.popitem(last=False)
        od[k] = None
    return misses


def py_fifo(keys: list, cap: int) -> int:
    """Misses of FIFO: hits change nothing; a miss evicts the oldest insertion."""
    od: OrderedDict = OrderedDict()
    misses = 0
    for k in keys:
        if k in od:
            continue
        misses += 1
        if cap == 0:
            continue
        if len(od) >= cap:
            od.popitem(last=False)
        od[k] = None
    return misses


def py_lfu(keys: list, cap: int) -> int:
    """Misses of LFU (frequency since insertion; ties: the least recently used goes)."""
    freq: dict = {}
    last: dict = {}
    misses = 0
    for t, k in enumerate(keys):
        if k in freq:
            freq[k] += 1
            last[k] = t
            continue
        misses += 1
        if cap == 0:
            continue
        if len(freq) >= cap:
            v = min(freq, key=lambda x: (freq[x], last[x]))
            del freq[v], last[v]
        freq[k] = 1
        last[k] = t
    return misses


def py_belady(keys: list, cap: int) -> int:
    """Misses of Belady's MIN: a miss evicts the key used farthest in the future (or never)."""
    cache: set = set()
    misses = 0
    for t, k in enumerate(keys):
        if k in cache:
            continue
        misses += 1
        if cap == 0:
            continue
        if len(cache) >= cap:
            def nxt(x, t=t):
                for j in range(t + 1, len(keys)):
                    if keys[j] == x:
                        return j
                return len(keys) + 1
            cache.remove(max(cache, key=nxt))
        cache.add(k)
    return misses


# the dict model ----------------------------------------------------------------------------
class DictStore:
    """What the store must behave like: a dict (table, row) -> payload, lazily initialized."""

    def __init__(self, specs: list[TableSpec], seed: int = 0, fused: bool = True) -> None:
        self.specs = {s.name: s for s in specs}
        self.seed = seed
        self.fused = fused  # numba kernels or the torch path for the bit-exact rows
        self.rows: dict[tuple[str, int], torch.Tensor] = {}

    def _payload(self, table: str, row: int) -> torch.Tensor:
        key = (table, row)
        if key not in self.rows:
            spec = self.specs[table]
            p = torch.zeros(spec.payload_dim)
            p[: spec.dim] = torch.from_numpy(lazy_row(spec, self.seed, row))
            self.rows[key] = p
        return self.rows[key]

    def read(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        """Embedding values of ids."""
        dim = self.specs[table].dim
        if ids.numel() == 0:
            return torch.empty(0, dim)
        return torch.stack([self._payload(table, int(i))[:dim] for i in ids])

    def payloads(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        """Full payloads (embedding and optimizer state) of ids."""
        return torch.stack([self._payload(table, int(i)) for i in ids])

    def apply(self, table: str, ids: torch.Tensor, grads: torch.Tensor) -> list[int]:
        """Sum duplicate gradients, then one optimizer step on the unique rows; returns them.

        The new rows come from the library's update (bit-exact placement reference) and must
        agree with `reference_step` within float32 rounding.
        """
        spec = self.specs[table]
        if ids.numel() == 0:
            return []
        uniq, inv = torch.unique(ids, sorted=True, return_inverse=True)
        p = torch.stack([self._payload(table, int(i)) for i in uniq]).contiguous()
        keys, gsum = summed_by_id(ids, grads)
        want = reference_step(spec.optimizer.to_config(), p.double().numpy(), gsum, spec.dim)
        BatchUpdate(spec.optimizer, spec.dim, uniq.numel(), inv, grads,
                    use_kernel=self.fused).apply(p, torch.arange(uniq.numel()))
        np.testing.assert_allclose(p.double().numpy(), want, rtol=STEP_RTOL, atol=STEP_ATOL,
                                   err_msg=f"{spec.optimizer!r} step differs from its definition")
        for i, row in enumerate(keys):
            self.rows[(table, row)] = p[i].clone()
        return keys


def py_clock(keys: list, cap: int) -> int:
    """Misses of CLOCK as a FIFO with one reference bit: a hit sets the bit; to evict, the
    oldest key with its bit set has it cleared and goes to the back, the first one without goes."""
    queue: OrderedDict = OrderedDict()  # key -> reference bit, oldest first
    misses = 0
    for k in keys:
        if k in queue:
            queue[k] = True
            continue
        misses += 1
        if cap == 0:
            continue
        while len(queue) >= cap:
            old, bit = queue.popitem(last=False)
            if bit:
                queue[old] = False
        queue[k] = False
    return misses


def py_sieve(keys: list, cap: int) -> int:
    """Misses of SIEVE (Zhang et al., NSDI '24): new keys enter at the head with no visited bit;
    a hit sets the bit; the hand walks from the tail toward the head clearing set bits, evicts the
    first unvisited key and stays at its newer neighbour (wrapping to the tail past the head)."""
    order: list = []  # index 0 is the tail (oldest)
    visited: dict = {}
    hand = None  # the key the hand points at
    misses = 0
    for k in keys:
        if k in visited:
            visited[k] = True
            continue
        misses += 1
        if cap == 0:
            continue
        if len(order) >= cap:
            i = order.index(hand) if hand is not None else 0
            while visited[order[i]]:
                visited[order[i]] = False
                i = i + 1 if i + 1 < len(order) else 0
            victim = order.pop(i)
            del visited[victim]
            hand = order[i] if i < len(order) else None
        order.append(k)
        visited[k] = False
    return misses
