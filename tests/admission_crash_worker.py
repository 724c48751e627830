"""The crash tests' training with feature admission on both tables and a ttl on one (run as a script
like crash_worker); the store clock advances once per step."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tierstore as ts  # noqa: E402
from tests import crash_worker as w  # noqa: E402

SPECS = [ts.TableSpec("a", 10**11, 8, optimizer=ts.Adagrad(0.1),
                      admission=ts.CountAdmission(min_count=3, sketch="1MiB"), ttl=6),
         ts.TableSpec("b", 5000, 4, optimizer=ts.Adam(0.01), init=ts.NormalInit(0.5),
                      admission=ts.CountAdmission(min_count=2, sketch="256KiB"))]


_PLAIN_STEP = w.train_step


def train_step(store: ts.TierStore, step: int) -> None:
    """crash_worker's step, then one tick of the store clock (row stamps, ttl expiry)."""
    _PLAIN_STEP(store, step)
    store.advance()


def use_admission() -> None:
    """Make crash_worker train (and dump) the tables with admission and a ttl."""
    w.SPECS[:] = SPECS
    w.train_step = train_step


def restore_plain(specs: list) -> None:
    """Undo `use_admission` (in-process tests)."""
    w.SPECS[:] = specs
    w.train_step = _PLAIN_STEP


if __name__ == "__main__":
    torch.set_num_threads(1)
    use_admission()
    a = sys.argv[1:]
    w.run(a[0], a[1], int(a[2]), int(a[3]), int(a[4]), int(a[5]), int(a[6]), out=sys.stdout)
