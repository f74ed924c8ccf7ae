"""Shared memory fails soft: no room is an OSError (never SIGBUS), the socket takes over,
a forged handle changes nobody's claim, and an unresolved handle is answered by rid."""

from __future__ import annotations

import errno
import gc
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import pytest
import torch

from bus import Envelope, PullInbox, PushOutbox, Rejected
from bus.shm import segment
from bus.shm.frames import _CLAIM_W, MAGIC
from bus.shm.segment import Segment, ShmSpaceError
from messages import (
    BatchEmbeddingOut,
    Codec,
    DecodeError,
    Output,
    Request,
    TokenizedGenerateReqInput,
    token_ids,
)

ROOT = Path(__file__).resolve().parents[2]


def _ours() -> set[str]:
    return {n for n in os.listdir(segment.SHM_DIR) if n.startswith(f"tsb-{os.getpid()}-")}


@pytest.fixture(autouse=True)
def no_leak() -> Iterator[None]:
    before = _ours()
    yield
    gc.collect()
    assert _ours() <= before, f"left in {segment.SHM_DIR}: {_ours() - before}"


@pytest.fixture
def no_room(monkeypatch: pytest.MonkeyPatch) -> None:
    """The allocation seam fails as a full /dev/shm makes posix_fallocate fail."""
    def full(fd: int, size: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(segment, "_reserve", full)


def _drain(inbox: PullInbox[Output] | PullInbox[Request],
           cond: Callable[[list[object]], bool] = bool, timeout: float = 10.0) -> list[object]:
    got: list[object] = []
    deadline = time.monotonic() + timeout
    while not cond(got):
        assert time.monotonic() < deadline, f"nothing arrived in time: {got}"
        got.extend(inbox.drain(16))
        time.sleep(0.001)  # sleep-ok: pacing of a deadline poll
    return got


def test_no_room_is_an_oserror_that_names_the_directory_and_leaves_no_file(
        no_room: None) -> None:
    with pytest.raises(ShmSpaceError) as info:
        Segment.create("f", 1 << 20, what="a test slab")
    err = info.value
    assert isinstance(err, OSError) and err.errno == errno.ENOSPC
    assert segment.SHM_DIR in str(err) and "1.0 MiB" in str(err) and "a test slab" in str(err)
    assert err.wanted == 1 << 20 and err.total is not None


def test_a_pool_without_room_sends_over_the_socket_and_retries_later(
        tmp_path: Path, no_room: None) -> None:
    codec: Codec[Output] = Codec(Output)
    with PullInbox(codec, f"ipc://{tmp_path}/t") as inbox, \
            PushOutbox(codec, f"ipc://{tmp_path}/t", shm_threshold=1) as out:
        pool = out.shm_frames
        assert pool is not None
        for i in range(3):
            out.send(BatchEmbeddingOut(rids=[f"e{i}"], embeddings=torch.full((1, 1 << 16), i)))
        got = _drain(inbox, lambda g: len(g) == 3)
        assert [float(e.message.embeddings[0, 9]) for e in got  # type: ignore[attr-defined]
                ] == [0.0, 1.0, 2.0]
        assert pool.fallbacks == 3 and pool.bytes_held == 0
        assert pool.alloc_failures == 1  # not one failed allocation per frame


def test_a_sender_on_a_full_tmpfs_lives_and_its_frames_arrive(tmp_path: Path) -> None:
    """A real 1 MiB tmpfs (skipped where mounting is not allowed): 4 MiB frames."""
    mnt = tmp_path / "shm"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)],
                      capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        code = textwrap.dedent(f"""
            import torch
            from bus import PullInbox, PushOutbox
            from messages import BatchEmbeddingOut, Codec, Output
            codec = Codec(Output)
            inbox = PullInbox(codec, "ipc://{tmp_path}/t")
            out = PushOutbox(codec, "ipc://{tmp_path}/t")
            for i in range(3):
                out.send(BatchEmbeddingOut(rids=["a"], embeddings=torch.full((1, 1 << 20), i)))
            got = []
            while len(got) < 3:
                got.extend(inbox.drain(3))
            print("arrived", [float(e.message.embeddings[0, -1]) for e in got],
                  out.shm_frames.fallbacks)
            out.close(); inbox.close()
        """)
        env = {**os.environ, "TSB_SHM_DIR": str(mnt), "PYTHONPATH": str(ROOT)}
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]  # before: -7 (SIGBUS)
        assert "arrived [0.0, 1.0, 2.0] 3" in proc.stdout
        assert not os.listdir(mnt)
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


@pytest.fixture
def requests(tmp_path: Path) -> Iterator[tuple[PushOutbox[Request], PullInbox[Request]]]:
    codec: Codec[Request] = Codec(Request)
    inbox = PullInbox(codec, f"ipc://{tmp_path}/r")
    out = PushOutbox(codec, f"ipc://{tmp_path}/r", shm_threshold=1)
    yield out, inbox
    out.close()
    inbox.close()


def _req(rid: str) -> TokenizedGenerateReqInput:
    return TokenizedGenerateReqInput(rid=rid, input_ids=token_ids([1, 2]),
                                     input_embeds=torch.ones(2, 1 << 15))


def test_a_forged_handle_changes_no_claim_and_a_replay_is_refused(
        requests: tuple[PushOutbox[Request], PullInbox[Request]]) -> None:
    out, inbox = requests
    assert out.shm_frames is not None and inbox.shm_frames is not None
    frames = out.codec.encode(_req("real"))
    wire, used = out.shm_frames.wrap(frames)
    mapper = inbox.shm_frames
    held = mapper.resolve(wire)  # the real receipt: claims the slab
    words = used[0].words
    assert words[_CLAIM_W] == os.getpid()
    h = msgspec.msgpack.decode(bytes(wire[0])[len(MAGIC):])
    for gen in (h[0][2] + 1, h[0][2] - 1, h[0][2]):  # forged ahead, stale, replayed
        forged = [[*h[0][:2], gen, *h[0][3:]]]
        with pytest.raises(DecodeError, match=r"reclaimed|already claimed"):
            mapper.resolve([MAGIC + msgspec.msgpack.encode(forged), *wire[1:]])
        assert words[_CLAIM_W] == os.getpid()  # before: 0, the real claim erased
    del held
    gc.collect()
    assert used[0].free()


def test_a_handle_that_does_not_resolve_is_answered_by_its_rid(
        requests: tuple[PushOutbox[Request], PullInbox[Request]]) -> None:
    out, inbox = requests
    assert out.shm_frames is not None
    frames = out.codec.encode(_req("lost-1"))
    wire, used = out.shm_frames.wrap(frames)
    h = msgspec.msgpack.decode(bytes(wire[0])[len(MAGIC):])
    h[0][1] = f"tsb-{os.getpid()}-f-000000000000"  # a slab that does not exist
    out._send([MAGIC + msgspec.msgpack.encode(h), *wire[1:]], block=True)
    out.shm_frames.cancel(used)
    got = _drain(inbox)
    assert isinstance(got[0], Rejected) and got[0].error.rid == "lost-1"


def test_a_slab_taken_back_from_a_late_reader_is_answered_by_rid(
        requests: tuple[PushOutbox[Request], PullInbox[Request]]) -> None:
    out, inbox = requests
    pool = out.shm_frames
    assert pool is not None
    pool.unclaimed_timeout = 0.0  # every unclaimed slab may be taken back at once
    pool.max_bytes = 1 << 18  # one slab
    out.send(_req("late-1"))  # nobody reads it yet
    out.send(_req("next-2"))  # takes the slab back from the first
    got = _drain(inbox, lambda g: len(g) == 2)
    first, second = got
    assert isinstance(first, Rejected) and first.error.rid == "late-1"
    assert "reclaimed" in first.error.reason
    assert isinstance(second, Envelope) and second.message.rid == "next-2"
    del got, second
    gc.collect()


def test_unlink_own_removes_only_this_process_files() -> None:
    seg = Segment.create("f", 4096)
    other = tempfile.NamedTemporaryFile(dir=segment.SHM_DIR, prefix="tsb-1-f-", delete=False)
    try:
        removed = segment.unlink_own()
        assert seg.name in removed and not os.path.exists(os.path.join(segment.SHM_DIR,
                                                                       seg.name))
        assert os.path.exists(other.name)
    finally:
        seg.close()
        os.unlink(other.name)
