"""The HTTP side's Prometheus families, beside the scheduler's (prefix ``tsb_http_``).

``tsb_http_requests_total{endpoint,status}``, ``tsb_http_in_flight``,
``tsb_http_ttft_seconds{endpoint}`` (time to first token as the client sees
it: from the request read to the first token's bytes handed to the server)
and ``tsb_http_loop_lag_seconds`` (how late a 20 ms timer of the event loop
fires: every request and every stream waits on that loop).
Labels are bounded: the endpoint is one of the routes (``other`` for
anything else) and the status one of the few this app answers.

As in the scheduler (:mod:`scheduler.core.metrics`), the hot path keeps
plain ints and lock-free histograms, written only by the event loop's
thread, and a collector turns them into families at scrape time:
``prometheus_client``'s own metric objects take a lock per ``inc``, five a
request, which was a tenth of the handler's time.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import prometheus_client
from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from scheduler.core.metrics import Histogram

__all__ = ["HttpMetrics"]

#: Seconds between two loop-lag probes.
LAG_INTERVAL = 0.02
_LAG_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0)
_TTFT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                 5.0, 10.0)


class HttpMetrics:
    """The HTTP families: recorded by the event loop, read by :meth:`text`.

    Attributes:
        in_flight: requests being answered now (a plain int the app moves).
    """

    def __init__(self) -> None:
        self.in_flight = 0
        self._answered: dict[tuple[str, int], int] = {}
        self._ttft: dict[str, Histogram] = {}
        self.loop_lag = Histogram(_LAG_BUCKETS)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(self))

    def answered(self, endpoint: str, status: int) -> None:
        """Count one answer."""
        key = (endpoint, status)
        self._answered[key] = self._answered.get(key, 0) + 1

    def first_token(self, endpoint: str, seconds: float) -> None:
        """Record one time to first token."""
        hist = self._ttft.get(endpoint)
        if hist is None:
            hist = self._ttft[endpoint] = Histogram(_TTFT_BUCKETS)
        hist.observe(seconds)

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

    def families(self) -> Iterator[Metric]:
        """The families as they stand (a copy of each dict first: a scrape may run on
        another thread than the loop that writes them)."""
        requests = CounterMetricFamily("tsb_http_requests", "HTTP requests answered, by "
                                       "endpoint and status", labels=["endpoint", "status"])
        for (endpoint, status), n in sorted(dict(self._answered).items()):
            requests.add_metric([endpoint, str(status)], n)
        yield requests
        yield GaugeMetricFamily("tsb_http_in_flight", "HTTP requests being answered",
                                value=self.in_flight)
        ttft = HistogramMetricFamily("tsb_http_ttft_seconds", "Time to first token as the "
                                     "client sees it (request read to first token sent)",
                                     labels=["endpoint"])
        for endpoint, hist in sorted(dict(self._ttft).items()):
            hist.add_to(ttft, [endpoint])
        yield ttft
        yield self.loop_lag.family("tsb_http_loop_lag_seconds", "How late the event loop "
                                   "runs a timer (probed every 20 ms)")


class _Collector(Collector):
    def __init__(self, metrics: HttpMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        return self._metrics.families()
