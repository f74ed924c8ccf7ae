"""Starts that fail, and stops that are asked twice, through the real command lines.

A broken model directory is one line naming the file and the cause, in every
mode (``serve``, ``frontend`` ring and zmq, ``Engine``), also when the model
loads in a child process; a failed start and a double Ctrl-C leave no run
directory; a double Ctrl-C with open streams never aborts the process.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from scheduler import Engine, ModelLoadError
from scheduler.models.loading import HFModelSpec, check_model_dir, load_model
from scheduler.models.tiny_hf import build_tiny_hf
from tests.frontend.cli_runs import (
    BREAKS,
    broken_copy,
    ctrl_c_while_starting,
    double_ctrl_c,
    failed_start,
    free_port,
    group_ctrl_c,
)

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_hf(tmp_path_factory.mktemp("hf") / "tiny", hidden=32, layers=1,
                         dtype=torch.float32)


@pytest.fixture(scope="module")
def broken(good: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("broken")
    return {how: broken_copy(good, root / how, how) for how in BREAKS}


def test_a_broken_model_directory_is_named_by_the_cheap_check(broken: dict[str, Path]) -> None:
    # Read before anything loads (a parent checks before it starts a child): the file
    # is named, and the cause.
    for how, says in (("truncated_weights", r"model\.safetensors: cut short: its tensors "
                                            r"need \d+ bytes, the file has \d+"),
                      ("invalid_config_json", r"config\.json: not valid JSON"),
                      ("missing_config", r"missing .*config\.json"),
                      ("missing_weights", r"missing .*model\.safetensors")):
        with pytest.raises(ModelLoadError, match=says) as info:
            check_model_dir(broken[how])
        assert "\n" not in str(info.value) and str(broken[how]) in info.value.path
    garbage = broken["missing_weights"] / "model.safetensors"
    garbage.write_bytes(b"\xff" * 64)  # a length past the file: no header at all
    with pytest.raises(ModelLoadError, match="not a safetensors file, or cut short"):
        check_model_dir(broken["missing_weights"])
    garbage.unlink()


def test_a_model_that_loads_in_a_child_reports_its_error_to_the_parent(
        broken: dict[str, Path]) -> None:
    # An unknown model_type passes the cheap check: the scheduler process finds it, and
    # its error (not "scheduler process exited (exit code 1)") is what the parent raises.
    with pytest.raises(ModelLoadError) as info:
        Engine("zmq", broken["unknown_model_type"], start_timeout=120)
    assert info.value.path.endswith("config.json")
    assert "no-such-model" in info.value.reason and "\n" not in str(info.value)
    with pytest.raises(ModelLoadError, match="no-such-model"):  # and in this process
        Engine("ring", broken["unknown_model_type"])


def test_a_load_that_fails_after_its_report_is_one_line(good: Path, tmp_path: Path,
                                                      capfd: pytest.CaptureFixture[str]) -> None:
    # transformers logs a table (a dozen lines) of mismatched weights, then raises "look
    # at the above report": the report is held, and its first row is the reason.
    shutil.copytree(good, tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config, "hidden_size": 64}))
    capfd.readouterr()
    with pytest.raises(ModelLoadError, match=r"size mismatch .* \(and \d+ more like it\)$"):
        load_model(HFModelSpec(str(tmp_path / "m")))
    assert "LOAD REPORT" not in capfd.readouterr().err


@pytest.mark.parametrize(("how", "mode"), [
    ("truncated_weights", "zmq"), ("unknown_model_type", "zmq"), ("unknown_model_type", "ring"),
    ("invalid_config_json", "ring"), ("missing_tokenizer", "ring")])
def test_the_frontend_says_a_broken_model_in_one_line(broken: dict[str, Path], how: str,
                                                       mode: str) -> None:
    got = failed_start(["-m", "frontend", "--port", str(free_port()), "--mode", mode,
                        "--model", str(broken[how])])
    assert got.returncode == 1, got
    assert len(got.lines) == 1, got.lines
    assert got.lines[0].startswith("error: ") and BREAKS[how][0] in got.lines[0], got.lines
    assert got.leftovers == []


@pytest.mark.parametrize("how", ["truncated_weights", "unknown_model_type"])
def test_serve_says_a_broken_model_in_one_line(broken: dict[str, Path], how: str,
                                               tmp_path: Path) -> None:
    got = failed_start(["-m", "scheduler", "serve", "--endpoint", str(tmp_path / "ep"),
                        "--model", str(broken[how])])
    assert got.returncode == 1, got
    assert len(got.lines) == 1 and got.lines[0].startswith("error: model "), got.lines
    assert BREAKS[how][0] in got.lines[0] and got.leftovers == []


def test_a_double_ctrl_c_with_open_streams_never_aborts_and_leaves_nothing() -> None:
    # SIGINT, 0.3 s, SIGINT, with 60 streams open: the embedded scheduler's thread was
    # still in a step at exit (SIGABRT, "terminate called without an active exception",
    # in about half the runs), and both run directories were left every time.
    for _ in range(3):
        got = double_ctrl_c("ring", streams=60, gap=0.3)
        assert not got.aborted and got.returncode == 0, (got.returncode, got.stderr[-2000:])
        assert got.leftovers == [] and got.streams == 60



@pytest.mark.parametrize("extra", [(), ("--dp-size", "2")], ids=["zmq", "zmq-dp2"])
def test_ctrl_c_to_the_process_group_lets_a_stream_in_flight_finish(
        extra: tuple[str, ...]) -> None:
    # A terminal's Ctrl-C reaches every process of its group: the scheduler processes
    # died of it at once (a KeyboardInterrupt traceback), so the stream ended with an
    # error 'shutdown' instead of being drained as the door promises.
    got = group_ctrl_c("zmq", tokens=300, extra=extra)
    assert got.at_signal == 1 and len(got.events) > 1, got
    last = got.events[-1]
    assert "error" not in last, last
    choices = last["choices"]
    assert isinstance(choices, list) and choices[0]["finish_reason"] == "length", last
    assert got.returncode == 0 and "Traceback" not in got.stderr, got.stderr[-2000:]


def test_ctrl_c_while_the_scheduler_process_imports_is_quiet() -> None:
    # The interpreter that imports for the scheduler processes (the fork server; once,
    # each spawned one) imports torch for seconds before it ignores SIGINT: a terminal's
    # Ctrl-C then printed a KeyboardInterrupt traceback from each.
    got = ctrl_c_while_starting()
    assert got.children, got
    assert "Traceback" not in got.stderr and "KeyboardInterrupt" not in got.stderr, \
        got.stderr[-3000:]
    assert got.returncode == 0 and got.left == [], got
