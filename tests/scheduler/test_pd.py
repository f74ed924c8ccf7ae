"""Prefill and decode apart (``Engine(pd=(P, D))``): a request is read on a prefill
replica, which streams its first token and hands its KV cache to a decode replica.

Greedy answers are token for token a colocated replica's (the float64 tiny
Llama, as in ``tests/scheduler/test_hf_model.py``, and the tiny GRU); a
stream has no gap and no duplicate; a state from another model is refused
naming both; a replica dying at each stage (before its prompt is read, in
hand-off, decoding) answers the request ``replica_lost``, through real
processes.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest

pytest.importorskip("transformers")

from messages import (
    BatchTokenIDOut,
    Guide,
    KVHandoff,
    SamplingParams,
    TokenizedGenerateReqInput,
    token_ids,
)
from scheduler import Engine, ModelConfig, RequestFailed
from scheduler.dp import Refused, dispatch_table, merge_replies
from scheduler.models.hf import HFCausalLM
from scheduler.models.protocol import PromptChunk, RequestState, StateMismatch
from scheduler.models.tiny import TinyLM
from tests.scheduler.rig import Loop

GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0)
BOUND = 1 << 20  #: a prefill replica's max_handoff_bytes under test (a tiny GRU's are KBs)
LENGTHS = (1, 2, 7, 40, 129, 300)


def _prompts(seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 384, size=n).tolist() for n in LENGTHS]


def _answers(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    handles = [engine.submit(p, GREEDY) for p in prompts]  # together: batched as served
    return [h.result(120).token_ids for h in handles]


def _load(engine: Engine) -> dict[str, object]:
    return dict(engine.collective_rpc("get_load").result or {})


@pytest.fixture(scope="module")
def pd_engine(model_dir: Path) -> Iterator[Engine]:
    """The module's pd engine: its tests only send requests, none kills a replica."""
    with Engine("zmq", model_dir, pd=(1, 1)) as engine:
        yield engine


# -- the model protocol: export and adopt ---------------------------------------------

def _read(model: HFCausalLM, key: int, prompt: list[int]) -> int:
    """Read ``prompt`` under ``key``; the greedy next token."""
    import torch
    logits = model.prefill_chunks([PromptChunk(key, torch.tensor(prompt), 0, True)])
    return int(logits[0].argmax())


def _decode(model: HFCausalLM, key: int, token: int, n: int) -> list[int]:
    import torch
    out = []
    for _ in range(n):
        token = int(model.decode_step([key], torch.tensor([token]))[0].argmax())
        out.append(token)
    return out


def test_an_adopted_state_decodes_as_the_one_it_came_from(model_dir: Path) -> None:
    here, there = HFCausalLM(model_dir), HFCausalLM(model_dir)
    prompt = _prompts()[3]
    first = _read(here, 0, prompt)
    state = here.export_state(0)
    assert state.kv.shape == (2, 2, 2, len(prompt), 16)  # layers, k/v, heads, positions, dim
    assert state.fingerprint == there.fingerprint and str(state.kv.dtype) == "torch.float64"
    there.adopt_state(7, state, len(prompt))
    assert _decode(there, 7, first, 6) == _decode(here, 0, first, 6)
    there.free(7)
    assert there.live_states == 0


def test_export_and_adopt_state_the_fingerprint_computed_once(
        model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fingerprint hashes the model's whole configuration (0.44 ms on the tiny
    Llama): made at load, never again for a hand-off on either side."""
    here, there = HFCausalLM(model_dir), HFCausalLM(model_dir)
    want = here.fingerprint
    for model in (here, there):
        def hashed_again(*args: object, **kw: object) -> str:
            raise AssertionError("the configuration was hashed again")
        monkeypatch.setattr(model.config, "to_json_string", hashed_again)
    prompt = _prompts()[2]
    _read(here, 0, prompt)
    state = here.export_state(0)
    assert state.fingerprint == want == there.fingerprint
    there.adopt_state(1, state, len(prompt))
    there.free(1)
    here.free(0)


def test_an_adopted_request_freed_under_a_prefix_cache_caches_nothing_and_holds_nothing(
        model_dir: Path) -> None:
    """The decode side never read the prompt (and under pd reads none: every new
    request goes to a prefill replica), so freeing an adopted request caches nothing;
    the same model then reads and caches a prompt of its own as before."""
    here, there = HFCausalLM(model_dir), HFCausalLM(model_dir)
    here.set_prefix_cache(64 << 20)
    there.set_prefix_cache(64 << 20)
    prompt = _prompts()[3]
    first = _read(here, 0, prompt)
    state = here.export_state(0)
    here.free(0)
    there.adopt_state(7, state, len(prompt))
    want = _decode(there, 7, first, 6)
    there.free(7)
    stats = there.prefix_cache_stats()
    assert stats is not None and stats.size == 0 and stats.locked_nodes == 0
    assert there.live_states == 0
    assert _read(there, 8, prompt) == first and _decode(there, 8, first, 6) == want
    there.free(8)
    stats = there.prefix_cache_stats()
    assert stats is not None and stats.size > 0 and stats.locked_nodes == 0


def test_a_state_of_another_dtype_or_shape_is_refused_naming_both(model_dir: Path) -> None:
    here, f32 = HFCausalLM(model_dir), HFCausalLM(model_dir, dtype="float32")
    prompt = _prompts()[2]
    _read(here, 0, prompt)
    state = here.export_state(0)
    with pytest.raises(StateMismatch) as info:
        f32.adopt_state(0, state, len(prompt))
    assert here.fingerprint in str(info.value) and f32.fingerprint in str(info.value)
    assert f32.live_states == 0
    n = len(prompt)
    with pytest.raises(StateMismatch,
                       match=rf"shape is \(2, 2, 2, {n}, 16\).*\(2, 2, 2, {n + 1}, 16\)"):
        here.adopt_state(1, state, len(prompt) + 1)
    gru = TinyLM()
    with pytest.raises(StateMismatch, match="tiny-gru"):
        gru.adopt_state(0, RequestState(state.kv, state.fingerprint), len(prompt))


# -- served: pd 1:1 against a colocated replica ----------------------------------------

def test_greedy_answers_under_pd_are_a_colocated_replicas(model_dir: Path,
                                                          pd_engine: Engine) -> None:
    with Engine("ring", model_dir) as colocated:
        want = _answers(colocated, _prompts())
    before = _load(pd_engine)
    got = _answers(pd_engine, _prompts())
    assert got == want
    load = _load(pd_engine)
    # Every request was read on replica0 and decoded on replica1 (none ended at its
    # first token: 8 tokens each, a random model with no stop token).
    assert load["dispatcher.handed_off"] == before["dispatcher.handed_off"] + len(LENGTHS)  # type: ignore[operator]
    assert load["replica1.dispatched"] == 0


def test_a_stream_under_pd_has_no_gap_and_no_duplicate(model_dir: Path,
                                                       pd_engine: Engine) -> None:
    prompt = _prompts(1)[4]
    whole = pd_engine.generate(prompt, GREEDY, timeout=120).token_ids
    chunks = list(pd_engine.stream(prompt, GREEDY))
    assert [t for c in chunks for t in c.token_ids] == whole
    assert chunks[0].token_ids == (whole[0],)  # the prefill replica's first token, alone
    assert [c.finish_reason for c in chunks][-1] == "length"
    assert all(c.finish_reason is None for c in chunks[:-1])


def test_top_and_prompt_logprobs_under_pd_are_a_colocated_replicas(
        model_dir: Path, pd_engine: Engine) -> None:
    # The prefill side sends a leaving request's first token with its alternatives and
    # its prompt's logprobs (whole answers too); the decode side sends the rest.
    prompt = _prompts(2)[3]
    sp = SamplingParams(max_new_tokens=6, temperature=0.0, top_logprobs=3, prompt_logprobs=2)
    with Engine("ring", model_dir) as colocated:
        want = colocated.generate(prompt, sp, return_logprob=True, timeout=120)
    got = pd_engine.generate(prompt, sp, return_logprob=True, timeout=120)
    assert got.token_ids == want.token_ids
    assert got.top_logprobs is not None and want.top_logprobs is not None
    assert [[t for t, _ in p] for p in got.top_logprobs] == \
        [[t for t, _ in p] for p in want.top_logprobs]
    assert got.prompt_logprobs is not None and want.prompt_logprobs is not None
    assert np.allclose(np.asarray(got.prompt_logprobs[1:]), want.prompt_logprobs[1:])
    chunks = list(pd_engine.stream(prompt, sp, return_logprob=True))
    assert [t for c in chunks for t in c.token_ids] == list(want.token_ids)
    assert [len(c.top_logprobs or ()) for c in chunks] == [len(c.token_ids) for c in chunks]


def test_a_guided_request_under_pd_obeys_its_guide_to_the_end(model_dir: Path,
                                                             pd_engine: Engine) -> None:
    """The decode replica compiles the hand-off's guide again and feeds it the tokens
    already answered: the rest of the answer obeys the same grammar (greedy, so as
    a colocated replica answers)."""
    choices = ["alpha beta", "gamma", "the queue"]
    specs = [Guide(kind="regex", spec="[a-z]{3}-[0-9]{2}"),
             Guide(kind="choice", spec=json.dumps(choices))]
    requests = [(p, SamplingParams(max_new_tokens=32, temperature=0.0, guide=g))
                for p in ([5, 17, 90], [200, 3, 4, 8, 9]) for g in specs]
    with Engine("ring", model_dir) as colocated:
        want = [colocated.generate(p, s, timeout=120) for p, s in requests]
    before = _load(pd_engine)
    got = [pd_engine.submit(p, s) for p, s in requests]
    results = [h.result(120) for h in got]
    assert [r.token_ids for r in results] == [w.token_ids for w in want]
    assert all(r.finish_reason == "stop" for r in results)
    handed = _load(pd_engine)["dispatcher.handed_off"]
    assert handed == before["dispatcher.handed_off"] + len(requests)  # type: ignore[operator]
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    decoded = [tok.decode(r.token_ids, skip_special_tokens=True) for r in results]
    texts = [t for t in decoded if isinstance(t, str)]
    assert re.fullmatch("[a-z]{3}-[0-9]{2}", texts[0]) and texts[1] in choices, texts
    assert re.fullmatch("[a-z]{3}-[0-9]{2}", texts[2]) and texts[3] in choices, texts


def test_aborts_at_every_stage_free_both_sides(pd_engine: Engine) -> None:
    """Queued or being read (aborted at once), at its first token (on the prefill side,
    in hand-off or just adopted: whichever the race gives), decoding (second token):
    each ends ``abort``, and neither replica keeps anything."""
    long = SamplingParams(max_new_tokens=100_000, temperature=0.0)
    rng = np.random.default_rng(6)
    at_once = [pd_engine.submit(rng.integers(3, 384, 1500).tolist(), long, stream=True)
               for _ in range(3)]
    for h in at_once:
        pd_engine.abort(h.rid)
    firsts = [pd_engine.submit(p, long, stream=True) for p in _prompts(7)[:4]]
    for h in firsts:
        next(iter(h))
        pd_engine.abort(h.rid)
    decoding = pd_engine.submit(_prompts(2)[3], long, stream=True)
    it = iter(decoding)
    next(it), next(it)  # the second token comes from the decode replica
    pd_engine.abort(decoding.rid)
    for h in [*at_once, *firsts, decoding]:
        assert h.result(30).finish_reason == "abort"
    deadline = time.monotonic() + 30
    while True:  # the replicas report what runs in their heartbeats
        load = _load(pd_engine)
        if all(load[f"replica{i}.{k}"] == 0 for i in (0, 1) for k in ("running", "queued")) \
                and load["replica0.in_flight"] == load["replica1.in_flight"] == 0:
            break
        assert time.monotonic() < deadline, load
        time.sleep(0.01)  # sleep-ok: pacing of a deadline poll


def test_the_tiny_gru_under_pd_answers_as_colocated() -> None:
    prompts = _prompts()
    sampled = SamplingParams(max_new_tokens=8, temperature=0.8, seed=5)
    with Engine("ring") as colocated:
        want = _answers(colocated, prompts)
        want_sampled = colocated.generate(prompts[3], sampled, timeout=60).token_ids
    with Engine("zmq", ModelConfig(), pd=(1, 1)) as engine:
        assert _answers(engine, prompts) == want
        # The sampler's generator travels with the hand-off: a seeded sample continues.
        assert engine.generate(prompts[3], sampled, timeout=60).token_ids == want_sampled


def test_two_prefill_and_two_decode_replicas_share_the_work_and_answer_as_colocated() -> None:
    """``pd=(2, 2)``: prompts are read on both prefill replicas, handed to both decode
    replicas by load, and answered as one colocated replica answers them."""
    prompts = _prompts()
    with Engine("ring") as colocated:
        want = _answers(colocated, prompts)
    long = SamplingParams(max_new_tokens=100_000, temperature=0.0)
    with Engine("zmq", ModelConfig(), pd=(2, 2)) as engine:
        assert _answers(engine, prompts) == want
        streams = [engine.submit([3, 4, 5 + n], long, stream=True) for n in range(8)]
        for h in streams:  # each past its hand-off: its second token came from decode
            it = iter(h)
            next(it), next(it)
        load = _load(engine)
        assert load["dispatcher.handed_off"] == len(prompts) + len(streams), load
        assert load["replica2.in_flight"] == load["replica3.in_flight"] == 4, load
        assert load["replica0.in_flight"] == load["replica1.in_flight"] == 0, load
        read = [load["replica0.dispatched"], load["replica1.dispatched"]]
        assert all(isinstance(n, int) and n > 0 for n in read), load  # both read prompts
        assert sum(read) == len(prompts) + len(streams), load  # type: ignore[arg-type]
        for h in streams:
            engine.abort(h.rid)
            assert h.result(30).finish_reason == "abort"


def test_a_hand_off_is_never_taken_from_upstream() -> None:
    """A dispatcher refuses a client's hand-off (it holds no state of ours); its route
    is part of the table's totality check, like every request type."""
    route = dispatch_table(merge_replies).lookup(KVHandoff)
    assert isinstance(route, Refused) and "prefill replica only" in route.why


# -- faults, with real processes -------------------------------------------------------

def _kill(engine: Engine, replica: int, sig: signal.Signals = signal.SIGKILL) -> None:
    for pid in engine.replica_pids[replica]:
        os.kill(pid, sig)


def test_a_replica_dying_at_each_stage_answers_replica_lost(model_dir: Path) -> None:
    long = SamplingParams(max_new_tokens=100_000, temperature=0.0)
    with Engine("zmq", model_dir, pd=(1, 1)) as engine:
        # Decoding: the decode replica dies under streams it runs.
        streams = [engine.submit(p, long, stream=True) for p in _prompts(3)[:3]]
        for h in streams:
            it = iter(h)
            next(it), next(it)
        _kill(engine, 1)
        for h in streams:
            with pytest.raises(RequestFailed) as info:
                h.result(30)
            assert info.value.code == "replica_lost" and "replica1" in str(info.value)
        deadline = time.monotonic() + 120
        while not _load(engine).get("replica1.live"):  # restarted, rejoined
            assert time.monotonic() < deadline
            time.sleep(0.05)  # sleep-ok: pacing of a deadline poll
        # In hand-off: the decode replica is stopped, so the hand-off waits in its
        # socket; it dies there.
        _kill(engine, 1, signal.SIGSTOP)
        handle = engine.submit(_prompts(4)[2], long, stream=True)
        next(iter(handle))  # the first token, from the prefill replica
        _kill(engine, 1)
        with pytest.raises(RequestFailed) as info:  # lost in its socket, or none to take it
            handle.result(30)
        assert info.value.code == "replica_lost"
        # Before its prompt is read: the only prefill replica dies with it queued (or is
        # found silent first): no other can read it.
        _kill(engine, 0, signal.SIGSTOP)
        queued = engine.submit(_prompts(5)[3], GREEDY)
        _kill(engine, 0)
        with pytest.raises(RequestFailed) as info:
            queued.result(30)
        assert info.value.code == "replica_lost"


def test_serve_and_the_frontend_take_pd_p_colon_d_and_refuse_the_rest() -> None:
    from frontend.__main__ import build_parser as frontend_parser
    from frontend.__main__ import settings_from
    from scheduler.__main__ import build_parser
    from scheduler.cli.options import pd_ratio
    assert pd_ratio("1:1") == (1, 1) and pd_ratio("2:3") == (2, 3)
    parser = build_parser()
    args = parser.parse_args(["serve", "--endpoint", "/tmp/x", "--pd", "1:2"])
    assert args.pd == (1, 2)
    for bad in ("0:1", "1:0", "1", "a:b", "1:1:1", "-1:2"):
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", "--endpoint", "/tmp/x", "--pd", bad])
    front = frontend_parser().parse_args(["--pd", "1:1"])
    assert front.pd == (1, 1)
    with pytest.raises(SystemExit, match="--pd needs --mode zmq"):
        settings_from(front)


# -- one scheduler's side: hand off, adopt, refuse (in process, the rig) ----------------

def test_a_scheduler_hands_off_and_another_adopts_and_refuses_what_cannot_continue(
        make_loop: Callable[..., Loop]) -> None:
    prefill, decode, colocated = (make_loop("zmq") for _ in range(3))
    ids = token_ids([5, 9, 2, 33, 17])
    sp = SamplingParams(max_new_tokens=6, temperature=0.0)
    colocated.send(TokenizedGenerateReqInput(rid="r", input_ids=ids, sampling=sp, stream=True))
    colocated.run_until(lambda: "r" in colocated.finished())
    prefill.send(TokenizedGenerateReqInput(rid="r", input_ids=ids, sampling=sp, stream=True,
                                           prefill_only=True))
    prefill.run_until(lambda: any(isinstance(o, KVHandoff) for o, _ in prefill.got))
    first = prefill.got[0][0]
    assert isinstance(first, BatchTokenIDOut) and first.finished_reasons == [None]
    h = prefill.got[1][0]
    assert isinstance(h, KVHandoff) and list(h.output_ids) == list(first.output_ids)
    assert h.sent == 1 and prefill.sched.model.live_states == 0 and not prefill.sched.busy
    decode.send(h)
    decode.run_until(lambda: "r" in decode.finished())
    rest, end = decode.finished()["r"]
    assert [*first.output_ids, *rest] == colocated.finished()["r"][0] and end == "length"
    assert decode.sched.model.live_states == 0
    # What cannot continue is refused, naming why (and, for another model, both).
    bad = {"g": msgspec.structs.replace(h, rid="g", sent=2),
           "m": msgspec.structs.replace(h, rid="m", fingerprint="other-model:0:float32"),
           "s": msgspec.structs.replace(h, rid="s", kv=h.kv[:0]),
           "q": msgspec.structs.replace(h, rid="q", sampling=msgspec.structs.replace(
               sp, guide=Guide(kind="json_object")))}
    for forged in bad.values():
        decode.send(forged)
    decode.run_until(lambda: len(decode.errors()) == 4)
    errors = decode.errors()
    assert all(e.code == "invalid_request" for e in errors.values())
    assert "2 tokens were sent of 1" in errors["g"].message
    assert "other-model:0:float32" in errors["m"].message
    assert h.fingerprint in errors["m"].message
    assert "shape" in errors["s"].message
    assert "hand-off of request 'q' refused: structured output needs the model's tokenizer" \
        in errors["q"].message  # (the tiny GRU has none: the guide cannot be resumed)
    assert decode.sched.model.live_states == 0 and not decode.sched.busy


@pytest.mark.parametrize("pd", [(1.5, 1), (1, 1, 1), (True, 1), "1:1", (0, 1), (1, 0)])
def test_an_engine_refuses_a_pd_that_is_not_two_counts(pd: object) -> None:
    with pytest.raises(ValueError, match="pd must be a pair of ints"):
        Engine("zmq", pd=pd)  # type: ignore[arg-type]


def test_an_engine_says_pd_needs_zmq() -> None:
    with pytest.raises(ValueError, match=r"pd=\(1, 1\) needs mode='zmq'"):
        Engine("ring", pd=(1, 1))


def _handoffs(prefill: Loop, n: int, sp: SamplingParams) -> list[KVHandoff]:
    """``n`` hand-offs of distinct prompts, read by ``prefill`` (rids ``h0``...)."""
    for i in range(n):
        prefill.send(TokenizedGenerateReqInput(rid=f"h{i}", input_ids=token_ids([5 + i, 9, 2]),
                                               sampling=sp, stream=True, prefill_only=True))
    prefill.run_until(lambda: sum(isinstance(o, KVHandoff) for o, _ in prefill.got) == n)
    hs = [o for o, _ in prefill.got if isinstance(o, KVHandoff)]
    return sorted(hs, key=lambda h: h.rid)


def test_a_decode_replica_adopts_within_max_batch_and_its_admission_bounds(
        make_loop: Callable[..., Loop]) -> None:
    """Adopted requests wait (their state held) for a batch slot, in arrival order, and
    a hand-off past the queue's bounds is refused ``overloaded``, as a new request is."""
    from scheduler import Limits
    prefill = make_loop("zmq")
    # A ring: the four are there before the first poll, which takes them together.
    decode = make_loop("ring", max_batch=1, limits=Limits(max_queued_requests=3))
    sp = SamplingParams(max_new_tokens=4, temperature=0.0)
    hs = _handoffs(prefill, 4, sp)
    for h in hs:
        decode.send(h)
    running: list[int] = []

    def stepped() -> bool:
        running.append(len(decode.sched.batch.running))
        return len(decode.finished()) + len(decode.errors()) == 4

    decode.run_until(stepped)
    assert max(running) == 1, running  # never past max_batch
    errors = decode.errors()
    assert list(errors) == ["h3"] and errors["h3"].code == "overloaded"
    assert "max_queued_requests=3" in errors["h3"].message
    # Each runs once the one before it ended: arrival order, one at a time.
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    for i, (o, _) in enumerate(decode.got):
        if isinstance(o, BatchTokenIDOut):
            for rid, _ids, _fin in o.items():
                first.setdefault(rid, i)
                last[rid] = i
    assert last["h0"] < first["h1"] and last["h1"] < first["h2"], (first, last)
    assert decode.sched.model.live_states == 0 and not decode.sched.busy
    assert decode.sched.admission.requests == decode.sched.admission.tokens == 0


def _held_prefill(make_loop: Callable[..., Loop], prefix: str, n: int, **kw: Any
                  ) -> tuple[Loop, list[int], Callable[[], list[str]]]:
    """A prefill replica under ``max_handoff_bytes=BOUND`` whose receivers hold, for now,
    more than that of its sends (``in_flight[0]``, the test's to change), sent ``n``
    prompts ``{prefix}0..``; and the rids it has streamed a first token of, in order."""
    from scheduler import Limits
    in_flight = [1 << 30]
    prefill = make_loop("zmq", limits=Limits(max_handoff_bytes=BOUND),
                        handoff_bytes=lambda: in_flight[0], **kw)
    sp = SamplingParams(max_new_tokens=6, temperature=0.0)
    for i in range(n):
        prefill.send(TokenizedGenerateReqInput(rid=f"{prefix}{i}",
                                               input_ids=token_ids([5 + i, 9]), sampling=sp,
                                               stream=True, prefill_only=True))

    def firsts() -> list[str]:
        return [rid for o, _ in prefill.got if isinstance(o, BatchTokenIDOut)
                for rid, _ids, _fin in o.items()]

    return prefill, in_flight, firsts


def test_a_prefill_replica_holds_read_prompts_while_hand_offs_in_flight_exceed_the_bound(
        make_loop: Callable[..., Loop]) -> None:
    """Past ``max_handoff_bytes`` unreleased, read prompts wait (first token streamed,
    state held, not decoding), and leave in order as room appears; none is dropped."""
    prefill, in_flight, firsts = _held_prefill(make_loop, "w", 3)
    prefill.run_until(lambda: set(firsts()) == {"w0", "w1", "w2"})
    for _ in range(5):
        prefill.sched.step()
    assert not [o for o, _ in prefill.got if isinstance(o, KVHandoff)]
    assert prefill.sched.model.live_states == 3 and not prefill.sched.batch.running
    tokens: dict[str, int] = {}
    for o, _ in prefill.got:
        assert isinstance(o, BatchTokenIDOut)
        for rid, ids, _fin in o.items():
            tokens[rid] = tokens.get(rid, 0) + len(ids)
    assert tokens == {"w0": 1, "w1": 1, "w2": 1}  # none decodes while it waits
    assert prefill.sched.statistics().running == 3 and prefill.sched.busy
    # Room for one: the oldest leaves (the bound is then reached by what it carries).
    in_flight[0] = BOUND - 1
    prefill.run_until(lambda: any(isinstance(o, KVHandoff) for o, _ in prefill.got))
    in_flight[0] = 1 << 30
    for _ in range(5):
        prefill.sched.step()
    hs = [o.rid for o, _ in prefill.got if isinstance(o, KVHandoff)]
    assert hs == ["w0"], hs
    in_flight[0] = 0
    prefill.run_until(lambda: sum(isinstance(o, KVHandoff) for o, _ in prefill.got) == 3)
    assert [o.rid for o, _ in prefill.got if isinstance(o, KVHandoff)] == ["w0", "w1", "w2"]
    assert prefill.sched.model.live_states == 0 and not prefill.sched.busy


def test_an_abort_of_a_request_waiting_to_be_handed_off_frees_it(
        make_loop: Callable[..., Loop]) -> None:
    from messages import AbortReq
    from scheduler import Limits
    prefill = make_loop("zmq", limits=Limits(max_handoff_bytes=BOUND),
                        handoff_bytes=lambda: BOUND)
    prefill.send(TokenizedGenerateReqInput(rid="a", input_ids=token_ids([5, 9]),
                                           sampling=SamplingParams(max_new_tokens=6),
                                           stream=True, prefill_only=True))
    prefill.run_until(lambda: bool(prefill.got))
    assert prefill.sched.model.live_states == 1
    prefill.send(AbortReq(rid="a"))
    prefill.run_until(lambda: "a" in prefill.finished())
    assert prefill.finished()["a"][1] == "abort"
    assert prefill.sched.model.live_states == 0 and not prefill.sched.busy


def test_read_prompts_waiting_to_be_handed_off_keep_their_batch_slots(
        make_loop: Callable[..., Loop]) -> None:
    """A prefill replica whose hand-offs are not taken holds at most ``max_batch``
    read states: the prompts after them wait in the queue (not read, not refused),
    and are read, in order, as the hand-offs before them leave."""
    prefill, in_flight, firsts = _held_prefill(make_loop, "q", 5, max_batch=2)
    prefill.run_until(lambda: len(firsts()) == 2)
    for _ in range(10):
        prefill.sched.step()
    assert firsts() == ["q0", "q1"]  # the other three not read: no slot
    assert prefill.sched.model.live_states == 2 and prefill.sched.batch.queued == 3
    assert not prefill.errors()
    in_flight[0] = 0
    prefill.run_until(lambda: sum(isinstance(o, KVHandoff) for o, _ in prefill.got) == 5)
    assert firsts() == ["q0", "q1", "q2", "q3", "q4"] and not prefill.errors()
    assert [o.rid for o, _ in prefill.got if isinstance(o, KVHandoff)] == \
        ["q0", "q1", "q2", "q3", "q4"]
    assert prefill.sched.model.live_states == 0 and not prefill.sched.busy


def test_a_hand_off_larger_than_the_bound_alone_is_refused_naming_rid_size_and_bound(
        make_loop: Callable[..., Loop]) -> None:
    from scheduler import Limits
    prefill = make_loop("zmq", limits=Limits(max_handoff_bytes=16), handoff_bytes=lambda: 0)
    prefill.send(TokenizedGenerateReqInput(rid="big", input_ids=token_ids([5, 9]),
                                           sampling=SamplingParams(max_new_tokens=6),
                                           stream=True, prefill_only=True))
    prefill.run_until(lambda: "big" in prefill.errors())
    err = prefill.errors()["big"]
    assert err.code == "invalid_request"
    assert re.fullmatch(r"request 'big': its hand-off of \d+ bytes exceeds "
                        r"max_handoff_bytes=16", err.message), err.message
    assert not [o for o, _ in prefill.got if isinstance(o, KVHandoff)]
    assert prefill.sched.model.live_states == 0 and not prefill.sched.busy


def test_the_hand_off_bounds_reach_every_hop_from_an_engine() -> None:
    """``Engine(limits=Limits(max_handoff_bytes=..., handoff_deadline=...))``: the
    replicas keep the byte bound (a larger hand-off is refused, naming it) and the
    dispatcher runs under both (its ``get_load`` says so)."""
    from scheduler import Limits
    limits = Limits(max_handoff_bytes=64, handoff_deadline=7.5)
    with Engine("zmq", ModelConfig(), pd=(1, 1), limits=limits) as engine:
        load = _load(engine)
        assert load["dispatcher.max_handoff_bytes"] == 64, load
        assert load["dispatcher.handoff_deadline"] == 7.5, load
        with pytest.raises(RequestFailed) as info:
            engine.generate([5, 9, 2], GREEDY, timeout=60)
    assert info.value.code == "invalid_request"
    assert re.search(r"its hand-off of \d+ bytes exceeds max_handoff_bytes=64",
                     str(info.value)), str(info.value)


def test_serve_and_the_frontend_take_the_hand_off_bounds_and_the_dispatcher_runs_under_them(
        tmp_path: Path) -> None:
    import subprocess
    import sys

    from bus import RpcClient
    from frontend.__main__ import build_parser as frontend_parser
    from scheduler.__main__ import build_parser
    from scheduler.cli.options import limits_from
    from scheduler.launch.wiring import Endpoints
    flags = ["--max-handoff-bytes", "4096", "--handoff-deadline", "7.5"]
    for args in (build_parser().parse_args(["serve", "--endpoint", "/tmp/x", *flags]),
                 frontend_parser().parse_args(flags)):
        got = limits_from(args)
        assert (got.max_handoff_bytes, got.handoff_deadline) == (4096, 7.5)
    with pytest.raises(ValueError, match="--handoff-deadline must be above 0"):
        limits_from(build_parser().parse_args(["serve", "--endpoint", "/tmp/x",
                                               "--handoff-deadline", "0"]))
    ep = tmp_path / "ep"
    proc = subprocess.Popen([sys.executable, "-m", "scheduler", "serve", "--endpoint",
                             str(ep), "--pd", "1:1", *flags],
                            stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    try:
        with RpcClient(Endpoints.in_dir(str(ep)).rpc) as client:
            load = client.call("get_load", timeout=120).result or {}
            assert load["dispatcher.max_handoff_bytes"] == 4096, load
            assert load["dispatcher.handoff_deadline"] == 7.5, load
            assert client.call("shutdown", timeout=30).success
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
