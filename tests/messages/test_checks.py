"""messages.checks.prompt_problem: the one check of a prompt's tokens, as the scheduler runs
it on packed ids and the HTTP door on a client's list of ids."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from messages import token_ids
from messages.checks import input_ids_problem, prompt_problem

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("ids", "most", "says"), [
    ([], None, "no input tokens"),
    ([1, 99, 100], None, "token id 100 is outside the vocabulary (size 100: ids 0..99)"),
    ([1, 2, 3], 2, "3 prompt tokens, the model reads at most 2"),
    ([0, 99], 2, ""),
])
def test_packed_and_listed_ids_get_one_answer(ids: list[int], most: int | None,
                                              says: str) -> None:
    assert prompt_problem(ids, 100, most) == says
    assert prompt_problem(token_ids(ids), 100, most) == says
    assert input_ids_problem("r1", token_ids(ids), 100, most) == \
        (f"request 'r1': {says}" if says else "")


def test_no_other_module_compares_ids_with_a_vocabulary_size() -> None:
    """The vocabulary bound is stated once: a comparison ``... >= vocab...`` anywhere else
    in the packages is a second copy of the check."""
    found = []
    for package in ("bus", "router", "scheduler", "frontend", "messages"):
        for path in (ROOT / package).rglob("*.py"):
            if path == ROOT / "messages" / "checks.py":
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Compare) and any(
                        isinstance(op, (ast.GtE, ast.Gt)) for op in node.ops):
                    text = ast.unparse(node.comparators[-1])
                    if "vocab" in text:
                        found.append(f"{path.relative_to(ROOT)}:{node.lineno}: "
                                     f"{ast.unparse(node)}")
    assert not found, "vocabulary checked outside messages/checks.py:\n" + "\n".join(found)
