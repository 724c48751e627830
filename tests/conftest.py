"""Shared fixtures and the run's settings: hypothesis profile, CI's data check, one thread, devices."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from tests import as_cuda, as_format, profiles

PROFILE = profiles.load()
SHARED = Path(__file__).resolve().parents[1] / ".." / "shared" / "data"
torch.set_num_threads(1)
REPO = Path(__file__).resolve().parents[1]
# subprocess workers (crash trials, CLI runs, readers) import what this interpreter imports: its
# whole sys.path, with the checkout first, whatever site or --target path holds the dependencies
os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys([str(REPO), *(p for p in sys.path if p)]))
# the devices a test runs on: the CPU always, CUDA too where there is one
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def pytest_report_header(config):
    """Say which hypothesis profile and shared data this run uses."""
    where = SHARED.resolve() if SHARED.exists() else "MISSING (its tests skip)"
    return [f"hypothesis profile: {PROFILE}; shared data: {where}"]


def pytest_sessionstart(session):
    """Under CI a missing ../shared fails the run: its tests would otherwise skip silently."""
    if profiles.in_ci() and not SHARED.is_dir():
        raise pytest.UsageError(f"CI=true but the shared data directory {SHARED} is missing; "
                                "the libCacheSim references and the real traces need it")


@pytest.fixture
def store_path(tmp_path):
    """A fresh directory for a store."""
    return tmp_path / "store"


@pytest.fixture(params=DEVICES)
def device(request) -> torch.device:
    """Each device a store can run on here: the CPU, and CUDA where available."""
    return torch.device(request.param)




@pytest.fixture(autouse=True)
def _as_cuda_layout(monkeypatch):
    """TIERSTORE_TEST_AS_CUDA=1: stores opened without a device take CUDA's layout (tests/as_cuda.py)."""
    if as_cuda.wanted():
        as_cuda.patch(monkeypatch.setattr)


@pytest.fixture(autouse=True)
def _as_table_format(monkeypatch):
    """TIERSTORE_TEST_TABLE_FORMAT=btree: new stores keep their tables as B-trees (as_format.py)."""
    if as_format.wanted():
        as_format.patch(monkeypatch.setattr)
