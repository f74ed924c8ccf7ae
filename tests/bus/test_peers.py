"""``PeerWatch``: a socket's connected peers, and when the last one went away."""

from __future__ import annotations

from collections.abc import Callable

import zmq

from bus import PeerWatch, PushOutbox
from messages import Codec, Output
from tests.conftest import eventually


def _counts(watch: PeerWatch, fell: list[bool]) -> Callable[[int], Callable[[], bool]]:
    """A condition factory: read the watch's events (recording each ``last_left``) until
    it counts ``n`` peers."""

    def until(n: int) -> Callable[[], bool]:
        def cond() -> bool:
            fell.append(watch.last_left())
            return watch.peers == n
        return cond

    return until


def test_bound_socket_reports_only_when_its_last_peer_leaves(
        ctx: zmq.Context[zmq.Socket[bytes]], ipc: Callable[[str], str]) -> None:
    push = ctx.socket(zmq.PUSH)
    push.bind(ipc("out"))
    fell: list[bool] = []
    with PeerWatch(push, "out") as watch:
        until = _counts(watch, fell)
        assert not watch.last_left()  # never had a peer: none lost
        pulls = [ctx.socket(zmq.PULL) for _ in range(2)]
        for p in pulls:
            p.connect(push.getsockopt_string(zmq.LAST_ENDPOINT))
        eventually(until(2), what="two peers")
        pulls[0].close(0)
        eventually(until(1), what="one peer left")
        assert not any(fell), "one of two left: a reader is still there"
        pulls[1].close(0)
        eventually(until(0), what="no peer left")
        assert fell.count(True) == 1 and watch.emptied == 1
        again = ctx.socket(zmq.PULL)  # a new reader is counted afresh
        again.connect(push.getsockopt_string(zmq.LAST_ENDPOINT))
        fell.clear()
        eventually(until(1), what="a new peer")
        assert not any(fell)
        again.close(0)
    push.close(0)


def test_connecting_socket_reports_when_the_listener_goes(
        ctx: zmq.Context[zmq.Socket[bytes]], ipc: Callable[[str], str]) -> None:
    pull = ctx.socket(zmq.PULL)
    endpoint = ipc("out")
    pull.bind(endpoint)
    push = ctx.socket(zmq.PUSH)
    fell: list[bool] = []
    with PeerWatch(push, "out") as watch:
        push.connect(endpoint)
        until = _counts(watch, fell)
        eventually(until(1), what="connected")
        pull.close(0)
        eventually(until(0), what="the listener gone")
        assert fell.count(True) == 1
    watch.close()  # idempotent
    push.close(0)


def test_an_outbox_watching_its_peers_counts_a_reader_that_was_there_first(
        ctx: zmq.Context[zmq.Socket[bytes]], ipc: Callable[[str], str]) -> None:
    pull = ctx.socket(zmq.PULL)
    endpoint = ipc("out")
    pull.bind(endpoint)
    fell: list[bool] = []
    with PushOutbox(Codec(Output), endpoint, ctx=ctx) as plain:
        assert plain.peers is None
    with PushOutbox(Codec(Output), endpoint, ctx=ctx, watch_peers=True) as out:
        assert out.peers is not None
        until = _counts(out.peers, fell)
        eventually(until(1), what="the reader there first counted")
        pull.close(0)
        eventually(until(0), what="the reader gone")
        assert fell.count(True) == 1


def test_a_connection_it_has_no_event_for_is_the_last_one_when_it_leaves(
        ctx: zmq.Context[zmq.Socket[bytes]], ipc: Callable[[str], str]) -> None:
    # zmq can drop a monitor event; here the connection exists before the watch.
    pull = ctx.socket(zmq.PULL)
    endpoint = ipc("out")
    pull.bind(endpoint)
    push = ctx.socket(zmq.PUSH)
    push.connect(endpoint)
    push.send(b"up")
    assert pull.poll(10_000) and pull.recv() == b"up"  # connected
    fell: list[bool] = []
    with PeerWatch(push, "out") as watch:
        assert not watch.last_left() and watch.peers == 0
        pull.close(0)

        def gone() -> bool:
            fell.append(watch.last_left())
            return any(fell)

        eventually(gone, what="the reader gone")
    push.close(0)
