"""Two tensor-parallel ranks over gloo on CPU."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from messages import SamplingParams
from scheduler import Engine, ModelConfig, RequestFailed, SchedulerGone
from tests import procs

SMALL = ModelConfig(vocab_size=128, hidden=32, layers=1, seed=5)


def test_two_ranks_agree_and_rpc_is_collective(tmp_path: Path) -> None:
    with Engine("zmq", SMALL, tp_size=2) as engine:
        handles = [engine.submit([1, 2, i + 1], SamplingParams(max_new_tokens=8,
                                                               temperature=0.9))
                   for i in range(20)]
        results = [h.result(timeout=60) for h in handles]
        assert all(len(r.token_ids) == 8 for r in results)
        digest = engine.collective_rpc("token_digest")
        assert digest.success and digest.result is not None
        digests = digest.result["digest"]
        assert isinstance(digests, list) and len(digests) == 2
        assert digests[0] == digests[1]  # identical token streams on both ranks
        assert digest.result["rank"] == [0, 1]

        ck = tmp_path / "model.ckpt"
        saved = engine.collective_rpc("save_checkpoint", path=str(ck))
        assert saved.success, saved.message
        shards = sorted(p.name for p in tmp_path.iterdir())
        assert shards == ["model.ckpt.rank0-of-2", "model.ckpt.rank1-of-2"]
        assert engine.collective_rpc("load_checkpoint", path=str(ck)).success

        (tmp_path / "model.ckpt.rank1-of-2").unlink()  # only rank 1 will fail
        failed = engine.collective_rpc("load_checkpoint", path=str(ck))
        assert not failed.success
        assert "rank 1 failed" in failed.message and "rank 0" not in failed.message

        # The single-rank engine with the same seed gives the same tokens.
        sp = SamplingParams(max_new_tokens=6, temperature=0.8, seed=11)
        tp_tokens = engine.generate([3, 4], sp, timeout=60).token_ids
    with Engine("ring", SMALL) as single:
        assert single.generate([3, 4], sp, timeout=60).token_ids == tp_tokens


def test_a_dying_rank_is_reported_and_the_engine_shuts_down() -> None:
    engine = Engine("zmq", SMALL, tp_size=2)
    try:
        h = engine.submit([1], SamplingParams(max_new_tokens=1_000_000))
        pids = [p.pid for p in engine._core._scheduler.essential]  # (close() forgets its processes)
        assert len(pids) == 2
        pid = pids[1]
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        # Either rank 0 noticed first (its broadcast failed: it answers every
        # request, naming the failure) or the engine did (a process exited).
        with pytest.raises((SchedulerGone, RequestFailed)) as info:
            h.result(timeout=30)
        assert time.monotonic() - t0 < 10
        if isinstance(info.value, RequestFailed):
            assert info.value.code == "internal"
        else:
            assert "rank1" in str(info.value)
        with pytest.raises(SchedulerGone):
            engine.submit([1]).result(timeout=30)
    finally:
        t0 = time.monotonic()
        engine.close(timeout=10)
        assert time.monotonic() - t0 < 15
    assert not any(procs.alive(p) for p in pids if p is not None)


def test_tp_needs_processes() -> None:
    with pytest.raises(ValueError, match="zmq"):
        Engine("ring", SMALL, tp_size=2)
