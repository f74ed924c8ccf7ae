"""Every figure in the README's benchmark table names a command and keys that are real.

The table (section ``## Benchmarks``) has one row per figure: its value,
the peer or floor beside it, the command and the JSON key that print it,
and when it was measured. This test reads every row and checks, without
running anything, that the command is ``python -m benchmarks.<name>`` (an
environment variable before it, scenario names after it) of a module that
exists and that every key the row names (in its key and peer
columns) is in that benchmark's output schema: its ``KEYS`` where it
declares them, else the keys its source writes literally (dict literals
and ``results["key"] = ...``), with the modules of its ``SCENARIOS`` for
``benchmarks.soak``. A benchmark that declares ``KEYS`` checks what it
prints against them (``benchmarks._timing.print_checked``); the last test
here checks, as cheaply, that every literal key its source writes is
declared.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
COMMAND = re.compile(r"`(?:[A-Z_]+=\S+ )*python -m (benchmarks\.[a-z0-9_]+)((?: [a-z0-9_]+)*)`")
KEY = re.compile(r"`([a-z][a-z0-9_]*)`")


def _section(text: str, title: str) -> list[str]:
    lines = text.splitlines()
    start = lines.index(title) + 1
    end = next((i for i in range(start, len(lines)) if lines[i].startswith("## ")), len(lines))
    return lines[start:end]


def _rows() -> list[dict[str, str]]:
    """The benchmark table's rows, as {column title: cell}."""
    lines = [line for line in _section((ROOT / "README.md").read_text(), "## Benchmarks")
             if line.startswith("|")]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    assert set(head) >= {"Figure", "This release", "Peer or floor", "Command", "Key",
                         "Measured"}, head
    assert set(lines[1].replace("|", "").strip()) <= set("-: "), lines[1]
    return [dict(zip(head, (c.strip() for c in line.strip().strip("|").split("|")),
                     strict=True)) for line in lines[2:]]


def _literal_keys(source: object) -> set[str]:
    """The string keys ``source`` (a module or function) writes: dict literals and
    ``x["key"] = ...``."""
    keys: set[str] = set()
    for node in ast.walk(ast.parse(inspect.getsource(source))):  # type: ignore[arg-type]
        if isinstance(node, ast.Dict):
            keys |= {k.value for k in node.keys
                     if isinstance(k, ast.Constant) and isinstance(k.value, str)}
        elif isinstance(node, ast.Assign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            keys |= {t.slice.value for t in targets if isinstance(t, ast.Subscript)
                     and isinstance(t.slice, ast.Constant) and isinstance(t.slice.value, str)}
    return keys


def schema(name: str) -> frozenset[str]:
    """The keys ``python -m <name>`` prints, read without running it."""
    module = importlib.import_module(name)
    declared = getattr(module, "KEYS", None)
    if declared is not None:
        return frozenset(declared)
    keys = _literal_keys(module)
    for scenario in getattr(module, "SCENARIOS", ()):  # benchmarks.soak's modules
        keys |= _literal_keys(inspect.getmodule(scenario) or module)
    return frozenset(keys)


def _named_keys(row: dict[str, str]) -> Iterator[str]:
    for column in ("Key", "Peer or floor"):
        yield from KEY.findall(row[column])


def test_the_table_has_a_row_per_figure_and_each_names_one_command() -> None:
    rows = _rows()
    assert len(rows) >= 10
    for row in rows:
        assert len(COMMAND.findall(row["Command"])) == 1, row
        assert len(KEY.findall(row["Key"])) >= 1, row
        assert re.search(r"\d", row["This release"]), row
        assert re.fullmatch(r"\d{4}-\d\d-\d\d, load \d+(\.\d+)?(-\d+(\.\d+)?)?",
                            row["Measured"]), row


@pytest.mark.parametrize("row", _rows(), ids=lambda r: r["Figure"][:40])
def test_each_row_s_keys_are_printed_by_its_command(row: dict[str, str]) -> None:
    ((name, args),) = COMMAND.findall(row["Command"])
    assert (ROOT / (name.replace(".", "/") + ".py")).exists(), name
    scenarios = {s.__name__ for s in getattr(importlib.import_module(name), "SCENARIOS", ())}
    assert set(args.split()) <= scenarios, f"{name} has no scenario {args.split()}"
    keys = schema(name)
    missing = [k for k in _named_keys(row) if k not in keys]
    assert not missing, f"{name} prints no {missing} (row {row['Figure']!r})"


@pytest.mark.parametrize(("name", "builder"), [("benchmarks.codec", "main"),
                                               ("benchmarks.http", "run")])
def test_a_benchmark_s_declared_keys_cover_the_keys_its_source_writes(name: str,
                                                                      builder: str) -> None:
    module = importlib.import_module(name)
    written = {k for k in _literal_keys(getattr(module, builder))
               if re.fullmatch(r"[a-z][a-z0-9]*_[a-z0-9_]+", k)}  # keys, not servers' names
    undeclared = written - set(module.KEYS)
    assert not undeclared, (f"{name}.{builder} writes keys its KEYS does not declare: "
                            f"{sorted(undeclared)}")


def test_importing_a_benchmark_defines_no_message_type() -> None:
    """A benchmark module imported for its ``KEYS`` (here, and by anyone) defines no
    :class:`~messages.Message` at import (a test's own are its to remove), or
    every scheduler and dispatcher started afterwards in that process fails its
    totality check on it (``NoSinkError: no sink for ...``)."""
    from messages import Message
    from messages.codec import concrete_types
    for path in sorted(Path(ROOT, "benchmarks").glob("*.py")):
        importlib.import_module(f"benchmarks.{path.stem}")
    foreign = [f"{t.__module__}.{t.__qualname__}" for t in concrete_types(Message)
               if t.__module__.split(".")[0] == "benchmarks"]
    assert not foreign, f"message types defined by benchmark modules: {foreign}"
