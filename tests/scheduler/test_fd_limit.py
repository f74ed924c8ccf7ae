"""``python -m scheduler serve`` raises its soft open-file limit at start-up, and says when
the hard one is low (each client holds sockets; the frontend's side is in
``tests/frontend/test_fd_limit.py``)."""

from __future__ import annotations

import resource
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import eventually


def _limit(soft: int, hard: int) -> Callable[[], None]:
    def set_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    return set_limit


def _serve_limits(tmp: Path, soft: int, hard: int) -> tuple[int, int, str]:
    """A ``serve`` started with limits (soft, hard): its limits once it serves, and its log."""
    log = tmp / "serve.log"
    where = tmp / "sched"
    with open(log, "wb") as err:
        proc = subprocess.Popen([sys.executable, "-m", "scheduler", "serve", "--endpoint",
                                 str(where)], stderr=err, preexec_fn=_limit(soft, hard))
    try:
        eventually(lambda: (where / "rpc").exists() or proc.poll() is not None, 120,
                   "serve to start")
        assert proc.poll() is None, log.read_text()
        with open(f"/proc/{proc.pid}/limits") as f:
            line = next(ln for ln in f if ln.startswith("Max open files"))
        return int(line.split()[3]), int(line.split()[4]), log.read_text()
    finally:
        proc.kill()
        proc.wait(30)


def test_serve_raises_its_soft_limit_to_the_hard_one(tmp_path: Path) -> None:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard == resource.RLIM_INFINITY or hard <= 256:
        pytest.skip(f"a hard limit of {hard} here")
    soft_now, hard_now, log = _serve_limits(tmp_path, 256, hard)
    assert (soft_now, hard_now) == (hard, hard)  # before: 256
    assert ("hard limit on open files is" in log) == (hard < 65536)


def test_serve_says_when_its_hard_limit_is_low(tmp_path: Path) -> None:
    soft_now, hard_now, log = _serve_limits(tmp_path, 512, 512)
    assert (soft_now, hard_now) == (512, 512)
    assert "scheduler serve: the hard limit on open files is 512 (ulimit -Hn)" in log
