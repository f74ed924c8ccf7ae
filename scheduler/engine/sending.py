"""Sending on a full work channel without outliving the scheduler.

A blocking zmq send would wait out its whole send timeout (10 s) even when
the scheduler died in the first millisecond, while every pending handle was
failed with ``SchedulerGone`` at once. A send waiting for room is a pending
call too: :func:`send_waiting` waits in slices and asks between them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import zmq

from bus import PushOutbox
from messages import Request
from scheduler.errors import Overloaded

__all__ = ["send_waiting"]

#: Seconds between two liveness checks of a send waiting for room.
SLICE = 0.1


def send_waiting(out: PushOutbox[Request], reqs: Sequence[Request], lock: threading.Lock,
                 check_open: Callable[[], None], alive: Callable[[], bool],
                 timeout: float, progress: Callable[[int], None] | None = None) -> int:
    """Send ``reqs`` in order as bursts, waiting for room in slices; how many were sent.

    ``check_open()`` raises when the engine is closed or the scheduler gone;
    it is called before each attempt and whenever ``alive()`` says no.
    ``progress(n)`` is told each time ``n`` more left, so a caller that sees
    an exception knows exactly which were sent.
    ``lock`` serializes the socket (zmq sockets are not thread-safe), also
    while waiting a slice for room.

    Raises:
        Overloaded: no room for ``timeout`` seconds in a row (says how many were sent).
        EngineClosed, SchedulerGone: from ``check_open`` (promptly, within a slice).
        EncodeError: the first unsent request cannot be encoded.
    """
    sent, since = 0, time.monotonic()
    while sent < len(reqs):
        check_open()
        with lock:
            n = out.send_many_nowait(reqs[sent:])
        if n:
            sent, since = sent + n, time.monotonic()
            if progress is not None:
                progress(n)
            continue
        if time.monotonic() - since > timeout:
            raise Overloaded(reqs[sent].rid, "overloaded", "the scheduler is not taking "
                             f"requests (its work channel stayed full for {timeout:g} s): "
                             f"{sent} of {len(reqs)} were sent")
        with lock:  # room, or a slice: then is it alive?
            out.socket.poll(int(SLICE * 1000), zmq.POLLOUT)
        if not alive():
            check_open()
    return sent
