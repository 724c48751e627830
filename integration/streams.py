"""A run's batch streams: training batches from a given step on, and the held-out batches."""

from __future__ import annotations

from collections.abc import Iterator

from tierstore.errors import ConfigError

from .config import TrainConfig
from .data import Batch, CriteoTSV, SyntheticCriteo

EVAL_STREAM = 1


def open_source(cfg: TrainConfig, cards: tuple[int, ...]) -> tuple[SyntheticCriteo | None, CriteoTSV | None]:
    """The run's data source: (synthetic generator, None) or (None, TSV reader)."""
    if cfg.data == "synthetic":
        return SyntheticCriteo(cards, seed=cfg.seed, alpha=cfg.alpha, hot=cfg.hot), None
    return None, CriteoTSV(cfg.data, cards)


def train_batches(cfg: TrainConfig, synth: SyntheticCriteo | None, tsv: CriteoTSV | None,
                  step: int) -> Iterator[Batch]:
    """Training batches from `step` on (synthetic: a pure function of the step)."""
    if synth is not None:
        yield from synth.batches(cfg.batch, start=step)
        return
    assert tsv is not None
    head = cfg.eval_batches
    skip = head + step
    while True:  # cycle over the file after the held-out head
        n = 0
        for b in tsv.batches(cfg.batch, skip=skip):
            n += 1
            yield b
        if n == 0 and skip == head:
            raise ConfigError(f"{cfg.data} has no training rows after the {head} held-out batches")
        if n == 0:  # resumed past the first epoch: find the position within the epoch
            per_epoch = sum(1 for _ in tsv.batches(cfg.batch, skip=head))
            skip = head + (skip - head) % max(per_epoch, 1)
            continue
        skip = head


def eval_batches(cfg: TrainConfig, synth: SyntheticCriteo | None, tsv: CriteoTSV | None) -> list[Batch]:
    """Held-out batches: a separate synthetic stream, or the first batches of the file."""
    if synth is not None:
        return [synth.batch(i, cfg.batch, stream=EVAL_STREAM) for i in range(cfg.eval_batches)]
    assert tsv is not None
    return [b for b, _ in zip(tsv.batches(cfg.batch), range(cfg.eval_batches), strict=False)]
