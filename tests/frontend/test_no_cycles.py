"""An answered request leaves no cyclic garbage behind (each mode, every kind of answer).

Cyclic garbage is freed only by the cycle collector, and a full collection
over 256 streams' leftovers held the event loop 30-45 ms (measured): the
frontend's objects must be freed by their reference counts alone.
"""

from __future__ import annotations

import gc
import socket
from collections import Counter

from tests.conftest import eventually
from tests.frontend.server import Server, raw_post

_OURS = ("frontend", "uvicorn", "scheduler")


def _ask(server: Server, path: str, body: object) -> bytes:
    """One request on its own connection (closed by the server after the answer)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(raw_post(path, body, close=True))
        out = b""
        while data := sock.recv(1 << 16):
            out += data
    return out


def test_answered_requests_leave_no_cyclic_garbage(server: Server) -> None:
    asks = [
        ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 4}),
        ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 4,
                             "stream": True}),
        ("/v1/chat/completions", {"model": "tiny", "max_tokens": 3, "stream": True,
                                  "messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": -1}),  # a 400
    ]
    metrics = server.app.metrics
    assert metrics is not None
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)  # what a collection finds is kept, to be looked at
    try:
        for _ in range(3):
            for path, body in asks:
                out = _ask(server, path, body)
                assert out.startswith((b"HTTP/1.1 200", b"HTTP/1.1 400")), out[:200]
        eventually(lambda: metrics.in_flight == 0, 30.0, "every request to be answered")
        gc.collect()
        ours = Counter(type(o).__qualname__ for o in gc.garbage
                       if type(o).__module__.split(".")[0] in _OURS)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    assert not ours, f"cyclic garbage left by answered requests: {ours.most_common(10)}"


def test_a_client_that_leaves_with_a_request_pipelined_leaves_no_watcher(server: Server) -> None:
    """A stream, a request pipelined behind it, then the client leaves: uvicorn gives the
    disconnect to the second one, and the first one's watcher used to wait for ever
    (without it: 778 left of 1,500 such clients)."""
    req = raw_post("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 100000,
                                       "ignore_eos": True, "stream": True})
    for _ in range(10):
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
            sock.sendall(req + b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
            assert sock.recv(100)  # the stream started
    eventually(lambda: not server.on_loop(lambda: server.tasks("Conn._wait")), 30.0,
               "every watcher to end")
