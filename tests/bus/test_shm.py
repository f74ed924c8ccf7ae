"""Same-node shared memory: the ring (capacity, slow/dead readers, dead writer), tensor frames
by handle, and no segment left in /dev/shm."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import pytest
import torch
import zmq

from bus import (
    EndOfChannel,
    Envelope,
    PeerGone,
    PullInbox,
    PushOutbox,
    Receiver,
    ShmInbox,
    ShmOutbox,
    ShmReader,
    ShmWriter,
    WouldBlock,
    sweep_shm,
)
from bus.shm.frames import MAGIC
from bus.shm.segment import SHM_DIR
from messages import AbortReq, BatchEmbeddingOut, Codec, DecodeError, Output, Request
from messages._tensors import DTYPE_CODES
from tests.conftest import eventually

ROOT = Path(__file__).resolve().parents[2]


def _ours() -> set[str]:
    return {n for n in os.listdir(SHM_DIR) if n.startswith(f"tsb-{os.getpid()}-")}


@pytest.fixture(autouse=True)
def no_leak() -> Iterator[None]:
    before = _ours()
    yield
    gc.collect()
    assert _ours() <= before, f"left in {SHM_DIR}: {_ours() - before}"


def _until(cond: Callable[[], object], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.001)  # sleep-ok: pacing of a deadline poll


def _receive(inbox: PullInbox[Output]) -> Envelope[Output]:
    got: list[object] = []

    def arrived() -> bool:
        got.extend(inbox.drain(1))
        return bool(got)

    _until(arrived)
    env = got[0]
    assert isinstance(env, Envelope), env
    return env


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[tuple[PushOutbox[Output], PullInbox[Output]]]:
    codec: Codec[Output] = Codec(Output)
    inbox = PullInbox(codec, f"ipc://{tmp_path}/t")
    out = PushOutbox(codec, f"ipc://{tmp_path}/t", shm_threshold=1)
    yield out, inbox
    out.close()
    inbox.close()


# -- tensor frames ------------------------------------------------------------

@pytest.mark.parametrize("dtype", sorted(DTYPE_CODES, key=str), ids=str)
def test_every_dtype_round_trips_through_shared_memory(
        pair: tuple[PushOutbox[Output], PullInbox[Output]], dtype: torch.dtype) -> None:
    out, inbox = pair
    src = torch.arange(3 * 4096, dtype=torch.float64).reshape(3, 4096).to(dtype)
    out.send(BatchEmbeddingOut(rids=["a", "b", "c"], embeddings=src))
    assert out.shm_frames is not None and out.shm_frames.bytes_held > 0
    msg = _receive(inbox).message
    assert isinstance(msg, BatchEmbeddingOut)
    got = msg.embeddings
    assert got.dtype == dtype and got.shape == src.shape
    assert got.view(torch.uint8).equal(src.contiguous().view(torch.uint8))


def test_a_slab_is_reused_only_after_the_receiver_released_it(
        pair: tuple[PushOutbox[Output], PullInbox[Output]]) -> None:
    out, inbox = pair
    pool = out.shm_frames
    assert pool is not None
    out.send(BatchEmbeddingOut(rids=["a"], embeddings=torch.ones(1, 1 << 16)))
    held = _receive(inbox)
    out.send(BatchEmbeddingOut(rids=["b"], embeddings=torch.ones(1, 1 << 16)))
    second = _receive(inbox)
    assert pool.bytes_held == 2 * (1 << 18)  # the first slab was still in use: a second one
    del held, second
    gc.collect()
    out.send(BatchEmbeddingOut(rids=["c"], embeddings=torch.full((1, 1 << 16), 7.0)))
    msg = _receive(inbox).message
    assert isinstance(msg, BatchEmbeddingOut) and float(msg.embeddings[0, 5]) == 7.0
    assert pool.bytes_held == 2 * (1 << 18)  # reused


def test_a_dead_receiver_does_not_pin_a_slab(
        pair: tuple[PushOutbox[Output], PullInbox[Output]]) -> None:
    out, inbox = pair
    pool = out.shm_frames
    assert pool is not None
    pool.max_bytes = 1 << 18  # one slab
    out.send(BatchEmbeddingOut(rids=["a"], embeddings=torch.ones(1, 1 << 16)))
    held = _receive(inbox)  # noqa: F841 - pinned
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, check=True)
    slab = next(iter(pool._classes.values()))[0]
    slab.words[4] = int(dead.stdout)  # the claim of a receiver that is gone
    out.send(BatchEmbeddingOut(rids=["b"], embeddings=torch.full((1, 1 << 16), 2.0)))
    assert pool.fallbacks == 0 and pool.bytes_held == 1 << 18


def test_a_full_pool_falls_back_to_the_socket(
        pair: tuple[PushOutbox[Output], PullInbox[Output]]) -> None:
    out, inbox = pair
    assert out.shm_frames is not None
    out.shm_frames.max_bytes = 0
    out.send(BatchEmbeddingOut(rids=["a"], embeddings=torch.ones(1, 1 << 16)))
    msg = _receive(inbox).message
    assert isinstance(msg, BatchEmbeddingOut) and msg.embeddings.sum() == 1 << 16
    assert out.shm_frames.fallbacks == 1


def test_tcp_peers_keep_the_socket_path_and_the_opt_out(tmp_path: Path) -> None:
    codec: Codec[Output] = Codec(Output)
    with PullInbox(codec, "tcp://127.0.0.1:*") as inbox:
        assert inbox.shm_frames is None
    with PushOutbox(codec, f"ipc://{tmp_path}/x", shm=False) as out:
        assert out.shm_frames is None
    with PushOutbox(codec, "tcp://127.0.0.1:9", shm=True) as out:
        assert out.shm_frames is None  # never across hosts


# -- tensors built in a slab (PushOutbox.empty) --------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, torch.bool])
def test_a_tensor_built_in_a_slab_is_sent_as_a_handle_only(
        pair: tuple[PushOutbox[Output], PullInbox[Output]], dtype: torch.dtype) -> None:
    out, inbox = pair
    pool = out.shm_frames
    assert pool is not None
    t = out.empty((3, 4096), dtype=dtype)
    assert t.shape == (3, 4096) and t.dtype == dtype and pool.bytes_held > 0
    src = torch.arange(3 * 4096, dtype=torch.float64).reshape(3, 4096).to(dtype)
    t.copy_(src)
    out.send(BatchEmbeddingOut(rids=["a", "b", "c"], embeddings=t))
    assert pool.lent_sends == 1 and pool.fallbacks == 0
    msg = _receive(inbox).message
    assert isinstance(msg, BatchEmbeddingOut)
    assert msg.embeddings.dtype == dtype
    assert msg.embeddings.view(torch.uint8).equal(src.view(torch.uint8))


def test_a_lent_slab_comes_back_only_when_the_receiver_and_the_producer_let_go(
        pair: tuple[PushOutbox[Output], PullInbox[Output]]) -> None:
    out, inbox = pair
    pool = out.shm_frames
    assert pool is not None
    t = out.empty((1, 1 << 16))
    t.fill_(1.0)
    out.send(BatchEmbeddingOut(rids=["a"], embeddings=t))
    held = _receive(inbox)
    del held
    gc.collect()  # the receiver released it, the producer still holds t
    u = out.empty((1, 1 << 16))
    assert pool.bytes_held == 2 * (1 << 18)  # not t's slab: t still views it
    assert float(t[0, 0]) == 1.0
    del t, u
    gc.collect()
    v = out.empty((1, 1 << 16))
    assert pool.bytes_held == 2 * (1 << 18)  # both came back: one reused
    del v


def test_a_lent_slab_sent_again_while_held_is_copied(
        pair: tuple[PushOutbox[Output], PullInbox[Output]]) -> None:
    out, inbox = pair
    pool = out.shm_frames
    assert pool is not None
    t = out.empty((2, 1 << 15))
    t.fill_(5.0)
    out.send(BatchEmbeddingOut(rids=["a", "b"], embeddings=t))
    first = _receive(inbox)
    out.send(BatchEmbeddingOut(rids=["a", "b"], embeddings=t))  # first still holds a view
    assert pool.lent_sends == 1
    second = _receive(inbox).message
    assert isinstance(second, BatchEmbeddingOut) and second.embeddings.equal(t)
    del first, second
    gc.collect()
    out.send(BatchEmbeddingOut(rids=["b"], embeddings=t[1:]))  # released: a handle again
    assert pool.lent_sends == 2
    msg = _receive(inbox).message
    assert isinstance(msg, BatchEmbeddingOut) and msg.embeddings.equal(t[1:])


def test_empty_is_an_ordinary_tensor_off_the_shared_memory_path(tmp_path: Path) -> None:
    codec: Codec[Output] = Codec(Output)
    with PushOutbox(codec, f"ipc://{tmp_path}/x", shm=False) as out:
        assert out.empty((4, 4)).shape == (4, 4)
        with pytest.raises(ValueError, match="negative"):
            out.empty((-1, 4))
    with PushOutbox(codec, f"ipc://{tmp_path}/y", shm_threshold=1 << 20) as out:
        assert out.shm_frames is not None
        small = out.empty((16,))  # below the threshold: the socket is cheaper
        out.shm_frames.max_bytes = 0
        full = out.empty((1 << 20,))  # the pool is full
        assert out.shm_frames.bytes_held == 0 and small.numel() == 16 and full.numel() == 1 << 20


def test_a_handle_outside_its_slab_is_rejected(
        pair: tuple[PushOutbox[Output], PullInbox[Output]]) -> None:
    out, inbox = pair
    assert out.shm_frames is not None and inbox.shm_frames is not None
    frames = out.codec.encode(BatchEmbeddingOut(rids=["a"], embeddings=torch.ones(1, 1 << 16)))
    wire, _ = out.shm_frames.wrap(frames)
    h = msgspec.msgpack.decode(bytes(wire[0])[len(MAGIC):])
    h[0][4] = 1 << 18  # offset + nbytes past the slab's end
    with pytest.raises(DecodeError, match="bytes at"):
        inbox.shm_frames.resolve([MAGIC + msgspec.msgpack.encode(h), *wire[1:]])
    out.shm_frames.cancel(_)


# -- the ring -----------------------------------------------------------------

def test_ring_delivers_to_every_reader_in_order_and_ends_cleanly() -> None:
    with ShmWriter(2, 4096) as w, ShmReader.attach(w.handle, 0) as r0, \
            ShmReader.attach(w.handle, 1) as r1:
        for i in range(300):  # wraps the 4 KiB ring many times
            w.send([b"%d" % i, b"x" * (i % 50)], timeout=0)
            assert [bytes(f) for f in r0.recv(1)] == [b"%d" % i, b"x" * (i % 50)]
            assert bytes(r1.recv(1)[0]) == b"%d" % i
        w.close()
        with pytest.raises(EndOfChannel):
            r0.drain(10)


def test_capacity_pressure_names_the_slow_reader() -> None:
    with ShmWriter(2, 4096, name="tp") as w, ShmReader.attach(w.handle, 0) as fast, \
            ShmReader.attach(w.handle, 1):
        sent = 0
        with pytest.raises(WouldBlock, match=r"reader 1 \(pid \d+, \d+ bytes behind\)"):
            while True:
                w.send([b"y" * 100], timeout=0.02)
                sent += 1
                fast.drain(100)
        assert 10 < sent < 40


def test_a_reader_that_never_attached_is_named() -> None:
    with ShmWriter(1, 4096) as w:
        with pytest.raises(WouldBlock, match="never attached"):
            for _ in range(100):
                w.send([b"z" * 100], timeout=0.01)


def test_a_reader_parked_in_a_receiver_wakes_at_once() -> None:
    codec: Codec[Request] = Codec(Request)
    with ShmWriter(1, 1 << 16) as w:
        inbox = ShmInbox(ShmReader.attach(w.handle, 0), codec, name="bcast")
        recv = Receiver([inbox])
        assert not recv.wait(0)
        ShmOutbox(w, codec).send(AbortReq(rid="r1"))
        assert recv.wait(10)
        (env,) = recv.poll()
        assert isinstance(env, Envelope) and env.message.rid == "r1"
        assert env.origin.inbox == "bcast"
        assert not recv.wait(0)
        w.close()
        assert recv.wait(10)
        assert recv.poll() == [] and recv.statistics().ended == ("bcast",)
        inbox.close()


_READER = """
import os, sys, time
sys.path.insert(0, {root!r})
from bus import ShmReader
r = ShmReader.attach({handle!r}, 0)
print("attached", flush=True)
time.sleep(60)  # sleep-ok: a reader that stays attached until the test SIGKILLs it
"""

_WRITER = """
import os, sys, time
sys.path.insert(0, {root!r})
from bus import ShmWriter
w = ShmWriter(1, 1 << 16)
for i in range(3):
    w.send([b"m%d" % i])
print(w.handle, flush=True)
time.sleep(60)  # sleep-ok: a writer that stays alive until the test SIGKILLs it
"""


def _spawn(code: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)


def test_a_dead_reader_is_named_and_dropped() -> None:
    with ShmWriter(2, 4096) as w, ShmReader.attach(w.handle, 1) as alive:
        child = _spawn(_READER.format(root=str(ROOT), handle=w.handle))
        try:
            assert child.stdout is not None and child.stdout.readline() == "attached\n"
            child.send_signal(signal.SIGKILL)
            child.wait(10)
            with pytest.raises(PeerGone, match=f"reader 0 \\(pid {child.pid}\\) died"):
                for _ in range(100):
                    w.send([b"q" * 100], timeout=10)
                    alive.drain(100)
            w.send([b"after"], timeout=10)  # the others go on
            assert w.dead_readers == {0: child.pid}
        finally:
            child.kill()
            child.wait()
            if child.stdout is not None:
                child.stdout.close()


def test_a_dead_writer_wakes_its_reader_and_is_swept_at_the_next_start() -> None:
    child = _spawn(_WRITER.format(root=str(ROOT)))
    try:
        assert child.stdout is not None
        handle = child.stdout.readline().strip()
        codec: Codec[Request] = Codec(Request)
        reader = ShmReader.attach(handle, 0)
        inbox = ShmInbox(reader, codec, name="bcast")
        recv: Receiver[Request] = Receiver([inbox])
        assert [bytes(r[0]) for r in reader.drain(10)] == [b"m0", b"m1", b"m2"]
        assert not recv.wait(0)
        child.send_signal(signal.SIGKILL)
        child.wait(10)
        assert recv.wait(10)  # woken by the writer's death, not a timeout
        assert recv.poll() == [] and recv.statistics().ended == ("bcast",)
        assert inbox.writer_gone is not None
        assert f"writer (pid {child.pid}) died" in str(inbox.writer_gone)
        reader.close()
        assert any(n.startswith(f"tsb-{child.pid}-") for n in os.listdir(SHM_DIR))
        removed = sweep_shm()  # what the next process to create a segment does
        assert any(n.startswith(f"tsb-{child.pid}-") for n in removed)
        assert not any(n.startswith(f"tsb-{child.pid}-") for n in os.listdir(SHM_DIR))
    finally:
        child.kill()
        child.wait()
        if child.stdout is not None:
            child.stdout.close()


def test_a_tcp_outbox_tracks_its_unsent_frames_only_once_asked_and_keeps_a_bounded_record(
        ) -> None:
    """Large frames over ``tcp://`` are tracked until zmq has written them out
    (``bytes_unsent``) from the first time someone asks: an outbox nobody asks (every
    tcp:// scheduler outside prefill and decode apart) tracks nothing, and one asked
    once, then seldom, keeps a record bounded by what is still unsent, not one entry
    for every frame it ever sent."""
    codec: Codec[Output] = Codec(Output)
    embeddings = torch.zeros(2, 1 << 15)  # 256 KiB: a frame it would track
    with PullInbox(codec, "tcp://127.0.0.1:*") as inbox, \
            PushOutbox(codec, inbox.socket.getsockopt_string(zmq.LAST_ENDPOINT)) as out:
        for n in range(20):
            out.send(BatchEmbeddingOut(rids=["a", "b"], embeddings=embeddings))
            assert isinstance(_receive(inbox).message, BatchEmbeddingOut), n
        assert out._unsent is None  # never asked: no tracker was made
        assert out.bytes_unsent == 0
        for n in range(500):
            out.send(BatchEmbeddingOut(rids=["a", "b"], embeddings=embeddings))
            assert isinstance(_receive(inbox).message, BatchEmbeddingOut), n
        assert out._unsent is not None and 0 < len(out._unsent) <= 2 * 64, out._unsent
        # Every frame arrived; zmq's I/O thread releases the last one's tracker once its
        # write returns, which on a busy host can come after the peer has read it.
        eventually(lambda: out.bytes_unsent == 0, 10.0, "the last frame's tracker to be done")
