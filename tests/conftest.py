"""Shared fixtures: stores in temporary directories, reference math."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import settings

settings.register_profile("ci", deadline=None, max_examples=40)
settings.register_profile("dev", deadline=None, max_examples=25)
settings.load_profile("ci" if os.environ.get("CI") else "dev")
torch.set_num_threads(1)


@pytest.fixture
def store_path(tmp_path):
    """A fresh directory for a store."""
    return tmp_path / "store"
