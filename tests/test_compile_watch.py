"""First-use kernel compilation is announced and timed apart (issue 39 row 7)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numba
import numpy as np
import pytest

from tierstore.compile_watch import ANNOUNCEMENT, watch_compilation

REPO = Path(__file__).resolve().parents[1]


def test_watch_announces_once_and_times_real_compilations():
    said = []
    with watch_compilation(said.append) as watch:
        @numba.njit  # no cache: compiles here, at the first call

        def f(x):
            return x.sum() * 2

        @numba.njit
        def g(x):
            return f(x) + 1  # compiles f inside g's compilation: one outermost event

        assert g(np.ones(4)) == 9.0
        assert f(np.ones(2, dtype=np.int64)) == 4  # a second signature: compiled again
    assert said == [ANNOUNCEMENT]
    assert watch.count == 2 and watch.seconds > 0
    with watch_compilation(said.append) as quiet:
        assert g(np.ones(4)) == 9.0  # compiled already: nothing to announce
    assert quiet.count == 0 and quiet.seconds == 0 and said == [ANNOUNCEMENT]


@pytest.mark.slow
def test_first_demo_run_says_it_compiles_and_the_second_does_not(tmp_path):
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "cache"),
           "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "tierstore.demo", "--steps", "2", "--batch", "256",
           "--path", str(tmp_path / "s"), "--no-progress"]
    first = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=600)
    assert first.returncode == 0, first.stderr
    assert ANNOUNCEMENT in first.stderr and "s compiling kernels (first use)" in first.stdout
    again = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=600)
    assert again.returncode == 0 and ANNOUNCEMENT not in again.stderr
    assert "compiling kernels" not in again.stdout
