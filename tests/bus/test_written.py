"""``PushOutbox.track_writes`` / ``wait_written``: what zmq still queues is counted, not
taken for sent (a process that exits drops it)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from bus import Envelope, PullInbox, PushOutbox, SocketOptions, WouldBlock
from messages import AbortReq, Codec, Request


def test_wait_written_counts_what_a_peer_not_reading_leaves_in_zmq(tmp_path: Path) -> None:
    endpoint = f"ipc://{tmp_path}/w"
    small = SocketOptions(hwm=4)
    with PullInbox(Codec(Request), endpoint, options=small) as inbox, \
            PushOutbox(Codec(Request), endpoint, options=small) as outbox:
        with pytest.raises(RuntimeError, match="'out'"):
            outbox.wait_written(0)
        sent = _fill(outbox, 0)  # every buffer up to the reader, the kernel's included
        outbox.track_writes()
        got: list[str] = []
        while not got:  # the reader takes a few: as many go in, and wait in zmq
            if inbox.socket.poll(100):
                got += [e.message.rid for e in inbox.drain(64) if isinstance(e, Envelope)]
        tracked = _fill(outbox, sent) - sent
        assert tracked > 0
        assert 0 < outbox.wait_written(0.2) <= tracked
        sent += tracked
        deadline = time.monotonic() + 30
        while len(got) < sent:  # the reader takes everything: zmq wrote it all out
            assert time.monotonic() < deadline, len(got)
            if inbox.socket.poll(100):
                got += [e.message.rid for e in inbox.drain(256) if isinstance(e, Envelope)]
        assert got == [f"r{n}" for n in range(sent)]
        assert outbox.wait_written(5.0) == 0


def _fill(outbox: PushOutbox[Request], sent: int) -> int:
    """Send until the reader's side takes nothing more for 0.2 s; returns the total sent."""
    idle = time.monotonic()
    while time.monotonic() - idle < 0.2:
        try:
            outbox.send_nowait(AbortReq(rid=f"r{sent}"))
        except WouldBlock:
            time.sleep(0.01)  # sleep-ok: pacing; zmq moves what it queued meanwhile
            continue
        sent += 1
        idle = time.monotonic()
    return sent
