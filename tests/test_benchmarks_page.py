"""BENCHMARKS.md is the current figures on one page (issue 39 row 13): short, one table per
benchmark main, each with its command; the change-by-change history lives in bench/HISTORY.md."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _mains() -> list[str]:
    return sorted(p.stem for p in (REPO / "bench").glob("*.py")
                  if 'if __name__ == "__main__"' in p.read_text())


def test_benchmarks_page_is_short_and_names_every_benchmark():
    text = (REPO / "BENCHMARKS.md").read_text()
    assert len(text.splitlines()) < 400, "the head is a summary: move history to bench/HISTORY.md"
    sections = re.split(r"\n## ", text)[1:]
    for name in _mains():
        hits = [s for s in sections if f"bench.{name}" in s]
        assert hits, f"bench.{name} has no section in BENCHMARKS.md"
        assert any("|" in s and "---" in s for s in hits), f"bench.{name}'s section has no table"
    assert "bench/HISTORY.md" in text and (REPO / "bench" / "HISTORY.md").is_file()
