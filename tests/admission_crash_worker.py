"""The crash tests' training with feature admission on both tables (run as a script like crash_worker)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tierstore as ts  # noqa: E402
from tests import crash_worker as w  # noqa: E402

SPECS = [ts.TableSpec("a", 10**11, 8, optimizer=ts.Adagrad(0.1),
                      admission=ts.CountAdmission(min_count=3, sketch="1MiB")),
         ts.TableSpec("b", 5000, 4, optimizer=ts.Adam(0.01), init=ts.NormalInit(0.5),
                      admission=ts.CountAdmission(min_count=2, sketch="256KiB"))]


def use_admission() -> None:
    """Make crash_worker train (and dump) the tables with admission."""
    w.SPECS[:] = SPECS


if __name__ == "__main__":
    torch.set_num_threads(1)
    use_admission()
    a = sys.argv[1:]
    w.run(a[0], a[1], int(a[2]), int(a[3]), int(a[4]), int(a[5]), int(a[6]), out=sys.stdout)
