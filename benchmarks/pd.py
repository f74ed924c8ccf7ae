"""Prefill and decode apart: what a KV hand-off costs, and whether answers change.

Run: ``python -m benchmarks.pd``. Every figure comes from one run on this
machine (compare ratios, not absolute numbers: the box is small and shared).

* **Transport, same node** (``kv_handoff_*``): a :class:`~messages.KVHandoff`
  whose ``kv`` is a 64-layer-equivalent cache of 64 MiB (``(64, 2, 8, 512,
  64)`` float16) crosses the path a served hand-off takes, through the
  library's channels and codecs, three processes: the *prefill* process
  sends it on its ``out`` outbox, the *dispatcher* process receives it and
  sends it on a replica's ``work`` outbox, the *decode* process receives it
  and adopts it (per-layer views, as ``HFCausalLM.adopt_state`` does), then
  acks. As served, the prefill side writes the state into its outbox's slab
  (``Model.export_state(key, empty=out.empty)``), so the first hop is a
  handle; that write (the export, from the model's cache) is timed apart
  (``kv_export_ms``) and left out of the transport, as ``benchmarks.shm``
  leaves out filling a slab tensor. The dispatcher's hop copies the bytes
  once into its own slab (a received view cannot be forwarded by handle);
  the decode side reads the slab: adopting is views only
  (``kv_adopt_us``), and the first decode step that takes the request into
  its batch copies it once into the batch's cache, as it does for any
  request that joins (``kv_adopt_copy_ms``, timed apart). The floor is a
  bare memcpy of the same bytes in the same run, into a tensor whose pages
  are already faulted (``kv_memcpy_ms``); ``benchmarks.shm``'s handoff of
  those bytes (one memcpy into a mapped segment, a few bytes over zmq, a
  view: ``kv_floor_ms``) is printed beside it.
* **A 2,000-token prompt on the tiny Llama** (float64): the hand-off end
  to end (export into a slab, both hops, adopt; ``kv_handoff_ms_p50``)
  beside reading the prompt again (``reprefill_ms_p50``, 512-token chunks
  as the scheduler reads it).
* **Interference** (``itl_*``): 16 streams decode while 4,000-token prompts
  arrive every 500 ms for ``PD_SECONDS`` (20) seconds, on the float64 tiny
  Llama: the streams' inter-token latency (the gaps between a stream's
  chunks, a chunk of k tokens counting k gaps) under ``pd=(1, 1)`` against
  ``dp_size=2`` with chunked prefill (two replica processes either way), the
  long prompts' time to first token, and the CPU seconds each replica
  process used (on a 2-core box the two replicas, the dispatcher and this
  client share two cores, which is what bounds the ratio). Each replica is
  pinned to a core of its own where there are enough (the dispatcher and
  the client float), in both configurations; ``replicas_pinned`` says
  whether they were.
* **Answers**: ``Engine(pd=(1, 1))`` against a colocated ``Engine("zmq")``,
  greedy, prompts of 1 to 2,000 tokens: ``match_ratio_pd_vs_colocated`` is
  the share of requests whose tokens are equal, token for token.

The last line is one JSON object.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks._procs import pin
from benchmarks._timing import print_checked
from benchmarks.shm import _Floor
from bus import PullInbox, PushOutbox, Receiver, WouldBlock
from bus.envelope import Envelope
from messages import OUT, WORK, AbortReq, KVHandoff, SamplingParams, token_ids

KV_SHAPE = (64, 2, 8, 512, 64)  # layers, keys/values, kv heads, positions, head dim
KV_DTYPE = torch.float16
REPEATS = 24
PROMPT = 2000
KEYS = frozenset([
    "kv_handoff_bytes", "kv_handoff_ms", "kv_handoff_gbps_same_node", "kv_memcpy_ms",
    "ratio_kv_handoff_vs_memcpy_floor", "kv_floor_ms", "ratio_kv_handoff_vs_shm_floor",
    "kv_export_ms", "kv_adopt_us", "kv_adopt_copy_ms",
    "kv_handoff_ms_p50", "reprefill_ms_p50", "ratio_reprefill_vs_kv_handoff",
    "match_ratio_pd_vs_colocated", "requests_compared", "interference_seconds",
    "itl_p50_ms_pd", "itl_p99_ms_pd", "itl_p50_ms_colocated", "itl_p99_ms_colocated",
    "itl_p99_ratio_pd_vs_colocated", "ttft_p50_ms_long_pd", "ttft_p50_ms_long_colocated",
    "replica_cpu_s_pd", "replica_cpu_s_colocated", "replicas_pinned"])


def _handoff(kv: torch.Tensor, rid: str = "h") -> KVHandoff:
    return KVHandoff(rid=rid, input_ids=token_ids(range(kv.shape[3])), output_ids=token_ids([7]),
                     sent=1, sampling=SamplingParams(temperature=0.0), kv=kv,
                     fingerprint="bench:0:float16")


def _one(inbox: PullInbox[Any], timeout: float = 120.0) -> Any:
    recv: Receiver[Any] = Receiver([inbox])
    deadline = time.monotonic() + timeout
    while True:
        if time.monotonic() > deadline:
            raise TimeoutError(f"nothing on {inbox.name} for {timeout} s (a process died?)")
        got = recv.poll()
        if got:
            env = got[0]
            assert isinstance(env, Envelope), env
            return env.message
        recv.wait(1.0)


def _relay(d: str) -> None:
    """The dispatcher's hop: a prefill replica's out, on to a decode replica's work."""
    with PullInbox(OUT.outbound_codec(), f"ipc://{d}/out", bind=False) as inbox, \
            PushOutbox(WORK.inbound_codec(), f"ipc://{d}/work") as out:
        while True:
            msg = _one(inbox)
            out.send(msg)
            stop = isinstance(msg, KVHandoff) and msg.rid == "stop"
            del msg  # the view: its slab goes back to the prefill side
            if stop:
                return


def _decode(d: str) -> None:
    """The decode replica: adopt (views of the slab), ack with the adopt's time in the rid;
    a rid ``copy`` also times copying the state into a fresh cache."""
    with PullInbox(WORK.inbound_codec(), f"ipc://{d}/work") as inbox, \
            PushOutbox(WORK.inbound_codec(), f"ipc://{d}/ack") as ack:
        while True:
            h = _one(inbox)
            assert isinstance(h, KVHandoff)
            t0 = time.perf_counter()
            kv = h.kv
            layers = [(kv[i, 0].unsqueeze(0), kv[i, 1].unsqueeze(0)) for i in range(kv.shape[0])]
            adopt_us = (time.perf_counter() - t0) * 1e6
            copy_ms = 0.0
            if h.rid == "copy":
                t0 = time.perf_counter()
                cache = [(k.clone(), v.clone()) for k, v in layers]
                copy_ms = (time.perf_counter() - t0) * 1e3
                del cache
            stop = h.rid == "stop"
            del h, kv, layers
            ack.send(AbortReq(rid=f"{adopt_us:.1f}:{copy_ms:.3f}"))
            if stop:
                return


class _Path:
    """The three processes' channels, seen from the prefill side."""

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="bench-pd-")
        ctx = mp.get_context("spawn")
        self.out = PushOutbox(OUT.outbound_codec(), f"ipc://{self.dir}/out", bind=True)
        self.acks = PullInbox(WORK.inbound_codec(), f"ipc://{self.dir}/ack", bind=True)
        self.procs = [ctx.Process(target=_relay, args=(self.dir,)),
                      ctx.Process(target=_decode, args=(self.dir,))]
        for p in self.procs:
            p.start()
        deadline = time.monotonic() + 300  # spawned children import torch: slow on a busy box
        while True:
            try:
                self.out.send_nowait(_handoff(torch.zeros(1, 2, 1, 1, 1, dtype=KV_DTYPE), "up"))
                break
            except WouldBlock:
                if time.monotonic() > deadline or not all(p.is_alive() for p in self.procs):
                    raise
                time.sleep(0.05)  # sleep-ok: pacing while the children start
        _one(self.acks, 300)

    def trip(self, h: KVHandoff) -> tuple[float, float, float]:
        """Round trip (ms), the decode side's adopt (µs) and copy (ms)."""
        t0 = time.perf_counter()
        self.out.send(h)
        ack = _one(self.acks)
        ms = (time.perf_counter() - t0) * 1e3
        adopt, copy = ack.rid.split(":")
        return ms, float(adopt), float(copy)

    def close(self) -> None:
        self.out.send(_handoff(torch.zeros(1, 2, 1, 1, 1, dtype=KV_DTYPE), "stop"))
        _one(self.acks)
        for p in self.procs:
            p.join(30)
        self.out.close()
        self.acks.close()


def transport(path: _Path) -> dict[str, float]:
    """The 64 MiB hand-off against the memcpy floor, in turns (the load hits both alike)."""
    floor = _Floor()
    src = torch.randn(KV_SHAPE).to(KV_DTYPE)
    dst = torch.empty_like(src)  # the bare memcpy's target, its pages faulted once
    dst.copy_(src)
    runs: list[float] = []
    floors: list[float] = []
    memcpys: list[float] = []
    adopts: list[float] = []
    exports: list[float] = []
    try:
        for i in range(REPEATS + 2):
            t0 = time.perf_counter()
            kv = path.out.empty(KV_SHAPE, dtype=KV_DTYPE)  # what export_state writes into
            kv.copy_(src)
            export_ms = (time.perf_counter() - t0) * 1e3
            ms, adopt_us, _ = path.trip(_handoff(kv))
            del kv
            fl = floor.trip(src)
            t0 = time.perf_counter()
            dst.copy_(src)
            mc = (time.perf_counter() - t0) * 1e3
            if i >= 2:  # the first two map and fault the pages
                runs.append(ms)
                floors.append(fl)
                memcpys.append(mc)
                adopts.append(adopt_us)
                exports.append(export_ms)
        copies = [path.trip(_handoff(src.clone(), "copy"))[2] for _ in range(3)]
    finally:
        floor.close()
    n = src.numel() * src.element_size()
    ms, fl, mc = (statistics.median(runs), statistics.median(floors),
                  statistics.median(memcpys))
    print(f"64 MiB hand-off {ms:.2f} ms, memcpy {mc:.2f} ms, shm floor {fl:.2f} ms, export "
          f"{statistics.median(exports):.2f} ms, adopt {statistics.median(adopts):.1f} us",
          file=sys.stderr)
    return {"kv_handoff_bytes": n, "kv_handoff_ms": round(ms, 3),
            "kv_handoff_gbps_same_node": round(n / ms / 1e6, 2), "kv_memcpy_ms": round(mc, 3),
            "ratio_kv_handoff_vs_memcpy_floor": round(mc / ms, 2),
            "kv_floor_ms": round(fl, 3), "ratio_kv_handoff_vs_shm_floor": round(fl / ms, 2),
            "kv_export_ms": round(statistics.median(exports), 3),
            "kv_adopt_us": round(statistics.median(adopts), 1),
            "kv_adopt_copy_ms": round(statistics.median(copies), 3)}


def long_prompt(path: _Path, model_dir: Path) -> dict[str, float]:
    """A 2,000-token prompt: hand-off end to end against reading it again."""
    from scheduler.models.hf import HFCausalLM
    from scheduler.models.protocol import PromptChunk
    model = HFCausalLM(model_dir)
    ids = torch.from_numpy(np.random.default_rng(0).integers(3, 384, PROMPT))
    handoffs: list[float] = []
    prefills: list[float] = []
    for i in range(7):
        t0 = time.perf_counter()
        for start in range(0, PROMPT, 512):
            chunk = ids[start:start + 512]
            model.prefill_chunks([PromptChunk(0, chunk, start, start + len(chunk) == PROMPT)])
        prefill_ms = (time.perf_counter() - t0) * 1e3
        t0 = time.perf_counter()
        state = model.export_state(0, lambda shape, dtype: path.out.empty(shape, dtype=dtype))
        h = KVHandoff(rid="long", input_ids=token_ids(ids.tolist()), output_ids=token_ids([7]),
                      sent=1, sampling=SamplingParams(temperature=0.0), kv=state.kv,
                      fingerprint=state.fingerprint)
        path.trip(h)
        ms = (time.perf_counter() - t0) * 1e3
        del h, state
        model.free(0)
        if i:
            handoffs.append(ms)
            prefills.append(prefill_ms)
    ho, pf = statistics.median(handoffs), statistics.median(prefills)
    print(f"2000-token prompt: hand-off {ho:.2f} ms, prefill again {pf:.2f} ms", file=sys.stderr)
    return {"kv_handoff_ms_p50": round(ho, 3), "reprefill_ms_p50": round(pf, 3),
            "ratio_reprefill_vs_kv_handoff": round(pf / ho, 2)}


def answers(model_dir: Path) -> dict[str, float]:
    """Greedy tokens under pd 1:1 against a colocated scheduler, prompts of 1..2,000."""
    from scheduler import Engine
    rng = np.random.default_rng(1)
    lengths = [1, 2, 5, 17, 64, 200, 511, 512, 513, 1000, 1500, 2000]
    prompts = [rng.integers(3, 384, n).tolist() for n in lengths]
    greedy = SamplingParams(max_new_tokens=16, temperature=0.0)

    def run(engine: Engine) -> list[list[int]]:
        handles = [engine.submit(p, greedy) for p in prompts]
        return [h.result(300).token_ids for h in handles]

    with Engine("zmq", model_dir) as colocated:
        want = run(colocated)
    with Engine("zmq", model_dir, pd=(1, 1)) as pd:
        got = run(pd)
    same = sum(g == w for g, w in zip(got, want, strict=True))
    return {"match_ratio_pd_vs_colocated": same / len(prompts),
            "requests_compared": len(prompts)}


def _cpu_s(pids: list[int]) -> list[float]:
    """User + system CPU seconds of each process so far (``/proc/<pid>/stat``)."""
    out = []
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        out.append((int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"))
    return out


def _interference(engine: Any, seconds: float) -> tuple[list[float], list[float], list[float]]:
    """ITL samples (ms) of 16 streams while long prompts arrive; the long prompts' TTFT
    (ms); each replica's CPU seconds meanwhile."""
    import threading
    rng = np.random.default_rng(2)
    streams = [rng.integers(3, 384, 64).tolist() for _ in range(16)]
    decode = SamplingParams(max_new_tokens=3000, temperature=0.0, ignore_eos=True)
    long = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
    gaps: list[float] = []
    ttfts: list[float] = []
    stop = threading.Event()
    started = threading.Barrier(17)

    def consume(prompt: list[int]) -> None:
        it = engine.stream_steps(prompt, decode)
        first = True
        last = 0.0
        for steps in it:
            now = time.perf_counter()
            n = sum(len(c.token_ids) for c in steps)
            if first:
                first = False
                started.wait()
            elif not stop.is_set():
                gaps.append((now - last) * 1e3 / max(n, 1))
                gaps.extend([0.0] * (n - 1))
            last = now
            if stop.is_set():
                it.close()
                return

    def first_token(t0: float, h: Any) -> None:
        next(iter(h))
        ttfts.append((time.perf_counter() - t0) * 1e3)

    def arrive() -> None:
        handles = []
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            t0 = time.perf_counter()
            h = engine.submit(rng.integers(3, 384, 4000).tolist(), long, stream=True)
            handles.append((t0, h))
            threading.Thread(target=first_token, args=(t0, h), daemon=True).start()
            time.sleep(0.5)  # sleep-ok: the arrival rate under test
        for _, h in handles:
            h.result(300)

    threads = [threading.Thread(target=consume, args=(p,)) for p in streams]
    for t in threads:
        t.start()
    started.wait()
    pids = [p for ranks in engine.replica_pids for p in ranks]
    cpu0 = _cpu_s(pids)
    arrive()
    cpu = [b - a for a, b in zip(cpu0, _cpu_s(pids), strict=True)]
    stop.set()
    for t in threads:
        t.join(120)
    return gaps, ttfts, cpu


def _pin(replicas: list[tuple[int, ...]]) -> bool:
    """Each replica process (every thread of it) on a core of its own, where the box has
    one for each: replica ``i`` on core ``i``; the dispatcher and this client float. On
    2 cores, unpinned, the prefill replica (busy all the time under this load) and
    the decode replica took turns on both, and the streams' gaps measured that.
    Returns whether it pinned (``replicas_pinned`` in the output)."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < len(replicas):
        return False
    for core, pids in zip(cores, replicas, strict=False):
        for pid in pids:
            pin(pid, {core})
    return True


def interference(model_dir: Path) -> dict[str, object]:
    """ITL of decoding streams while long prompts arrive: pd 1:1 against dp_size=2."""
    from scheduler import Engine
    seconds = float(os.environ.get("PD_SECONDS", "20"))
    res: dict[str, object] = {"interference_seconds": seconds}
    for name, kw in (("pd", {"pd": (1, 1)}), ("colocated", {"dp_size": 2})):
        with Engine("zmq", model_dir, **kw) as engine:
            res["replicas_pinned"] = _pin(engine.replica_pids)
            gaps, ttfts, cpu = _interference(engine, seconds)
        p50, p99 = np.percentile(gaps, [50, 99])
        res[f"itl_p50_ms_{name}"] = round(float(p50), 2)
        res[f"itl_p99_ms_{name}"] = round(float(p99), 2)
        res[f"ttft_p50_ms_long_{name}"] = round(statistics.median(ttfts), 1) if ttfts else None
        res[f"replica_cpu_s_{name}"] = [round(c, 1) for c in cpu]
        print(f"{name}: itl p50 {p50:.2f} ms p99 {p99:.2f} ms over {len(gaps)} tokens, "
              f"long ttft p50 {res[f'ttft_p50_ms_long_{name}']} ms, replica cpu {cpu}",
              file=sys.stderr)
    pd99, co99 = res["itl_p99_ms_pd"], res["itl_p99_ms_colocated"]
    assert isinstance(pd99, float) and isinstance(co99, float)
    res["itl_p99_ratio_pd_vs_colocated"] = round(pd99 / co99, 2)
    return res


def main() -> None:
    from scheduler.models.tiny_hf import build_tiny_hf
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    model_dir = build_tiny_hf(Path(tempfile.mkdtemp(prefix="bench-pd-model-")))
    path = _Path()
    try:
        res: dict[str, float] = {**transport(path), **long_prompt(path, model_dir)}
    finally:
        path.close()
    out: dict[str, object] = {**res, **answers(model_dir), **interference(model_dir)}
    print_checked(out, KEYS, "benchmarks.pd")


if __name__ == "__main__":
    main()
