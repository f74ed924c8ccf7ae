"""A server's open-file limit: raised to the hard limit at start-up, said when low, and
the connections it holds under it.

Every connection a server holds is a file descriptor, and so is every
socket, pipe and eventfd it holds besides. The usual soft limit on open
files (``ulimit -n``) is 1,024: under it an HTTP server holds about 1,000
concurrent clients, and past that the kernel refuses ``accept()``. The
hard limit is the ceiling a process may raise its own soft limit to
without privileges (commonly 524,288 or 1,048,576), so a server raises its
soft limit to it at start-up, as vLLM and SGLang do
(``python -m frontend``, ``python -m scheduler serve`` and ``dispatch``
call :func:`raise_open_files_limit`). Where the hard limit itself is low
(below :data:`LOW_HARD_LIMIT`), the server logs one line saying what that
caps and how to raise it.

The raised limit is inherited by the processes a server starts (replicas,
ranks). Nothing here uses ``select()``, whose descriptors must stay below
1,024: every wait is ``poll``/``epoll`` (:mod:`bus.fdwait`).

A server that accepts connections holds at most what its limit leaves
(:class:`ConnectionBudget`, from :func:`open_files_limit` and
:func:`files_in_use`), and when ``accept()`` fails for lack of descriptors
all the same (:data:`NO_FILES`) it stops reading its listening socket for
a moment rather than spin on it (``python -m frontend``'s
``frontend.listening.Acceptor``, the scheduler's metrics port).
"""

from __future__ import annotations

import errno
import logging
import os
import resource
from dataclasses import dataclass

__all__ = ["ACCEPT_GONE", "LOW_HARD_LIMIT", "NO_FILES", "ConnectionBudget", "files_in_use",
           "open_files_limit", "raise_open_files_limit"]

log = logging.getLogger("bus.fdlimit")

#: A hard limit on open files below this is logged at start-up as a ceiling on clients.
LOW_HARD_LIMIT = 65536
#: ``accept()`` errors that mean "no descriptor (or memory) for one more connection".
NO_FILES = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
#: ``accept()`` errors that concern one connection only (it left before it was taken).
ACCEPT_GONE = frozenset({errno.ECONNABORTED, errno.EPROTO, errno.EPERM, errno.ECONNRESET})


def open_files_limit() -> int:
    """This process's soft limit on open files (``RLIMIT_NOFILE``); a large number
    (``2**31 - 1``) where it is unlimited."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return 2**31 - 1 if soft == resource.RLIM_INFINITY else soft


def _nr_open() -> int:
    """The kernel's ceiling on a process's open files (Linux: ``fs.nr_open``)."""
    try:
        with open("/proc/sys/fs/nr_open") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 1 << 20


def raise_open_files_limit(server: str) -> int:
    """Raise this process's soft limit on open files to its hard limit; returns the
    soft limit it has now. Logs one warning when the hard limit is below
    :data:`LOW_HARD_LIMIT` (naming ``server``, what the limit caps, and how to
    raise it), and one when the soft limit cannot be raised. Never raises: a
    server that cannot raise its limit still serves, under the one it has.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = _nr_open() if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            log.warning("%s: could not raise the soft limit on open files from %d to %d "
                        "(%s): it serves about %d connections at once", server, soft,
                        target, exc, soft)
    if hard != resource.RLIM_INFINITY and hard < LOW_HARD_LIMIT:
        log.warning("%s: the hard limit on open files is %d (ulimit -Hn): it holds at most "
                    "that many connections, sockets and files at once, and a client past "
                    "that is refused; raise it (ulimit -Hn, systemd LimitNOFILE=, docker "
                    "--ulimit nofile=) to serve more", server, hard)
    return open_files_limit() if soft == resource.RLIM_INFINITY else soft


def files_in_use() -> int:
    """How many descriptors this process has open (Linux: ``/proc/self/fd``; else 64)."""
    try:
        return max(0, len(os.listdir("/proc/self/fd")) - 1)  # (less listdir's own)
    except OSError:
        return 64


@dataclass(frozen=True)
class ConnectionBudget:
    """How many connections a server holds under its open-file limit.

    Attributes:
        files: the open-file limit (soft ``RLIMIT_NOFILE``).
        serve: connections served at once; a new one past them is answered 503.
        accept: connections open at once (served or being answered 503); past
            them a new connection waits in the listen backlog.
    """

    files: int
    serve: int
    accept: int

    @classmethod
    def for_limit(cls, files: int, in_use: int) -> ConnectionBudget:
        """The budget for an open-file limit of ``files`` with ``in_use`` descriptors
        already open: a spare of 1/32 of the limit (at least 32) is left for what the
        process opens later (rpc clients, files), an eighth of the rest (at most 64)
        for connections that are answered 503."""
        accept = max(2, files - in_use - max(32, files // 32))
        return cls(files, max(1, accept - max(1, min(64, accept // 8))), accept)
