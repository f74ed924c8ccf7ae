"""The HTTP side's Prometheus families, beside the scheduler's (prefix ``tsb_http_``).

``tsb_http_requests_total{endpoint,status}``, ``tsb_http_in_flight``,
``tsb_http_ttft_seconds{endpoint}`` (time to first token as the client sees
it: from the request read to the first token's bytes handed to the server)
and ``tsb_http_loop_lag_seconds`` (how late a 20 ms timer of the event loop
fires: every request and every stream waits on that loop).
Labels are bounded: the endpoint is one of the routes (``other`` for
anything else) and the status one of the few this app answers.
"""

from __future__ import annotations

import asyncio

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["HttpMetrics"]

#: Seconds between two loop-lag probes.
LAG_INTERVAL = 0.02
_LAG_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0)
_TTFT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                 5.0, 10.0)


class HttpMetrics:
    """The HTTP families, in a registry of their own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._requests = Counter("tsb_http_requests", "HTTP requests answered, by endpoint "
                                 "and status", ["endpoint", "status"], registry=self.registry)
        self.in_flight = Gauge("tsb_http_in_flight", "HTTP requests being answered",
                               registry=self.registry)
        self._ttft = Histogram("tsb_http_ttft_seconds", "Time to first token as the client "
                               "sees it (request read to first token sent)", ["endpoint"],
                               buckets=_TTFT_BUCKETS, registry=self.registry)
        self.loop_lag = Histogram("tsb_http_loop_lag_seconds", "How late the event loop runs "
                                  "a timer (probed every 20 ms)", buckets=_LAG_BUCKETS,
                                  registry=self.registry)
        self._children: dict[tuple[str, int], Counter] = {}
        self._ttft_children: dict[str, Histogram] = {}

    def answered(self, endpoint: str, status: int) -> None:
        """Count one answer."""
        key = (endpoint, status)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self._requests.labels(endpoint, str(status))
        child.inc()

    def first_token(self, endpoint: str, seconds: float) -> None:
        """Record one time to first token."""
        child = self._ttft_children.get(endpoint)
        if child is None:
            child = self._ttft_children[endpoint] = self._ttft.labels(endpoint)
        child.observe(seconds)

    def text(self) -> bytes:
        """The families in the text exposition format."""
        return prometheus_client.generate_latest(self.registry)

    async def probe_loop_lag(self) -> None:
        """Record the loop's lag until cancelled (a task of the server's loop)."""
        loop = asyncio.get_running_loop()
        observe = self.loop_lag.observe
        while True:
            t = loop.time()
            await asyncio.sleep(LAG_INTERVAL)
            observe(max(0.0, loop.time() - t - LAG_INTERVAL))
