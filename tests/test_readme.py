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

Each block's process is forked from one that has imported the third-party
libraries every block starts with (:data:`PRELOADED`: torch's import alone is
seconds of CPU) and nothing of this project, so a block still imports our
packages as a new user's ``python -c`` would, from a fresh ``__main__``.
"""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
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


#: What the interpreter each block is forked from imports first: third-party only.
PRELOADED = ("numpy", "torch", "zmq", "msgspec")

#: Run with ``python -c`` (so ``__main__`` has no file, as for a block: a spawned
#: scheduler imports no main module) and PRELOADED as arguments. Reads one job a
#: line on stdin ({"code", "cwd", "out"}), forks it, answers ``pid N``, then
#: ``exit N CODE`` (CODE as ``Popen.returncode``: minus the signal that ended it).
#: The child starts a session, runs in ``cwd`` with stdin from /dev/null and
#: stdout and stderr to ``out``, and runs the code in a new ``__main__``: an
#: exception prints its traceback and exits 1, as ``python -c`` does.
_FORKER = r"""
import json, os, select, sys, types
for _name in sys.argv[1:]:
    __import__(_name)


def _child(job):
    os.setsid()
    os.chdir(job["cwd"])
    null = os.open(os.devnull, os.O_RDONLY)
    out = os.open(job["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(null)
    os.close(out)
    sys.argv = ["-c"]
    main = types.ModuleType("__main__")
    sys.modules["__main__"] = main
    exec(compile(job["code"], "<string>", "exec"), main.__dict__)
    sys.exit(0)


def _serve():
    running = set()
    while True:
        ready, _, _ = select.select([0], [], [], 0.05 if running else None)
        for pid in list(running):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                running.discard(pid)
                os.write(1, f"exit {pid} {os.waitstatus_to_exitcode(status)}\n".encode())
        if ready:
            line = os.read(0, 1 << 16)
            while line and not line.endswith(b"\n"):  # a job longer than one read
                more = os.read(0, 1 << 16)
                if not more:
                    return None
                line += more
            if not line:
                return None
            job = json.loads(line)
            pid = os.fork()
            if pid == 0:
                return job
            running.add(pid)
            os.write(1, f"pid {pid}\n".encode())


_job = _serve()
if _job is not None:
    _child(_job)
"""


class Forker:
    """The process every block is forked from (:data:`_FORKER`); one job at a time."""

    def __init__(self, env: dict[str, str], cwd: Path) -> None:
        self._proc = subprocess.Popen([sys.executable, "-c", _FORKER, *PRELOADED], env=env,
                                      cwd=cwd, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self._pending = b""

    def _line(self, deadline: float) -> str | None:
        """The forker's next line, or None past ``deadline`` (monotonic)."""
        assert self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        while b"\n" not in self._pending:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            data = os.read(fd, 4096)
            if not data:
                raise RuntimeError(f"the forker exited (exit {self._proc.wait()})")
            self._pending += data
        line, self._pending = self._pending.split(b"\n", 1)
        return line.decode()

    def run(self, code: str, cwd: Path, timeout: float) -> tuple[int | None, bytes]:
        """Run ``code`` in ``cwd``: its exit code (None: killed past ``timeout`` seconds)
        and its output. Whatever it started and left behind is killed with its session."""
        assert self._proc.stdin is not None
        out = cwd / ".block-output"
        self._proc.stdin.write(json.dumps({"code": code, "cwd": str(cwd),
                                           "out": str(out)}).encode() + b"\n")
        self._proc.stdin.flush()
        started = self._line(time.monotonic() + 120.0)  # (the forker may still be importing)
        assert started is not None and started.startswith("pid "), started
        pid = int(started.split()[1])
        ended = self._line(time.monotonic() + timeout)
        returncode: int | None = None
        if ended is None:  # ran past its deadline
            os.killpg(pid, signal.SIGKILL)
            ended = self._line(time.monotonic() + 60.0)
        else:
            returncode = int(ended.split()[2])
        assert ended is not None and ended.startswith(f"exit {pid} "), ended
        try:  # whatever the block started and left behind goes with its session
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return returncode, out.read_bytes()

    def close(self) -> None:
        """End the forker (its stdin closed) and reap it."""
        assert self._proc.stdin is not None
        self._proc.stdin.close()
        try:
            self._proc.wait(30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(30)
        if self._proc.stdout is not None:
            self._proc.stdout.close()


@pytest.fixture(scope="module")
def forker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Forker]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    f = Forker(env, tmp_path_factory.mktemp("forker"))
    yield f
    f.close()


@pytest.mark.parametrize("block", BLOCKS, ids=[b.name for b in BLOCKS])
def test_readme_block_runs_as_written(block: Block, tmp_path: Path, forker: Forker) -> None:
    if block.skip is not None:
        pytest.skip(block.skip)
    returncode, output = forker.run(block.code, tmp_path, block.timeout)
    if returncode is None:
        pytest.fail(f"README.md block at line(s) {block.parts} ran past {block.timeout:.0f} s")
    assert returncode == 0, (
        f"README.md block at line(s) {block.parts} failed (exit {returncode}):\n"
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
