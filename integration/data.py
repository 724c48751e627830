"""Training data: a synthetic Criteo-like generator with a planted model, and a Criteo TSV reader."""

from __future__ import annotations

import gzip
import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from tierstore.errors import ConfigError, StoreCorruptError

NUM_DENSE = 13
NUM_SPARSE = 26
DENSE_NAMES = [f"I{i}" for i in range(1, NUM_DENSE + 1)]
SPARSE_NAMES = [f"C{i}" for i in range(1, NUM_SPARSE + 1)]

# Distinct values per categorical feature in Criteo's Kaggle set (the shape of a real profile).
KAGGLE_CARDINALITIES = (1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593,
                        3194, 27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105,
                        142572)
# The Kaggle profile with its five largest features blown up so the 26 tables hold 1.1 * 10**11 rows.
_HUGE = {2: 5 * 10**10, 3: 2 * 10**10, 11: 2 * 10**10, 15: 10**10, 20: 10**10}
CRITEO_1E11 = tuple(_HUGE.get(i, c) for i, c in enumerate(KAGGLE_CARDINALITIES))

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def mix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finalizer, elementwise on uint64 (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * _M1
        x = (x ^ (x >> np.uint64(27))) * _M2
        return x ^ (x >> np.uint64(31))


def _signed_unit(bits: np.ndarray) -> np.ndarray:
    """uint64 bits -> float64 uniform in [-1, 1)."""
    return (bits >> np.uint64(11)).astype(np.float64) * (2.0 / (1 << 53)) - 1.0


@dataclass(frozen=True)
class Batch:
    """One batch: dense features [B, 13], categorical ids [26, B] (feature-major), labels [B]."""

    dense: torch.Tensor
    ids: torch.Tensor
    labels: torch.Tensor

    @property
    def size(self) -> int:
        """Number of samples."""
        return int(self.labels.numel())

    def jagged(self) -> tuple[list[str], torch.Tensor, torch.Tensor]:
        """TorchRec's jagged layout (keys, values, lengths): one id per feature and sample."""
        values = self.ids.reshape(-1)
        return list(SPARSE_NAMES), values, torch.ones(values.numel(), dtype=torch.int64)


def parse_tables(text: str) -> tuple[int, ...]:
    """Table profile -> 26 row counts: 'criteo' (1.1e11 rows), 'kaggle', 'uniform:N', or 26 ints."""
    t = text.strip().lower()
    if t == "criteo":
        return CRITEO_1E11
    if t == "kaggle":
        return KAGGLE_CARDINALITIES
    try:
        if t.startswith("uniform:"):
            return (int(float(t.split(":", 1)[1])),) * NUM_SPARSE
        rows = tuple(int(float(x)) for x in t.split(","))
    except ValueError:
        rows = ()
    if len(rows) != NUM_SPARSE:
        raise ConfigError(f"tables must be 'criteo', 'kaggle', 'uniform:N' or 26 comma-separated "
                          f"row counts, got {text!r}")
    return rows


def _check_cards(cards: Sequence[int]) -> tuple[int, ...]:
    cards = tuple(cards)
    if len(cards) != NUM_SPARSE or any(isinstance(c, bool) or not isinstance(c, int) or c < 1
                                       for c in cards):
        raise ConfigError(f"need {NUM_SPARSE} positive int cardinalities, got {cards!r}")
    return cards


class SyntheticCriteo:
    """Criteo-like batches, a pure function of (seed, stream, step); labels from a planted model.

    Each categorical feature draws a Zipf(alpha) rank (ranks past `hot` wrap into it), maps it
    one-to-one onto a spread-out row id of its table, and contributes a hidden per-rank effect
    to the label's logit, as do a linear term over the dense features and one pairwise term.
    """

    def __init__(self, cardinalities: Sequence[int], *, seed: int = 0, alpha: float = 1.1,
                 hot: int = 2_000_000, signal: float = 1.0) -> None:
        self.cards = _check_cards(cardinalities)
        if not (isinstance(alpha, (int, float)) and alpha > 1.0):
            raise ConfigError(f"alpha must be > 1, got {alpha!r}")
        if isinstance(hot, bool) or not isinstance(hot, int) or not 1 <= hot <= 2**24:
            raise ConfigError(f"hot must be an int in [1, 2**24], got {hot!r}")
        if max(self.cards) >= 2**63 // hot:
            raise ConfigError(f"cardinalities up to {2**63 // hot - 1} are supported with hot={hot}")
        self.seed, self.alpha, self.hot, self.signal = int(seed), float(alpha), hot, float(signal)
        self._mult = np.array([_coprime_mult(c, f) for f, c in enumerate(self.cards)], np.int64)
        self._add = np.array([int(mix64(np.array([f + 1 + 1000 * self.seed], np.uint64))[0]) % c
                              for f, c in enumerate(self.cards)], np.int64)
        self._cards = np.array(self.cards, np.int64)
        self._span = np.minimum(self._cards, hot).astype(np.int64)  # distinct ranks per feature
        wrng = np.random.default_rng([self.seed, 0xD15EA5E])
        self._w_dense = wrng.normal(0.0, 0.6 / math.sqrt(NUM_DENSE), NUM_DENSE)
        self._feat_scale = wrng.uniform(0.2, 1.0, NUM_SPARSE) * 2.2 / math.sqrt(NUM_SPARSE)
        self._pair = (int(wrng.integers(NUM_SPARSE)), int(wrng.integers(NUM_SPARSE)))
        self._bias = -1.2

    def batch(self, step: int, size: int, stream: int = 0) -> Batch:
        """The batch at `step` of `stream` (0: training; others: held-out), `size` samples."""
        rng = np.random.default_rng([self.seed, stream, step])
        raw = rng.zipf(self.alpha, (NUM_SPARSE, size))
        ranks = (raw - 1) % self._span[:, None]  # int64, 0-based, < min(card, hot)
        ids = (ranks * self._mult[:, None] + self._add[:, None]) % self._cards[:, None]
        z = rng.standard_normal((size, NUM_DENSE))
        counts = np.floor(np.exp(1.5 * z + 1.0))  # Criteo-like non-negative counts
        dense = np.log1p(counts)
        feat = np.arange(NUM_SPARSE, dtype=np.uint64)[:, None]
        with np.errstate(over="ignore"):
            salt = np.uint64(self.seed) * _GOLDEN + feat * _M2
            effect = _signed_unit(mix64(ranks.astype(np.uint64) * _GOLDEN + salt))
        logit = (self._bias + (dense - dense_mean()) @ self._w_dense
                 + self.signal * (self._feat_scale[:, None] * effect).sum(0))
        a, b = self._pair
        logit += 0.5 * self.signal * effect[a] * effect[b]
        labels = rng.random(size) < 1.0 / (1.0 + np.exp(-logit))
        return Batch(torch.from_numpy(dense.astype(np.float32)), torch.from_numpy(ids),
                     torch.from_numpy(labels.astype(np.float32)))

    def batches(self, size: int, start: int = 0, stop: int | None = None,
                stream: int = 0) -> Iterator[Batch]:
        """Batches `start, start+1, ...` (up to `stop`) of a stream."""
        step = start
        while stop is None or step < stop:
            yield self.batch(step, size, stream)
            step += 1


def dense_mean() -> float:
    """The mean of the synthetic log1p(count) dense features (for centring the planted logit)."""
    return 1.45


def _coprime_mult(card: int, feature: int) -> int:
    """A multiplier coprime with `card`, so rank -> id is one-to-one within a table."""
    if card == 1:
        return 1
    m = int(mix64(np.array([feature + 77], np.uint64))[0]) % card or 1
    while math.gcd(m, card) != 1:
        m = m % (card - 1) + 1
    return m


# Criteo TSV ------------------------------------------------------------------------------------
_HEX = np.full(256, 255, np.uint8)
for _i, _c in enumerate(b"0123456789abcdef"):
    _HEX[_c] = _i
    _HEX[ord(chr(_c).upper())] = _i


def hash_categorical(col: np.ndarray, feature: int, card: int) -> np.ndarray:
    """Hex strings (8 digits, '' when missing) -> ids in [0, card) of one feature's table."""
    raw = np.char.rjust(col.astype("U8"), 8, "0").astype("S8")
    digits = _HEX[np.frombuffer(raw.tobytes(), np.uint8).reshape(-1, 8)]
    if bool((digits == 255).any()):
        bad = col[(digits == 255).any(1)][0]
        raise StoreCorruptError(f"categorical value {bad!r} of C{feature + 1} is not hexadecimal")
    value = (digits.astype(np.uint64) << (np.arange(7, -1, -1, dtype=np.uint64) * np.uint64(4))).sum(1)
    value = np.where(col == "", np.uint64(1 << 32), value.astype(np.uint64))  # missing: own id
    with np.errstate(over="ignore"):
        h = mix64(value + np.uint64(feature + 1) * _GOLDEN)
    return (h % np.uint64(card)).astype(np.int64)


def parse_criteo_lines(lines: Sequence[str], cards: Sequence[int], delimiter: str = "\t") -> Batch:
    """Parse Criteo rows (label, I1..I13, C1..C26) into a Batch; dense -> log1p(max(x, 0))."""
    cards = _check_cards(cards)
    n = len(lines)
    text = delimiter.join(line.rstrip("\r\n") for line in lines)
    cells = np.array(text.split(delimiter), dtype=str)
    width = 1 + NUM_DENSE + NUM_SPARSE
    if cells.size != n * width:
        raise StoreCorruptError(f"Criteo rows must have {width} columns each; got {cells.size} "
                                f"cells in {n} rows")
    cells = cells.reshape(n, width)
    try:
        labels = cells[:, 0].astype(np.float64)
        dense = np.where(cells[:, 1:14] == "", "0", cells[:, 1:14]).astype(np.float64)
    except ValueError as exc:
        raise StoreCorruptError(f"bad label or integer feature in Criteo rows: {exc}") from exc
    dense = np.log1p(np.maximum(dense, 0.0))
    ids = np.stack([hash_categorical(cells[:, 14 + f], f, cards[f]) for f in range(NUM_SPARSE)])
    return Batch(torch.from_numpy(dense.astype(np.float32)), torch.from_numpy(ids),
                 torch.from_numpy(labels.astype(np.float32)))


class CriteoTSV:
    """Streams a Criteo file (Kaggle train.txt, Terabyte day_N, .gz too, or the CSV sample) in batches."""

    def __init__(self, path: str | os.PathLike, cardinalities: Sequence[int]) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise ConfigError(f"Criteo data file {self.path} does not exist")
        self.cards = _check_cards(cardinalities)
        with self._open() as f:
            first = f.readline()
        self.delimiter = "\t" if "\t" in first else ","
        self.header = first.lower().startswith("label")

    def _open(self):
        if self.path.suffix == ".gz":
            return gzip.open(self.path, "rt", encoding="utf-8", newline="")
        return open(self.path, encoding="utf-8", newline="")

    def batches(self, size: int, skip: int = 0) -> Iterator[Batch]:
        """Batches of `size` rows, after skipping `skip` batches; a short final batch is dropped."""
        if size < 1:
            raise ConfigError(f"batch size must be >= 1, got {size}")
        with self._open() as f:
            if self.header:
                f.readline()
            index = 0
            while True:
                lines = [line for _, line in zip(range(size), f, strict=False)]
                lines = [x for x in lines if x.strip()]
                if len(lines) < size:
                    return
                if index >= skip:
                    yield parse_criteo_lines(lines, self.cards, self.delimiter)
                index += 1
