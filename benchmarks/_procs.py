"""A benchmark's processes, found and placed through ``/proc`` (Linux): a process's
threads, its descendants, and every thread of a process pinned to a set of cores."""

from __future__ import annotations

import os

__all__ = ["descendants", "pin", "threads"]


def threads(pid: int) -> list[int]:
    """The thread ids of ``pid`` (none once it has ended)."""
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return []


def descendants(pid: int) -> list[int]:
    """Every living descendant of ``pid``: its children (of any of its threads), theirs..."""
    found = []
    for tid in threads(pid):
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                children = [int(c) for c in f.read().split()]
        except OSError:
            continue
        for child in children:
            found += [child, *descendants(child)]
    return found


def pin(pid: int, cores: set[int]) -> None:
    """Every thread of ``pid`` on ``cores`` (threads it starts later inherit them; one
    that ends meanwhile is passed over)."""
    for tid in threads(pid):
        try:
            os.sched_setaffinity(tid, cores)
        except OSError:
            pass
