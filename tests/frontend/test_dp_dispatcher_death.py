"""The door over data-parallel replicas when their dispatcher is SIGKILLed: the request
in flight and every one after it are 503, and the replicas stop within the bound
(:data:`scheduler.launch.processes.UPSTREAM_BOUND`) instead of decoding for nobody."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from frontend import ByteTokenizer, Settings
from scheduler import ModelConfig
from scheduler.launch.processes import UPSTREAM_BOUND
from tests.conftest import eventually
from tests.frontend.server import Server

TOK = ByteTokenizer()
STUB = ModelConfig(vocab_size=TOK.vocab_size, kind="stub")
#: Greedy on the stub is token 0 for ever (no end-of-text): runs until stopped.
ENDLESS = {"model": "tiny", "prompt": "x", "max_tokens": 1_000_000, "temperature": 0,
           "ignore_eos": True}
#: Slack on the bound for this shared 2-core machine.
SLACK = 2.0


def test_a_killed_dispatcher_is_503_at_the_door_and_its_replicas_stop() -> None:
    server = Server(Settings(mode="zmq", dp_size=2, model=STUB), TOK)
    try:
        engine = server.engine
        dispatcher = engine._scheduler.essential[0].pid
        assert dispatcher is not None
        replicas = [pid for ranks in engine.replica_pids for pid in ranks]
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(httpx.post, f"{server.url}/v1/completions", json=ENDLESS,
                                  timeout=60.0)
            eventually(lambda: engine.pending == 1, 30.0, "the request to be sent")
            os.kill(dispatcher, signal.SIGKILL)
            killed_at = time.monotonic()
            cut = waiting.result(timeout=60.0)
        assert cut.status_code == 503, cut.text
        while any(os.path.exists(f"/proc/{pid}") for pid in replicas):  # exited, reaped
            assert time.monotonic() - killed_at < UPSTREAM_BOUND + SLACK, replicas
            time.sleep(0.02)  # sleep-ok: pacing of a deadline poll
        r = httpx.post(f"{server.url}/v1/completions",
                       json={"model": "tiny", "prompt": "x", "max_tokens": 2})
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "scheduler_unavailable"
        assert "dispatcher" in r.json()["error"]["message"], r.text
        assert httpx.get(f"{server.url}/health").status_code == 503
    finally:
        server.stop()
