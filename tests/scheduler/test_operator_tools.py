"""Operator tools under abuse: ``top`` against foreign or trickling endpoints, the metrics
server against idle and back-to-back connections, and an Engine's fds at close()."""

from __future__ import annotations

import gc
import logging
import os
import resource
import socket
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator

import pytest
from prometheus_client import CollectorRegistry, Gauge

from bus.fdlimit import ConnectionBudget, files_in_use
from scheduler import Engine, ModelConfig
from scheduler.cli.top import ScrapeError, run_top, scrape
from scheduler.core.metrics_http import MetricsServer
from tests.conftest import eventually

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


@pytest.fixture
def nofile() -> Iterator[None]:
    """The soft limit on open files, put back after the test."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _limit_to(more: int) -> None:
    """Lower the soft limit so that exactly ``more`` more descriptors can be opened."""
    used = {int(fd) for fd in os.listdir("/proc/self/fd")}
    free = [n for n in range(max(used) + more + 2) if n not in used]
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (free[more], hard))


def _accept_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "accept" in r.getMessage()]


def _scrape_on(sock: socket.socket, port: int) -> bytes:
    """``GET /metrics`` on a socket made before the descriptors ran out."""
    sock.settimeout(30)
    sock.connect(("127.0.0.1", port))
    sock.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
    got = b""
    while chunk := sock.recv(65536):
        got += chunk
    return got


def test_out_of_descriptors_the_metrics_port_pauses_instead_of_spinning(
        nofile: None, caplog: pytest.LogCaptureFixture) -> None:
    # Outside review: with no descriptor left, accept() failed and the listener stayed
    # readable: 169,726 identical warnings in 8 s, a thread spinning at 100% CPU.
    registry = CollectorRegistry()
    Gauge("tsb_test_value", "a test gauge", registry=registry).set(3)
    clients = [socket.socket() for _ in range(20)]
    scraper = socket.socket()
    with caplog.at_level(logging.WARNING, logger="scheduler.metrics"), \
            MetricsServer(registry, "127.0.0.1", 0) as server:
        try:
            _limit_to(0)
            for c in clients:  # (no descriptor needed: the sockets exist)
                c.setblocking(False)
                assert c.connect_ex(("127.0.0.1", server.port)) in (0, 115)  # EINPROGRESS
            eventually(lambda: bool(_accept_lines(caplog)), 30, "an accept() to fail")
            failed = server.accept_failures
            time.sleep(1.0)  # sleep-ok: a window in which a spinning accept fails thousands
            lines = _accept_lines(caplog)
            assert len(lines) == 1, (len(lines), lines[:3])  # a summary, not a line each
            assert "out of file descriptors" in lines[0]
            assert server.accept_failures - failed <= 30  # a pause of 0.1 s between tries
        finally:
            for c in clients:
                c.close()
        _limit_to(64)
        assert b"tsb_test_value 3.0" in _scrape_on(scraper, server.port)  # serving again
        scraper.close()


def test_out_of_descriptors_an_idle_connection_makes_room_for_a_scrape(
        nofile: None, caplog: pytest.LogCaptureFixture) -> None:
    registry = CollectorRegistry()
    Gauge("tsb_test_value", "a test gauge", registry=registry).set(3)
    idle = [socket.socket() for _ in range(10)]
    scraper = socket.socket()
    with caplog.at_level(logging.WARNING, logger="scheduler.metrics"), \
            MetricsServer(registry, "127.0.0.1", 0, idle_timeout=60) as server:
        try:
            _limit_to(3)
            for c in idle:
                c.setblocking(False)
                assert c.connect_ex(("127.0.0.1", server.port)) in (0, 115)
            assert b"tsb_test_value 3.0" in _scrape_on(scraper, server.port)
        finally:
            for c in [*idle, scraper]:
                c.close()
        assert 1 <= server.accept_failures <= 30
        assert len(_accept_lines(caplog)) == 1


def test_the_metrics_port_holds_what_the_open_file_limit_leaves(nofile: None) -> None:
    _limit_to(200)
    limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    budget = ConnectionBudget.for_limit(limit, files_in_use())
    with MetricsServer(CollectorRegistry(), "127.0.0.1", 0) as server:
        assert server.max_connections == budget.accept < 200  # (before: 1,024 whatever the limit)
