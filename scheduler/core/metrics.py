"""Prometheus metrics of one scheduler, recorded per batch and read at scrape time.

The hot path records nothing Prometheus-shaped: it keeps plain counters (a
dict increment per received message, an int per routed output) and feeds
latency histograms once per step with the whole step's values
(:class:`Histogram.observe_many`).
A scrape runs :class:`SchedulerCollector`, which turns those counters and
the scheduler's live sizes into metric families. So there is no lock and no
per-message allocation on the loop's thread, and a scrape from the HTTP
thread reads plain ints and a small array.

Every name has the prefix ``tsb_`` and follows Prometheus conventions
(``_total`` counters, ``_seconds`` histograms). Labels take values from
bounded sets only: inbox names, request/output class names, sink class
names, rpc method names registered on the scheduler (others count as
``unknown``), and the fixed reject/refusal reasons below. The list of names
is in ``docs/ARCHITECTURE.md``.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from messages import DecodeError, NotCarried

if TYPE_CHECKING:  # the loop imports this module; only types flow back
    from scheduler.core.batch import Seq
    from scheduler.core.loop import Scheduler

__all__ = ["PREFIX", "Histogram", "SchedulerCollector", "SchedulerMetrics", "metrics_text",
           "reject_reason"]

PREFIX = "tsb_"

#: Latency buckets, seconds: 100 µs to 60 s.
LATENCY_BUCKETS: tuple[float, ...] = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
    2.5, 5.0, 10.0, 30.0, 60.0,
)

#: Why a frame was rejected, as a bounded label (see :func:`reject_reason`).
REJECT_REASONS = ("malformed", "oversized", "invalid_field", "unknown_type", "duplicate_rid",
                  "wrong_channel")


def reject_reason(err: DecodeError) -> str:
    """Map a :class:`~messages.DecodeError` to one of :data:`REJECT_REASONS`."""
    reason = err.reason
    if "max_frames" in reason or "max_message_bytes" in reason:
        return "oversized"
    if err.message_type is None:
        return "malformed"
    if isinstance(err, NotCarried):  # a type this channel does not carry
        return "wrong_channel"
    if reason.startswith("message type: ") or (err.rid is None and "tag" in reason.lower()):
        return "unknown_type"
    return "invalid_field"


class Histogram:
    """Bucket counts and a sum, fed a batch at a time; no lock (one writer thread).

    Plain lists and ``bisect``: for the few dozen values a step yields, that
    costs ~0.1 µs a value, where a numpy pass has ~10 µs of fixed cost.
    """

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: Sequence[float] = LATENCY_BUCKETS) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last: +Inf
        self.total = 0.0

    def observe(self, value: float) -> None:
        """Record one value."""
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    def observe_many(self, values: Sequence[float]) -> None:
        """Record a batch of values."""
        counts, bounds, find = self.counts, self.bounds, bisect.bisect_left
        for v in values:
            counts[find(bounds, v)] += 1
        self.total += sum(values)

    def family(self, name: str, doc: str, labels: Sequence[str] = (),
               values: Sequence[str] = ()) -> HistogramMetricFamily:
        """This histogram as a metric family (for a collector)."""
        fam = HistogramMetricFamily(name, doc, labels=list(labels) or None)
        self.add_to(fam, values)
        return fam

    def add_to(self, fam: HistogramMetricFamily, values: Sequence[str] = ()) -> None:
        """Add this histogram as one labelled sample set of ``fam``."""
        cum = list(itertools.accumulate(self.counts))
        buckets = [(repr(b), c) for b, c in zip(self.bounds, cum, strict=False)]
        buckets.append(("+Inf", cum[-1]))
        fam.add_metric(list(values), buckets, self.total)


class SchedulerMetrics:
    """What the scheduler's loop records: counters per label set, and latency histograms.

    Written only by the loop's thread. Attributes are plain dicts and
    :class:`Histogram` objects; :class:`SchedulerCollector` reads them.
    """

    def __init__(self) -> None:
        # (inbox, request class): the class, not its name, so the loop pays
        # no attribute lookup per message; names are taken at scrape time.
        self.received: dict[tuple[str, type], int] = {}
        self.rejected: dict[tuple[str, str], int] = {}  # (inbox, reason)
        self.rpc: dict[str, Histogram] = {}  # method -> latency
        self.step = Histogram()
        self.queue_wait = Histogram()
        self.ttft = Histogram()
        self.itl = Histogram()
        self.e2e = Histogram()

    def on_tokens(self, seqs: Sequence[Seq], now: float) -> None:
        """Time a step's tokens: first tokens, gaps between tokens, finished requests."""
        first: list[float] = []
        waits: list[float] = []
        gaps: list[float] = []
        done: list[float] = []
        for s in seqs:
            if s.t_last == 0.0:
                first.append(now - s.t_arrival)
                waits.append(s.t_admit - s.t_arrival)
            else:
                gaps.append(now - s.t_last)
            s.t_last = now
            if s.finished is not None:
                done.append(now - s.t_arrival)
        if first:
            self.ttft.observe_many(first)
            self.queue_wait.observe_many(waits)
        self.itl.observe_many(gaps)
        self.e2e.observe_many(done)

    def on_embedded(self, seqs: Sequence[Seq], now: float) -> None:
        """Time a step's finished embeddings."""
        self.queue_wait.observe_many([s.t_admit - s.t_arrival for s in seqs])
        self.e2e.observe_many([now - s.t_arrival for s in seqs])

    def reject(self, inbox: str, err: DecodeError) -> None:
        """Count one rejected frame (cold path)."""
        key = (inbox, reject_reason(err))
        self.rejected[key] = self.rejected.get(key, 0) + 1

    def rpc_latency(self, method: str, seconds: float) -> None:
        """Record one rpc's latency under ``method`` (already bounded by the caller)."""
        h = self.rpc.get(method)
        if h is None:
            h = self.rpc[method] = Histogram()
        h.observe(seconds)


class SchedulerCollector(Collector):
    """Turns a scheduler's counters and sizes into metric families at scrape time."""

    def __init__(self, sched: Scheduler, metrics: SchedulerMetrics) -> None:
        self._sched = sched
        self._m = metrics

    def collect(self) -> Iterator[Metric]:
        s, m, p = self._sched, self._m, PREFIX
        received = CounterMetricFamily(f"{p}received", "Requests received, per inbox and "
                                       "request type.", labels=["inbox", "type"])
        for (inbox, kind), n in list(m.received.items()):
            received.add_metric([inbox, kind.__name__], n)
        yield received
        rejected = CounterMetricFamily(f"{p}rejected", "Frames that failed to decode or "
                                       "validate, per inbox and reason.",
                                       labels=["inbox", "reason"])
        for (inbox, why), n in list(m.rejected.items()):
            rejected.add_metric([inbox, why], n)
        yield rejected
        adm = s.admission
        refused = CounterMetricFamily(f"{p}refused", "Requests answered 'overloaded', per "
                                      "reason.", labels=["reason"])
        refused.add_metric(["queue_requests"], adm.refused_requests)
        refused.add_metric(["queue_tokens"], adm.refused_tokens)
        refused.add_metric(["output_backlog"], s.backlog_aborts)
        yield refused
        routed = CounterMetricFamily(f"{p}routed", "Outputs a sink took, per output type and "
                                     "sink.", labels=["type", "sink"])
        failed = CounterMetricFamily(f"{p}sink_failures", "Outputs a sink refused with an "
                                     "error, per output type and sink.", labels=["type", "sink"])
        for (out_type, sink), (ok, bad) in s.router.counts().items():
            routed.add_metric([out_type, sink], ok)
            failed.add_metric([out_type, sink], bad)
        yield routed
        yield failed
        stats = s.statistics()
        rstats = s.router.statistics()
        yield _gauge(f"{p}backlog_outputs", "Outputs waiting for a consumer that is not "
                     "reading.", rstats.backlog)
        yield _counter(f"{p}backlog_overflows", "Times an output backlog hit its bound.",
                       rstats.overflows)
        yield _gauge(f"{p}queued_requests", "Requests waiting for a batch slot.", stats.queued)
        yield _gauge(f"{p}queued_tokens", "Tokens (prompt + max_new_tokens) of the waiting "
                     "requests.", adm.tokens)
        yield _gauge(f"{p}running_requests", "Requests in the running batch.", stats.running)
        yield _counter(f"{p}generated_tokens", "Tokens sampled.", stats.tokens)
        yield _counter(f"{p}finished_requests", "Requests that got a terminal answer.",
                       stats.finished)
        yield _counter(f"{p}steps", "Scheduler steps.", stats.steps)
        yield m.step.family(f"{p}step_seconds", "Time of one scheduler step.")
        yield m.queue_wait.family(f"{p}queue_wait_seconds", "Arrival to admission into "
                                  "the running batch.")
        yield m.ttft.family(f"{p}time_to_first_token_seconds", "Arrival to first token.")
        yield m.itl.family(f"{p}inter_token_seconds", "Between two tokens of one request.")
        yield m.e2e.family(f"{p}request_seconds", "Arrival to the terminal answer "
                           "(generate and embedding).")
        cache = s.model.prefix_cache_stats()
        if cache is not None:
            yield _counter(f"{p}prefix_cache_hit_tokens", "Prompt tokens read from the "
                           "prefix cache instead of computed.", cache.hit_tokens)
            yield _counter(f"{p}prefix_cache_miss_tokens", "Prompt tokens of generate "
                           "requests computed (no cached prefix held them).", cache.miss_tokens)
            yield _gauge(f"{p}prefix_cache_bytes", "Bytes of state the prefix cache holds.",
                         cache.size)
            yield _counter(f"{p}prefix_cache_evictions", "Prefix-cache nodes evicted (least "
                           "recently used first).", cache.evictions)
        rpc = HistogramMetricFamily(f"{p}rpc_seconds", "Rpc latency in the scheduler, per "
                                    "method.", labels=["method"])
        for method, h in list(m.rpc.items()):
            h.add_to(rpc, [method])
        yield rpc


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def registry_for(sched: Scheduler, metrics: SchedulerMetrics) -> CollectorRegistry:
    """A registry exposing one scheduler (what ``/metrics`` serves)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SchedulerCollector(sched, metrics))
    return registry


def exposition(registry: CollectorRegistry) -> str:
    """The registry in Prometheus' text format."""
    return generate_latest(registry).decode()


def chunks(text: str, size: int = 60_000) -> list[str]:
    """``text`` in pieces of at most ``size`` characters (an rpc string holds 64 KiB)."""
    return [text[i : i + size] for i in range(0, len(text), size)] or [""]



class _Families:
    """A collector over families already built (a merged exposition)."""

    def __init__(self, families: Sequence[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)


def label_replicas(texts: Mapping[str, str]) -> str:
    """One exposition from several schedulers', each sample labelled ``replica``.

    What ``Engine.metrics()`` returns with ``dp_size > 1``: the same families
    as one scheduler's, so a dashboard sums or splits by that label.
    """
    families: dict[str, Metric] = {}
    for replica, text in texts.items():
        for fam in text_string_to_metric_families(text):
            merged = families.get(fam.name)
            if merged is None:
                merged = families[fam.name] = Metric(fam.name, fam.documentation, fam.type,
                                                     fam.unit)
            for s in fam.samples:
                merged.add_sample(s.name, {**s.labels, "replica": replica}, s.value,
                                  s.timestamp, s.exemplar)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(families.values())))
    return exposition(registry)


def metrics_text(result: Mapping[str, object], dp_size: int) -> str | None:
    """The exposition a ``metrics`` rpc result carries (None: it carries none).

    With ``dp_size > 1``, each replica that answered, its samples labelled
    ``replica`` (:func:`label_replicas`): one lost must not blind the
    dashboard to the others.
    """
    def text(key: str) -> str | None:
        pieces = result.get(key)
        return "".join(str(p) for p in pieces) if isinstance(pieces, list) else None

    if dp_size == 1:
        return text("text")
    parts = {f"replica{i}": text(f"replica{i}.text") for i in range(dp_size)}
    answered = {name: t for name, t in parts.items() if t is not None}
    return label_replicas(answered) if answered else None
