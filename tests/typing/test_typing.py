"""Run mypy over tests/typing/cases and check it reports exactly the marked lines.

``# E:`` marks a line mypy must reject; ``# R: T`` a ``reveal_type`` whose
revealed type must be ``T``. Any other error fails the test: the typed API
must accept correct code and refuse misuse.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from mypy import api

CASES = sorted((Path(__file__).parent / "cases").glob("*.py"))


@pytest.fixture(scope="module")
def mypy_output() -> str:
    """One mypy run over every case (torch's stubs make a run cost seconds)."""
    out, _, _ = api.run(["--strict", "--hide-error-context", "--no-error-summary",
                         *map(str, CASES)])
    return out


@pytest.mark.parametrize("case", CASES, ids=lambda p: p.name)
def test_mypy_reports_exactly_the_marked_lines(case: Path, mypy_output: str) -> None:
    out = mypy_output
    lines = case.read_text().splitlines()
    want_errors = {i + 1 for i, line in enumerate(lines) if "# E:" in line}
    want_reveals = {i + 1: line.split("# R:")[1].strip()
                    for i, line in enumerate(lines) if "# R:" in line}
    got_errors: set[int] = set()
    got_reveals: dict[int, str] = {}
    for row in out.splitlines():
        m = re.match(rf"(?:.*/)?{re.escape(case.name)}:(\d+): (error|note): (.*)", row)
        if not m:
            continue
        lineno, kind, text = int(m.group(1)), m.group(2), m.group(3)
        if kind == "note" and text.startswith("Revealed type is"):
            got_reveals[lineno] = text.split('"')[1].rstrip("?")
        elif kind == "error":
            got_errors.add(lineno)
    assert got_errors == want_errors, out
    assert got_reveals == want_reveals, out
