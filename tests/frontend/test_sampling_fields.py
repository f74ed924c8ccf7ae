"""What eval harnesses and batch clients send, through the door over a real Hugging Face
model (the float64 tiny Llama the tests build), checked against references computed here
from ``transformers``' own logits: penalties, ``logit_bias``, ``min_tokens``."""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar, cast

import httpx
import openai
import pytest

pytest.importorskip("transformers")

import torch

from tests.frontend.server import Server, openai_client

PROMPT = [1, 45, 120, 7, 300, 45, 9]
N = 24
T = TypeVar("T")


@pytest.fixture(scope="module")
def model_dir(tiny_hf: Path) -> Path:
    return tiny_hf


@pytest.fixture(scope="module")
def hf(model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)


@pytest.fixture(scope="module")
def server(hf_door: Server) -> Server:
    """The shared door in each mode (``tests/frontend/conftest.py``): ``dp2`` is zmq with
    two data-parallel replicas (the sampling fields, the top and prompt logprobs travel
    through the dispatcher too)."""
    return hf_door


def client(server: Server) -> openai.OpenAI:
    return openai_client(server)


#: Each model's references, by their arguments. A reference is a pure function of the
#: model and its arguments and costs seconds (a full forward pass per token), and every
#: mode's server is checked against the same ones: each is computed once per module.
_MEMO: weakref.WeakKeyDictionary[Any, dict[tuple[object, ...], Any]] = (
    weakref.WeakKeyDictionary())


def _memo(hf: Any, key: tuple[object, ...], compute: Callable[[], T]) -> T:
    """``compute()``, run once per ``hf`` and ``key`` (a deep copy each time: no caller
    can change what the next one is given)."""
    memo = _MEMO.setdefault(hf, {})
    if key not in memo:
        memo[key] = compute()
    return cast(T, copy.deepcopy(memo[key]))


def reference(hf: Any, prompt: list[int], n: int, *, rep: float = 1.0, freq: float = 0.0,
              pres: float = 0.0, bias: dict[int, float] | None = None
              ) -> tuple[list[int], list[float]]:
    """Greedy tokens with vLLM's penalties, one step at a time from the model's full
    forward pass (written apart from scheduler.models.logits); and each token's logprob
    under the model's own distribution."""
    key = ("reference", tuple(prompt), n, rep, freq, pres, tuple(sorted((bias or {}).items())))
    return _memo(hf, key, lambda: _reference(hf, prompt, n, rep, freq, pres, bias or {}))


def _reference(hf: Any, prompt: list[int], n: int, rep: float, freq: float, pres: float,
               bias: dict[int, float]) -> tuple[list[int], list[float]]:
    ids, out, lps = list(prompt), list[int](), list[float]()
    with torch.no_grad():
        for _ in range(n):
            raw = hf(torch.tensor([ids])).logits[0, -1]
            logits = raw.clone()
            for t, v in bias.items():
                logits[t] += v
            for t in set(ids):  # prompt and answer
                logits[t] = logits[t] / rep if logits[t] > 0 else logits[t] * rep
            for t in set(out):
                logits[t] -= freq * out.count(t) + pres
            tok = int(logits.float().argmax())
            lps.append(float(torch.log_softmax(raw, -1)[tok]))
            ids.append(tok)
            out.append(tok)
    return out, lps


def answer(server: Server, **extra: object) -> tuple[str, list[float], str | None, int]:
    """The greedy answer to PROMPT: its text, logprobs, finish reason and token count."""
    r = client(server).completions.create(
        model="tiny", prompt=PROMPT, max_tokens=N, temperature=0.0, logprobs=0,
        extra_body={"ignore_eos": True, **extra})
    lp = r.choices[0].logprobs
    assert lp is not None and lp.token_logprobs is not None and r.usage is not None
    return (r.choices[0].text, list(lp.token_logprobs), r.choices[0].finish_reason,
            r.usage.completion_tokens)


def text_of(model_dir: Path, ids: list[int]) -> str:
    """The answer's text for ``ids``, as the door builds it."""
    from frontend import Detokenizer, HFTokenizer

    d = Detokenizer(HFTokenizer(str(model_dir)))
    return d.push(ids) + d.finish()


def repeats(ids: list[int]) -> int:
    """How many tokens of ``ids`` appeared before in it."""
    return len(ids) - len(set(ids))


@pytest.mark.parametrize("penalty", [
    {"repetition_penalty": 1.8},
    {"frequency_penalty": 1.5},
    {"presence_penalty": 2.0},
    {"frequency_penalty": 0.7, "presence_penalty": 0.5, "repetition_penalty": 1.3},
])
def test_penalties_are_vllms_against_the_models_own_logits(
        server: Server, hf: Any, model_dir: Path, penalty: dict[str, float]) -> None:
    plain, _ = reference(hf, PROMPT, N)
    assert repeats(plain) >= 4, plain  # greedy on its own repeats itself
    want, want_lps = reference(hf, PROMPT, N, rep=penalty.get("repetition_penalty", 1.0),
                               freq=penalty.get("frequency_penalty", 0.0),
                               pres=penalty.get("presence_penalty", 0.0))
    assert repeats(want) < repeats(plain), (want, plain)
    text, lps, _, count = answer(server, **penalty)
    assert count == N and text == text_of(model_dir, want)
    assert text != text_of(model_dir, plain)
    # The logprobs stay the model's own (vLLM's default raw_logprobs), not the penalized.
    assert lps == pytest.approx(want_lps, abs=1e-4)


def test_no_penalty_is_plain_greedy(server: Server, hf: Any, model_dir: Path) -> None:
    plain, lps = reference(hf, PROMPT, N)
    text, got, _, _ = answer(server)
    assert text == text_of(model_dir, plain) and got == pytest.approx(lps, abs=1e-4)


def test_logit_bias_plus_100_forces_its_token_and_minus_100_bans_one(
        server: Server, hf: Any, model_dir: Path) -> None:
    forced = 200
    text, _, _, count = answer(server, logit_bias={str(forced): 100})
    assert count == N and text == text_of(model_dir, [forced] * N)
    plain, _ = reference(hf, PROMPT, N)
    banned = plain[0]
    want, _ = reference(hf, PROMPT, N, bias={banned: -100.0})
    assert banned not in want
    text, _, _, _ = answer(server, logit_bias={str(banned): -100})
    assert text == text_of(model_dir, want)


def test_min_tokens_holds_the_stop_tokens_back(server: Server, model_dir: Path) -> None:
    # EOS (2) pushed to the top: the answer ends at once, or after min_tokens.
    c = client(server)
    for min_tokens, want in ((0, 0), (5, 5)):
        r = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=N, temperature=0.0,
                                 logit_bias={"2": 100}, extra_body={"min_tokens": min_tokens})
        assert r.usage is not None
        assert (r.choices[0].finish_reason, r.usage.completion_tokens) == ("stop", want)
    chat = c.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=N,
        temperature=1.0, seed=3, logit_bias={"2": 100}, extra_body={"min_tokens": 4})
    assert chat.usage is not None
    assert (chat.choices[0].finish_reason, chat.usage.completion_tokens) == ("stop", 4)


def test_chat_takes_the_penalties(server: Server) -> None:
    c = client(server)
    kw: dict[str, Any] = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                          "max_tokens": 16, "temperature": 0.0}
    plain = c.chat.completions.create(**kw).choices[0].message.content
    pen = c.chat.completions.create(**kw, frequency_penalty=2.0,
                                    extra_body={"repetition_penalty": 2.0})
    assert pen.choices[0].message.content != plain


def top_reference(hf: Any, prompt: list[int], n: int, k: int) -> list[list[float]]:
    """Greedy: each position's ``k`` highest logprobs, from the model's own forward pass."""
    return _memo(hf, ("top", tuple(prompt), n, k), lambda: _top_reference(hf, prompt, n, k))


def _top_reference(hf: Any, prompt: list[int], n: int, k: int) -> list[list[float]]:
    ids = list(prompt)
    tops = []
    with torch.no_grad():
        for _ in range(n):
            logp = torch.log_softmax(hf(torch.tensor([ids])).logits[0, -1], -1)
            tops.append(logp.topk(k).values.tolist())
            ids.append(int(logp.float().argmax()))
    return tops


@pytest.mark.parametrize("stream", [False, True])
def test_completion_logprobs_give_the_top_alternatives(server: Server, hf: Any,
                                                       stream: bool) -> None:
    want = top_reference(hf, PROMPT, 8, 5)
    got = client(server).completions.create(
        model="tiny", prompt=PROMPT, max_tokens=8, temperature=0.0, logprobs=5, stream=stream,
        extra_body={"ignore_eos": True})
    choices = [c.choices[0] for c in got] if stream else [got.choices[0]]  # type: ignore[union-attr]
    tops = [d for c in choices if c.logprobs for d in c.logprobs.top_logprobs or []]
    tokens = [t for c in choices if c.logprobs for t in c.logprobs.tokens or []]
    lps = [v for c in choices if c.logprobs for v in c.logprobs.token_logprobs or []]
    assert len(tops) == len(tokens) == 8
    for d, w, token, lp in zip(tops, want, tokens, lps, strict=True):
        # (texts may coincide: two ids that each end inside a character are both "")
        assert 1 <= len(d) <= 6 and d[token] == pytest.approx(lp, abs=1e-5)
        assert sorted(d.values(), reverse=True)[0] == pytest.approx(w[0], abs=1e-4)
        assert lp == pytest.approx(w[0], abs=1e-4)  # greedy: the most likely one
        assert all(any(v == pytest.approx(x, abs=1e-4) for x in w) for v in d.values())


@pytest.mark.parametrize("stream", [False, True])
def test_chat_top_logprobs_are_the_most_likely_in_order(server: Server, stream: bool) -> None:
    got = client(server).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=8,
        temperature=1.0, seed=5, logprobs=True, top_logprobs=3, stream=stream,
        extra_body={"ignore_eos": True})
    parts = [c.choices[0] for c in got] if stream else [got.choices[0]]  # type: ignore[union-attr]
    entries = [e for p in parts if p.logprobs for e in p.logprobs.content or []]
    assert len(entries) == 8
    for e in entries:
        values = [t.logprob for t in e.top_logprobs]
        assert len(values) == 3 and values == sorted(values, reverse=True)
        assert e.logprob <= values[0] + 1e-6  # sampled at temperature 1: maybe not the top
        assert all(t.bytes is not None for t in e.top_logprobs)


def prompt_reference(hf: Any, prompt: list[int], k: int) -> tuple[list[float], list[list[float]]]:
    """Each prompt token's logprob after the first (and the ``k`` highest at its position),
    from ``transformers``' own forward pass."""
    with torch.no_grad():
        logp = torch.log_softmax(hf(torch.tensor([prompt])).logits[0], -1)
    return ([float(logp[j - 1, prompt[j]]) for j in range(1, len(prompt))],
            [logp[j - 1].topk(k).values.tolist() for j in range(1, len(prompt))])


def test_echo_scores_the_prompt_as_lm_eval_asks(server: Server, hf: Any,
                                                model_dir: Path) -> None:
    """lm-eval's loglikelihood request: ``echo, max_tokens 0, logprobs``. Twice: the
    second time the prompt is in the prefix cache, which a scored prompt must not use."""
    want, want_top = prompt_reference(hf, PROMPT, 5)
    c = client(server)
    for _ in range(2):
        r = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=0, echo=True,
                                 logprobs=5)
        choice = r.choices[0]
        lp = choice.logprobs
        assert lp is not None and lp.token_logprobs is not None and lp.tokens is not None
        assert r.usage is not None and r.usage.completion_tokens == 0
        assert choice.finish_reason == "length"
        assert choice.text == text_of(model_dir, PROMPT)
        assert len(lp.tokens) == len(PROMPT) and lp.token_logprobs[0] is None
        # float64 end to end (the model's, the wire's): equal to transformers' own
        assert lp.token_logprobs[1:] == pytest.approx(want, abs=1e-9)
        assert lp.top_logprobs is not None and lp.top_logprobs[0] is None
        for d, w, own in zip(lp.top_logprobs[1:], want_top, want, strict=True):
            # The 5 most likely and the prompt's own token (texts may coincide: two ids
            # that each end inside a character are both "").
            assert d is not None and 1 <= len(d) <= 6
            assert max(d.values()) == pytest.approx(w[0], abs=1e-9)
            assert all(any(v == pytest.approx(x, abs=1e-9) for x in [*w, own])
                       for v in d.values())
        assert lp.text_offset is not None and len(lp.text_offset) == len(PROMPT)


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_an_answer_begins_with_the_prompt(server: Server, hf: Any,
                                                    model_dir: Path, stream: bool) -> None:
    want, _ = prompt_reference(hf, PROMPT, 1)
    plain, plain_lps = reference(hf, PROMPT, 3)
    r = client(server).completions.create(
        model="tiny", prompt=PROMPT, max_tokens=3, echo=True, logprobs=1, temperature=0.0,
        stream=stream, extra_body={"ignore_eos": True})
    choices = [c.choices[0] for c in r] if stream else [r.choices[0]]  # type: ignore[union-attr]
    text = "".join(c.text for c in choices)
    assert text == text_of(model_dir, PROMPT) + text_of(model_dir, plain)
    lps = [v for c in choices if c.logprobs for v in c.logprobs.token_logprobs or []]
    assert lps[0] is None
    assert lps[1:] == pytest.approx([*want, *plain_lps], abs=1e-5)
    offsets = [o for c in choices if c.logprobs for o in c.logprobs.text_offset or []]
    assert offsets == sorted(offsets) and len(offsets) == len(PROMPT) + 3


@pytest.mark.parametrize("stream", [False, True])
def test_echo_of_a_one_token_prompt_keeps_the_answers_alternatives(server: Server,
                                                                   stream: bool) -> None:
    """A one-token prompt has no logprob to score, so no alternatives come for it; the
    echoed answer still gives each answer token's, as without echo, after the prompt
    token's null (a batch whose prompts scored nothing sent ``None`` for them, and the
    echo dropped the answer's alternatives with the prompt's)."""
    c = client(server)
    plain = c.completions.create(model="tiny", prompt=[PROMPT[1]], max_tokens=3, logprobs=2,
                                 temperature=0.0, extra_body={"ignore_eos": True})
    assert plain.choices[0].logprobs is not None
    want = plain.choices[0].logprobs.top_logprobs
    assert want is not None and len(want) == 3
    r = c.completions.create(model="tiny", prompt=[PROMPT[1]], max_tokens=3, logprobs=2,
                             temperature=0.0, echo=True, stream=stream,
                             extra_body={"ignore_eos": True})
    choices = [c.choices[0] for c in r] if stream else [r.choices[0]]  # type: ignore[union-attr]
    tops: list[dict[str, float] | None] = []
    for ch in choices:
        if ch.logprobs is None or not ch.logprobs.tokens:
            continue
        assert ch.logprobs.top_logprobs is not None, ch.logprobs
        assert len(ch.logprobs.top_logprobs) == len(ch.logprobs.tokens), ch.logprobs
        tops += ch.logprobs.top_logprobs
    assert tops[0] is None and len(tops) == 4
    for got, w in zip(tops[1:], want, strict=True):
        assert got is not None and w is not None and got.keys() == w.keys()
        assert list(got.values()) == pytest.approx(list(w.values()), abs=1e-9)


def test_echo_without_logprobs_and_max_tokens_0_is_the_prompt(server: Server,
                                                              model_dir: Path) -> None:
    r = client(server).completions.create(model="tiny", prompt=PROMPT, max_tokens=0,
                                          echo=True)
    assert r.choices[0].text == text_of(model_dir, PROMPT) and r.choices[0].logprobs is None


def test_n_answers_per_prompt_in_vllms_order(server: Server) -> None:
    c = client(server)
    r = c.completions.create(model="tiny", prompt=[PROMPT, PROMPT[:4]], n=3, max_tokens=6,
                             temperature=1.0, seed=11, extra_body={"ignore_eos": True})
    assert [ch.index for ch in r.choices] == list(range(6))
    texts = [ch.text for ch in r.choices]
    assert len(set(texts[:3])) == 3  # three answers of one prompt, not one thrice
    again = c.completions.create(model="tiny", prompt=[PROMPT, PROMPT[:4]], n=3,
                                 max_tokens=6, temperature=1.0, seed=11,
                                 extra_body={"ignore_eos": True})
    assert [ch.text for ch in again.choices] == texts  # seeded: reproducible
    alone = c.completions.create(model="tiny", prompt=PROMPT[:4], max_tokens=6,
                                 temperature=1.0, seed=11, extra_body={"ignore_eos": True})
    assert alone.choices[0].text == texts[3]  # prompt 1's first answer: its own seed
    assert r.usage is not None and r.usage.completion_tokens == 36
    assert r.usage.prompt_tokens == len(PROMPT) + 4  # each prompt counted once


def test_chat_n_streamed_and_whole(server: Server) -> None:
    c = client(server)
    kw: dict[str, Any] = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                          "max_tokens": 5, "temperature": 1.0, "seed": 4, "n": 2,
                          "extra_body": {"ignore_eos": True}}
    whole = c.chat.completions.create(**kw)
    assert [ch.index for ch in whole.choices] == [0, 1]
    got = ["", ""]
    for chunk in c.chat.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            got[ch.index] += ch.delta.content or ""
    assert got == [ch.message.content for ch in whole.choices]
    assert got[0] != got[1]


def test_best_of_keeps_the_most_likely_answers(server: Server) -> None:
    c = client(server)
    every = c.completions.create(model="tiny", prompt=PROMPT, n=4, max_tokens=6,
                                 temperature=1.0, seed=2, logprobs=0,
                                 extra_body={"ignore_eos": True})
    scores = {ch.text: sum(ch.logprobs.token_logprobs or []) for ch in every.choices
              if ch.logprobs}
    best = c.completions.create(model="tiny", prompt=PROMPT, n=1, best_of=4, max_tokens=6,
                                temperature=1.0, seed=2, extra_body={"ignore_eos": True})
    assert len(best.choices) == 1 and best.choices[0].logprobs is None
    assert best.choices[0].text == max(scores, key=lambda t: scores[t])
    assert best.usage is not None and best.usage.completion_tokens == 24


def prefix_hits(server: Server) -> float:
    """The replica's ``prefix_cache_hit_tokens`` counter, read from the door's /metrics."""
    text = httpx.get(f"{server.url}/metrics").text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if "prefix_cache_hit_tokens" in line and not line.startswith("#"))


def test_n_answers_share_their_prompts_prefill(server: Server, hf: Any,
                                               model_dir: Path) -> None:
    """The n answers of one prompt arrive together; all but the first are admitted a step
    later, from the prefix cache the first filled, so its prompt is read once on each
    replica that serves some of them (the dispatcher spreads copies by load)."""
    prompt = [1, *((i * 37 + 11) % 250 + 2 for i in range(199))]
    before = prefix_hits(server)
    r = client(server).completions.create(model="tiny", prompt=prompt, n=4, max_tokens=4,
                                          temperature=0.0, extra_body={"ignore_eos": True})
    hits = prefix_hits(server) - before
    replicas = server.app.settings.dp_size
    assert hits >= (4 - replicas) * (len(prompt) - 1), hits
    want, _ = reference(hf, prompt, 4)
    assert [ch.text for ch in r.choices] == [text_of(model_dir, want)] * 4
