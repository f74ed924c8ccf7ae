"""``python -m scheduler top ENDPOINT``: a live terminal view of one scheduler's metrics.

Reads ``/metrics`` (Prometheus text) every ``interval`` seconds and shows
load, queue, rates over the last interval, and p50/p99 latencies over the
last interval (over the whole run until one has passed). Plain ANSI: a
clear-screen and a table, so it needs nothing but a terminal.
"""

from __future__ import annotations

import http.client
import math
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TextIO

from prometheus_client.parser import text_string_to_metric_families

from messages import BusError
from scheduler.core.metrics import PREFIX

__all__ = ["ScrapeError", "Snapshot", "metrics_url", "render", "run_top", "scrape"]

_CLEAR = "\x1b[H\x1b[2J"


def metrics_url(endpoint: str) -> str:
    """``PORT``, ``HOST:PORT`` or a full URL, as the URL of ``/metrics``."""
    if endpoint.startswith(("http://", "https://")):
        if endpoint.rstrip("/").endswith("/metrics"):
            return endpoint
        return endpoint.rstrip("/") + "/metrics"
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


#: Most bytes one page may have (a scheduler's is a few KiB).
_MAX_PAGE = 16 << 20


class ScrapeError(BusError, OSError):
    """The endpoint did not give a metrics page in time: its message is one line for
    the operator (unreachable, an HTTP error, not Prometheus text, too slow)."""


def _get(url: str, timeout: float) -> bytes:
    """GET ``url`` (each read bounded by ``timeout``); the connection is always closed."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ScrapeError(f"not an http(s) URL: {url}")
    conn: http.client.HTTPConnection = (
        http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    )(parts.hostname, parts.port, timeout=timeout)
    try:
        conn.request("GET", (parts.path or "/") + (f"?{parts.query}" if parts.query else ""))
        with conn.getresponse() as resp:
            if resp.status != 200:
                raise ScrapeError(f"{url} answered HTTP {resp.status} {resp.reason}")
            return resp.read(_MAX_PAGE + 1)
    finally:
        conn.close()


def _fetch(url: str, timeout: float) -> bytes:
    """The page's bytes, the whole response within ``timeout`` seconds (not per read:
    a server that trickles bytes is given up on)."""
    got: list[bytes | BaseException] = []

    def fetch() -> None:
        try:
            got.append(_get(url, timeout))
        except BaseException as exc:  # handed to the caller's thread
            got.append(exc)

    # A thread bounds the whole exchange; a socket timeout bounds each read only.
    # Left behind past the deadline, it ends at its own socket timeout (daemon).
    worker = threading.Thread(target=fetch, name="top-scrape", daemon=True)
    worker.start()
    worker.join(timeout)
    if not got:
        raise ScrapeError(f"no whole answer from {url} within {timeout:g} s")
    result = got[0]
    if isinstance(result, ScrapeError):
        raise result
    if isinstance(result, ConnectionRefusedError):
        raise ScrapeError(f"cannot reach {url}: connection refused")
    if isinstance(result, (OSError, http.client.HTTPException, ValueError)):
        detail = str(result).replace("\n", " ")[:100]
        raise ScrapeError(f"cannot read {url} ({type(result).__name__}: {detail}): "
                          "not an HTTP metrics endpoint?")
    if isinstance(result, BaseException):
        raise result
    if len(result) > _MAX_PAGE:
        raise ScrapeError(f"{url}: the page is over {_MAX_PAGE >> 20} MiB: not a scheduler's")
    return result


def scrape(url: str, *, timeout: float = 5.0) -> Snapshot:
    """Fetch and parse one ``/metrics`` page, the whole response within ``timeout`` seconds.

    Raises:
        ScrapeError: (an ``OSError``) the endpoint did not answer in time, answered
            an HTTP error, or its page is not a scheduler's Prometheus metrics.
    """
    end = time.monotonic() + timeout
    body = _fetch(url, timeout)
    if PREFIX.encode() not in body:  # before parsing: a foreign page can be slow to parse
        raise ScrapeError(f"{url} has no {PREFIX}* metrics: is it a scheduler's /metrics?")
    snap = Snapshot(time.monotonic())
    try:
        for fam in text_string_to_metric_families(body.decode()):
            if time.monotonic() > end:  # the deadline holds for the whole scrape
                raise ScrapeError(f"{url}: its page took over {timeout:g} s to read and "
                                  "parse: not a scheduler's /metrics?")
            for s in fam.samples:
                if s.name.endswith("_bucket"):
                    le = float(s.labels["le"])
                    b = snap.buckets.setdefault(s.name[: -len("_bucket")], {})
                    b[le] = b.get(le, 0.0) + s.value
                else:
                    snap.values[s.name] = snap.values.get(s.name, 0.0) + s.value
    except ScrapeError:
        raise
    except Exception as exc:  # the parser raises several kinds on foreign text
        raise ScrapeError(f"{url} is not Prometheus metrics text "
                          f"({type(exc).__name__}: {str(exc)[:100]})") from None
    if not any(name.startswith(PREFIX) for name in (*snap.values, *snap.buckets)):
        raise ScrapeError(f"{url} has no {PREFIX}* metrics: is it a scheduler's /metrics?")
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

    Returns a process exit status: 0, or 1 when the endpoint cannot be read (one
    line on stderr says why).
    """
    url = metrics_url(endpoint)
    old: Snapshot | None = None
    shown = 0
    try:
        while frames is None or shown < frames:
            try:
                new = scrape(url)
            except OSError as exc:  # one line, never a traceback
                print(f"top: {exc}", file=sys.stderr)
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
