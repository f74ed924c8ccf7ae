"""Bus: channel throughput, ring vs queue.Queue/SimpleQueue, idle wake latency, rpc under flood.

Run: ``python -m benchmarks.bus``. The last line is one JSON object. Every
contest runs side by side in this one run; cross-process figures use
producer processes (the machine has 2 cores, so they are noisy: repeats and
medians). Latencies use CLOCK_MONOTONIC, which all processes share.

Bursts compare like with like: ours (``encode_many``: 256 requests per zmq
message, encoded by the producer and decoded into messages by a
``Receiver``) against raw pyzmq coalesced the same way (the same requests,
pre-encoded, joined 256 per zmq message, received without a copy as ours
is, and sliced back per message, no decode):
``ratio_burst_ours_vs_raw_coalesced``. Ours also encodes and decodes, which
raw does not. ``ratio_burst_ours_vs_raw_per_message`` is
against raw pyzmq sending one message at a time (not coalesced): it says
what coalescing buys, not how fast the codec is.
``ratio_burst_decode_only_vs_raw_coalesced`` is a bound, not a contestant:
our bursts through msgspec's C decode alone (no uint32 cast of the ids, no
envelope, no ``Receiver``), which any receive path built on msgspec pays.
"""

from __future__ import annotations

import array
import gc
import json
import multiprocessing as mp
import os
import queue
import random
import select
import statistics
import sys
import tempfile
import threading
import time
from typing import Any

import zmq

from benchmarks._timing import percentiles
from benchmarks.codec import pickled_twin
from bus import (
    Envelope,
    PullInbox,
    PushOutbox,
    Receiver,
    Ring,
    RingInbox,
    RpcClient,
    RpcServer,
)
from messages import (
    SEND_BURST,
    Codec,
    Message,
    Request,
    RpcReqInput,
    RpcReqOutput,
    SamplingParams,
    TokenizedGenerateReqInput,
    token_ids,
)

N_MSGS = 100_000


def small_request(i: int = 0) -> TokenizedGenerateReqInput:
    return TokenizedGenerateReqInput(rid=f"req-{i:08d}", input_ids=token_ids(range(256)),
                                     sampling=SamplingParams(max_new_tokens=64))


# -- (a) throughput through each channel kind -----------------------------------

def _produce(kind: str, endpoint: str, n: int, ready: Any, start: Any) -> None:
    ctx = zmq.Context()
    codec: Codec[Message] = Codec(Message)
    req = small_request()
    raw = bytes(codec.encode(req)[0])
    stype = zmq.DEALER if kind in ("dealer", "router") else zmq.PUSH
    sock = ctx.socket(stype)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.connect(endpoint)
    # built untimed: the requests ours encodes, the bytes raw sends
    msgs = [small_request(i) for i in range(n)] if kind in ("burst", "decode_only") else []
    raws = [bytes(codec.encode(small_request(i))[0]) for i in range(n)] \
        if kind == "raw_coalesced" else []
    size = int(os.environ.get("BENCH_BURST", SEND_BURST))
    ready.set()
    start.wait()
    if kind == "raw":
        for _ in range(n):
            sock.send(raw)
    elif kind == "raw_coalesced":  # one zmq message per burst: the lengths, then the bytes
        for i in range(0, n, size):
            part = raws[i:i + size]
            sock.send_multipart([array.array("I", [len(b) for b in part]).tobytes(),
                                 b"".join(part)])
    elif kind in ("burst", "decode_only"):  # ours, coalesced: what PushOutbox.send_many sends
        for i in range(0, n, size):
            sock.send_multipart(codec.encode_many(msgs[i:i + size]))
    elif kind == "pickle":
        twin = pickled_twin(req)  # the same fields: our messages refuse pickle
        for _ in range(n):
            sock.send_pyobj(twin)
    else:
        for _ in range(n):
            sock.send_multipart(codec.encode(req))
    sock.close(linger=-1)
    ctx.term()


def throughput(kind: str, n: int) -> float:
    """Messages/s received (and decoded) by the consumer from a producer process."""
    d = tempfile.mkdtemp()
    ep = f"ipc://{d}/t"
    ctx = zmq.Context()
    codec: Codec[Request] = Codec(Request)
    start = mp.get_context("spawn").Event()
    ready = mp.get_context("spawn").Event()
    inbox: PullInbox[Request] | RpcServer[Request] | None = None
    sock: zmq.Socket[bytes] | None = None
    if kind in ("raw", "pickle", "raw_coalesced", "decode_only"):
        sock = ctx.socket(zmq.PULL)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.bind(ep)
    elif kind in ("pull", "burst"):
        inbox = PullInbox(codec, ep, ctx=ctx)
    else:
        inbox = RpcServer(codec, ep, kind="router" if kind == "router" else "dealer", ctx=ctx)
    proc = mp.get_context("spawn").Process(target=_produce, args=(kind, ep, n, ready, start))
    proc.start()
    ready.wait(120)  # the producer imported and connected: time the messages alone
    time.sleep(0.05)  # pacing: let the connection settle  # sleep-ok
    # Every consumer receives as a scheduler process does: with what start-up
    # built (torch's ~170k objects) hidden from the collector by gc.freeze().
    # Without it, one full collection in a 100k-message run stalled it ~0.2 s.
    gc.freeze()
    got = 0
    start.set()
    t0 = time.perf_counter()
    if kind == "raw_coalesced":
        assert sock is not None
        while got < n:  # each message sliced out of its burst, as a view
            # copy=False, as ours receives (a copy per burst would weaken the baseline)
            head_frame, body = sock.recv_multipart(copy=False)
            head, data = head_frame.buffer, body.buffer
            off = 0
            views = []
            for size in array.array("I", head):
                views.append(data[off:off + size])
                off += size
            got += len(views)
    elif kind == "decode_only":
        assert sock is not None
        # A bound, not a contestant: each burst only through the codec's own msgspec
        # decoder (as Codec.decode_any calls it), with no uint32 cast and no Receiver.
        bursts = codec._single_any
        while got < n:
            got += len(bursts.decode(sock.recv(copy=False).buffer).items)  # type: ignore[attr-defined]
    elif sock is not None:
        recv = sock.recv_pyobj if kind == "pickle" else sock.recv
        for _ in range(n):
            recv()
    else:
        assert inbox is not None
        receiver: Receiver[Request] = Receiver([inbox], budget=256)
        while got < n:
            receiver.wait(1.0)
            got += len(receiver.poll())
    dt = time.perf_counter() - t0
    gc.unfreeze()
    proc.join()
    if inbox is not None:
        inbox.close()
    if sock is not None:
        sock.close(0)
    ctx.term()
    return n / dt


# -- (b) ring vs queue.Queue --------------------------------------------------------

def ring_rate(n: int) -> float:
    ring: Ring[int] = Ring(1 << 14)
    def produce() -> None:
        put = ring.put
        for i in range(n):
            put(i)
    t = threading.Thread(target=produce)
    t0 = time.perf_counter()
    t.start()
    got = 0
    fd = ring.fileno()
    while got < n:
        items = ring.drain(4096)
        if not items:
            select.select([fd], [], [], 1.0)
        got += len(items)
    dt = time.perf_counter() - t0
    t.join()
    ring.release()
    return n / dt


def _stdlib_queue_rate(q: queue.SimpleQueue[int] | queue.Queue[int], n: int) -> float:
    """Items/s from one producer thread to this thread through ``q`` (put/get, no batching)."""
    def produce() -> None:
        put = q.put
        for i in range(n):
            put(i)
    t = threading.Thread(target=produce)
    t0 = time.perf_counter()
    t.start()
    get = q.get
    for _ in range(n):
        get()
    dt = time.perf_counter() - t0
    t.join()
    return n / dt


# -- (c) idle wake latency ----------------------------------------------------------

def _wake_sender(kind: str, endpoint: str, samples: int, ready: Any, lo: float, hi: float
                 ) -> None:
    ctx = zmq.Context()
    codec: Codec[Message] = Codec(Message)
    sock = ctx.socket(zmq.PUSH if kind in ("pull", "raw") else zmq.DEALER)
    sock.connect(endpoint)
    ready.wait()
    rnd = random.Random(1)
    for i in range(samples):
        time.sleep(rnd.uniform(lo, hi))  # pacing: the receiver must be parked when it lands
        stamp = time.perf_counter_ns()
        if kind == "raw":
            sock.send(stamp.to_bytes(8, "little"))
        else:
            sock.send_multipart(codec.encode(RpcReqInput(
                rid=f"w{i}", method="ping", parameters={"t": stamp})))
    sock.close(linger=-1)
    ctx.term()


def _collect_wakes(receiver: Receiver[Request], samples: int, out: list[float]) -> None:
    """Park, and on each wake record how long ago the message was stamped."""
    while len(out) < samples:
        receiver.wait(5.0)
        now = time.perf_counter_ns()
        for env in receiver.poll():
            assert isinstance(env, Envelope) and isinstance(env.message, RpcReqInput)
            out.append((now - int(env.message.parameters["t"] or 0)) / 1e3)


def wake_latency(kind: str, samples: int) -> list[float]:
    """us from send to the receiver returning from wait(), while it is parked."""
    d = tempfile.mkdtemp()
    ep = f"ipc://{d}/w"
    out: list[float] = []
    ctx = zmq.Context()
    codec: Codec[Request] = Codec(Request)
    if kind == "ring":
        ring: Ring[Request] = Ring(1024)
        receiver: Receiver[Request] = Receiver([RingInbox(ring)])
        def send() -> None:
            rnd = random.Random(1)
            for i in range(samples):
                time.sleep(rnd.uniform(0.002, 0.006))  # pacing, not waiting
                ring.put(RpcReqInput(rid=f"w{i}", method="ping",
                                     parameters={"t": time.perf_counter_ns()}))
        t = threading.Thread(target=send)
        t.start()
        _collect_wakes(receiver, samples, out)
        t.join()
        ring.release()
        ctx.term()
        return out
    ready = mp.get_context("spawn").Event()
    proc = mp.get_context("spawn").Process(target=_wake_sender,
                                           args=(kind, ep, samples, ready, 0.002, 0.006))
    if kind == "raw":
        sock = ctx.socket(zmq.PULL)
        sock.bind(ep)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        proc.start()
        ready.set()
        while len(out) < samples:
            poller.poll(5000)
            now = time.perf_counter_ns()
            out.append((now - int.from_bytes(sock.recv(), "little")) / 1e3)
        sock.close(0)
    else:
        inbox = PullInbox(codec, ep, ctx=ctx) if kind == "pull" else RpcServer(codec, ep, ctx=ctx)
        receiver = Receiver([inbox])
        proc.start()
        ready.set()
        _collect_wakes(receiver, samples, out)
        inbox.close()
    proc.join()
    ctx.term()
    return out


def seed_ring_only_park(samples: int) -> list[float]:
    """The seed's loop: park on the ring alone (1 s timeout), then read rpc. us to notice."""
    d = tempfile.mkdtemp()
    ep = f"ipc://{d}/s"
    ctx = zmq.Context()
    rpc = ctx.socket(zmq.DEALER)
    rpc.bind(ep)
    ring: Ring[Request] = Ring(16)
    ready = mp.get_context("spawn").Event()
    proc = mp.get_context("spawn").Process(target=_wake_sender,
                                           args=("dealer", ep, samples, ready, 0.05, 0.9))
    proc.start()
    ready.set()
    out: list[float] = []
    codec: Codec[Request] = Codec(Request)
    while len(out) < samples:
        select.select([ring.fileno()], [], [], 1.0)  # parked on the ring alone
        ring.drain(16)
        while True:
            try:
                frames = rpc.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            msg = codec.decode(frames)
            assert isinstance(msg, RpcReqInput)
            out.append((time.perf_counter_ns() - int(msg.parameters["t"] or 0)) / 1e3)
    proc.join()
    rpc.close(0)
    ring.release()
    ctx.term()
    return out


# -- (d) rpc round trip, idle and under flood ---------------------------------------

def _loop_server(work_ep: str, rpc_ep: str, stop_after: float) -> None:
    """A scheduler-shaped loop: drain work (no-op), answer rpc."""
    codec: Codec[Request] = Codec(Request)
    out: Codec[Message] = Codec(Message)
    with PullInbox(codec, work_ep) as work, RpcServer(codec, rpc_ep) as rpc:
        receiver = Receiver([work, rpc], budget=256)
        deadline = time.monotonic() + stop_after
        while time.monotonic() < deadline:
            receiver.wait(0.1)
            for env in receiver.poll():
                if isinstance(env, Envelope) and isinstance(env.message, RpcReqInput):
                    if env.message.method == "stop":
                        deadline = 0
                    rpc.reply(out.encode(RpcReqOutput(rid=env.message.rid, success=True)),
                              env.origin)


def _flooder(work_ep: str, seconds: float) -> None:
    codec: Codec[Message] = Codec(Message)
    with PushOutbox(codec, work_ep) as out:
        req = small_request()
        frames = codec.encode(req)
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            for _ in range(100):
                out._send(frames)


def rpc_latency(flood: bool, samples: int) -> list[float]:
    d = tempfile.mkdtemp()
    work_ep, rpc_ep = f"ipc://{d}/work", f"ipc://{d}/rpc"
    spawn = mp.get_context("spawn")
    server = spawn.Process(target=_loop_server, args=(work_ep, rpc_ep, 120.0))
    server.start()
    flooder = None
    out: list[float] = []
    with RpcClient(rpc_ep) as client:
        client.call("ping", timeout=60)  # the server is up
        if flood:
            flooder = spawn.Process(target=_flooder, args=(work_ep, 60.0))
            flooder.start()
            time.sleep(0.5)  # pacing: let the flood build up  # sleep-ok
        for _ in range(samples):
            t0 = time.perf_counter()
            client.call("ping", timeout=30)
            out.append((time.perf_counter() - t0) * 1e6)
            time.sleep(0.002)  # pacing between calls  # sleep-ok
        client.call("stop", timeout=30)
    if flooder is not None:
        flooder.kill()
        flooder.join()
    server.join(10)
    if server.is_alive():
        server.kill()
    return out


def main() -> None:
    res: dict[str, float] = {}
    say = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    n = int(os.environ.get("BENCH_MSGS", N_MSGS))
    rates: dict[str, list[float]] = {k: [] for k in ("raw", "pickle", "pull", "dealer", "router")}
    for _ in range(3):
        for kind in rates:
            rates[kind].append(throughput(kind, n))
    med = {k: statistics.median(v) for k, v in rates.items()}
    # Bursts: 10 000 requests sent as fast as the producer can, ours coalesced
    # (encode_many, one zmq message per SEND_BURST, decoded by a Receiver)
    # against raw pyzmq coalesced the same way (pre-encoded bytes joined per
    # SEND_BURST, sliced per message, no decode) and one message at a time;
    # interleaved; and the decode_only bound.
    bursts: dict[str, list[float]] = {"raw": [], "raw_coalesced": [], "burst": [],
                                      "decode_only": []}
    for r in range(6):  # the first round of each warms up (discarded)
        for kind in bursts:
            rate = throughput(kind, 10_000)
            if r:
                bursts[kind].append(rate)
    burst_med = {k: statistics.median(v) for k, v in bursts.items()}
    say("(a) small generate request (256 ids, ~1.1 KB), messages/s, median of 3:")
    for k, v in med.items():
        say(f"  {k:8s} {v:12,.0f}")
    say(f"  10k burst: ours coalesced {burst_med['burst']:,.0f}, raw coalesced the same "
        f"way {burst_med['raw_coalesced']:,.0f}, raw per message {burst_med['raw']:,.0f}; "
        f"bound: msgspec's decode alone {burst_med['decode_only']:,.0f} (median of 5)")
    rings: dict[str, list[float]] = {"ring": [], "queue": [], "simplequeue": []}
    for _ in range(3):  # in turns
        rings["ring"].append(ring_rate(1_000_000))
        rings["queue"].append(_stdlib_queue_rate(queue.Queue(1 << 14), 300_000))
        # unbounded: its producer never waits
        rings["simplequeue"].append(_stdlib_queue_rate(queue.SimpleQueue(), 1_000_000))
    ring_r, queue_r, simple_r = (statistics.median(rings[k]) for k in rings)
    say(f"(b) Ring {ring_r:,.0f} items/s vs queue.Queue {queue_r:,.0f} items/s vs "
        f"queue.SimpleQueue (unbounded, no fd to park on) {simple_r:,.0f} items/s")
    # p99 of a cross-process wake swings run to run on 2 cores: interleave the
    # kinds over several rounds and take the median of each round's figure.
    rounds: dict[str, list[tuple[float, float]]] = {k: [] for k in ("raw", "ring", "pull",
                                                                    "dealer")}
    for _ in range(5):
        for k in rounds:
            rounds[k].append(percentiles(wake_latency(k, 200)))
    say("(c) idle wake latency, us (p50 / p99), median of 5 interleaved rounds:")
    for k, v in rounds.items():
        p50 = statistics.median(x for x, _ in v)
        p99 = statistics.median(y for _, y in v)
        say(f"  {k:8s} {p50:9.0f} / {p99:9.0f}")
        res[f"wake_p50_us_{k}"] = round(p50, 1)
        res[f"wake_p99_us_{k}"] = round(p99, 1)
    seed = seed_ring_only_park(12)
    s50, s99 = percentiles(seed)
    say(f"  seed's ring-only park, rpc noticed after: {s50 / 1e3:.0f} / {s99 / 1e3:.0f} ms")
    idle = rpc_latency(False, 300)
    flood = rpc_latency(True, 300)
    i50, i99 = percentiles(idle)
    f50, f99 = percentiles(flood)
    say(f"(d) rpc round trip, us (p50 / p99): idle {i50:.0f} / {i99:.0f}, "
        f"work inbox flooded {f50:.0f} / {f99:.0f}")
    res.update({
        "msgs_per_s_raw": round(med["raw"]),
        "msgs_per_s_pickle": round(med["pickle"]),
        "msgs_per_s_pull": round(med["pull"]),
        "msgs_per_s_dealer": round(med["dealer"]),
        "msgs_per_s_router": round(med["router"]),
        "ratio_small_ours_vs_raw": round(med["pull"] / med["raw"], 3),
        # the pickle twin carries the ids as packed bytes, as ours does
        "ratio_small_ours_vs_pickle_bytes_ids": round(med["pull"] / med["pickle"], 2),
        "msgs_per_s_burst_ours": round(burst_med["burst"]),
        "msgs_per_s_burst_raw_coalesced": round(burst_med["raw_coalesced"]),
        "msgs_per_s_burst_raw_per_message": round(burst_med["raw"]),
        "ratio_burst_ours_vs_raw_coalesced": round(
            burst_med["burst"] / burst_med["raw_coalesced"], 3),
        "ratio_burst_ours_vs_raw_per_message": round(burst_med["burst"] / burst_med["raw"], 3),
        "msgs_per_s_burst_decode_only": round(burst_med["decode_only"]),
        "ratio_burst_decode_only_vs_raw_coalesced": round(
            burst_med["decode_only"] / burst_med["raw_coalesced"], 3),
        "ring_items_per_s": round(ring_r),
        "queue_items_per_s": round(queue_r),
        "simplequeue_items_per_s": round(simple_r),
        "ratio_ring_vs_queue": round(ring_r / queue_r, 2),
        "ratio_ring_vs_simplequeue": round(ring_r / simple_r, 2),
        "wake_p99_us_rpc": res["wake_p99_us_dealer"],
        "wake_p99_us_raw_poller": res["wake_p99_us_raw"],
        "ratio_wake_p99_pull_vs_raw_poller": round(res["wake_p99_us_pull"] /
                                                   res["wake_p99_us_raw"], 2),
        "seed_ring_only_park_p50_ms": round(s50 / 1e3, 1),
        "seed_ring_only_park_p99_ms": round(s99 / 1e3, 1),
        "rpc_idle_p50_us": round(i50, 1),
        "rpc_idle_p99_us": round(i99, 1),
        "rpc_flood_p50_us": round(f50, 1),
        "rpc_flood_p99_us": round(f99, 1),
    })
    print(json.dumps(res))


if __name__ == "__main__":
    main()
