"""Tensor parallel: per-step broadcast cost vs the model's step time, ours vs pickle.

Run: ``python -m benchmarks.tp``. Two gloo ranks on this machine. For batches
of 0..256 small generate requests, rank 0 broadcasts one poll's envelopes and
rank 1 decodes them; the figure is rank 1's time per step (pack + transfer +
unpack), median of 7 rounds, the two transports alternating round by round
(the load on a shared box drifts; their ratio is the figure to read).
``broadcast_shm_us_<n>`` sends them through the same-node shared-memory ring
instead of gloo (the default when every rank is local); both carry the same
poll format (outline plus bursts). The contrast broadcasts the same
envelopes with ``broadcast_object_list`` (pickle). The last line is one JSON
object.
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist

from benchmarks._timing import print_checked
from benchmarks.codec import pickled_twin
from bus import Envelope, Origin
from messages import Codec, Request, SamplingParams, TokenizedGenerateReqInput, token_ids
from scheduler.launch.tp import BroadcastReceiver, TPConfig, init_ranks
from scheduler.models.tiny import ModelConfig, TinyLM

SIZES = [0, 1, 8, 64, 256]
STEPS = 200
ROUNDS = 7


class _Fixed:
    """Stands in for rank 0's Receiver: every poll returns the same envelopes."""

    def __init__(self, envelopes: list[Envelope[Request]]) -> None:
        self.envelopes = envelopes

    def poll(self) -> list[Envelope[Request]]:
        return self.envelopes

    def wait(self, timeout: float | None) -> bool:
        return True


def _envelopes(n: int) -> list[Envelope[Request]]:
    origin = Origin("work")
    return [Envelope(TokenizedGenerateReqInput(rid=f"req-{i:06d}",
                                               input_ids=token_ids(range(256)),
                                               sampling=SamplingParams(max_new_tokens=64)),
                     origin) for i in range(n)]


def _rank(rank: int, tp: TPConfig, out: Any) -> None:
    init_ranks(rank, tp)
    codec: Codec[Request] = Codec(Request)
    results: dict[str, float] = {}
    for n in SIZES:
        envs = _envelopes(n)
        # Our messages refuse pickle: the contrast pickles same-field twins.
        twins = [(pickled_twin(e.message), e.origin) for e in envs]  # type: ignore[arg-type]
        # Both transports side by side, alternating round by round: on a shared
        # 2-core box the load drifts, and the ratio is what matters.
        recvs = {t: BroadcastReceiver(rank, _Fixed(envs) if rank == 0 else None,  # type: ignore[arg-type]
                                      codec, transport=t) for t in ("collective", "shm")}
        per: dict[str, list[float]] = {t: [] for t in recvs}
        for _ in range(ROUNDS):
            for transport, recv in recvs.items():
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(STEPS):
                    got = recv.poll()
                per[transport].append((time.perf_counter() - t0) / STEPS * 1e6)
                assert len(got) == n
        dist.barrier()
        for transport, recv in recvs.items():
            recv.close()
            results[f"{'ours' if transport == 'collective' else 'shm'}_{n}"] = \
                statistics.median(per[transport])
        runs = []
        for _ in range(3):
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(STEPS // 4):
                box: list[object] = [twins if rank == 0 else None]
                dist.broadcast_object_list(box, src=0)
            runs.append((time.perf_counter() - t0) / (STEPS // 4) * 1e6)
        results[f"pickle_{n}"] = statistics.median(runs)
    if rank == 1:
        out.put(results)
    dist.barrier()
    dist.destroy_process_group()


#: Every key of the JSON object ``main`` prints (checked once printed).
KEYS = frozenset(f"{kind}_us_{n}" for n in SIZES
                 for kind in ("broadcast", "broadcast_shm", "broadcast_pickle", "decode_step"))


def step_time_us(batch: int) -> float:
    model = TinyLM(ModelConfig())
    tokens = torch.zeros(max(batch, 1), dtype=torch.long)
    states = torch.zeros(max(batch, 1), 2, 128)
    for _ in range(5):
        model.decode(tokens, states)
    t0 = time.perf_counter()
    for _ in range(50):
        model.decode(tokens, states)
    return (time.perf_counter() - t0) / 50 * 1e6


def main() -> None:
    spawn = mp.get_context("spawn")
    tp = TPConfig(2, f"{tempfile.mkdtemp()}/init")
    q = spawn.Queue()
    procs = [spawn.Process(target=_rank, args=(r, tp, q)) for r in range(2)]
    for p in procs:
        p.start()
    res: dict[str, float] = q.get(timeout=600)
    for p in procs:
        p.join()
    out: dict[str, float] = {}
    print("requests  gloo us/step  shm us/step  pickle us/step  model decode step us",
          file=sys.stderr)
    for n in SIZES:
        step = step_time_us(n)
        print(f"{n:8d}  {res[f'ours_{n}']:12.1f}  {res[f'shm_{n}']:11.1f}  "
              f"{res[f'pickle_{n}']:14.1f}  {step:12.1f}", file=sys.stderr)
        out[f"broadcast_us_{n}"] = round(res[f"ours_{n}"], 1)
        out[f"broadcast_shm_us_{n}"] = round(res[f"shm_{n}"], 1)
        out[f"broadcast_pickle_us_{n}"] = round(res[f"pickle_{n}"], 1)
        out[f"decode_step_us_{n}"] = round(step, 1)
    print_checked(out, KEYS, "benchmarks.tp")


if __name__ == "__main__":
    main()
