"""uvicorn's HTTP protocol, with a deadline on a new connection's first byte, paced.

uvicorn closes a keep-alive connection that stays silent for
``timeout_keep_alive`` seconds after a response, but arms that timer only
after a response: a connection that never sends a byte stays open for ever,
and some 20,000 of them took every file descriptor (an outside probe: every
client, ``/health`` included, was then turned away). :func:`http_protocol`
arms the same timer when a connection is made, so a silent new connection
is closed as a silent idle one is. (A client that sends part of its headers
and then stops is uvicorn's to bound; ``--body-timeout`` covers the body.)

Its received bytes also take their turn on the loop (:mod:`frontend.turns`):
past the iteration's slice, a connection's bytes wait, unread, for a later
iteration, so a burst of arriving requests is parsed a share at a time. And
a client that leaves is seen by every request of its connection, not only
the last one it pipelined (uvicorn tells that one alone).
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any

from frontend.turns import loop_turns

__all__ = ["http_protocol"]


def http_protocol(name: str = "auto") -> type[asyncio.Protocol]:
    """uvicorn's protocol class ``name`` (``auto``, ``h11``, ``httptools``), closing a
    connection that sends nothing within its keep-alive timeout."""
    from uvicorn.config import HTTP_PROTOCOLS
    from uvicorn.importer import import_from_string

    base: Any = import_from_string(HTTP_PROTOCOLS[name])

    class Guarded(base):  # type: ignore[misc]
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            super().connection_made(transport)
            self._turns = loop_turns()  # (looked up once, not per read)
            me: Any = self  # (uvicorn's attributes, untyped here)
            if me.timeout_keep_alive_task is None and not transport.is_closing():
                me.timeout_keep_alive_task = me.loop.call_later(
                    me.timeout_keep_alive, me.timeout_keep_alive_handler)

        _paced = False  # reading paused until its bytes' turn

        # A request pipelined behind one still answering becomes the
        # connection's ``cycle``, and uvicorn tells only that one when the
        # client leaves: the earlier one never saw its disconnect, so it held
        # its slot to its end (outside probe: a non-streamed request, or any
        # stream on the asyncio loop, ran to max_tokens). The earlier ones are
        # kept here (until answered) and told too.
        @property
        def cycle(self) -> Any:
            return self.__dict__.get("_cycle")

        @cycle.setter
        def cycle(self, new: Any) -> None:
            old = self.__dict__.get("_cycle")
            if old is not None and old is not new and not old.response_complete:
                earlier = self.__dict__.setdefault("_earlier", [])
                earlier[:] = [c for c in earlier if not c.response_complete]
                earlier.append(old)
            self.__dict__["_cycle"] = new

        def connection_lost(self, exc: Exception | None) -> None:
            super().connection_lost(exc)
            for c in self.__dict__.pop("_earlier", ()):
                if not c.response_complete:
                    c.disconnected = True
                    c.message_event.set()

        def data_received(self, data: bytes) -> None:
            # Bytes take their turn on the loop (frontend.turns): 256 requests
            # arriving at once were all parsed, and their tasks made, in one
            # iteration (~50 us each: 13 ms of held loop). A connection whose
            # bytes wait is not read meanwhile (nothing piles up unparsed).
            if not self._turns.call(functools.partial(self._in_turn, data)):
                self.transport.pause_reading()
                self._paced = True

        def _in_turn(self, data: bytes) -> None:
            transport: Any = self.transport
            if transport.is_closing():
                return
            if self._paced:  # first: parsing may pause it again (uvicorn's flow control)
                self._paced = False
                transport.resume_reading()
            super().data_received(data)

    Guarded.__name__ = f"Guarded{base.__name__}"
    return Guarded
