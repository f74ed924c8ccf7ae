"""A process watched by pid (a child's parent, a replica's dispatcher) is named by its pid
and its start time: a pid alone may be another process's by the time the watch begins."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

from bus.shm.segment import start_time
from scheduler.launch.processes import _when_gone


def test_a_pid_that_names_another_process_once_watched_counts_as_gone() -> None:
    # The pid is alive (this process's own) but is not the process watched (that one
    # started earlier): without the check after the pidfd is made, the watch parked on a
    # process that would never exit.
    gone = threading.Event()
    _when_gone(os.getpid(), start_time(os.getpid()) - 1, gone.set, "test-watch")
    assert gone.is_set()


def test_a_live_watched_process_is_not_gone() -> None:
    gone = threading.Event()
    with subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                          stdin=subprocess.PIPE) as proc:
        _when_gone(proc.pid, start_time(proc.pid), gone.set, "test-watch")
        assert not gone.is_set()
        assert proc.stdin is not None
        proc.stdin.close()  # it exits: the watch fires
        proc.wait(timeout=30)
    assert gone.wait(30)


def test_start_time_names_one_process() -> None:
    assert start_time(os.getpid()) == start_time(os.getpid()) > 0
    with subprocess.Popen([sys.executable, "-c", "pass"]) as proc:
        started = start_time(proc.pid)
        proc.wait(timeout=30)
    assert started > 0 and start_time(proc.pid) == -1  # reaped: nothing to read
