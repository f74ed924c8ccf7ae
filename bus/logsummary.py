"""``LogSummary``: count events on a hot path and log them as periodic summaries.

A flood of rejected frames must not become a flood of log lines (each one a
syscall and a formatted string, paid by the loop that should serve the next
message). Events are counted per (channel, reason) and logged at most once
per ``interval`` seconds, with their counts and one example reason.
"""

from __future__ import annotations

import logging
import time

__all__ = ["LogSummary"]


class LogSummary:
    """Counts ``(channel, reason)`` events; logs one summary line per ``interval`` at most."""

    def __init__(self, logger: logging.Logger, what: str, *, interval: float = 10.0,
                 level: int = logging.WARNING) -> None:
        self.logger = logger
        self.what = what
        self.interval = interval
        self.level = level
        self.total = 0
        self._counts: dict[str, int] = {}
        self._example: dict[str, str] = {}
        self._last = -float("inf")

    def add(self, channel: str, reason: str) -> None:
        """Count one event; log the summary if ``interval`` has passed since the last one."""
        self.total += 1
        self._counts[channel] = self._counts.get(channel, 0) + 1
        self._example.setdefault(channel, reason[:200])
        now = time.monotonic()
        if now - self._last >= self.interval:
            self.flush(now)

    def flush(self, now: float | None = None) -> None:
        """Log what was counted since the last summary (nothing if nothing was)."""
        if not self._counts:
            return
        self._last = time.monotonic() if now is None else now
        parts = ", ".join(f"{n} on {ch!r} (e.g. {self._example[ch]})"
                          for ch, n in self._counts.items())
        self.logger.log(self.level, "%s: %s", self.what, parts)
        self._counts.clear()
        self._example.clear()
