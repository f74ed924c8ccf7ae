"""``python -m scheduler top ENDPOINT``: a live terminal view of one scheduler's metrics.

Reads ``/metrics`` (Prometheus text) every ``interval`` seconds and shows
load, queue, rates over the last interval, and p50/p99 latencies over the
last interval (over the whole run until one has passed). Plain ANSI: a
clear-screen and a table, so it needs nothing but a terminal.
"""

from __future__ import annotations

import math
import sys
import time
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TextIO

from prometheus_client.parser import text_string_to_metric_families

from scheduler.core.metrics import PREFIX

__all__ = ["Snapshot", "metrics_url", "render", "run_top", "scrape"]

_CLEAR = "\x1b[H\x1b[2J"


def metrics_url(endpoint: str) -> str:
    """``PORT``, ``HOST:PORT`` or a full URL, as the URL of ``/metrics``."""
    if endpoint.startswith(("http://", "https://")):
        return endpoint if endpoint.rstrip("/").endswith("/metrics") else \
            endpoint.rstrip("/") + "/metrics"
    if endpoint.isdigit():
        endpoint = f"127.0.0.1:{endpoint}"
    return f"http://{endpoint}/metrics"


@dataclass
class Snapshot:
    """One scrape: plain values (summed over labels) and histogram buckets, by metric name."""

    t: float
    values: dict[str, float] = field(default_factory=dict)
    # name -> {upper bound: cumulative count}, summed over labels
    buckets: dict[str, dict[float, float]] = field(default_factory=dict)


def scrape(url: str, *, timeout: float = 5.0) -> Snapshot:
    """Fetch and parse one ``/metrics`` page.

    Raises:
        OSError: the endpoint did not answer.
    """
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        text = resp.read().decode()
    snap = Snapshot(time.monotonic())
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.endswith("_bucket"):
                le = float(s.labels["le"])
                b = snap.buckets.setdefault(s.name[: -len("_bucket")], {})
                b[le] = b.get(le, 0.0) + s.value
            else:
                snap.values[s.name] = snap.values.get(s.name, 0.0) + s.value
    return snap


def _quantile(buckets: Mapping[float, float], q: float) -> float:
    """The ``q`` quantile from cumulative buckets (upper bound of the bucket it falls in)."""
    bounds = sorted(buckets)
    total = buckets[bounds[-1]] if bounds else 0.0
    if total <= 0:
        return math.nan
    for b in bounds:
        if buckets[b] >= q * total:
            return b
    return math.inf


def _window(new: Snapshot, old: Snapshot | None, name: str) -> Mapping[float, float]:
    cur = new.buckets.get(name, {})
    if old is None or name not in old.buckets:
        return cur
    delta = {b: c - old.buckets[name].get(b, 0.0) for b, c in cur.items()}
    return delta if max(delta.values(), default=0.0) > 0 else cur


def _ms(v: float) -> str:
    return "-" if math.isnan(v) else ("inf" if math.isinf(v) else f"{v * 1e3:,.1f}")


def render(new: Snapshot, old: Snapshot | None, url: str) -> str:
    """One screen of the view."""
    p = PREFIX
    v = new.values
    dt = (new.t - old.t) if old is not None else 0.0

    def rate(name: str) -> str:
        if old is None or dt <= 0:
            return "-"
        return f"{(v.get(name, 0.0) - old.values.get(name, 0.0)) / dt:,.1f}"

    lines = [
        f"typed-sched-bus top  {url}  ({time.strftime('%H:%M:%S')})",
        "",
        f"running {v.get(f'{p}running_requests', 0):>8.0f}"
        f"   queued {v.get(f'{p}queued_requests', 0):>8.0f}"
        f"   queued tokens {v.get(f'{p}queued_tokens', 0):>10.0f}"
        f"   backlog {v.get(f'{p}backlog_outputs', 0):>6.0f}",
        "",
        f"{'per second':<22}{'rate':>12}{'total':>14}",
    ]
    for label, name in (("requests received", f"{p}received_total"),
                        ("tokens generated", f"{p}generated_tokens_total"),
                        ("requests finished", f"{p}finished_requests_total"),
                        ("refused (overloaded)", f"{p}refused_total"),
                        ("frames rejected", f"{p}rejected_total"),
                        ("sink failures", f"{p}sink_failures_total"),
                        ("steps", f"{p}steps_total")):
        lines.append(f"{label:<22}{rate(name):>12}{v.get(name, 0.0):>14,.0f}")
    lines += ["", f"{'latency (ms)':<22}{'p50':>12}{'p99':>14}"]
    for label, name in (("time to first token", f"{p}time_to_first_token_seconds"),
                        ("inter-token", f"{p}inter_token_seconds"),
                        ("request", f"{p}request_seconds"),
                        ("queue wait", f"{p}queue_wait_seconds"),
                        ("step", f"{p}step_seconds"),
                        ("rpc", f"{p}rpc_seconds")):
        b = _window(new, old, name)
        lines.append(f"{label:<22}{_ms(_quantile(b, 0.5)):>12}{_ms(_quantile(b, 0.99)):>14}")
    return "\n".join(lines)


def run_top(endpoint: str, *, interval: float = 1.0, frames: int | None = None,
            out: TextIO = sys.stdout, clear: bool = True,
            sleep: Callable[[float], None] = time.sleep) -> int:
    """Show the view every ``interval`` seconds (``frames`` times, or until Ctrl-C).

    Returns a process exit status: 0, or 1 when the endpoint cannot be read.
    """
    url = metrics_url(endpoint)
    old: Snapshot | None = None
    shown = 0
    try:
        while frames is None or shown < frames:
            try:
                new = scrape(url)
            except OSError as exc:
                print(f"cannot read {url}: {exc}", file=sys.stderr)
                return 1
            out.write((_CLEAR if clear else "") + render(new, old, url) + "\n")
            out.flush()
            old = new
            shown += 1
            if frames is None or shown < frames:
                sleep(interval)
    except KeyboardInterrupt:
        pass
    return 0
