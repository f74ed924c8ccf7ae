"""A tensor-parallel start-up without room for its ring in /dev/shm fails at once, by name."""

from __future__ import annotations

import os
import tempfile

import pytest

from bus import ShmSpaceError
from bus.shm.segment import SHM_DIR
from scheduler import Engine
from scheduler.launch import tp


def test_tp_start_up_names_the_size_of_a_small_dev_shm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tp, "shm_space", lambda: (60 << 20, 64 << 20))  # Docker's default
    before = set(os.listdir(tempfile.gettempdir()))
    with pytest.raises(ShmSpaceError) as info:
        Engine("zmq", tp_size=2)
    message = str(info.value)
    assert SHM_DIR in message and "60.0 MiB free of 64.0 MiB" in message
    assert "64.0 MiB" in message and "--shm-size" in message
    mine = f"tsbrun-{os.getpid()}-"
    assert not [n for n in set(os.listdir(tempfile.gettempdir())) - before
                if n.startswith(mine)]  # refused before anything was made


def test_tp_start_up_names_a_shm_directory_it_cannot_read(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    # Without this: TSB_SHM_DIR naming a missing directory started the ranks,
    # which failed with two tracebacks and SchedulerGone after 9 s.
    monkeypatch.setattr(tp, "shm_space", lambda: None)
    with pytest.raises(ShmSpaceError, match="cannot be read"):
        Engine("zmq", tp_size=2)
