"""Shared prefixes: the replicas' prefix cache and ``cache_aware`` dispatch, against the plain ones.

Run: ``python -m benchmarks.prefix`` (``--scale F`` shrinks the request count).
The last line is one JSON object from one run.

Workload (the issue's): the float64 tiny Llama this module builds
(``scheduler.models.tiny_hf``), ``Engine("zmq", dp_size=2)``; 8 system
prompts of 1,024 tokens, each request one of them followed by a 32-token
user turn, 8 tokens out, greedy; 512 requests in random order at
concurrency 16 (16 client threads, each streaming one request at a time).
Every torch runs one thread: two replicas, a dispatcher and the client
share this machine's 2 cores.

Scale: the issue's full workload runs here, not scaled down: the six
configurations took 5.5-8 minutes at load 6-8.5 on this shared 2-core box
(the four of them with one cache size, 2 minutes at load 2.5-3.7).
``--scale F`` sends ``F * 512`` requests (at least 32) for a quicker look;
with few requests the first concurrent wave (16 prompts, each missing)
weighs more, so ``cached_token_ratio_*`` falls short of the ideal (0.63
for ``cache_aware`` at 32 requests). The JSON says which scale ran
(``requests``).

Configurations, each on a fresh engine (so a fresh cache), in this order:
``round_robin`` with the cache off (``nocache``); ``cache_aware`` with the
cache (``cache``); ``round_robin`` and ``least_loaded`` with it; then
``cache_aware`` and ``round_robin`` with a cache that holds every prompt
(``cache_large``).

The cache: each replica's is bounded at ``--cache-mib``, by default 6 MiB:
6,144 tokens (1 KiB a token in this model), room for about 5 of the 8
system prompts beside the user turns and answers that join it, where the
working set is all 8 (8 MiB and the turns). Routing can only add to the
cache where one replica's cache does not hold the whole working set, and
that is what production sees: a 7B model in float16 holds ~8k tokens a
GiB, so a replica's cache holds a few hundred prompts like these against
traffic with many more. 6 MiB sits between the two edges measured (one run
each of ``cache_aware``, ``round_robin`` and ``least_loaded``, load 6-10;
"reads" are prompts that read their system prompt, not from the cache):

* 4 MiB (exactly 4 prompts, no room for turns): even with the prompts
  split 4 and 4, each replica evicts prompts it still serves; 139 reads
  under ``cache_aware``, 269 under ``round_robin``, TTFT p50 ratio 0.94.
* 5 MiB: 10 reads against 211, ratio 0.14 (47.4 ms against 334.6 ms).
* 6 MiB: 11 reads against 160, ratio 0.32 (47.7 ms against 148.3 ms); it
  still holds a split of 5 and 3, which the first wave's load can make.
* 1 GiB (the library's default, ``--large-cache-mib``): 16 reads under
  either (each replica reads each prompt once: ``cache_aware``'s free
  spill copies them too, as it balances), so the TTFT ratio compares the
  two policies' balance of load on this shared box, not what routing
  adds: from 0.69 to 1.91 over eight runs.

The ``*_cache_large`` keys keep printing that regime beside the headline.

On stderr, per configuration, where its time to first token went (its
``timeline``): how many requests read their system prompt rather than from
the cache, when the last of them was sent, the TTFT p50 of those reads, of
the hits, and of the hits sent after the last read (the steady state), and
each replica's finished requests (the warm-up request included); and, for
``cache_aware``, how the dispatcher routed (its spills).

Keys:

* ``cached_token_ratio_cache_aware``: prompt tokens read from the replicas'
  caches (``tsb_prefix_cache_hit_tokens_total``, summed over replicas) over
  the ideal: every system prompt computed once, on the one replica
  ``cache_aware`` serves it from (ideal hits = requests * 1024 - 8 * 1024);
  ``cached_token_ratio_<policy>`` likewise for the others, and
  ``cached_token_ratio_<policy>_large`` with the large cache.
* ``ttft_p50_ms_<config>``: median time to first token (submit to first
  streamed chunk, client side); ``ttft_p50_ratio_cache_aware_vs_round_robin_nocache``,
  ``..._vs_round_robin_cache`` and ``..._vs_round_robin_cache_large`` (each
  ``cache_aware`` over ``round_robin`` at the same cache size), and
  ``..._vs_least_loaded_cache``: against the policy a user would otherwise pick
  (the library's default), with the same cache.
* ``requests_per_s_<config>``; ``requests_per_s_ratio_cache_aware_vs_round_robin_nocache``.
* ``in_flight_gap_mean_<config>``: how unevenly the two replicas were loaded:
  the difference in requests in flight between them, as the dispatcher
  counts them (its ``get_load``), sampled every 50 ms, averaged.
* ``match_ratio_vs_nocache``: share of requests whose greedy tokens under
  ``cache_aware`` with the cache equal those of ``round_robin`` without it.
* ``dispatch_overhead_us_per_request_cache_aware``: what the ``cache_aware``
  choice costs the dispatcher per request (its tree lookup over both
  replicas, and recording the prompt), timed in-process on this workload's
  prompts; ``dispatch_pick_us_per_request_least_loaded`` is the plain
  ledger's pick beside it (the whole dispatcher hop is ``benchmarks.dp``'s
  ``dispatch_overhead_us_per_request``, tens of microseconds; a model step
  here is milliseconds).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from benchmarks._timing import percentiles, print_checked
from messages import SamplingParams, token_ids
from scheduler import Engine, Limits
from scheduler.dp.affinity import PrefixAffinity
from scheduler.dp.ledger import Cost, Ledger
from scheduler.models.tiny_hf import build_tiny_hf

SYSTEMS = 8
SYSTEM_TOKENS = 1024
TURN_TOKENS = 32
REQUESTS = 512
CONCURRENCY = 16
MAX_NEW = 8
GREEDY = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0)
#: (policy, cache): ``nocache`` off, ``cache`` at ``--cache-mib`` (below the working
#: set), ``cache_large`` at ``--large-cache-mib`` (every prompt fits in every replica).
CONFIGS = (("round_robin", "nocache"), ("cache_aware", "cache"), ("round_robin", "cache"),
           ("least_loaded", "cache"), ("cache_aware", "cache_large"),
           ("round_robin", "cache_large"))
_NAMES = [f"{p}_{c}" for p, c in CONFIGS]
#: What the last line holds (its output schema; README figures are checked against it).
KEYS = frozenset(
    ["requests", "concurrency", "dp_size", "cache_mib_per_replica",
     "cache_mib_per_replica_large", "match_ratio_vs_nocache",
     "ttft_p50_ratio_cache_aware_vs_round_robin_nocache",
     "ttft_p50_ratio_cache_aware_vs_round_robin_cache",
     "ttft_p50_ratio_cache_aware_vs_least_loaded_cache",
     "ttft_p50_ratio_cache_aware_vs_round_robin_cache_large",
     "requests_per_s_ratio_cache_aware_vs_round_robin_nocache",
     "dispatch_overhead_us_per_request_cache_aware",
     "dispatch_pick_us_per_request_least_loaded"]
    + [f"{k}_{n}" for n in _NAMES
       for k in ("ttft_p50_ms", "ttft_p99_ms", "requests_per_s", "in_flight_gap_mean")]
    + [f"cached_token_ratio_{p}{c.removeprefix('cache')}" for p, c in CONFIGS
       if c != "nocache"])
#: Each replica's prefix cache in the default run, MiB (1,024 tokens a MiB in this
#: model): below the working set of 8 prompts (see the module docstring).
CACHE_MIB = 6.0
#: Each replica's prefix cache in the large runs: the library's default (1 GiB).
LARGE_CACHE_MIB = Limits().prefix_cache_bytes / (1 << 20)


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def workload(n: int, seed: int = 0) -> list[list[int]]:
    """``n`` prompts: one of 8 system prompts, then a fresh 32-token user turn; shuffled."""
    rng = random.Random(seed)
    systems = [[rng.randrange(3, 384) for _ in range(SYSTEM_TOKENS)] for _ in range(SYSTEMS)]
    prompts = [systems[i % SYSTEMS] + [rng.randrange(3, 384) for _ in range(TURN_TOKENS)]
               for i in range(n)]
    rng.shuffle(prompts)
    return prompts


def _metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def run(model_dir: Path, policy: str, cache_bytes: int, prompts: list[list[int]]
        ) -> tuple[list[list[int]], list[float], float, float, float]:
    """(tokens per request, TTFTs in ms, requests/s, cached prompt tokens, mean gap in
    flight between the replicas) of one config."""
    limits = Limits(prefix_cache_bytes=cache_bytes)
    answers: list[list[int]] = [[] for _ in prompts]
    ttfts: list[float] = [0.0] * len(prompts)
    sent: list[float] = [0.0] * len(prompts)  # s after the clients started
    cached: list[int] = [0] * len(prompts)  # prompt tokens read from the cache
    todo: queue.SimpleQueue[int] = queue.SimpleQueue()
    for i in range(len(prompts)):
        todo.put(i)
    with Engine("zmq", str(model_dir), dp_size=2, dp_policy=policy,  # type: ignore[arg-type]
                limits=limits, start_timeout=300) as engine:
        engine.generate(prompts[0][:16], GREEDY, timeout=120)  # warm up (not cached: short)

        def client() -> None:
            while True:
                try:
                    i = todo.get_nowait()
                except queue.Empty:
                    return
                t1 = time.perf_counter()
                sent[i] = t1 - t0
                tokens: list[int] = []
                for chunk in engine.submit(prompts[i], GREEDY, stream=True):
                    if not ttfts[i]:
                        ttfts[i] = (time.perf_counter() - t1) * 1e3
                    if chunk.cached_tokens is not None:
                        cached[i] = chunk.cached_tokens
                    tokens.extend(chunk.token_ids)
                answers[i] = tokens

        t0 = time.perf_counter()
        threads = [threading.Thread(target=client) for _ in range(CONCURRENCY)]
        for t in threads:
            t.start()
        # The replicas' difference in requests in flight, as the dispatcher counts them.
        gaps: list[int] = []
        while any(t.is_alive() for t in threads):
            load = engine.collective_rpc("get_load").result or {}
            a, b = load.get("replica0.in_flight"), load.get("replica1.in_flight")
            if isinstance(a, int) and isinstance(b, int):
                gaps.append(abs(a - b))
            time.sleep(0.05)  # sleep-ok: sampling pace
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        metrics = engine.metrics()
        hits = _metric(metrics, "tsb_prefix_cache_hit_tokens_total")
        say(f"  {policy} timeline: {json.dumps(_timeline(sent, ttfts, cached, metrics))}")
        load = engine.collective_rpc("get_load").result or {}
        routed = {k.removeprefix("dispatcher.affinity_"): v for k, v in load.items()
                  if k.startswith("dispatcher.affinity_")}
        if routed:  # how cache_aware routed (its spills), beside the figures
            say(f"  {policy} routed: {json.dumps(routed)}")
    return answers, ttfts, len(prompts) / wall, hits, statistics.mean(gaps or [0])


def _timeline(sent: list[float], ttfts: list[float], cached: list[int], metrics: str
              ) -> dict[str, object]:
    """Where the time to first token went (see the module docstring's stderr lines)."""
    reads = [i for i, c in enumerate(cached) if c < SYSTEM_TOKENS]
    last = max((sent[i] for i in reads), default=0.0)
    hits = [ttfts[i] for i, c in enumerate(cached) if c >= SYSTEM_TOKENS]
    warm = [ttfts[i] for i, c in enumerate(cached) if c >= SYSTEM_TOKENS and sent[i] > last]

    def p50(xs: list[float]) -> float | None:
        return round(statistics.median(xs), 1) if xs else None

    per_replica: dict[str, int] = {}
    for line in metrics.splitlines():
        if line.startswith("tsb_finished_requests_total{") and 'replica="' in line:
            name = line.split('replica="', 1)[1].split('"', 1)[0]
            per_replica[name] = per_replica.get(name, 0) + int(float(line.rsplit(" ", 1)[1]))
    return {"reads": len(reads), "last_read_sent_s": round(last, 2),
            "ttft_p50_ms_reads": p50([ttfts[i] for i in reads]), "ttft_p50_ms_hits": p50(hits),
            "ttft_p50_ms_hits_after_last_read": p50(warm), "requests_per_replica": per_replica}


def dispatch_us(prompts: list[list[int]]) -> tuple[float, float]:
    """us per request of (cache_aware's lookup + record + pick, the ledger's pick alone)."""
    ids = [token_ids(p) for p in prompts]
    out = []
    for aware in (True, False):
        runs = []
        for _ in range(3):
            ledger = Ledger(2, "cache_aware" if aware else "least_loaded")
            affinity = PrefixAffinity(2)
            t0 = time.perf_counter()
            for k, p in enumerate(ids):
                prefer = affinity.prefer(p, ledger.requests, ledger.live) if aware else None
                i = ledger.pick(None, (), prefer)
                if aware:
                    affinity.record(i, p)
                ledger.add(str(k), i, 0, Cost(len(p), MAX_NEW), None)
                if k >= CONCURRENCY:
                    ledger.finish(str(k - CONCURRENCY))
            runs.append((time.perf_counter() - t0) / len(ids) * 1e6)
        out.append(statistics.median(runs))
    return out[0], out[1]


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.prefix")
    parser.add_argument("--scale", type=float, default=1.0,
                        help="share of the 512 requests to send (at least 32)")
    parser.add_argument("--cache-mib", type=float, default=CACHE_MIB,
                        help=f"each replica's prefix cache, MiB (default {CACHE_MIB:g}: "
                             "below the working set)")
    parser.add_argument("--large-cache-mib", type=float, default=LARGE_CACHE_MIB,
                        help="each replica's prefix cache in the *_cache_large runs, MiB "
                             f"(default: the library's, {LARGE_CACHE_MIB:g})")
    args = parser.parse_args()
    # One torch thread here and in every replica (inherited): OpenMP workers
    # spinning on a busy 2-core box made a step tens of times slower.
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    n = max(32, int(REQUESTS * args.scale))
    prompts = workload(n)
    ideal = n * SYSTEM_TOKENS - SYSTEMS * SYSTEM_TOKENS
    cache_mib = {"nocache": 0.0, "cache": args.cache_mib, "cache_large": args.large_cache_mib}
    result: dict[str, object] = {"requests": n, "concurrency": CONCURRENCY, "dp_size": 2,
                                 "cache_mib_per_replica": args.cache_mib,
                                 "cache_mib_per_replica_large": args.large_cache_mib}
    answers: dict[str, list[list[int]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_hf(Path(tmp) / "tiny-llama")
        for policy, cache in CONFIGS:
            name = f"{policy}_{cache}"
            say(f"{name}: {n} requests ...")
            got, ttfts, rps, hits, gap = run(model_dir, policy,
                                             int(cache_mib[cache] * (1 << 20)), prompts)
            answers[name] = got
            p50, p99 = percentiles(ttfts)
            figures: dict[str, object] = {
                f"ttft_p50_ms_{name}": round(p50, 1), f"ttft_p99_ms_{name}": round(p99, 1),
                f"requests_per_s_{name}": round(rps, 2),
                f"in_flight_gap_mean_{name}": round(gap, 2)}
            if cache != "nocache":
                figures[f"cached_token_ratio_{policy}{cache.removeprefix('cache')}"] = round(
                    hits / ideal, 3)
            say(f"  {json.dumps(figures)}")
            result.update(figures)
    aware, base = "cache_aware_cache", "round_robin_nocache"
    same = sum(a == b for a, b in zip(answers[aware], answers[base], strict=True))
    result["match_ratio_vs_nocache"] = round(same / n, 4)
    for mine, other in ((aware, base), (aware, "round_robin_cache"),
                        (aware, "least_loaded_cache"),
                        ("cache_aware_cache_large", "round_robin_cache_large")):
        result[f"ttft_p50_ratio_cache_aware_vs_{other}"] = round(
            float(result[f"ttft_p50_ms_{mine}"])  # type: ignore[arg-type]
            / float(result[f"ttft_p50_ms_{other}"]), 3)  # type: ignore[arg-type]
    result["requests_per_s_ratio_cache_aware_vs_round_robin_nocache"] = round(
        float(result[f"requests_per_s_{aware}"])  # type: ignore[arg-type]
        / float(result[f"requests_per_s_{base}"]), 3)  # type: ignore[arg-type]
    aware_us, plain_us = dispatch_us(prompts)
    result["dispatch_overhead_us_per_request_cache_aware"] = round(aware_us - plain_us, 1)
    result["dispatch_pick_us_per_request_least_loaded"] = round(plain_us, 1)
    print_checked(result, KEYS, "benchmarks.prefix")


if __name__ == "__main__":
    main()
