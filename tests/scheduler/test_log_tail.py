"""The tail of a flood is logged: a summary's last counts are not held for a later event.

``LogSummary`` logs at most one line per interval; the counts of a burst
that ends inside an interval are logged by a timer when it is up.
"""

from __future__ import annotations

import logging
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import zmq

from bus import LogSummary
from tests.conftest import eventually


def _summed(text: str, what: str) -> int:
    """The events the summary lines of ``what`` in ``text`` count, in all."""
    return sum(int(n) for line in text.splitlines() if line.startswith(what)
               for n in re.findall(r"(\d+) on '", line))


def test_a_burst_of_garbage_to_serve_is_logged_whole_once_it_stops(tmp_path: Path) -> None:
    # Without this: the first frame of a flood was logged, the rest never (the summary
    # waited for an event after its interval, and none came).
    log = tmp_path / "serve.log"
    where = tmp_path / "sched"
    with open(log, "wb") as err:
        proc = subprocess.Popen([sys.executable, "-m", "scheduler", "serve", "--endpoint",
                                 str(where)], stderr=err)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    work = ctx.socket(zmq.PUSH)
    try:
        eventually(lambda: (where / "rpc").exists() or proc.poll() is not None, 120,
                   "serve to start")
        assert proc.poll() is None, log.read_text()
        work.connect(f"ipc://{where}/work")
        for n in range(300):
            work.send(b"\xc1garbage" + n.to_bytes(2, "big"))
        what = "rejected messages with no readable rid"
        deadline = time.monotonic() + 60  # the interval is 10 s
        while _summed(log.read_text(), what) < 300:
            assert time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.1)  # sleep-ok: pacing of a deadline poll
        assert _summed(log.read_text(), what) == 300
        assert len([ln for ln in log.read_text().splitlines() if ln.startswith(what)]) <= 3
    finally:
        work.close(0)
        ctx.term()
        proc.kill()
        proc.wait(30)


def test_a_held_back_tail_is_logged_when_the_interval_is_up(
        caplog: pytest.LogCaptureFixture) -> None:
    summary = LogSummary(logging.getLogger("tests.tail"), "dropped", interval=0.3)
    with caplog.at_level(logging.WARNING, logger="tests.tail"):
        for i in range(50):
            summary.add("work", f"frame {i}")
        lines = [r.getMessage() for r in caplog.records]
        assert lines == ["dropped: 1 on 'work' (e.g. frame 0)"]  # the first, at once
        eventually(lambda: len(caplog.records) == 2, 10.0, "the tail to be logged")
        assert caplog.records[1].getMessage() == "dropped: 49 on 'work' (e.g. frame 1)"
    eventually(lambda: not any(t.name.startswith("log-summary") for t in threading.enumerate()),
               10.0, "the timer's thread to end")
    assert summary.total == 50
