"""A model directory's files, checked before anything is loaded, and the error that names them."""

from __future__ import annotations

import json
import os
from pathlib import Path

from scheduler.errors import EngineError

__all__ = ["HF_EXTRA", "ModelLoadError", "check_model_dir", "weight_files"]

#: What to install for ``--model DIR``.
HF_EXTRA = "pip install -e '.[hf]'"


class ModelLoadError(EngineError, ValueError):
    """A model could not be loaded: a missing or broken file, a missing package, a bad
    option, or the loader's own error (converted at one place,
    :func:`scheduler.models.loading.load_model`). Its message is one line:
    ``model PATH: REASON``.

    Attributes:
        path: the model directory, or the file in it, concerned.
        reason: what is wrong (one line).
    """

    def __init__(self, path: str | os.PathLike[str], reason: str) -> None:
        self.path = str(path)
        self.reason = " ".join(reason.split())  # one line, whatever the cause's text
        super().__init__(f"model {self.path}: {self.reason}")


def check_model_dir(path: str | os.PathLike[str]) -> Path:
    """The model directory, if its files can be loaded as far as reading them tells.

    Cheap (no ``transformers``, no tensor read), so a parent checks a directory
    before it starts the process that loads it: ``config.json`` is there and is
    a JSON object, every safetensors file is there and whole (its header parses
    and its tensors' bytes are all in the file: a copy cut short is caught here,
    not as a loader's traceback in a child).

    Raises:
        ModelLoadError: naming the missing or broken file and what is wrong with it.
    """
    try:
        root = Path(path).expanduser().resolve()
        is_dir = root.is_dir()
    except (OSError, RuntimeError) as exc:  # a symlink loop, a name too long, no home
        raise ModelLoadError(path, f"the path does not resolve: {exc}") from exc
    if not is_dir:
        raise ModelLoadError(root, "no such directory (a model is loaded from a local "
                                   "directory, never downloaded)")
    _check_config(root / "config.json")
    for weights in weight_files(root):
        _check_safetensors(weights)
    return root


def weight_files(root: Path) -> list[Path]:
    """The safetensors files a model directory's weights are in (the index's shards, else
    ``model.safetensors``).

    Raises:
        ModelLoadError: the index is unreadable, or a file is missing.
    """
    index = root / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ModelLoadError(root, f"unreadable {index}: {exc}") from exc
        for shard in sorted(shards):
            if not (root / shard).is_file():
                raise ModelLoadError(root, f"missing {root / shard} (listed in {index.name})")
        return [root / shard for shard in sorted(shards)]
    if not (root / "model.safetensors").is_file():
        found = "; found pytorch_model.bin, which needs unpickling: convert it to " \
                "safetensors" if (root / "pytorch_model.bin").exists() else ""
        raise ModelLoadError(root, f"missing {root / 'model.safetensors'}{found}")
    return [root / "model.safetensors"]


def _check_config(config: Path) -> None:
    """``config.json`` is a readable JSON object."""
    if config.exists() and not config.is_file():
        raise ModelLoadError(config, "not a file (config.json must be a JSON file)")
    if not config.is_file():
        raise ModelLoadError(config.parent, f"missing {config}")
    try:
        parsed = json.loads(config.read_bytes())
    except (OSError, ValueError) as exc:  # (UnicodeDecodeError and JSONDecodeError too)
        raise ModelLoadError(config, f"not valid JSON ({exc})") from exc
    if not isinstance(parsed, dict):
        raise ModelLoadError(config, f"not a JSON object ({type(parsed).__name__})")


#: A safetensors header past this is no header (safetensors' own limit).
_MAX_HEADER = 100_000_000


def _check_safetensors(file: Path) -> None:
    """``file`` is a whole safetensors file: 8 bytes of header length, a JSON header,
    then every tensor's bytes (the header's last ``data_offsets`` end is the file's)."""
    try:
        with file.open("rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            header = json.loads(f.read(n)) if 0 < n <= min(size - 8, _MAX_HEADER) else None
    except OSError as exc:
        raise ModelLoadError(file, f"unreadable ({exc})") from exc
    except ValueError as exc:
        raise ModelLoadError(file, f"its safetensors header is not valid JSON "
                                   f"({exc})") from exc
    if header is None:
        raise ModelLoadError(file, f"not a safetensors file, or cut short ({size} bytes, "
                                   f"no whole header)")
    try:
        end = max((int(t["data_offsets"][1]) for name, t in header.items()
                   if name != "__metadata__"), default=0)
    except (AttributeError, KeyError, TypeError, IndexError, ValueError) as exc:
        raise ModelLoadError(file, f"its safetensors header is malformed ({exc!r})") from exc
    if 8 + n + end > size:
        raise ModelLoadError(file, f"cut short: its tensors need {8 + n + end} bytes, "
                                   f"the file has {size} (an interrupted copy or download?)")
