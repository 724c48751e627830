"""Shared fixtures and the run's settings: hypothesis profile, CI's data check, one thread."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests import profiles

PROFILE = profiles.load()
SHARED = Path(__file__).resolve().parents[1] / ".." / "shared" / "data"
torch.set_num_threads(1)


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
