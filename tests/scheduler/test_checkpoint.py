"""Checkpoints: round trip, and refusal of anything but a bounded regular file."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch

from scheduler.core.checkpoint import load_state, save_state


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(4, 3, generator=g),
        "b": torch.arange(5, dtype=torch.int64),
        "h": torch.randn(2, 2, generator=g).to(torch.bfloat16),
        "empty": torch.empty(0, 7),
    }


def test_round_trip(tmp_path: Path) -> None:
    state = _state()
    path = tmp_path / "m.ckpt"
    size = save_state(state, path)
    assert size == path.stat().st_size
    got = load_state(path)
    assert list(got) == list(state)
    for name, t in state.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape
        assert torch.equal(got[name], t)
    assert [p.name for p in tmp_path.iterdir()] == ["m.ckpt"]  # no temp file left behind


def test_fifo_is_refused_without_waiting_for_a_writer(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    # Run in a thread so a regression (a blocking open) fails the test
    # instead of hanging the suite; nobody ever opens the FIFO for writing.
    outcome: list[BaseException | None] = []

    def load() -> None:
        try:
            load_state(fifo)
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    t0 = time.monotonic()
    th = threading.Thread(target=load, daemon=True)
    th.start()
    th.join(10)
    if th.is_alive():  # unblock the stuck open so the thread can end
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail("load_state blocked on a FIFO with no writer")
    assert time.monotonic() - t0 < 5
    (exc,) = outcome
    assert isinstance(exc, ValueError)
    assert str(fifo) in str(exc) and "FIFO" in str(exc)


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="needs /dev/zero")
def test_dev_zero_is_refused() -> None:
    with pytest.raises(ValueError, match=r"/dev/zero.*character device"):
        load_state("/dev/zero")


def test_directory_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="directory"):
        load_state(tmp_path)


def test_file_over_max_bytes_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "m.ckpt"
    size = save_state(_state(), path)
    with pytest.raises(ValueError, match=f"{size} bytes, more than max_bytes={size - 1}"):
        load_state(path, max_bytes=size - 1)
    assert torch.equal(load_state(path, max_bytes=size)["w"], _state()["w"])


def test_missing_file_raises_oserror(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_state(tmp_path / "nope.ckpt")


@pytest.mark.parametrize("cut", [0, 3, 8, 12, -1])
def test_truncated_file_is_refused(tmp_path: Path, cut: int) -> None:
    path = tmp_path / "m.ckpt"
    save_state(_state(), path)
    data = path.read_bytes()
    path.write_bytes(data[:cut])
    with pytest.raises(ValueError, match=r"m\.ckpt"):
        load_state(path)


@pytest.mark.parametrize("data", [
    b"garbage, not a checkpoint at all",
    (5).to_bytes(8, "little") + b"\xc1\xc1\xc1\xc1\xc1",  # 0xc1: never valid msgpack
    (1 << 40).to_bytes(8, "little") + b"x" * 16,  # index length past the file
])
def test_garbage_is_refused(tmp_path: Path, data: bytes) -> None:
    path = tmp_path / "junk.ckpt"
    path.write_bytes(data)
    with pytest.raises(ValueError, match=r"junk\.ckpt"):
        load_state(path)


def test_save_is_atomic_on_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "m.ckpt"
    save_state(_state(), path)
    before = path.read_bytes()

    def fail(fd: int) -> None:
        raise OSError(28, "No space left on device")

    # Fails after the temp file is written, before the rename.
    monkeypatch.setattr(os, "fsync", fail)
    with pytest.raises(OSError, match="No space"):
        save_state({"w": torch.ones(2)}, path)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["m.ckpt"]  # the temp file is gone


@pytest.mark.parametrize("delta", [-1, 1])
def test_file_that_changes_size_while_read_is_refused(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch,
                                                      delta: int) -> None:
    path = tmp_path / "m.ckpt"
    save_state(_state(), path)
    real_fstat = os.fstat

    def stale_fstat(fd: int) -> os.stat_result:
        # As if the file grew (delta -1) or shrank (+1) between fstat and read.
        st = list(real_fstat(fd))
        st[6] += delta  # st_size
        return os.stat_result(st)

    monkeypatch.setattr(os, "fstat", stale_fstat)
    with pytest.raises(ValueError, match="changed size while being read"):
        load_state(path)
