"""Shared timing helpers: medians of repeated runs, so a noisy 2-core box still compares fairly."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Collection, Mapping


def per_call_us(fn: Callable[[], object], *, repeats: int = 7, min_time: float = 0.05) -> float:
    """Median over ``repeats`` runs of the time per call of ``fn``, in microseconds."""
    n = 1
    while True:  # calibrate the loop count so one run takes ``min_time``
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        dt = time.perf_counter() - t0
        if dt >= min_time:
            break
        n *= 2 if dt == 0 else max(2, min(10, int(min_time / dt) + 1))
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        runs.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(runs)


def percentiles(samples_us: list[float]) -> tuple[float, float]:
    """(p50, p99) of latency samples."""
    s = sorted(samples_us)
    return s[len(s) // 2], s[min(len(s) - 1, int(len(s) * 0.99))]


def interleaved(fns: dict[str, Callable[[], object]], *, rounds: int = 3,
                repeats: int = 7, min_time: float = 0.05) -> dict[str, float]:
    """:func:`per_call_us` of each contestant, in turns over ``rounds``; the median round.

    A neighbour's burst of load then hurts every contestant alike, instead
    of whichever happened to run during it.
    """
    runs: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            runs[k].append(per_call_us(fn, repeats=repeats, min_time=min_time))
    return {k: statistics.median(v) for k, v in runs.items()}


def print_checked(results: Mapping[str, object], keys: Collection[str], module: str) -> None:
    """Print ``results`` as the last line's JSON object, then raise unless it has exactly
    ``keys``: a benchmark's ``KEYS`` is its output schema, which the README's figures
    are checked against without a run (the figures are printed either way).

    Raises:
        AssertionError: naming the keys printed but not declared, and declared but
            not printed.
    """
    print(json.dumps(results))
    extra, missing = set(results) - set(keys), set(keys) - set(results)
    if extra or missing:
        raise AssertionError(f"{module} prints keys not in its KEYS: {sorted(extra)}; "
                             f"declares keys it does not print: {sorted(missing)}")
