"""Every ```python block of README.md runs as written, as a new user would run it.

Each block runs in its own ``python`` process, in a fresh temp directory, with
a deadline; a block fails the test if it raises (exit status not 0) or
overruns. New blocks are picked up by themselves. The conventions (written in
README.md's top comment too), as HTML comments on the lines just above a
block, which render as nothing:

* ``<!-- readme-test: continues -->``: the block continues the one before
  (it runs appended to it, in one process: names carry over). Say so in
  the prose as well, for the human reader.
* ``<!-- readme-test: skip: REASON -->``: not run, for the stated reason
  (a second host, a server started by hand); a skip without a reason
  fails. Prefer making the block run.
* ``<!-- readme-test: timeout: SECONDS -->``: a longer deadline than the
  default, for a block that starts many processes.

Processes a block leaves behind are killed with its session when it ends.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
#: Seconds a block may run unless its marker says otherwise (the CI box is a busy
#: 2-core machine: the deadline catches a hang, it does not measure speed).
DEFAULT_TIMEOUT = 300.0

_FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.M | re.S)
_MARKER = re.compile(r"^<!--\s*readme-test:\s*(.*?)\s*-->\s*$")
_HEADING = re.compile(r"^#+\s+(.*)$", re.M)


@dataclass
class Block:
    """One runnable unit: a block, with the blocks that continue it appended."""

    name: str
    line: int
    code: str
    skip: str | None = None
    timeout: float = DEFAULT_TIMEOUT
    parts: list[int] = field(default_factory=list)


def _markers(text: str, start: int) -> list[str]:
    """The readme-test markers on the lines just above offset ``start`` (blank lines between
    markers allowed, any other line ends them)."""
    found: list[str] = []
    for line in reversed(text[:start].splitlines()[-6:]):
        if not line.strip():
            continue
        m = _MARKER.match(line.strip())
        if m is None:
            break
        found.append(m.group(1))
    return found


def blocks(text: str) -> list[Block]:
    """The README's python blocks, grouped by ``continues``, with their markers applied.

    Raises:
        ValueError: a marker this file does not know, a skip with no reason, or a
            ``continues`` on the first block.
    """
    out: list[Block] = []
    for m in _FENCE.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        headings = _HEADING.findall(text[:m.start()])
        name = f"L{line}-{re.sub(r'[^A-Za-z0-9]+', '-', headings[-1] if headings else 'top')}"
        continues, skip, timeout = False, None, None
        for marker in _markers(text, m.start()):
            key, _, value = marker.partition(":")
            key, value = key.strip(), value.strip()
            if key == "continues":
                continues = True
            elif key == "skip":
                if not value:
                    raise ValueError(f"README.md line {line}: a skip must state its reason")
                skip = value
            elif key == "timeout":
                timeout = float(value)
            else:
                raise ValueError(f"README.md line {line}: unknown readme-test marker {marker!r}")
        if continues:
            if not out:
                raise ValueError(f"README.md line {line}: the first block cannot continue one")
            prev = out[-1]
            prev.code += "\n" + m.group(1)
            prev.parts.append(line)
            prev.skip = prev.skip or skip
            prev.timeout = max(prev.timeout, timeout or 0.0)
            continue
        out.append(Block(name, line, m.group(1), skip, timeout or DEFAULT_TIMEOUT, [line]))
    return out


BLOCKS = blocks(README.read_text(encoding="utf-8"))


def test_the_readme_has_python_blocks() -> None:
    assert len(BLOCKS) >= 5


@pytest.mark.parametrize("block", BLOCKS, ids=[b.name for b in BLOCKS])
def test_readme_block_runs_as_written(block: Block, tmp_path: Path) -> None:
    if block.skip is not None:
        pytest.skip(block.skip)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    proc = subprocess.Popen([sys.executable, "-c", block.code], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=block.timeout)
    except subprocess.TimeoutExpired:
        output = b""
        pytest.fail(f"README.md block at line(s) {block.parts} ran past {block.timeout:.0f} s")
    finally:
        try:  # whatever the block started and left behind goes with its session
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    assert proc.returncode == 0, (
        f"README.md block at line(s) {block.parts} failed (exit {proc.returncode}):\n"
        + output.decode(errors="replace")[-4000:])


def test_markers_are_understood() -> None:
    text = ("# T\n```python\na = 1\n```\n<!-- readme-test: continues -->\n```python\n"
            "print(a)\n```\n## U\n<!-- readme-test: skip: needs two hosts -->\n"
            "<!-- readme-test: timeout: 9 -->\n```python\nboom()\n```\n")
    got = blocks(text)
    assert [(b.parts, b.code, b.skip, b.timeout) for b in got] == [
        ([2, 6], "a = 1\n\nprint(a)\n", None, DEFAULT_TIMEOUT),
        ([12], "boom()\n", "needs two hosts", 9.0)]
    with pytest.raises(ValueError, match="state its reason"):
        blocks("<!-- readme-test: skip -->\n```python\nx\n```\n")
    with pytest.raises(ValueError, match="unknown"):
        blocks("<!-- readme-test: sometimes -->\n```python\nx\n```\n")
