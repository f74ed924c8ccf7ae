"""Soak and abuse: what one bad frame, flood, prompt, consumer or kill costs a real scheduler.

Run: ``python -m benchmarks.soak [SCENARIO ...]`` (default: all, in the
order of :data:`SCENARIOS`). The last line is one JSON object; every key
with a bound in :data:`BOUNDS` (a must-be-zero count, a latency ceiling)
is checked at the end, each violation is named on stderr and in the JSON
(``violations``), and the exit status is 1 if there is any. A new scenario
is a function returning a dict of keys, appended to :data:`SCENARIOS`
(or to a module's list, as :mod:`benchmarks.soak_dp`), with its bounds in
:data:`BOUNDS`.

* ``fuzz_frames``, ``fuzz_non_decode_errors``, ``reject_us_p50``: the codec
  fuzz of :mod:`benchmarks._fuzz` (200k mutated and random frames; only
  ``DecodeError`` may come out; the cost to reject a constraint-breaking frame).
* ``serve_fuzz_frames``, ``serve_alive``, ``legit_answered_ratio``: a
  ``python -m scheduler serve`` process takes mutated frames on its work and
  rpc sockets, interleaved with legitimate generate and rpc requests; it must
  stay up and answer every legitimate one. **Filtered:** a mutated frame that
  decodes to an rpc call other than ``get_load`` (``shutdown``,
  ``save_checkpoint``: it would stop the server or write files) is not sent;
  ``serve_fuzz_filtered`` counts them.
* ``overload_rss_growth_mib``, ``overload_rpc_p99_ms``, ``overload_refused``:
  200k generate requests offered far beyond the admission limits; the
  server's RSS growth and rpc latency meanwhile.
* ``long_prompt_rpc_max_ms``: rpc latency while a 2^17-token prompt is
  prefilled (chunked), and ``long_prompt_answered``.
* ``slow_consumer_rpc_max_ms``, ``slow_consumer_silent_drops``: the output
  consumer stops reading while streams run; rpc latency meanwhile, and how
  many requests never got a terminal answer once it reads again (must be 0).
* ``kill_pending_answered_ms``: ``Engine("zmq")`` with 300 requests in
  flight, scheduler SIGKILLed: time until every pending call has failed.

Every socket is ``ipc://`` in a temp dir; every process is stopped.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager

import zmq

from benchmarks import soak_conns, soak_dp, soak_files, soak_respawn, soak_starts
from benchmarks._fuzz import fuzz_codec, mutate, valid_frames
from benchmarks._timing import percentiles
from bus import RpcClient
from messages import (
    BatchTokenIDOut,
    Codec,
    ErrorOut,
    Message,
    Output,
    Request,
    RpcReqInput,
    SamplingParams,
    TokenizedGenerateReqInput,
    token_ids,
)
from scheduler import Engine, EngineError, ModelConfig

CODEC: Codec[Message] = Codec(Message)
OUT: Codec[Output] = Codec(Output)


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


class Server:
    """A ``python -m scheduler serve`` process, an output reader, a work PUSH and an rpc client."""

    def __init__(self, *extra: str) -> None:
        self.dir = tempfile.mkdtemp(prefix="tsb-soak-")
        os.rmdir(self.dir)  # serve makes it, 0700
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "scheduler", "serve", "--endpoint", self.dir, *extra],
            stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while not os.path.exists(f"{self.dir}/rpc"):
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError("serve did not start")
            time.sleep(0.01)  # sleep-ok: pacing a deadline poll
        self.out = self.ctx.socket(zmq.PULL)
        self.out.setsockopt(zmq.RCVHWM, 50)
        self.out.bind(f"ipc://{self.dir}/out")
        self.work = self.ctx.socket(zmq.PUSH)
        self.work.setsockopt(zmq.SNDHWM, 0)
        self.work.connect(f"ipc://{self.dir}/work")
        self.rpc = RpcClient(f"ipc://{self.dir}/rpc", ctx=self.ctx)
        assert self.rpc.call("get_load", timeout=120).success
        self.terminal: dict[str, str] = {}
        self.reading = threading.Event()
        self.reading.set()
        self._stop = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while not self._stop.is_set():
            if not self.reading.is_set():
                self.reading.wait(0.05)
                continue
            if not self.out.poll(50):
                continue
            for _ in range(1000):
                try:
                    frames = self.out.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                got = OUT.decode_any([f.buffer for f in frames])  # one message or a burst
                for msg in got if isinstance(got, list) else [got]:
                    if isinstance(msg, ErrorOut):
                        self.terminal[msg.rid] = msg.code
                    elif isinstance(msg, BatchTokenIDOut):
                        for rid, fin in zip(msg.rids, msg.finished_reasons, strict=True):
                            if fin is not None:
                                self.terminal[rid] = fin

    def submit(self, rid: str, ids: list[int], **sp: object) -> None:
        req = TokenizedGenerateReqInput(rid=rid, input_ids=token_ids(ids), stream=True,
                                        sampling=SamplingParams(**sp))  # type: ignore[arg-type]
        self.work.send_multipart(CODEC.encode(req), copy=False)

    def rpc_ms(self) -> float:
        t = time.perf_counter()
        assert self.rpc.call("get_load", timeout=30).success
        return (time.perf_counter() - t) * 1e3

    def wait_terminal(self, rids: list[str], timeout: float) -> int:
        """How many of ``rids`` are still without a terminal answer after waiting."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            missing = sum(1 for r in rids if r not in self.terminal)
            if not missing:
                return 0
            time.sleep(0.01)  # sleep-ok: pacing a deadline poll
        return sum(1 for r in rids if r not in self.terminal)

    def close(self) -> None:
        self._stop.set()
        self.reading.set()
        self._reader.join()
        self.proc.kill()
        self.proc.wait(30)
        self.rpc.close()
        self.out.close(0)
        self.work.close(0)
        self.ctx.term()
        shutil.rmtree(self.dir, ignore_errors=True)


@contextmanager
def server(*extra: str) -> Iterator[Server]:
    s = Server(*extra)
    try:
        yield s
    finally:
        s.close()


def _side_effect(codec: Codec[Request], frames: list[bytes]) -> bool:
    """Whether these frames decode to an rpc that would touch files or stop the server."""
    try:
        msg = codec.decode(frames)
    except Exception:
        return False
    return isinstance(msg, RpcReqInput) and msg.method != "get_load"


def serve_fuzz(n: int = 20_000, seed: int = 1) -> dict[str, float]:
    """Mutated frames into work and rpc, with legitimate requests among them."""
    rng = random.Random(seed)
    codec: Codec[Request] = Codec(Request)
    pool = valid_frames(codec)
    with server() as s:
        bad_rpc = s.ctx.socket(zmq.DEALER)
        bad_rpc.setsockopt(zmq.SNDHWM, 0)
        bad_rpc.connect(f"ipc://{s.dir}/rpc")
        legit: list[str] = []
        rpc_ok = rpc_calls = 0
        sent = filtered = 0
        while sent < n:
            frames = mutate(rng, pool)
            if not frames:
                continue
            if _side_effect(codec, frames):  # said in the docstring and counted
                filtered += 1
                continue
            i = sent
            sent += 1
            (s.work if i % 2 else bad_rpc).send_multipart(frames, copy=False)
            if i % 100 == 0:
                rid = f"legit-{i}"
                legit.append(rid)
                s.submit(rid, [1, 2, 3], max_new_tokens=2)
            if i % 1000 == 0:
                rpc_calls += 1
                rpc_ok += s.rpc.call("get_load", timeout=30).success
        missing = s.wait_terminal(legit, 60)
        answered = sum(1 for r in legit if s.terminal.get(r) == "length")
        alive = s.proc.poll() is None and s.rpc.call("get_load", timeout=30).success
        bad_rpc.close(0)
    return {"serve_fuzz_frames": n, "serve_alive": int(alive),
            "legit_answered_ratio": (answered + rpc_ok) / (len(legit) + rpc_calls),
            "serve_fuzz_unanswered": missing, "serve_fuzz_filtered": filtered}


def _flood(endpoint: str, n: int) -> None:
    """Send ``n`` generate requests (rids ``o0``...) as fast as the socket takes them."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.LINGER, 300_000)  # deliver all, but not for ever to a dead server
    sock.connect(endpoint)
    ids = token_ids(range(1, 17))
    sp = SamplingParams(max_new_tokens=64, temperature=0.8)
    for i in range(n):
        req = TokenizedGenerateReqInput(rid=f"o{i}", input_ids=ids, stream=True, sampling=sp)
        sock.send_multipart(CODEC.encode(req), copy=False)
    sock.close()
    ctx.term()


def overload(n: int = 200_000) -> dict[str, float]:
    """Offer far more than the admission limits allow; RSS and rpc latency meanwhile."""
    with server("--max-queued-requests", "1024") as s:
        for i in range(2000):  # warm: allocator pools, model, codec caches
            s.submit(f"warm-{i}", [1, 2, 3], max_new_tokens=1)
        s.wait_terminal([f"warm-{i}" for i in range(2000)], 60)
        base = _rss_mib(s.proc.pid)
        lat: list[float] = []
        stop = threading.Event()

        def probe() -> None:
            while not stop.is_set():
                lat.append(s.rpc_ms())
                time.sleep(0.005)  # sleep-ok: pacing the probe, not waiting for a condition

        t = threading.Thread(target=probe)
        t.start()
        peak = base
        # The flood comes from its own process: in this one it would hold the
        # GIL and the probe would measure our own client, not the server.
        flood = multiprocessing.get_context("spawn").Process(
            target=_flood, args=(f"ipc://{s.dir}/work", n))
        flood.start()
        while flood.is_alive():
            peak = max(peak, _rss_mib(s.proc.pid))
            flood.join(0.05)
        rids = [f"o{i}" for i in range(n)]
        deadline = time.monotonic() + 300
        while sum(1 for r in rids if r not in s.terminal) and time.monotonic() < deadline:
            peak = max(peak, _rss_mib(s.proc.pid))
            time.sleep(0.05)  # sleep-ok: pacing a deadline poll
        stop.set()
        t.join()
        refused = sum(1 for r in rids if s.terminal.get(r) == "overloaded")
        lost = sum(1 for r in rids if r not in s.terminal)
    _, p99 = percentiles(lat)
    return {"overload_offered": n, "overload_refused": refused, "overload_unanswered": lost,
            "overload_rss_growth_mib": round(peak - base, 1), "overload_rpc_p99_ms": round(p99, 2),
            "overload_rpc_samples": len(lat)}


def long_prompt() -> dict[str, float]:
    """A 2^17-token prompt is admitted and prefilled in chunks; rpc meanwhile."""
    with server() as s:
        s.submit("long", [i % 500 for i in range(1 << 17)], max_new_tokens=4)
        s.submit("short", [1, 2], max_new_tokens=200)
        lat: list[float] = []
        deadline = time.monotonic() + 300
        while "long" not in s.terminal and time.monotonic() < deadline:
            lat.append(s.rpc_ms())
        answered = s.terminal.get("long") == "length"
    return {"long_prompt_rpc_max_ms": round(max(lat), 2), "long_prompt_rpc_samples": len(lat),
            "long_prompt_answered": int(answered)}


def slow_consumer(n: int = 400) -> dict[str, float]:
    """The output consumer stops reading while streams run; then reads again."""
    with server("--hwm", "50", "--max-backlog", "64") as s:
        s.reading.clear()  # the consumer stops reading
        rids = [f"s{i}" for i in range(n)]
        for rid in rids:
            s.submit(rid, [1, 2, 3], max_new_tokens=200, temperature=0.0)
        lat: list[float] = []
        t_end = time.monotonic() + 5
        while time.monotonic() < t_end:
            lat.append(s.rpc_ms())
        s.reading.set()  # and reads again
        missing = s.wait_terminal(rids, 120)
        aborted = sum(1 for r in rids if s.terminal.get(r) == "overloaded")
    return {"slow_consumer_rpc_max_ms": round(max(lat), 2), "slow_consumer_requests": n,
            "slow_consumer_aborted": aborted, "slow_consumer_silent_drops": missing}


def kill_pending(n: int = 300) -> dict[str, float]:
    """SIGKILL the scheduler with ``n`` requests in flight; time until every call failed."""
    with Engine("zmq", ModelConfig()) as engine:
        handles = [engine.submit([1, 2, 3], SamplingParams(max_new_tokens=100_000))
                   for _ in range(n)]
        engine.collective_rpc("get_load")
        pid = engine._core._scheduler.essential[0].pid
        assert pid is not None
        failed = 0
        t0 = time.perf_counter()
        os.kill(pid, signal.SIGKILL)
        for h in handles:
            try:
                h.result(timeout=30)
            except EngineError:
                failed += 1
        ms = (time.perf_counter() - t0) * 1e3
    return {"kill_pending_answered_ms": round(ms, 1), "kill_pending_failed": failed,
            "kill_pending_requests": n}


def codec_fuzz() -> dict[str, float]:
    """The codec fuzz (:mod:`benchmarks._fuzz`)."""
    fz = fuzz_codec(200_000)
    return {k: fz[k] for k in ("fuzz_frames", "fuzz_non_decode_errors", "reject_us_p50",
                               "reject_random_us_p50")}


#: Every scenario, in the order a full run takes them.
SCENARIOS: list[Callable[[], Mapping[str, object]]] = [
    codec_fuzz, serve_fuzz, overload, long_prompt, slow_consumer, kill_pending,
    *soak_dp.SCENARIOS, *soak_files.SCENARIOS, *soak_conns.SCENARIOS,
    *soak_respawn.SCENARIOS, *soak_starts.SCENARIOS]

#: key -> (comparison, bound): what every run must hold (checked for the keys it printed).
BOUNDS: dict[str, tuple[str, float]] = {
    "fuzz_non_decode_errors": ("==", 0),
    "serve_alive": ("==", 1),
    "legit_answered_ratio": (">=", 1.0),
    "serve_fuzz_unanswered": ("==", 0),
    "overload_unanswered": ("==", 0),
    "long_prompt_answered": ("==", 1),
    "slow_consumer_silent_drops": ("==", 0),
    "kill_pending_failed": (">=", 300),
    "dp_flood_requests": (">=", 12_000),
    "dp_flood_false_losses": ("==", 0),
    "dp_flood_failed": ("==", 0),
    "dp_pause_false_losses": ("==", 0),
    "dp_stuck_rpc_client_max_silence_ms": ("<=", 1000),
    "dp_short_behind_long_ttft_p50_ms": ("<=", 500),
    "dp_replica_respawn_ms": ("<=", 5000),
    "log_lines_per_1000_garbage_frames": ("<=", 5),
    "shm_full_sender_alive": ("==", 1),
    "leaked_files_after_kills": ("==", 0),
    **soak_conns.BOUNDS,
    **soak_respawn.BOUNDS,
    **soak_starts.BOUNDS,
}

_CMP: dict[str, Callable[[float, float], bool]] = {
    "==": lambda a, b: a == b, "<=": lambda a, b: a <= b, ">=": lambda a, b: a >= b}


def violations(out: Mapping[str, object]) -> list[str]:
    """Each bound of :data:`BOUNDS` that a printed key breaks, named with its value."""
    return [f"{k} = {out[k]} (must be {op} {bound})" for k, (op, bound) in BOUNDS.items()
            if k in out and not (isinstance(v := out[k], int | float) and _CMP[op](v, bound))]


def main(argv: list[str]) -> int:
    chosen = [s for s in SCENARIOS if not argv or s.__name__ in argv]
    unknown = set(argv) - {s.__name__ for s in SCENARIOS}
    if unknown:
        print(f"unknown scenarios {sorted(unknown)}; known: "
              f"{[s.__name__ for s in SCENARIOS]}", file=sys.stderr)
        return 2
    out: dict[str, object] = {}
    for part in chosen:
        t0 = time.perf_counter()
        got = part()
        print(f"{part.__name__}: {got} ({time.perf_counter() - t0:.1f} s)", file=sys.stderr,
              flush=True)
        out.update(got)
    bad = violations(out)
    for line in bad:
        print(f"VIOLATION: {line}", file=sys.stderr)
    print(json.dumps({**out, "violations": len(bad)}))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
