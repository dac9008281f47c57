"""docs/benchmarks.md opens with an index that lists every benchmark `python -m kvmesh.bench` runs, once."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvmesh.bench.__main__ import BENCHES

pytestmark = pytest.mark.unit

DOC = Path(__file__).resolve().parents[3] / "docs" / "benchmarks.md"


def indexed() -> list[str]:
    """The benchmark names of the index's table, in order."""
    section = DOC.read_text(encoding="utf-8").split("\n## Index of benchmarks\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `([a-z-]+)` \|", section, flags=re.MULTILINE)


def test_every_benchmark_is_in_the_index_once() -> None:
    names = indexed()
    assert len(names) == len(set(names)), f"listed twice: {sorted({n for n in names if names.count(n) > 1})}"
    assert not set(BENCHES) - set(names), f"missing from docs/benchmarks.md's index: {set(BENCHES) - set(names)}"
    assert not set(names) - set(BENCHES), f"not a benchmark of python -m kvmesh.bench: {set(names) - set(BENCHES)}"


def test_help_lists_the_benchmarks_and_points_to_the_index(capsys: pytest.CaptureFixture[str]) -> None:
    from kvmesh.bench.__main__ import main

    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in BENCHES) and "docs/benchmarks.md" in out
