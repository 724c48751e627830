"""Hypothesis profiles that every property test follows: `dev`, `ci` (derandomized) and `fast`.

`ci` is chosen when CI is set (as .ci/run does), `HYPOTHESIS_PROFILE` picks one by name (`fast`
is for mutation runs). Tests size themselves with `examples(weight)`, so a profile changes them
all; none hard-codes its own count.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

EXAMPLES = {"dev": 50, "ci": 100, "fast": 8}


def in_ci() -> bool:
    """True when running under CI (CI=true, as .ci/run exports)."""
    return os.environ.get("CI", "").lower() not in ("", "0", "false", "no")


def load() -> str:
    """Register the profiles and load the one for this run; returns its name."""
    for name, n in EXAMPLES.items():
        settings.register_profile(name, deadline=None, max_examples=n, derandomize=name != "dev",
                                  database=None if name != "dev" else settings.default.database,
                                  suppress_health_check=[HealthCheck.too_slow])
    name = os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if in_ci() else "dev")
    settings.load_profile(name)
    return name


def examples(weight: float = 1.0) -> int:
    """The loaded profile's example count scaled for a costly test (at least 3)."""
    return max(3, int(settings.default.max_examples * weight))


def needs(present: bool, reason: str) -> pytest.MarkDecorator:
    """Skip a test whose shared data is missing, except under CI, where it runs (and fails)."""
    return pytest.mark.skipif(not present and not in_ci(), reason=reason)
