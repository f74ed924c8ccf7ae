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


@pytest.fixture(scope="module")
def truncated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("transformers")
    from scheduler.models.tiny_hf import build_tiny_hf

    root = build_tiny_hf(tmp_path_factory.mktemp("hf") / "cut")
    weights = root / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    return root


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
