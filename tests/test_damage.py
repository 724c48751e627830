"""Issue 38's damage suite: byte flips, zeroed pages and truncations of a closed store's files,
opened read-only and for writing in fresh processes. Counted outcome: no crash (a signal or a
non-tierstore exception) and no silently wrong row. A fast subset runs by default; the sweep
over every page of both files runs under `-m slow`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import tierstore as ts

WORKER = Path(__file__).with_name("damage_worker.py")
ROOT = Path(__file__).resolve().parents[1]


def _build(path: Path, rows: int = 3000) -> Path:
    """A closed store of `rows` trained rows; returns the .npz of its expected rows."""
    spec = ts.TableSpec("t", 10**6, 8, optimizer=ts.Adagrad(0.1))
    ids = torch.arange(rows) * 31
    with ts.TierStore(path, spec, device_capacity=64, host_capacity=64, seed=3, device="cpu") as s:
        g = torch.Generator().manual_seed(0)
        s.apply("t", ids, torch.randn(rows, 8, generator=g))
        want = s.read("t", ids).numpy()
    np.savez(path.parent / "want.npz", ids=ids.numpy(), rows=want)
    return path.parent / "want.npz"


def probe(path: Path, mode: str, want: Path) -> dict:
    """Open and read `path` in a fresh process; the worker's outcome, or a crash record."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, str(WORKER), str(path), mode, str(want)], env=env,
                       capture_output=True, text=True, timeout=300)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not lines:
        return {"outcome": "crash", "rc": p.returncode, "stderr": p.stderr[-800:]}
    return json.loads(lines[-1])


def _acceptable(out: dict) -> bool:
    return out["outcome"] == "error" or (out["outcome"] == "read" and out["wrong"] == 0)


# row 4: a truncated data.mdb opened read-only -----------------------------------------------------
@pytest.mark.parametrize("frac", [0.25, 0.5, 0.75])
def test_truncated_data_file_is_an_error_not_sigbus(tmp_path, frac):
    want = _build(tmp_path / "s")
    data = tmp_path / "s" / "data.mdb"
    os.truncate(data, int(data.stat().st_size * frac) // 4096 * 4096)
    for mode in ("ro", "rw"):
        out = probe(tmp_path / "s", mode, want)
        assert out["outcome"] == "error" and out["type"] == "StoreCorruptError", (mode, out)
