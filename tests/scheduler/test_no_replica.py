"""What no scheduler could serve is refused before one starts (``serve``, ``serve --dp``,
``Engine``), and a ``serve --dp`` whose every replica was given up on exits 1 saying so
in one line, instead of running on and answering nothing."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from messages import SamplingParams
from scheduler import Engine, ModelConfig, ModelLoadError, SchedulerGone
from scheduler.cli.options import DEPRECATED_ALIASES
from tests import procs
from tests.frontend.cli_runs import broken_tiny_hf


def _serve(tmp_path: Path, *args: str, timeout: float = 60.0) -> tuple[int, str, float]:
    """``serve`` with ``args``: its exit code, its stderr and how long it ran."""
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "scheduler", "serve", "--endpoint",
                           str(tmp_path / "ep"), *args], stderr=subprocess.PIPE, text=True,
                          timeout=timeout, check=False)
    return done.returncode, done.stderr, time.monotonic() - t0


@pytest.mark.parametrize("args", [["--dp", "2", "--max-batch", "0"], ["--max-batch", "0"],
                                  ["--dp", "0"]])
def test_serve_refuses_arguments_no_replica_could_serve_before_starting_one(
        tmp_path: Path, args: list[str]) -> None:
    code, err, _ = _serve(tmp_path, *args)  # --dp 2 --max-batch 0 ran for ever before
    assert code != 0
    flag = DEPRECATED_ALIASES.get(args[-2], args[-2])  # named as --help names it
    assert f"{flag} must be at least 1, not 0" in err, err
    assert "Traceback" not in err


@pytest.fixture(scope="module")
def truncated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("transformers")
    return broken_tiny_hf(tmp_path_factory.mktemp("hf") / "cut", "truncated_weights")


def test_serve_dp_refuses_a_truncated_model_naming_the_file(tmp_path: Path,
                                                            truncated: Path) -> None:
    code, err, _ = _serve(tmp_path, "--dp", "2", "--model", str(truncated))
    assert code != 0
    assert f"{truncated / 'model.safetensors'}" in err and "safetensors" in err, err
    assert "Traceback" not in err


def test_an_engine_refuses_what_no_replica_could_serve_before_starting_one(
        truncated: Path) -> None:
    t0 = time.monotonic()
    with pytest.raises(ModelLoadError, match=r"model\.safetensors"):
        Engine("zmq", truncated, dp_size=2)
    with pytest.raises(ValueError, match="max_batch must be at least 1"):
        Engine("zmq", ModelConfig(kind="stub"), dp_size=2, max_batch=0)
    assert time.monotonic() - t0 < 30  # not a hello that waits out its 60 s


def test_serve_dp_whose_replicas_all_keep_dying_exits_1_saying_none_can_serve(
        tmp_path: Path) -> None:
    serve = subprocess.Popen([sys.executable, "-m", "scheduler", "serve", "--dp", "2",
                              "--endpoint", str(tmp_path / "ep")], stderr=subprocess.PIPE,
                             text=True)
    try:
        deadline = time.monotonic() + 180
        while serve.poll() is None:  # every replica killed as soon as it appears
            for pid in procs.started(serve.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            assert time.monotonic() < deadline, "serve --dp ran on with no replica left"
            time.sleep(0.05)  # sleep-ok: pacing a deadline poll
        assert serve.stderr is not None
        err = serve.stderr.read()
        assert serve.returncode == 1, err
        said = [line for line in err.splitlines() if "no replica can serve" in line]
        assert len(said) == 1, err
        assert said[0].startswith("scheduler: no replica can serve: each exited 6 times")
        assert "Traceback" not in err and "interrupted" not in err, err
    finally:
        if serve.poll() is None:
            serve.kill()
        serve.wait(30)
        if serve.stderr is not None:
            serve.stderr.close()


def test_an_engine_whose_replicas_all_keep_dying_says_none_can_serve() -> None:
    with Engine("zmq", ModelConfig(kind="stub"), dp_size=2) as engine:
        deadline = time.monotonic() + 180
        while engine.gone is None:  # every replica killed as soon as it is known
            for pids in engine.replica_pids:
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
            assert time.monotonic() < deadline, "the engine never said none can serve"
            time.sleep(0.05)  # sleep-ok: pacing a deadline poll
        assert engine.gone.startswith("no replica can serve: each exited 6 times")
        with pytest.raises(SchedulerGone, match="no replica can serve"):
            engine.generate([1, 2], SamplingParams(max_new_tokens=2))


@pytest.fixture(scope="module")
def wrong_shape(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model that passes every check before a start (its files are whole, its config
    reads) and fails only once a replica loads it: its weights are for another shape."""
    pytest.importorskip("transformers")
    from scheduler.models.tiny_hf import build_tiny_hf

    root = build_tiny_hf(tmp_path_factory.mktemp("hf") / "wrong", hidden=32, layers=1)
    config = json.loads((root / "config.json").read_text())
    (root / "config.json").write_text(json.dumps({**config, "hidden_size": 64}))
    return root


def test_serve_dp_whose_model_fails_in_the_replicas_exits_1_with_one_line(
        tmp_path: Path, wrong_shape: Path) -> None:
    code, err, _ = _serve(tmp_path, "--dp", "2", "--model", str(wrong_shape),
                          timeout=180)  # restarted for ever before
    assert code == 1, err
    said = [line for line in err.splitlines() if "no replica can serve" in line]
    assert len(said) == 1, err
    assert said[0].startswith(f"scheduler: no replica can serve: model {wrong_shape}"), err
    assert "size mismatch" in said[0] and "Traceback" not in err, err
    assert "restarting it" not in err, err  # a model that does not load is not retried
    assert "did not load its model" not in err, err  # said once: by the exit's line


def test_an_engine_whose_model_fails_in_the_replicas_raises_model_load_error(
        wrong_shape: Path) -> None:
    t0 = time.monotonic()
    with pytest.raises(ModelLoadError, match="size mismatch") as caught:
        Engine("zmq", wrong_shape, dp_size=2)  # an RpcTimeout after 100 s before
    assert str(caught.value).startswith(f"model {wrong_shape}")
    # (well under the 100 s of the rpc timeout it used to wait for; two replicas
    # importing torch on a loaded 2-core machine take tens of seconds)
    assert time.monotonic() - t0 < 90
