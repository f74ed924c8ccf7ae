"""Which model a scheduler runs: a spec that travels to the scheduler process, and its loader.

A spec is small and plain (a :class:`~scheduler.models.tiny.ModelConfig`, or
an :class:`HFModelSpec` naming a local directory), so ``zmq`` mode passes the
*path* to the scheduler process and the model is loaded there, once.
:func:`model_spec` checks what it can cheaply in the caller (the directory,
its files, that ``transformers`` is installed), so a mistake is one clear
error at the engine's constructor or the command line, not a dead child.
"""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from scheduler.models.files import HF_EXTRA, ModelLoadError, check_model_dir
from scheduler.models.protocol import Model
from scheduler.models.tiny import ModelConfig, build_model

__all__ = ["HFModelSpec", "ModelArg", "ModelLoadError", "ModelSpec", "check_model_dir",
           "check_model_loads", "load_model", "model_spec", "own_process_threads"]

@dataclass(frozen=True, slots=True)
class HFModelSpec:
    """A Hugging Face causal LM in a local directory (never fetched from the hub).

    Attributes:
        path: the directory (``config.json`` and ``*.safetensors``).
        dtype: ``"float32"``, ``"bfloat16"``, ``"float16"``, ``"float64"``;
            ``None``: the checkpoint's own.
        device: ``"cpu"`` or ``"cuda"`` (``"cuda:N"``).
    """

    path: str
    dtype: str | None = None
    device: str = "cpu"


ModelSpec = ModelConfig | HFModelSpec
#: What ``Engine(model=...)`` accepts: a spec, or a directory (``str`` or ``Path``).
ModelArg = ModelConfig | HFModelSpec | str | os.PathLike[str] | None


def model_spec(model: ModelArg) -> ModelSpec:
    """The spec for ``model``: the built-in model by default, a directory as a HF model.

    Raises:
        ModelLoadError: the directory or its files are missing, or
            ``transformers`` is not installed (the message says what to install).
    """
    if model is None:
        return ModelConfig()
    if isinstance(model, ModelConfig):
        return model
    spec = model if isinstance(model, HFModelSpec) else HFModelSpec(os.fspath(model))
    root = check_model_dir(spec.path)
    if importlib.util.find_spec("transformers") is None:
        raise ModelLoadError(root, f"loading a Hugging Face model needs transformers: "
                                   f"{HF_EXTRA}")
    if spec.device.startswith("cuda") and not torch.cuda.is_available():
        raise ModelLoadError(root, f"device {spec.device!r}: no CUDA device here")
    return HFModelSpec(str(root), spec.dtype, spec.device)


def own_process_threads(model: ModelSpec) -> None:
    """Size torch's intra-op thread pool for a process that serves ``model`` and nothing else.

    The built-in models (a small GRU, the stub) run one thread: their
    operations are far too small to split, and an idle OpenMP worker
    spin-waits after every parallel region on a core the frontend or the
    client needs (on 2 cores, with the stub model, that spinning was two
    thirds of the scheduler's CPU: 120 against 43 ticks over the same 1.5 s
    of ``benchmarks/http``'s completions, at 30-50% more requests/s). A Hugging
    Face model keeps torch's default: its matrix products do gain from
    threads. Only a process that is the scheduler calls this (a ``zmq`` mode
    child, ``serve``): in ``ring`` mode the pool is the host process's own.
    """
    if isinstance(model, ModelConfig):
        torch.set_num_threads(1)


def load_model(model: ModelSpec | Model) -> Model:
    """The model a spec describes (a model passes through as it is).

    Raises:
        ModelLoadError: as :func:`model_spec`, or the model failed to load.
    """
    if isinstance(model, ModelConfig):
        return build_model(model)
    if not isinstance(model, HFModelSpec):
        return model
    spec = model_spec(model)
    assert isinstance(spec, HFModelSpec)
    try:
        from scheduler.models.hf import HFCausalLM
    except ImportError as exc:
        raise ModelLoadError(spec.path, f"loading a Hugging Face model needs transformers "
                                        f"({exc}): {HF_EXTRA}") from exc
    return HFCausalLM(spec.path, dtype=spec.dtype, device=spec.device)


def check_model_loads(model: ModelSpec) -> None:
    """Check, without building it, that ``model`` would load: what a process that
    starts schedulers runs first, so that a model no scheduler could load is one
    error here rather than processes that die at start, one after the other.

    For a directory: :func:`model_spec`'s checks, its ``config.json`` read as
    ``transformers`` reads it (an unknown ``model_type`` fails here), and every
    weight file's safetensors header read and matched against the file's size
    (a truncated or corrupt file fails here). No tensor is read. The built-in
    model needs nothing.

    Raises:
        ModelLoadError: naming the file and the cause.
    """
    if not isinstance(model, HFModelSpec):
        return
    spec = model_spec(model)
    assert isinstance(spec, HFModelSpec)
    root = Path(spec.path)
    from safetensors import SafetensorError, safe_open
    for weights in _weight_files(root):  # first: reading a header costs no import
        try:
            with safe_open(str(weights), "pt"):
                pass
        except (SafetensorError, OSError) as exc:
            raise ModelLoadError(weights, f"unreadable safetensors: {_one_line(exc)}") \
                from exc
    from transformers import AutoConfig
    try:
        AutoConfig.from_pretrained(root, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelLoadError(root / "config.json", _one_line(exc)) from exc


def _weight_files(root: Path) -> list[Path]:
    """The safetensors files a model directory loads (its index's shards, or the one)."""
    index = root / "model.safetensors.index.json"
    if not index.is_file():
        return [root / "model.safetensors"]
    shards = json.loads(index.read_text())["weight_map"].values()  # check_model_dir read it
    return [root / shard for shard in sorted(set(shards))]


def _one_line(exc: BaseException) -> str:
    """``exc``'s message on one line (transformers' run over several)."""
    return " ".join(str(exc).split()) or type(exc).__name__
