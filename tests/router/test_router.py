from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from bus import Origin, PullInbox, Receiver, Ring, RpcServer
from messages import (
    BatchEmbeddingOut,
    BatchTokenIDOut,
    Codec,
    ErrorOut,
    Message,
    Output,
    Request,
    RpcReqInput,
    RpcReqOutput,
)
from router import (
    AmbiguousRouteError,
    CallbackSink,
    NoSinkError,
    RingSink,
    Router,
    RouterFrozenError,
    RoutingError,
    RpcReplySink,
    SinkFailure,
    TypeTable,
    scheduler_router,
)

RPC = Origin("rpc")
WORK = Origin("work")


class Spy:
    def __init__(self) -> None:
        self.got: list[tuple[Output, Origin]] = []

    def send(self, output: Output, origin: Origin, /) -> None:
        self.got.append((output, origin))


def _batch() -> BatchTokenIDOut:
    return BatchTokenIDOut.from_lists(["a"], [[1]], [None])


@pytest.mark.parametrize("rpc_first", [True, False])
def test_rpc_reply_never_reaches_the_transport_whatever_the_order(rpc_first: bool) -> None:
    transport, rpc = Spy(), Spy()
    router: Router[Output] = Router(Output)
    pairs: list[tuple[type[Output], Spy]] = [(RpcReqOutput, rpc), (Output, transport)]
    for cls, sink in pairs if rpc_first else reversed(pairs):
        router.register(cls, sink)
    router.route(RpcReqOutput(rid="r", success=True), RPC)
    router.route(_batch(), WORK)
    assert [type(o) for o, _ in rpc.got] == [RpcReqOutput]
    assert [type(o) for o, _ in transport.got] == [BatchTokenIDOut]


def test_totality_check_lists_every_uncovered_type() -> None:
    router: Router[Output] = Router(Output)
    router.register(RpcReqOutput, Spy())
    with pytest.raises(NoSinkError) as info:
        router.freeze()
    uncovered = set(info.value.output_types)  # (test-only Output subclasses may add to it)
    assert {BatchTokenIDOut, BatchEmbeddingOut, ErrorOut} <= uncovered
    assert RpcReqOutput not in uncovered
    assert "BatchTokenIDOut" in str(info.value)


def test_unknown_type_at_route_is_an_error_not_a_drop() -> None:
    router: Router[Output] = Router(Output, types=[RpcReqOutput])
    router.register(RpcReqOutput, Spy())
    with pytest.raises(NoSinkError, match="BatchTokenIDOut"):
        router.route(_batch(), WORK)


def test_registration_rules() -> None:
    router: Router[Output] = Router(Output, types=[])
    with pytest.raises(TypeError):
        router.register(RpcReqInput, Spy())  # type: ignore[misc]
    with pytest.raises(TypeError):
        router.register("Output", Spy())  # type: ignore[arg-type]
    router.register(Output, Spy())
    router.route(_batch(), WORK)
    with pytest.raises(RouterFrozenError):
        router.register(RpcReqOutput, Spy())
    with pytest.raises(TypeError):
        router.registry[Output] = Spy()  # type: ignore[index]


def test_ambiguous_multiple_inheritance_names_both() -> None:
    class A:
        pass

    class B:
        pass

    table: TypeTable[object, str] = TypeTable(object)
    table.register(A, "a")
    table.register(B, "b")

    class C(A, B):
        pass

    with pytest.raises(AmbiguousRouteError) as info:
        table.lookup(C)
    assert "A" in str(info.value) and "B" in str(info.value)


def test_failing_sink_is_isolated_counted_and_reported() -> None:
    failures: list[SinkFailure] = []

    def boom(output: Output, origin: Origin) -> None:
        raise OSError("disk full")

    ok = Spy()
    router: Router[Output] = Router(Output, on_failure=failures.append)
    router.register(Output, ok)
    router.register(RpcReqOutput, CallbackSink(boom))
    assert not router.route(RpcReqOutput(rid="r", success=True), RPC)
    assert router.route(_batch(), WORK)
    assert router.statistics().failed == 1 and router.statistics().routed == 1
    assert failures[0].output_type == "RpcReqOutput" and failures[0].origin == RPC
    assert len(ok.got) == 1


@pytest.mark.parametrize("mode", ["zmq", "ring"])
def test_scheduler_table_in_both_modes(mode: str, ctx: zmq.Context[zmq.Socket[bytes]],
                                       ipc: Callable[[str], str]) -> None:
    """The seed's reply bug: in both modes, rpc replies go down the rpc pair only."""
    req: Codec[Request] = Codec(Request)
    with RpcServer(req, ipc("rpc"), ctx=ctx) as server:
        client = ctx.socket(zmq.DEALER)
        client.connect(server.endpoint)
        client.send_multipart(Codec(Message).encode(RpcReqInput(rid="c1", method="m")))
        receiver = Receiver([server])
        assert receiver.wait(10)
        env = receiver.poll()[0]
        egress: Ring[Output] = Ring(8)
        spy = Spy()
        transport = RingSink(egress) if mode == "ring" else spy
        router = scheduler_router(transport, RpcReplySink(server))
        router.route(RpcReqOutput(rid="c1", success=True), env.origin)
        router.route(_batch(), WORK)
        assert client.poll(10_000)
        reply = Codec(Message).decode(client.recv_multipart())
        assert isinstance(reply, RpcReqOutput) and reply.rid == "c1"
        seen = egress.drain(10) if mode == "ring" else [o for o, _ in spy.got]
        assert [type(o) for o in seen] == [BatchTokenIDOut]  # the transport never saw it
        client.close(0)
        egress.release()


def test_rpc_sink_refuses_a_non_rpc_origin(ctx: zmq.Context[zmq.Socket[bytes]],
                                           ipc: Callable[[str], str]) -> None:
    req: Codec[Request] = Codec(Request)
    with RpcServer(req, ipc("rpc"), ctx=ctx) as server, PullInbox(req, ipc("w"), ctx=ctx):
        with pytest.raises(RoutingError, match="not an rpc channel"):
            RpcReplySink(server).send(RpcReqOutput(rid="x", success=True), WORK)


# -- properties: the router picks what a reference MRO walk picks --------------

_names = (f"H{i}" for i in itertools.count())


@st.composite
def hierarchies(draw: st.DrawFn) -> tuple[list[type], list[type]]:
    """Random single/multiple-inheritance hierarchies under a fresh base."""
    root = type(next(_names), (), {})
    classes: list[type] = [root]
    for _ in range(draw(st.integers(1, 12))):
        k = draw(st.integers(1, min(2, len(classes))))
        idx = draw(st.lists(st.integers(0, len(classes) - 1), min_size=k, max_size=k,
                            unique=True))
        bases = tuple(classes[i] for i in idx)
        try:
            classes.append(type(next(_names), bases, {}))
        except TypeError:  # inconsistent MRO: skip
            continue
    registered = draw(st.lists(st.sampled_from(classes), unique=True, min_size=1))
    return classes, registered


def _reference(cls: type, registered: list[type]) -> type | str | None:
    matches = [k for k in cls.__mro__ if k in registered]
    if not matches:
        return None
    first = matches[0]
    if any(not issubclass(first, k) for k in matches[1:]):
        return "ambiguous"
    return first


@given(hierarchies(), st.randoms())
@settings(max_examples=300, deadline=None)
def test_lookup_matches_reference_mro_walk(h: tuple[list[type], list[type]], rnd: object
                                           ) -> None:
    classes, registered = h
    order = list(registered)
    rnd.shuffle(order)  # type: ignore[attr-defined]
    table: TypeTable[object, type] = TypeTable(object)
    for k in order:
        table.register(k, k)
    for _ in range(2):  # the second pass is served by the cache: same answers
        for cls in classes:
            want = _reference(cls, registered)
            try:
                got: type | str | None = table.lookup(cls)
            except NoSinkError:
                got = None
            except AmbiguousRouteError:
                got = "ambiguous"
            assert got == want


def test_a_backlog_that_keeps_everything_on_overflow_stays_cheap() -> None:
    from bus import WouldBlock
    from messages import ErrorOut
    from router import Backlog

    class Stuck:
        def send(self, output: Output, origin: Origin, /) -> None:
            raise WouldBlock("out", "not reading")

    backlog: Backlog[Output] = Backlog(16)
    calls: list[int] = []

    def keep_all(items: list[tuple[Output, Origin]]) -> list[tuple[Output, Origin]]:
        calls.append(len(items))
        return items

    backlog.on_overflow = keep_all
    sink, origin = Stuck(), Origin("work")
    for i in range(8000):
        backlog.push(sink, ErrorOut(rid=f"r{i}", code="overloaded"), origin)
    assert len(backlog) == 8000
    # Terminal answers are kept, but each overflow waits for the queue to double:
    # a push costs O(1) amortized, not a pass over the queue.
    assert len(calls) <= 12 and sum(calls) < 4 * 8000


def test_batching_sends_runs_in_one_call_and_never_twice() -> None:
    class Many:
        def __init__(self) -> None:
            self.calls: list[list[str]] = []
            self.bad = "e2"

        def send(self, output: ErrorOut, origin: Origin, /) -> None:
            if output.rid == self.bad:
                raise ValueError("cannot encode")
            self.calls.append([output.rid])

        def send_many(self, outputs: Sequence[ErrorOut], origin: Origin, /) -> int:
            if outputs[0].rid == self.bad:
                raise ValueError("cannot encode")
            n = next((i for i, o in enumerate(outputs) if o.rid == self.bad), len(outputs))
            self.calls.append([o.rid for o in outputs[:n]])
            return n  # stops before the one it cannot send

    sink = Many()
    failures: list[SinkFailure] = []
    router: Router[Output] = Router(Output, types=[ErrorOut], on_failure=failures.append)
    router.register(ErrorOut, sink)
    with router.batching():
        for n in range(5):
            router.route(ErrorOut(rid=f"e{n}", code="internal"), Origin("work"))
        assert sink.calls == []  # held until the block ends
    assert sink.calls == [["e0", "e1"], ["e3", "e4"]]  # e2 failed alone, nothing twice
    assert [f.output_type for f in failures] == ["ErrorOut"]
    assert router.statistics().routed == 4


def test_batching_holds_nothing_for_a_sink_that_takes_one_at_a_time() -> None:
    sent: list[str] = []
    router: Router[Output] = Router(Output, types=[ErrorOut])
    router.register(ErrorOut, CallbackSink(lambda o, g: sent.append(o.rid)))
    with router.batching():
        router.route(ErrorOut(rid="a", code="internal"), Origin("rpc"))
        assert sent == ["a"]  # at once: an rpc reply must not wait for the step's end
