"""What a process leaves on disk is removed by someone, whoever dies.

A frontend makes a *run directory* for its ipc endpoints (and the
tensor-parallel rendezvous file); its schedulers make shared-memory files.
A process that ends normally removes what it made. One that is killed
(SIGKILL, or SIGTERM with no handler) runs no clean-up, so every such name
carries its creator's pid, and the survivors remove a dead creator's
leftovers:

* a child whose parent died (the parent watch of
  :mod:`scheduler.launch.processes`) unlinks its own shared-memory files,
  then sweeps every dead creator's files and run directories (its parent's
  among them) before it exits;
* a new run directory or segment sweeps the leftovers of dead creators
  first, so nothing outlives the next start either.

Run directories are ``<tmp>/tsbrun-<pid>-<kind>-<random>``, mode 0700; a
sweep removes only directories of this user whose creator is dead.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
from collections.abc import Iterator

from bus.shm.segment import dead_creators, sweep_stale, unlink_own

__all__ = ["leave_files", "make_run_dir", "remove_run_dir", "run_dir", "sweep_run_dirs"]

_RUN_DIR = re.compile(r"tsbrun-(\d+)-[a-z]+-[a-z0-9_]+")


def make_run_dir(kind: str) -> str:
    """A fresh run directory named for this process (0700), after sweeping dead creators'.

    Raises:
        OSError: the temp directory is not writable.
    """
    sweep_run_dirs()
    return tempfile.mkdtemp(prefix=f"tsbrun-{os.getpid()}-{kind}-")


def remove_run_dir(path: str) -> None:
    """Remove ``path``, a run directory this process made; never raises.

    One named for another pid is left: a child made by ``os.fork`` inherits
    its parent's finalizers and exit hooks, and must not remove what the
    parent still serves from.
    """
    m = _RUN_DIR.fullmatch(os.path.basename(path))
    if m is None or int(m.group(1)) == os.getpid():
        shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def run_dir(kind: str) -> Iterator[str]:
    """A run directory (:func:`make_run_dir`) that the block owns: removed when it
    ends, however it ends (an exception, a failed start, ``SystemExit``).

    Raises:
        OSError: the temp directory is not writable.
    """
    path = make_run_dir(kind)
    try:
        yield path
    finally:
        remove_run_dir(path)


def sweep_run_dirs() -> list[str]:
    """Remove every run directory of this user whose creator is dead; returns their paths."""
    removed = dead_creators(tempfile.gettempdir(), _RUN_DIR)
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


def leave_files() -> None:
    """Before an ``os._exit`` (the parent died): remove what this process made, and
    what dead creators (the parent among them) left. Never raises."""
    for step in (unlink_own, sweep_stale, sweep_run_dirs):
        try:
            step()
        except Exception:  # pragma: no cover - exiting anyway: the next start sweeps
            pass
