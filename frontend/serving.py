"""uvicorn's HTTP protocol, with a deadline on a new connection's first byte.

uvicorn closes a keep-alive connection that stays silent for
``timeout_keep_alive`` seconds after a response, but arms that timer only
after a response: a connection that never sends a byte stays open for ever,
and some 20,000 of them took every file descriptor (an outside probe: every
client, ``/health`` included, was then turned away). :func:`http_protocol`
arms the same timer when a connection is made, so a silent new connection
is closed as a silent idle one is. (A client that sends part of its headers
and then stops is uvicorn's to bound; ``--body-timeout`` covers the body.)
"""

from __future__ import annotations

import asyncio
from typing import Any

__all__ = ["http_protocol"]


def http_protocol(name: str = "auto") -> type[asyncio.Protocol]:
    """uvicorn's protocol class ``name`` (``auto``, ``h11``, ``httptools``), closing a
    connection that sends nothing within its keep-alive timeout."""
    from uvicorn.config import HTTP_PROTOCOLS
    from uvicorn.importer import import_from_string

    base: Any = import_from_string(HTTP_PROTOCOLS[name])

    class FirstByteDeadline(base):  # type: ignore[misc]
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            super().connection_made(transport)
            me: Any = self  # (uvicorn's attributes, untyped here)
            if me.timeout_keep_alive_task is None and not transport.is_closing():
                me.timeout_keep_alive_task = me.loop.call_later(
                    me.timeout_keep_alive, me.timeout_keep_alive_handler)

    FirstByteDeadline.__name__ = f"FirstByteDeadline{base.__name__}"
    return FirstByteDeadline
