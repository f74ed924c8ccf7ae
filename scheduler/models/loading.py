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
import logging
import os
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from scheduler.models.files import HF_EXTRA, ModelLoadError, check_model_dir
from scheduler.models.protocol import Model
from scheduler.models.tiny import ModelConfig, build_model

if TYPE_CHECKING:  # (transformers is the optional [hf] extra)
    from transformers import PretrainedConfig

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


def own_process_threads(model: ModelSpec | Model) -> None:
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

    Every failure to load a Hugging Face model is a :class:`ModelLoadError`
    (one line naming the file and the cause), whatever raised it: this is
    where ``transformers``' and ``safetensors``' errors are converted.

    Raises:
        ModelLoadError: as :func:`model_spec`, or the model failed to load.
    """
    if isinstance(model, ModelConfig):
        return build_model(model)
    if not isinstance(model, HFModelSpec):
        return model
    spec, config = _checked_config(model)
    from scheduler.models.hf import HFCausalLM, held_log  # (_checked_config imported it)
    root = Path(spec.path)
    with held_log() as held, _converted(root, held):
        return HFCausalLM(root, config=config, dtype=spec.dtype, device=spec.device)


def check_model_loads(model: ModelSpec) -> None:
    """Check, without building it, that ``model`` would load: what a process that
    starts schedulers runs first, so that a model no scheduler could load is one
    error here rather than processes that die at start, one after the other.

    For a directory: :func:`model_spec`'s checks (``config.json`` read as JSON,
    every weight file's safetensors header matched against its size; no tensor
    is read), then ``config.json`` read as ``transformers`` reads it (an unknown
    ``model_type`` fails here). The built-in model needs nothing.

    Raises:
        ModelLoadError: naming the file and the cause.
    """
    if isinstance(model, HFModelSpec):
        _checked_config(model)


def _checked_config(model: HFModelSpec) -> tuple[HFModelSpec, PretrainedConfig]:
    """``model``'s spec, checked (:func:`model_spec`), and its ``config.json`` as
    ``transformers`` reads it: what both loading and checking start with.

    Raises:
        ModelLoadError: naming the file and the cause (or that transformers is missing).
    """
    spec = model_spec(model)
    assert isinstance(spec, HFModelSpec)
    try:
        from scheduler.models.hf import load_config
    except ImportError as exc:
        raise ModelLoadError(spec.path, f"loading a Hugging Face model needs transformers "
                                        f"({exc}): {HF_EXTRA}") from exc
    root = Path(spec.path)
    with _converted(root / "config.json"):
        return spec, load_config(root)


@contextmanager
def _converted(path: Path, held: Sequence[logging.LogRecord] = ()) -> Iterator[None]:
    """Any error the block raises, as a ModelLoadError about ``path`` (one line; with
    the first row of a report the loader logged, ``held``, that names a mismatch)."""
    try:
        yield
    except ModelLoadError:
        raise
    except Exception as exc:
        rows = _rows(held)
        if not rows:
            reason = _one_line(exc)
        else:
            reason = f"{type(exc).__name__}: {rows[0]}"
            if len(rows) > 1:
                reason += f" (and {len(rows) - 1} more like it)"
        raise ModelLoadError(path, reason) from exc


_COLOUR = re.compile(r"\x1b\[[0-9;]*m")


def _rows(held: Sequence[logging.LogRecord]) -> list[str]:
    """The lines of ``held`` that name a mismatch, colour codes and table rules removed."""
    lines = (_COLOUR.sub("", line) for record in held
             for line in record.getMessage().splitlines())
    return [" ".join(line.replace("|", " ").split()) for line in lines
            if "mismatch" in line.lower() and "|" in line]



#: A cause longer than this is cut to its first sentence.
_LONG = 200


def _one_line(exc: BaseException) -> str:
    """``exc`` as one line: its type and the first line of its text (the first sentence
    of a long one: ``transformers`` follows it with advice on upgrading), with the next
    line too when the first ends in ``:`` (it announces the cause, as pydantic's
    ``Validation error for field 'x':`` does)."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    text = lines[0] if lines else ""
    if text.endswith(":") and len(lines) > 1:
        text = f"{text} {lines[1]}"
    if len(text) > _LONG and ". " in text:
        text = text[:text.index(". ") + 1]
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
