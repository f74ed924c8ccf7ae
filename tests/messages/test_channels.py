"""Each channel's door (``messages.channels``): what it carries passes, the rest is refused
on both ends, with the rid where readable; and the rpc methods' declared shapes
(``messages.rpc_api``) match what a scheduler registers and returns."""

from __future__ import annotations

import inspect
from pathlib import Path

import msgspec
import pytest

from bus import Envelope, Receiver, Rejected, Ring, RingInbox
from messages import (
    CHANNELS,
    OUT,
    RPC,
    WORK,
    AbortReq,
    BatchTokenIDOut,
    Codec,
    DecodeError,
    EncodeError,
    ErrorOut,
    KVHandoff,
    Message,
    NotCarried,
    Request,
    RpcReqInput,
    RpcReqOutput,
    TokenizedGenerateReqInput,
    catalogue_schema,
    catalogue_types,
    token_ids,
)
from messages.rpc_api import RPC_METHODS
from router import CallbackSink, scheduler_router
from scheduler import ModelConfig, Scheduler, TinyLM

ANY: Codec[Message] = Codec(Message)


def _gen(rid: str) -> TokenizedGenerateReqInput:
    return TokenizedGenerateReqInput(rid=rid, input_ids=token_ids([1, 2]))


def test_every_catalogue_message_travels_on_exactly_one_channel_one_way() -> None:
    """A hand-off is the one relay: out of a prefill scheduler, into a decode scheduler's
    work (through a dispatcher); every other type has one channel and one direction."""
    carried = [t for ch in CHANNELS for t in (*ch.inbound, *ch.outbound) if t is not KVHandoff]
    assert sorted(t.__name__ for t in carried) == sorted(
        t.__name__ for t in catalogue_types() if t is not KVHandoff)
    assert KVHandoff in OUT.outbound and KVHandoff in WORK.inbound
    assert [ch for ch in CHANNELS if KVHandoff in (*ch.inbound, *ch.outbound)] == [WORK, OUT]


@pytest.mark.parametrize("msg,door", [
    (RpcReqInput(rid="r-1", method="save_checkpoint"), WORK.inbound_codec()),
    (_gen("g-1"), RPC.inbound_codec()),
    (AbortReq(rid="a-1"), RPC.inbound_codec()),
    (ErrorOut(rid="e-1", code="internal"), RPC.outbound_codec()),
    (RpcReqOutput(rid="o-1", success=True), OUT.outbound_codec()),
])
def test_a_type_the_channel_does_not_carry_is_refused_on_both_ends(
        msg: Message, door: Codec[Message]) -> None:
    with pytest.raises(EncodeError, match="not carried on the"):
        door.encode(msg)  # the sender's door: nothing leaves
    with pytest.raises(EncodeError, match="not carried on the"):
        door.encode_many([msg, msg])
    with pytest.raises(NotCarried) as info:
        door.decode(ANY.encode(msg))  # the receiver's door
    err = info.value
    assert err.rid == getattr(msg, "rid") and err.message_type == type(msg).__name__  # noqa: B009
    assert err.channel == door.channel and err.carried == tuple(sorted(
        t.__name__ for t in door.types))
    with pytest.raises(NotCarried):
        door.check_type(msg)
    with pytest.raises(NotCarried):
        door.validate(msg)


def test_what_the_channel_carries_passes_the_door() -> None:
    work = WORK.inbound_codec()
    msgs: list[Request] = [_gen("g-1"), AbortReq(rid="g-1")]
    assert [m.rid for m in work.decode_any(work.encode_many(msgs))] == ["g-1", "g-1"]  # type: ignore[union-attr]
    work.check_type(msgs[0])


def test_a_refused_member_of_a_burst_rejects_only_itself() -> None:
    work = WORK.inbound_codec()
    frames = ANY.encode_many([_gen("ok-1"), RpcReqInput(rid="bad-1", method="get_load")])
    with pytest.raises(DecodeError):
        work.decode_any(frames)
    got = work.decode_members(frames)
    assert isinstance(got[0], TokenizedGenerateReqInput)
    assert isinstance(got[1], NotCarried) and got[1].rid == "bad-1"


def test_another_channels_output_type_gives_no_rid_from_its_rid_column() -> None:
    out = BatchTokenIDOut.from_lists(["x"], [[1]], [None])
    with pytest.raises(NotCarried) as info:
        WORK.inbound_codec().decode(ANY.encode(out))
    assert info.value.rid is None  # item 1 of a batch is its rid column, not an address


def test_the_ring_door_refuses_without_validating() -> None:
    ring: Ring[Request] = Ring(8)
    inbox = RingInbox(ring, validate=WORK.inbound_codec().check_type)
    ring.put(RpcReqInput(rid="r-9", method="get_load"))
    ring.put(_gen("g-9"))
    got = Receiver([inbox]).poll()
    assert isinstance(got[0], Rejected) and isinstance(got[0].error, NotCarried)
    assert got[0].error.rid == "r-9"
    assert isinstance(got[1], Envelope) and got[1].message.rid == "g-9"
    inbox.close()


def test_a_channel_with_nothing_one_way_has_no_door_that_way() -> None:
    with pytest.raises(ValueError, match="carries nothing"):
        WORK.outbound_codec()
    with pytest.raises(ValueError, match="carries nothing"):
        OUT.inbound_codec()


def test_the_schema_publishes_the_channels() -> None:
    doc = catalogue_schema()
    assert doc["x-channels"] == {ch.name: ch.carried_tags() for ch in CHANNELS}


# -- the rpc methods' declared shapes ------------------------------------------------

@pytest.fixture
def sched() -> Scheduler:
    sink: CallbackSink[RpcReqOutput] = CallbackSink(lambda o, g: None)
    router = scheduler_router(CallbackSink(lambda o, g: None), sink)
    return Scheduler(Receiver([]), router, TinyLM(ModelConfig(vocab_size=64, hidden=8,
                                                              layers=1)))


def test_every_registered_method_is_declared_with_its_parameters(sched: Scheduler) -> None:
    assert set(sched.rpc.methods) == {spec.name for spec in RPC_METHODS}
    for spec in RPC_METHODS:
        sig = inspect.signature(sched.rpc.methods[spec.name])
        params = {n: p.default is inspect.Parameter.empty for n, p in sig.parameters.items()}
        fields = msgspec.structs.fields(spec.params)
        declared = {f.name: f.required for f in fields}
        assert params == declared, spec.name


def test_every_method_result_matches_its_declared_shape(sched: Scheduler,
                                                        tmp_path: Path) -> None:
    args: dict[str, dict[str, object]] = {
        "hello": {"protocol_version": 2, "fingerprint": "", "layout": "{}"},
        "save_checkpoint": {"path": str(tmp_path / "w")},
        "load_checkpoint": {"path": str(tmp_path / "w")},
    }
    for spec in RPC_METHODS:  # shutdown last: the tuple's order
        reply = sched.rpc.answer(RpcReqInput(rid="m", method=spec.name,
                                             parameters=args.get(spec.name, {})))  # type: ignore[arg-type]
        assert reply.success, f"{spec.name}: {reply.message}"
        msgspec.convert(reply.result, spec.result)


def test_model_info_of_todays_models_reads_their_config(sched: Scheduler) -> None:
    facts = sched.model_facts()
    assert (facts.model, facts.vocab_size, facts.stop_token_ids) == ("tiny-gru", 64, [])
    assert facts.max_prompt_tokens == 1 << 20


def test_model_info_prefers_what_a_model_states(sched: Scheduler) -> None:
    class Stated(TinyLM):
        name = "stated"
        vocab_size = 64
        stop_token_ids = (3, 5)
        max_prompt_tokens = 100

    sched.model = Stated(ModelConfig(vocab_size=64, hidden=8, layers=1))
    facts = sched.model_facts()
    assert (facts.model, facts.vocab_size, facts.stop_token_ids, facts.max_prompt_tokens) == \
        ("stated", 64, [3, 5], 100)
