"""A real frontend server on 127.0.0.1 (an ephemeral port) in a thread of the test process.

``uvicorn`` serves the app on its own event loop in a thread; the test
drives it over HTTP with the ``openai`` client or ``httpx``. ``stop()`` asks
uvicorn to exit (the lifespan closes the engine) and joins the thread.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from typing import TypeVar, cast

import numpy.typing as npt
import openai
import uvicorn

from frontend import Frontend, Settings, Tokenizer
from frontend.serving import http_protocol
from messages import SamplingParams
from scheduler import AsyncEngine, StreamChunk
from tests.conftest import eventually

T = TypeVar("T")


def raw_post(path: str, body: object, *, close: bool = False) -> bytes:
    """The bytes of one POST of ``body`` as JSON, for tests that speak HTTP by hand
    (pipelining, leaving mid-answer); ``close``: ask the server to close after it."""
    data = json.dumps(body).encode()
    head = [f"POST {path} HTTP/1.1", "host: test", "content-type: application/json",
            f"content-length: {len(data)}", *(["connection: close"] if close else [])]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + data


class Server:
    """One frontend server, started at construction, stopped by :meth:`stop`."""

    def __init__(self, settings: Settings, tokenizer: Tokenizer, *,
                 engine: Callable[[Settings], AsyncEngine] | None = None,
                 timeout_keep_alive: int = 5, head_timeout: float = 30.0,
                 max_head_bytes: int = 64 << 10, send_timeout: float = 30.0,
                 http: str = "auto") -> None:
        self.app = Frontend(settings, tokenizer, engine=engine)
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(self.app, lifespan="on", log_level="warning",
                                access_log=False, http=http_protocol(
                                    http, head_timeout=head_timeout,
                                    max_head_bytes=max_head_bytes,
                                    send_timeout=send_timeout),
                                timeout_keep_alive=timeout_keep_alive)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, args=([self._sock],),
                                        name="frontend-test-server", daemon=True)
        self._thread.start()
        eventually(lambda: self._server.started or not self._thread.is_alive(), 60.0,
                   "the frontend to start")
        if not self._server.started:
            self._sock.close()
            raise RuntimeError("the frontend did not start (see the log)")

    @property
    def engine(self) -> AsyncEngine:
        assert self.app.engine is not None
        return self.app.engine

    def on_loop(self, fn: Callable[[], T]) -> T:
        """``fn()``, run on the server's event loop (its tasks are the loop's to touch)."""
        loop = self.engine._loop
        assert loop is not None

        async def run() -> T:
            return fn()

        return asyncio.run_coroutine_threadsafe(run(), loop).result(30)

    def transport_of(self, client: socket.socket) -> asyncio.WriteTransport:
        """The server's transport for ``client``'s connection (found among uvicorn's
        open connections by the client's address, waiting for it to be accepted)."""
        me = client.getsockname()
        found: list[asyncio.WriteTransport] = []

        def accepted() -> bool:
            for protocol in list(self._server.server_state.connections):
                transport = getattr(protocol, "transport", None)
                if transport is not None and transport.get_extra_info("peername") == me:
                    found.append(transport)
                    return True
            return False

        eventually(accepted, 10.0, f"the server to accept {me}")
        return found[0]

    def tasks(self, qualname: str) -> list[asyncio.Task[object]]:
        """The server's tasks running a coroutine of ``qualname`` (call on its loop)."""
        return [t for t in asyncio.all_tasks()
                if getattr(t.get_coro(), "__qualname__", "") == qualname]

    def cancel_answers(self) -> int:
        """Cancel every request being answered, as uvicorn's shutdown does past its grace
        period; returns how many (call on the loop: :meth:`on_loop`)."""
        tasks = self.tasks("RequestResponseCycle.run_asgi")
        for t in tasks:
            t.cancel(msg="Task cancelled, timeout graceful shutdown exceeded")
        return len(tasks)

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(60.0)
        self._sock.close()
        assert not self._thread.is_alive(), "the frontend did not stop"


class ScriptedEngine(AsyncEngine):
    """The real engine and scheduler, with each request's k-th new token replaced by
    ``script[k]``: the steps, their timing and every abort are real; only the ids
    are the test's (an untrained model's own ids say nothing about CJK text)."""

    script: Sequence[int] = ()

    def stream_steps(self, input_ids: npt.ArrayLike, sampling: SamplingParams | None = None,
                     *, return_logprob: bool = False, rid: str | None = None,
                     dp_rank: int | None = None) -> AsyncIterator[list[StreamChunk]]:
        return self._scripted(super().stream_steps(input_ids, sampling,
                                                   return_logprob=return_logprob, rid=rid,
                                                   dp_rank=dp_rank))

    async def _scripted(self, steps: AsyncIterator[list[StreamChunk]]
                        ) -> AsyncIterator[list[StreamChunk]]:
        k = 0
        script = self.script
        try:
            async for chunks in steps:
                out = []
                for chunk in chunks:
                    n = len(chunk.token_ids)
                    ids = tuple(script[(k + i) % len(script)] for i in range(n))
                    k += n
                    out.append(StreamChunk(chunk.rid, ids, chunk.finish_reason, chunk.logprobs))
                yield out
        finally:
            await cast(AsyncGenerator[list[StreamChunk], None], steps).aclose()


#: The openai clients the running test made (closed when it ends: tests/frontend/conftest.py).
_CLIENTS: list[openai.OpenAI] = []


def openai_client(server: Server, timeout: float | None = None) -> openai.OpenAI:
    """An ``openai`` client of ``server`` (no retries), closed once the test that made it
    ends: an unclosed one keeps its pooled connections open until a collection finds it."""
    client = (openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
              if timeout is None else
              openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                            timeout=timeout))
    _CLIENTS.append(client)
    return client


def close_clients() -> None:
    """Close every client :func:`openai_client` made since the last call."""
    while _CLIENTS:
        _CLIENTS.pop().close()
