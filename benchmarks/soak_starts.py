"""Soak: starts that fail and stops asked twice, through the real command lines (part of
``python -m benchmarks.soak``; alone: ``python -m benchmarks.soak failed_starts``).

One scenario, ``failed_starts``, returns:

* ``model_load_error_lines`` (must be 1): the most stderr lines any start
  printed for a broken model directory (a copy of a tiny Hugging Face model:
  ``model.safetensors`` cut in half, an unknown ``model_type``, no
  ``config.json``, ``config.json`` not JSON, no weights, no
  ``tokenizer.json``) through ``python -m scheduler serve`` and
  ``python -m frontend`` in ring and in zmq mode; each start must also exit
  1 and name the broken file (``model_load_error_unnamed`` counts those that
  did not, must be 0). ``serve`` needs no tokenizer, so that case is the
  frontend's alone.
* ``leftover_dirs_after_failed_starts`` (must be 0): ``tsbrun-*`` run
  directories left in each run's own ``TMPDIR`` by those failed starts and by
  ``double_ctrl_c_runs`` frontends (ring mode, 60 open streams, SIGINT,
  0.3 s, SIGINT), of which ``double_ctrl_c_aborts`` (must be 0) died of a
  signal or printed "terminate called".

Needs the ``[hf]`` extra (the model is built with ``transformers``).
"""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from scheduler.models.tiny_hf import build_tiny_hf
from tests.frontend.cli_runs import BREAKS, broken_copy, double_ctrl_c, failed_start, free_port

__all__ = ["BOUNDS", "SCENARIOS", "failed_starts"]

#: Double Ctrl-C runs (each about 10 s on 2 busy cores).
DOUBLE_CTRL_C_RUNS = 5


def _starts(model: Path, how: str, endpoint: Path) -> dict[str, list[str]]:
    argv = {"frontend ring": ["-m", "frontend", "--port", str(free_port()), "--mode", "ring",
                              "--model", str(model)],
            "frontend zmq": ["-m", "frontend", "--port", str(free_port()), "--mode", "zmq",
                             "--model", str(model)]}
    if how != "missing_tokenizer":
        argv["serve"] = ["-m", "scheduler", "serve", "--endpoint", str(endpoint),
                         "--model", str(model)]
    return argv


def failed_starts() -> dict[str, object]:
    """The keys of the module docstring."""
    most_lines, unnamed, leftovers, aborts = 0, 0, 0, 0
    with tempfile.TemporaryDirectory(prefix="tsb-soak-starts-") as tmp:
        good = build_tiny_hf(Path(tmp) / "good", hidden=32, layers=1, dtype=torch.float32)
        for how, (file, _) in BREAKS.items():
            model = broken_copy(good, Path(tmp) / how, how)
            for where, argv in _starts(model, how, Path(tmp) / f"ep-{how}").items():
                got = failed_start(argv)
                most_lines = max(most_lines, len(got.lines))
                ok = got.returncode == 1 and len(got.lines) >= 1 and file in got.lines[-1]
                if not ok or got.leftovers:
                    print(f"  {how} via {where}: exit {got.returncode}, {len(got.lines)} "
                          f"lines, last {got.lines[-1:]}, left {got.leftovers}", file=sys.stderr)
                unnamed += not ok
                leftovers += len(got.leftovers)
    for _ in range(DOUBLE_CTRL_C_RUNS):
        stop = double_ctrl_c("ring", streams=60, gap=0.3)
        aborts += stop.aborted
        leftovers += len(stop.leftovers)
    return {"model_load_error_lines": most_lines, "model_load_error_unnamed": unnamed,
            "leftover_dirs_after_failed_starts": leftovers,
            "double_ctrl_c_runs": DOUBLE_CTRL_C_RUNS, "double_ctrl_c_aborts": aborts}


SCENARIOS: list[Callable[[], dict[str, object]]] = [failed_starts]

#: key -> (comparison, bound), merged into soak's table.
BOUNDS: dict[str, tuple[str, float]] = {
    "model_load_error_lines": ("==", 1),
    "model_load_error_unnamed": ("==", 0),
    "leftover_dirs_after_failed_starts": ("==", 0),
    "double_ctrl_c_aborts": ("==", 0),
}
