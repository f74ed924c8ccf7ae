"""Signals once a command is stopping: what ``serve``, ``dispatch`` and ``python -m frontend``
do alike after their first SIGINT or SIGTERM."""

from __future__ import annotations

import signal
import sys
from types import FrameType, TracebackType

__all__ = ["STOP_SIGNALS", "StopSignals", "ignore_stop_signals"]

#: The signals that ask a command to stop.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopSignals:
    """While entered, the first SIGINT or SIGTERM asks to stop: :meth:`requested` says so
    from then on, and a ``KeyboardInterrupt`` is raised where the main thread runs (so
    a loop blocked in a poll stops at once). Those after it are ignored, so they never
    cut the clean-up the first one began.

    The exception alone is not enough: a handler runs wherever the main thread next
    checks for signals, and some of those places cannot raise. pyzmq checks signals
    in a frame's ``__dealloc__``, which runs for every message a loop reads; a
    destructor, a weakref or gc callback hands its exception to
    :data:`sys.unraisablehook` and goes on. A loop forwarding a flood of messages
    lost its stop there and forwarded until killed. So a loop that serves a command
    also asks :meth:`requested` every iteration, and stops within one step whatever
    became of the exception. A ``KeyboardInterrupt`` of this handler's that was
    discarded so is not reported (the loop delivers the stop); other unraisable
    errors go to the hook that was there before, which is put back on exit.
    """

    def __init__(self) -> None:
        #: The signal that asked to stop (``None``: none yet).
        self.signum: int | None = None
        self._raised: KeyboardInterrupt | None = None
        self._hook = sys.unraisablehook

    def requested(self) -> bool:
        """Whether a stop signal has come (never blocks; for a loop to ask every step)."""
        return self.signum is not None

    def __enter__(self) -> StopSignals:
        self._hook = sys.unraisablehook
        sys.unraisablehook = self._unraisable
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if sys.unraisablehook == self._unraisable:
            sys.unraisablehook = self._hook

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None:
            return  # stopping already: the clean-up goes on
        self.signum = signum
        self._raised = KeyboardInterrupt()
        raise self._raised

    def _unraisable(self, unraisable: sys.UnraisableHookArgs) -> None:
        if self._raised is None or unraisable.exc_value is not self._raised:
            self._hook(unraisable)


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
