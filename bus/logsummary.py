"""``LogSummary``: count events on a hot path and log them as periodic summaries.

A flood of rejected frames must not become a flood of log lines (each one a
syscall and a formatted string, paid by the loop that should serve the next
message). Events are counted per (channel, reason) and logged at most once
per ``interval`` seconds, with their counts and one example reason.

The last counts of a burst are logged within ``interval`` too, with no later
event to carry them: counts held back arm a timer (one daemon thread, for
that summary, until it fires) that logs them when the interval is up. A
summary whose owner has a loop of its own costs that loop nothing more: no
per-event syscall, and no poll of the summary from the loop.

What is still held back when the process exits is logged then: every
summary is in a weak registry, and an ``atexit`` hook flushes them all
(the timer's thread is a daemon, which the exit would otherwise cut
short). An owner need not remember to flush at its close; one that has a
close may flush there all the same, to log its tail before the exit.

The interval is 10 s unless the summary is given one, or the environment
variable ``TSB_LOG_SUMMARY_INTERVAL`` (seconds, above 0) sets another for
every summary a process makes without one (tests use a short one, to see a
burst's tail logged in seconds).
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import weakref

__all__ = ["DEFAULT_INTERVAL", "INTERVAL_ENV", "LogSummary"]

#: Seconds between two summary lines when neither the caller nor the environment says.
DEFAULT_INTERVAL = 10.0
#: The environment variable that sets the interval of summaries made without one.
INTERVAL_ENV = "TSB_LOG_SUMMARY_INTERVAL"


def _default_interval() -> float:
    """:data:`INTERVAL_ENV` in seconds if it is set, else :data:`DEFAULT_INTERVAL`.

    Raises:
        ValueError: the variable is set to something other than a number above 0.
    """
    text = os.environ.get(INTERVAL_ENV, "").strip()
    if not text:
        return DEFAULT_INTERVAL
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise ValueError(f"{INTERVAL_ENV}={text!r}: expected a number of seconds above 0")
    return value

#: Every summary alive, flushed at the interpreter's exit (see :func:`_flush_all`).
_LIVE: weakref.WeakSet[LogSummary] = weakref.WeakSet()
_LIVE_LOCK = threading.Lock()


class LogSummary:
    """Counts ``(channel, reason)`` events; logs one summary line per ``interval`` at most,
    and what it counted within ``interval`` of the count (a timer logs a burst's tail).

    Thread-safe: events may be counted from any thread. What is held back when the
    interpreter exits is logged then (an ``atexit`` hook flushes every summary).

    ``interval`` (seconds): ``None`` takes :data:`INTERVAL_ENV` from the environment if
    it is set, else :data:`DEFAULT_INTERVAL` (10 s).
    """

    def __init__(self, logger: logging.Logger, what: str, *, interval: float | None = None,
                 level: int = logging.WARNING) -> None:
        self.logger = logger
        self.what = what
        self.interval = _default_interval() if interval is None else interval
        self.level = level
        self.total = 0
        self._counts: dict[str, int] = {}
        self._example: dict[str, str] = {}
        self._last = -float("inf")
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None  # armed while counts are held back
        with _LIVE_LOCK:
            _LIVE.add(self)

    def add(self, channel: str, reason: str) -> None:
        """Count one event; log the summary if ``interval`` has passed since the last one,
        else make sure it is logged when the interval is up."""
        with self._lock:
            self.total += 1
            self._counts[channel] = self._counts.get(channel, 0) + 1
            self._example.setdefault(channel, reason[:200])
            now = time.monotonic()
            if now - self._last < self.interval:
                if self._timer is None:
                    self._timer = threading.Timer(self._last + self.interval - now, self._due)
                    self._timer.daemon = True  # (never holds a process's exit)
                    self._timer.name = f"log-summary: {self.what[:40]}"
                    self._timer.start()
                return
            line = self._take(now)
        self._log(line)

    def flush(self, now: float | None = None) -> None:
        """Log what was counted since the last summary (nothing if nothing was)."""
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            line = self._take(time.monotonic() if now is None else now)
        self._log(line)

    def _due(self) -> None:
        with self._lock:
            self._timer = None
            line = self._take(time.monotonic())
        self._log(line)

    def _take(self, now: float) -> str | None:
        """The summary of what was counted, which is forgotten (None if nothing was)."""
        if not self._counts:
            return None
        self._last = now
        line = ", ".join(f"{n} on {ch!r} (e.g. {self._example[ch]})"
                         for ch, n in self._counts.items())
        self._counts.clear()
        self._example.clear()
        return line

    def _log(self, line: str | None) -> None:
        # (outside the lock: a slow handler holds no thread that counts)
        if line is not None:
            self.logger.log(self.level, "%s: %s", self.what, line)


def _flush_all() -> None:
    """Log what every live summary holds back (at the interpreter's exit)."""
    with _LIVE_LOCK:
        live = list(_LIVE)
    for summary in live:
        try:
            summary.flush()
        except Exception:  # (a handler that fails at exit: the next summary still logs)
            continue


# Registered after ``logging`` registered its own shutdown: atexit runs hooks last-in
# first-out, so the summaries are logged before the handlers are flushed and closed.
atexit.register(_flush_all)
