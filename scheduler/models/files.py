"""A model directory's files, checked before anything is loaded, and the error that names them."""

from __future__ import annotations

import json
import os
from pathlib import Path

from scheduler.errors import EngineError

__all__ = ["HF_EXTRA", "ModelLoadError", "check_model_dir"]

#: What to install for ``--model DIR``.
HF_EXTRA = "pip install -e '.[hf]'"


class ModelLoadError(EngineError, ValueError):
    """A model could not be loaded: a missing file, a missing package, a bad option.

    Attributes:
        path: the model directory (or file) concerned.
    """

    def __init__(self, path: str | os.PathLike[str], reason: str) -> None:
        self.path = str(path)
        super().__init__(f"model {self.path}: {reason}")


def check_model_dir(path: str | os.PathLike[str]) -> Path:
    """The model directory, if it holds a config and safetensors weights.

    Raises:
        ModelLoadError: naming the missing directory or file.
    """
    root = Path(path).expanduser().resolve()
    if not root.is_dir():
        raise ModelLoadError(root, "no such directory (a model is loaded from a local "
                                   "directory, never downloaded)")
    if not (root / "config.json").is_file():
        raise ModelLoadError(root, f"missing {root / 'config.json'}")
    index = root / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ModelLoadError(root, f"unreadable {index}: {exc}") from exc
        for shard in sorted(shards):
            if not (root / shard).is_file():
                raise ModelLoadError(root, f"missing {root / shard} (listed in {index.name})")
    elif not (root / "model.safetensors").is_file():
        found = "; found pytorch_model.bin, which needs unpickling: convert it to " \
                "safetensors" if (root / "pytorch_model.bin").exists() else ""
        raise ModelLoadError(root, f"missing {root / 'model.safetensors'}{found}")
    return root
