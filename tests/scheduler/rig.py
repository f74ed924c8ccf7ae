"""A scheduler rig the loop tests share: a work inbox (ring or PULL), a real rpc pair, a spy."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import zmq

from bus import Origin, PullInbox, Receiver, Ring, RingInbox, RpcClient, RpcServer
from bus.channels import Inbox
from messages import (
    BatchTokenIDOut,
    Codec,
    ErrorOut,
    Message,
    Output,
    Request,
    RpcReqOutput,
    SamplingParams,
    TokenizedGenerateReqInput,
    token_ids,
)
from router import CallbackSink, RingSink, RpcReplySink, Sink, scheduler_router
from scheduler import Limits, ModelConfig, Scheduler, TinyLM

SMALL = ModelConfig(vocab_size=64, hidden=16, layers=1, seed=1)
CODEC: Codec[Message] = Codec(Message)


class Loop:
    """A scheduler over a ring or PULL work inbox, an rpc ROUTER, and a spy (or ring) transport."""

    def __init__(self, kind: str, ctx: zmq.Context[zmq.Socket[bytes]], ipc: Callable[[str], str],
                 *, egress: Ring[Output] | None = None, validate: bool = False,
                 model: TinyLM | None = None, **kw: object) -> None:
        self.rpc = RpcServer(Codec(Request), ipc("rpc"), ctx=ctx)
        self.ring: Ring[Request] | None = None
        self.push: zmq.Socket[bytes] | None = None
        work: Inbox[Request]
        if kind == "ring":
            self.ring = Ring(1 << 15)
            work = RingInbox(self.ring, validate=Codec(Request).validate if validate else None)
        else:
            pull: PullInbox[Request] = PullInbox(Codec(Request), ipc("work"), ctx=ctx)
            self.push = ctx.socket(zmq.PUSH)
            self.push.connect(pull.endpoint)
            work = pull
        self.work = work
        self.got: list[tuple[Output, Origin]] = []
        transport: Sink[Output] = RingSink(egress) if egress is not None else \
            CallbackSink(lambda o, g: self.got.append((o, g)))
        limits = kw.pop("limits", None)
        router = scheduler_router(transport, RpcReplySink(self.rpc),
                                  max_backlog=limits.max_backlog if isinstance(limits, Limits)
                                  else 1024)
        self.sched = Scheduler(Receiver([work, self.rpc]), router, model or TinyLM(SMALL),
                               limits=limits, **kw)  # type: ignore[arg-type]
        self.client = RpcClient(self.rpc.endpoint, ctx=ctx)

    def send(self, req: Request) -> None:
        if self.ring is not None:
            self.ring.put(req)
        else:
            assert self.push is not None
            self.push.send_multipart(CODEC.encode(req))

    def run_until(self, cond: Callable[[], bool], timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            assert time.monotonic() < deadline, "scheduler did not get there in time"
            if not self.sched.step() and not self.sched.busy:
                self.sched.receiver.wait(0.005 if self.sched.router.backlog else 0.05)

    def errors(self) -> dict[str, ErrorOut]:
        return {o.rid: o for o, _ in self.got if isinstance(o, ErrorOut)}

    def finished(self) -> dict[str, tuple[list[int], str]]:
        acc: dict[str, list[int]] = {}
        done: dict[str, tuple[list[int], str]] = {}
        for o, _ in self.got:
            if isinstance(o, BatchTokenIDOut):
                for rid, ids, fin in o.items():
                    acc.setdefault(rid, []).extend(ids.tolist())
                    if fin is not None:
                        done[rid] = (acc[rid], fin)
        return done

    def call(self, method: str, timeout: float = 10.0) -> RpcReqOutput:
        """An rpc answered while this thread drives the loop."""
        result: list[RpcReqOutput] = []
        t = threading.Thread(target=lambda: result.append(
            self.client.call(method, timeout=timeout)))
        t.start()
        self.run_until(lambda: bool(result) or not t.is_alive(), timeout)
        t.join()
        assert result, f"rpc {method} got no answer"
        return result[0]

    def close(self) -> None:
        self.client.close()
        self.rpc.close()
        self.work.close()
        if self.push is not None:
            self.push.close(0)
        if self.ring is not None:
            self.ring.release()

    # -- what the older loop tests call the same things ------------------------

    @property
    def transport(self) -> list[tuple[Output, Origin]]:
        return self.got

    @property
    def codec(self) -> Codec[Message]:
        return CODEC

    def outputs(self, kind: type[Output]) -> list[Output]:
        return [o for o, _ in self.got if isinstance(o, kind)]

    def send_raw(self, frame: bytes) -> None:
        assert self.push is not None
        self.push.send(frame)


def gen(rid: str, ids: list[int] | range, **sp: object) -> TokenizedGenerateReqInput:
    """A generate request with these ids and sampling fields."""
    return TokenizedGenerateReqInput(rid=rid, input_ids=token_ids(ids),
                                     sampling=SamplingParams(**sp))  # type: ignore[arg-type]
