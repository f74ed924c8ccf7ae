"""Signals once a command is stopping: what ``serve``, ``dispatch`` and ``python -m frontend``
do alike after their first SIGINT or SIGTERM."""

from __future__ import annotations

import signal

__all__ = ["STOP_SIGNALS", "ignore_stop_signals"]

#: The signals that ask a command to stop.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def ignore_stop_signals() -> None:
    """SIGINT and SIGTERM ignored by the kernel from now on: the interpreter's exit puts
    a Python handler back to the default, which a late second signal would then meet
    (status -15 or -2 for a second signal 20-300 ms after the first)."""
    for sig in STOP_SIGNALS:
        for _ in range(10):  # one pending raises "race condition": handled, then again
            try:
                signal.signal(sig, signal.SIG_IGN)
                break
            except OSError:
                continue
