"""Operator tools under abuse: ``top`` against foreign or trickling endpoints, the metrics
server against idle and back-to-back connections, and an Engine's fds at close()."""

from __future__ import annotations

import gc
import os
import socket
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator

import pytest
from prometheus_client import CollectorRegistry, Gauge

from scheduler import Engine, ModelConfig
from scheduler.cli.top import ScrapeError, run_top, scrape
from scheduler.core.metrics_http import MetricsServer

SMALL = ModelConfig(vocab_size=128, hidden=32, layers=1, seed=3)


class _FakeServer:
    """A TCP server on 127.0.0.1 that answers every connection with ``answer(conn)``."""

    def __init__(self, answer: Callable[[socket.socket, threading.Event], None]) -> None:
        self.stop = threading.Event()
        self._sock = socket.create_server(("127.0.0.1", 0))
        self._sock.settimeout(0.1)
        self.port: int = self._sock.getsockname()[1]
        self._answer = answer
        self._threads: list[threading.Thread] = []
        self._accept = threading.Thread(target=self._run, daemon=True)
        self._accept.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            t = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            self._threads.append(t)
            t.start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                conn.recv(4096)
                self._answer(conn, self.stop)
            except OSError:
                pass

    def close(self) -> None:
        self.stop.set()
        self._accept.join()
        for t in self._threads:
            t.join()
        self._sock.close()


@pytest.fixture
def fake() -> Iterator[Callable[[Callable[[socket.socket, threading.Event], None]], int]]:
    servers: list[_FakeServer] = []

    def start(answer: Callable[[socket.socket, threading.Event], None]) -> int:
        servers.append(_FakeServer(answer))
        return servers[-1].port

    yield start
    for s in servers:
        s.close()


@pytest.mark.parametrize("reply", [
    b"\x00\x01\x02garbage that is not http\r\n\r\n",
    b"HTTP/1.0 200 OK\r\nContent-Type: text/html\r\n\r\n<html><body>hello</body></html>",
    b"HTTP/1.0 200 OK\r\n\r\n# HELP x y\nsome_other_metric 1\n",
    b"HTTP/1.0 404 Not Found\r\n\r\nnope",
], ids=["garbage", "html", "foreign-metrics", "404"])
def test_top_against_a_foreign_endpoint_prints_one_line_and_exits_1(
        fake: Callable[[Callable[[socket.socket, threading.Event], None]], int],
        capsys: pytest.CaptureFixture[str], reply: bytes) -> None:
    port = fake(lambda conn, stop: conn.sendall(reply))
    assert run_top(str(port), frames=1) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and err.startswith("top: ")


def test_top_gives_up_on_a_trickling_server_after_a_whole_response_deadline(
        fake: Callable[[Callable[[socket.socket, threading.Event], None]], int]) -> None:
    def trickle(conn: socket.socket, stop: threading.Event) -> None:
        conn.sendall(b"HTTP/1.0 200 OK\r\n")
        while not stop.wait(0.1):  # sleep-ok: one byte a tenth of a second, for ever
            conn.sendall(b"X")

    port = fake(trickle)
    t0 = time.monotonic()
    with pytest.raises(ScrapeError, match="within 1 s"):
        scrape(f"http://127.0.0.1:{port}/metrics", timeout=1.0)
    assert time.monotonic() - t0 < 10  # before: never (urlopen's timeout is per read)


@pytest.fixture
def metrics() -> Iterator[MetricsServer]:
    registry = CollectorRegistry()
    Gauge("tsb_test_value", "a test gauge", registry=registry).set(3)
    server = MetricsServer(registry, "127.0.0.1", 0, idle_timeout=0.5, deadline=1.0)
    yield server
    server.close()


def _get(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as resp:
        return str(resp.read().decode())


def test_idle_connections_cost_no_thread_and_do_not_block_a_scrape(
        metrics: MetricsServer) -> None:
    threads = threading.active_count()
    t0 = time.monotonic()
    idle = [socket.create_connection(("127.0.0.1", metrics.port), timeout=10)
            for _ in range(50)]  # back to back, and silent
    try:
        connect_s = time.monotonic() - t0
        assert "tsb_test_value 3.0" in _get(metrics.port)
        assert threading.active_count() == threads  # before: one thread per connection
        assert connect_s < 5.0  # generous: a burst past the backlog took 8 s before
        for s in idle:  # each is closed by the server once idle too long
            s.settimeout(30)
            assert s.recv(1) == b""
        assert metrics.closed_idle == 50
    finally:
        for s in idle:
            s.close()


def test_a_trickling_client_is_cut_off_at_the_deadline(metrics: MetricsServer) -> None:
    with socket.create_connection(("127.0.0.1", metrics.port), timeout=30) as s:
        s.sendall(b"G")
        deadline = time.monotonic() + 30
        try:
            while time.monotonic() < deadline:
                s.sendall(b"E")
                time.sleep(0.1)  # sleep-ok: trickling on purpose
        except OSError:
            pass  # cut off (reset)
        s.settimeout(30)
        try:
            assert s.recv(1) == b""
        except ConnectionResetError:
            pass
        assert time.monotonic() < deadline
    assert "tsb_test_value" in _get(metrics.port)  # and the server serves on


def test_a_scrape_is_answered_while_300_slowloris_connections_trickle() -> None:
    # Without this: 300 connections trickling their request held the 4 workers of the
    # old server, and a Prometheus scrape failed for minutes; here they cost a socket.
    registry = CollectorRegistry()
    Gauge("tsb_test_value", "a test gauge", registry=registry).set(3)
    slow: list[socket.socket] = []
    with MetricsServer(registry, "127.0.0.1", 0) as server:  # (its defaults: 5 s, 10 s)
        try:
            for _ in range(300):
                s = socket.create_connection(("127.0.0.1", server.port), timeout=10)
                s.sendall(b"GET /metrics HTTP/1.1\r\nX-Slow: ")
                slow.append(s)
            for _ in range(3):
                for s in slow:
                    s.sendall(b"x")  # a byte each, well within its deadline
                t0 = time.monotonic()
                assert "tsb_test_value 3.0" in _get(server.port)
                assert time.monotonic() - t0 < 5.0  # (before: 503, or nothing for minutes)
                time.sleep(0.2)  # sleep-ok: trickling on purpose
            assert server.answered == 3 and server.cut_off == server.closed_idle == 0
            for s in slow:  # every trickler is still open: none was answered or cut
                s.setblocking(False)
                with pytest.raises(BlockingIOError):
                    s.recv(1)
        finally:
            for s in slow:
                s.close()


def _fds() -> set[str]:
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.add(f"{fd}:{os.readlink(f'/proc/self/fd/{fd}')}")
        except OSError:
            pass
    return out


def test_a_closed_engine_releases_its_pipes_at_close_not_at_gc() -> None:
    with Engine("zmq", SMALL):
        pass  # warms up what lives for the whole process (zmq's context, mp's tracker)
    gc.disable()
    try:
        before = _fds()
        engine = Engine("zmq", SMALL)
        engine.close()
        left = {f for f in _fds() - before if "pipe:" in f}
        assert not left, left  # before: 2 pipes per scheduler process, until collected
    finally:
        gc.enable()
