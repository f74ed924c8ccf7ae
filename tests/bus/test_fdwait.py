"""``bus.fdwait``: waits on descriptors numbered past ``select()``'s 1,024, as a server whose
open-file limit was raised holds them."""

from __future__ import annotations

import os
import re
import resource
from collections.abc import Iterator
from pathlib import Path

import pytest

from bus import ShmReader, ShmWriter, WouldBlock
from bus.fdwait import wait_readable

_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def high_fds() -> Iterator[None]:
    """Descriptors taken until the next one opened is numbered above 1,024 (the soft
    limit raised for it first); all closed and the limit put back after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = 1200
    if hard != resource.RLIM_INFINITY and hard < need + 64:
        pytest.skip(f"a hard limit on open files of {hard} here")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, need + 64), hard))
    held: list[int] = []
    try:
        while True:
            fd = os.open(os.devnull, os.O_RDONLY)
            held.append(fd)
            if fd > 1030:
                break
        yield
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_pipe_above_1024_is_waited_on(high_fds: None) -> None:
    r, w = os.pipe()
    try:
        assert r > 1024
        assert wait_readable([r], 0) == []
        assert wait_readable([r], 0.01) == []
        os.write(w, b"x")
        assert wait_readable([r], None) == [r]
        os.close(w)
        os.read(r, 1)
        assert wait_readable([r], 0) == [r]  # hung up: readable (EOF)
    finally:
        os.close(r)


def test_a_closed_descriptor_is_an_error_not_a_wait() -> None:
    r, w = os.pipe()
    os.close(r)
    os.close(w)
    with pytest.raises(OSError, match=f"fd {r}"):
        wait_readable([r], 10)
    with pytest.raises(ValueError):
        wait_readable([-1], 0)


def test_a_shared_memory_ring_opened_above_1024_watches_its_peers(high_fds: None) -> None:
    # The reader's wait on its writer's pidfd and the writer's on its readers' pidfds
    # raised ValueError from select() with descriptors above 1,024.
    with ShmWriter(1, 4096) as w, ShmReader.attach(w.handle, 0) as r:
        with pytest.raises(WouldBlock):
            r.recv(timeout=0)
        for i in range(200):  # wraps the ring: the writer looks at its reader's pidfd
            w.send([b"%d" % i, b"y" * 40], timeout=1)
            assert bytes(r.recv(1)[0]) == b"%d" % i


def test_no_package_waits_with_select_select() -> None:
    found = [f"{path.relative_to(_ROOT)}:{n}"
             for package in ("messages", "bus", "router", "scheduler", "frontend")
             for path in sorted((_ROOT / package).rglob("*.py"))
             for n, line in enumerate(path.read_text().splitlines(), 1)
             if re.search(r"\bselect\.select\(|\bfrom select import\b", line)]
    assert not found, f"select.select() cannot wait on a descriptor above 1,023: {found}"
