"""How ``python -m frontend`` runs a :class:`~frontend.app.Frontend`: the engine is started
before the server says a word, closed on every way out, and no signal cuts that close.

Three phases, one signal handler for SIGINT and SIGTERM across them:

* **starting**: the engine starts (the model loads, in this process or a
  scheduler process) before uvicorn runs, so a start that fails is one line
  (``error: ...``, exit 1) rather than uvicorn's start-up lines and a
  traceback. A first signal cancels the start (which closes what it began);
* **serving**: uvicorn's own handling (the first signal drains, a second
  SIGINT stops waiting for open connections). A signal that comes before
  uvicorn has installed its handlers is handed to it all the same;
* **closing**: the engine is closed, whatever ended the serving (a forced
  exit skips the lifespan's shutdown, so it is closed here, not by the
  lifespan alone). Signals are noted and ignored: a second Ctrl-C never cuts
  the close, so the embedded scheduler's thread has ended and the scheduler
  processes are gone before the interpreter exits (a thread still in torch
  at exit aborts the process: "terminate called without an active
  exception", SIGABRT).
"""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import Callable
from types import FrameType

import uvicorn

from frontend.app import Frontend
from scheduler import ModelLoadError
from scheduler.cli.signals import STOP_SIGNALS, ignore_stop_signals

__all__ = ["run"]


class _Signals:
    """The SIGINT and SIGTERM handler of a run, by phase (see the module docstring)."""

    def __init__(self) -> None:
        self.loop: asyncio.AbstractEventLoop | None = None
        self.starting: asyncio.Task[int] | None = None
        self.server: uvicorn.Server | None = None
        self.received = 0

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.received += 1
        if self.server is not None:
            self.server.handle_exit(signum, frame)
        elif self.starting is not None and self.loop is not None:
            self.loop.call_soon_threadsafe(self.starting.cancel)
            self.starting = None  # once: the start closes what it began


def run(app: Frontend, server: uvicorn.Server, announce: Callable[[], None]) -> int:
    """Start ``app``'s engine, call ``announce``, serve ``server`` until stopped, close; the
    exit status.

    0 once stopped by a signal or a shutdown, 1 when the engine did not start
    (its reason printed in one line), 3 when the server did not start (uvicorn's
    status for that).
    """
    handler = _Signals()
    for sig in STOP_SIGNALS:
        signal.signal(sig, handler)
    try:
        with asyncio.Runner(loop_factory=server.config.get_loop_factory()) as runner:
            return runner.run(_run(app, server, handler, announce))
    finally:
        ignore_stop_signals()


async def _run(app: Frontend, server: uvicorn.Server, handler: _Signals,
               announce: Callable[[], None]) -> int:
    handler.loop = asyncio.get_running_loop()
    handler.starting = asyncio.current_task()
    try:
        try:
            if handler.received:  # a signal before this task could be cancelled
                raise asyncio.CancelledError
            await app.start()
        except asyncio.CancelledError:
            print("interrupted while starting: stopped", file=sys.stderr)
            return 0
        except ModelLoadError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        except Exception as exc:  # (SchedulerGone, RpcTimeout, EndpointInUse, ...)
            print(f"error: the engine did not start: {type(exc).__name__}: {exc}",
                  file=sys.stderr)
            return 1
        handler.starting = None
        handler.server = server
        announce()
        await server.serve()
        return 0 if server.started else 3
    finally:
        handler.starting = handler.server = None  # closing: signals are only counted
        await app.close()

