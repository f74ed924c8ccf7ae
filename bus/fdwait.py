"""Wait for file descriptors to become readable, whatever their number.

``select()`` takes descriptors below ``FD_SETSIZE`` (1,024) only,
and raises ``ValueError`` for one above it. A server raises its soft
open-file limit to the hard one at start-up (:mod:`bus.fdlimit`), so the
descriptor of a pidfd, eventfd or socket opened while it holds a thousand
connections is above 1,024. Every wait on a raw descriptor in this project
goes through :func:`wait_readable` (``poll``, no such bound); a test keeps
``select.select`` out of the packages.
"""

from __future__ import annotations

import errno
import os
import select
from collections.abc import Sequence

__all__ = ["wait_readable"]

_READ = select.POLLIN | select.POLLPRI | select.POLLHUP | select.POLLERR


def wait_readable(fds: Sequence[int], timeout: float | None) -> list[int]:
    """The descriptors of ``fds`` that are readable (or hung up, or in error) within
    ``timeout`` seconds (``None``: wait until one is; ``0``: look without waiting),
    in the order of ``fds``; an empty list if none is in time.

    Raises:
        ValueError: a descriptor is negative.
        OSError: a descriptor is not open (``EBADF``).
    """
    poller = select.poll()
    for fd in fds:
        poller.register(fd, _READ)
    ms = None if timeout is None else max(0, int(timeout * 1000 + 0.999))
    events = dict(poller.poll(ms))
    if any(ev & select.POLLNVAL for ev in events.values()):
        bad = [fd for fd, ev in events.items() if ev & select.POLLNVAL]
        raise OSError(errno.EBADF, f"{os.strerror(errno.EBADF)}: fd {bad[0]}")
    return [fd for fd in fds if fd in events]
