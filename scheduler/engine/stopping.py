"""How an engine's close stops what runs its scheduler, within one deadline.

``close(timeout)`` bounds the whole close: the shutdown rpc and the exits
share one deadline, and a scheduler process still running at its end (hung,
stopped) is killed (else a stopped scheduler would hold a frontend's exit
past its close timeout). An embedded scheduler is a thread of the caller,
which cannot be killed: it gets the step it is in.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Collection, Iterable
from multiprocessing.process import BaseProcess

__all__ = ["SEND_AT_LEAST", "close_timeout", "stop_processes", "stop_thread"]

log = logging.getLogger("scheduler.engine")

#: close(None) and close(inf): as long as it takes (11 days: a bound every join and
#: wait takes, poll(2)'s milliseconds included).
_FOREVER = 1e6
#: The shutdown rpc's least wait, so that it is sent even by close(0).
SEND_AT_LEAST = 0.1
#: Seconds a data-parallel replica gets to exit after its dispatcher did.
_REPLICA_GRACE = 2.0


def close_timeout(timeout: float | None) -> float:
    """``close``'s ``timeout`` as seconds every wait takes: None or inf, as long as it
    takes; NaN or below 0, none. A timeout that is no number raises TypeError here,
    before anything is closed (raised once the engine is marked closed, every
    request would hang and the processes stay)."""
    if timeout is None or timeout > _FOREVER:
        return _FOREVER
    return timeout if timeout > 0 else 0.0


def stop_thread(thread: threading.Thread, deadline: float) -> None:
    """Join an embedded scheduler's thread, which has the shutdown: by ``deadline``,
    else through the step it is in (its rings must outlive it: released under a
    running thread, they abort the process at exit)."""
    thread.join(max(0.1, deadline - time.monotonic()))
    if thread.is_alive():
        log.warning("the embedded scheduler is still in a step at the close's deadline: "
                    "waiting for it to end")
        thread.join()


def stop_processes(procs: Iterable[BaseProcess], essential: Collection[BaseProcess],
                   deadline: float, *, kill_now: bool) -> bool:
    """Join each process by ``deadline``, then kill it; returns whether any was killed.

    A process not in ``essential`` (a replica the dispatcher could not shut down:
    lost, stopped) gets a short grace once the dispatcher is gone, not what is
    left of the deadline. ``kill_now``: a rank died, the others may wait on it
    for ever."""
    killed = False
    for proc in procs:
        if kill_now:
            proc.kill()
            killed = True
        left = deadline - time.monotonic()
        proc.join(max(0.1, left if proc in essential else min(left, _REPLICA_GRACE)))
        if proc.is_alive():
            proc.kill()
            proc.join()
            killed = True
    return killed
