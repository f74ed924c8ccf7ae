"""``python -m frontend --model DIR`` checks that the model would load before anything
starts: a truncated weights file is one line naming it, not a scheduler (or every
replica) dying at start-up behind a ``hello`` that waits out its 60 s."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from frontend.__main__ import parse, settings_from
from tests.frontend.cli_runs import broken_tiny_hf


@pytest.fixture(scope="module")
def truncated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("transformers")
    return broken_tiny_hf(tmp_path_factory.mktemp("hf") / "cut", "truncated_weights")


def test_a_truncated_model_is_refused_naming_its_file_before_a_run_directory_is_made(
        tmp_path: Path, truncated: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # where the run directory would go
    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    args = parse(["--mode", "zmq", "--dp-size", "2", "--model", str(truncated)])
    with pytest.raises(SystemExit) as raised:
        settings_from(args)
    message = str(raised.value)
    assert str(truncated / "model.safetensors") in message and "\n" not in message
    assert "safetensors" in message.split(":", 1)[1]
    assert os.listdir(tmp_path) == []  # no run directory left behind


def test_an_unknown_model_type_is_refused_naming_config_json(tmp_path: Path,
                                                             truncated: Path) -> None:
    odd = tmp_path / "odd"
    shutil.copytree(truncated, odd)  # sound weights, a model type nobody knows
    import torch
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(2)}, str(odd / "model.safetensors"))
    config = (odd / "config.json").read_text().replace('"llama"', '"no_such_model"')
    (odd / "config.json").write_text(config)
    args = parse(["--mode", "zmq", "--model", str(odd), "--endpoint", str(tmp_path / "ep")])
    with pytest.raises(SystemExit, match=r"config\.json: .*no_such_model"):
        settings_from(args)


def test_a_symlink_loop_as_the_model_directory_is_a_model_load_error(tmp_path: Path) -> None:
    from scheduler import Engine, ModelLoadError

    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    with pytest.raises(ModelLoadError, match=r"loop: the path does not resolve"):
        Engine("zmq", loop)  # a RuntimeError from Path.resolve before


def test_a_directory_named_config_json_is_said_to_be_no_file(tmp_path: Path,
                                                              truncated: Path) -> None:
    from scheduler.models.loading import ModelLoadError, check_model_dir

    odd = tmp_path / "odd"
    shutil.copytree(truncated, odd)
    (odd / "config.json").unlink()
    (odd / "config.json").mkdir()
    with pytest.raises(ModelLoadError, match=r"config\.json: not a file"):
        check_model_dir(odd)  # "missing .../config.json" before


def test_a_cause_announced_by_a_colon_is_kept_on_the_one_line(tmp_path: Path,
                                                               truncated: Path) -> None:
    import json

    import torch
    from safetensors.torch import save_file

    from scheduler.models.loading import HFModelSpec, ModelLoadError, check_model_loads

    odd = tmp_path / "odd"
    shutil.copytree(truncated, odd)
    save_file({"w": torch.zeros(2)}, str(odd / "model.safetensors"))
    config = json.loads((odd / "config.json").read_text())
    (odd / "config.json").write_text(json.dumps({**config, "num_hidden_layers": "two"}))
    with pytest.raises(ModelLoadError) as raised:
        check_model_loads(HFModelSpec(str(odd)))
    message = str(raised.value)  # it ended at "...field 'num_hidden_layers':" before
    assert "num_hidden_layers" in message and "two" in message, message
    assert not message.endswith(":") and "\n" not in message
