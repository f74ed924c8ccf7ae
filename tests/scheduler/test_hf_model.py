"""A Hugging Face causal LM from a local directory, checked token for token against
``transformers``.

The model is a tiny random Llama (hidden 64, 2 layers) with a BPE tokenizer
trained here, built in float64 and loaded in its own dtype: a random model's
logits are near ties, and float32 rounding between a batched and a single
matmul would flip some.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from messages import SamplingParams, token_ids
from scheduler import Engine, HFModelSpec, ModelLoadError
from scheduler.__main__ import main
from scheduler.models.hf import HFCausalLM
from scheduler.models.loading import model_spec
from scheduler.models.tiny_hf import build_tiny_hf
from tests.scheduler.conftest import HFEngines

MAX_NEW = 8
CHUNK = 512  # the scheduler's default max_prefill_tokens


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> Callable[[list[int], int], list[int]]:
    """``transformers``' own greedy answer for one prompt, EOS cut off (memoized)."""
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    memo: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def answer(prompt: list[int], n: int = MAX_NEW) -> list[int]:
        key = (tuple(prompt), n)
        if key not in memo:
            with torch.inference_mode():
                out = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n)
            memo[key] = out[0, len(prompt):].tolist()
        return memo[key]

    return answer


def _prompts(n: int = 16, seed: int = 0) -> list[list[int]]:
    """Prompts of different lengths, one longer than a prefill chunk."""
    rng = np.random.default_rng(seed)
    lengths = [1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144, 7, 4, 30, 60, CHUNK + 190][:n]
    return [rng.integers(3, 384, size=k).tolist() for k in lengths]


def _expected(ref: list[int], eos: int = 2) -> tuple[list[int], str]:
    """What the scheduler answers for ``transformers``' output: EOS ends it (``stop``)."""
    if eos in ref:
        return ref[:ref.index(eos)], "stop"
    return ref, "length"


# zmq with one replica: test_serve_model_dir_answers_like_transformers; two: here
@pytest.mark.parametrize("mode,dp", [("ring", 1), ("zmq", 2)])
def test_greedy_equals_transformers_generate_for_16_prompts_together(
        model_dir: Path, reference: Callable[[list[int], int], list[int]],
        hf_engines: HFEngines, mode: str, dp: int) -> None:
    prompts = _prompts()
    with contextlib.ExitStack() as own:  # zmq: the session's shared engine
        engine = hf_engines.get(dp) if mode == "zmq" else own.enter_context(
            Engine("ring", model_dir))
        handles = engine.submit_many(prompts, SamplingParams(max_new_tokens=MAX_NEW,
                                                             temperature=0.0))
        got = [h.result(timeout=120) for h in handles]
    for prompt, result in zip(prompts, got, strict=True):
        tokens, reason = _expected(reference(prompt, MAX_NEW))
        assert (result.token_ids, result.finish_reason) == (tokens, reason), len(prompt)


def test_a_request_stops_at_the_models_eos_as_generate_does(
        model_dir: Path, reference: Callable[[list[int], int], list[int]],
        tmp_path: Path) -> None:
    prompt = _prompts()[5]
    ref = reference(prompt, MAX_NEW)
    assert len(ref) == MAX_NEW and 2 not in ref, ref  # transformers ran to max_new_tokens
    fresh = [i for i in range(1, MAX_NEW) if ref[i] not in ref[:i]]  # first time seen
    assert len(fresh) >= 2, ref
    asked_at, at = fresh[0], fresh[-1]
    eos_dir = tmp_path / "eos"
    shutil.copytree(model_dir, eos_dir)
    gen = json.loads((eos_dir / "generation_config.json").read_text())
    gen["eos_token_id"] = [2, ref[at]]  # generation_config.json wins over config.json
    (eos_dir / "generation_config.json").write_text(json.dumps(gen))
    with Engine("ring", eos_dir) as engine:
        result = engine.generate(prompt, SamplingParams(max_new_tokens=MAX_NEW,
                                                        temperature=0.0), timeout=60)
        asked = engine.generate(prompt, SamplingParams(
            max_new_tokens=MAX_NEW, temperature=0.0,
            stop_token_ids=[ref[asked_at]]), timeout=60)  # type: ignore[arg-type]
        ignored = engine.generate(prompt, SamplingParams(max_new_tokens=MAX_NEW,
                                                         temperature=0.0, ignore_eos=True),
                                  timeout=60)
    assert (result.token_ids, result.finish_reason) == (ref[:at], "stop")
    assert (asked.token_ids, asked.finish_reason) == (ref[:asked_at], "stop")
    assert (ignored.token_ids, ignored.finish_reason) == (ref, "length")  # past its EOS
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(eos_dir, local_files_only=True)
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=MAX_NEW)
    assert out[0, len(prompt):].tolist() == ref[:at + 1]  # generate stopped there too


def _wait(cond: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)  # sleep-ok: polling another thread's state with a deadline


def test_an_abort_mid_decode_frees_that_requests_kv_cache(model_dir: Path) -> None:
    with Engine("ring", model_dir) as engine:
        model = engine._core._loaded  # the adapter the embedded scheduler runs
        assert isinstance(model, HFCausalLM)
        short = engine.submit([5, 6, 7], SamplingParams(max_new_tokens=3, temperature=0.0))
        # Greedy: the answer is the same every run, and its first 2000 tokens hold no
        # EOS (a sampled one, seeded by a random rid, ended at EOS now and then).
        long = engine.submit(_prompts()[15], SamplingParams(max_new_tokens=2000,
                                                            temperature=0.0), stream=True)
        chunks = iter(long)
        next(chunks)  # decoding now
        assert short.result(timeout=60).finish_reason == "length"
        # Read from this thread while the scheduler's moves states between its
        # resident batch and its caches: wait for the settled count.
        _wait(lambda: model.live_states == 1)
        engine.abort(long.rid)
        assert long.result(timeout=60).finish_reason == "abort"
        _wait(lambda: model.live_states == 0)


def test_a_seeded_sample_is_the_same_whatever_shares_the_batch(model_dir: Path) -> None:
    sp = SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0, seed=7)
    prompt = _prompts()[8]
    with Engine("ring", model_dir) as engine:
        alone = engine.generate(prompt, sp, timeout=60).token_ids
        others = engine.submit_many(_prompts(seed=1)[:9], SamplingParams(
            max_new_tokens=MAX_NEW + 3, temperature=0.8, seed=3))
        mine = engine.submit(prompt, sp)
        assert mine.result(timeout=60).token_ids == alone
        for h in others:
            h.result(timeout=60)
        assert engine._core._loaded is not None and engine._core._loaded.live_states == 0


def test_embedding_is_the_unit_mean_of_last_hidden_states_also_when_chunked(
        model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    for prompt in (_prompts()[6], _prompts()[15]):
        with torch.inference_mode():
            hidden = hf.base_model(input_ids=torch.tensor([prompt])).last_hidden_state[0]
        want = hidden.mean(0).float()
        want = want / want.norm()
        with Engine("ring", model_dir) as engine:
            got = engine.embed(prompt, timeout=60)
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-5, atol=1e-6)


def test_a_model_directory_missing_a_file_is_one_clear_error(model_dir: Path,
                                                             tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no such directory"):
        model_spec(tmp_path / "nowhere")
    broken = tmp_path / "broken"
    shutil.copytree(model_dir, broken)
    (broken / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"missing .*model\.safetensors"):
        Engine("ring", broken)
    (broken / "config.json").unlink()
    with pytest.raises(ModelLoadError, match=r"missing .*config\.json"):
        model_spec(str(broken))
    with pytest.raises(ValueError, match="one rank"):
        Engine("zmq", model_dir, tp_size=2)
    with pytest.raises(ModelLoadError, match="unknown dtype"):
        HFCausalLM(model_dir, dtype="float8")


def test_serve_model_errors_are_one_line(model_dir: Path, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    assert main(["serve", "--endpoint", str(tmp_path / "ep"),
                 "--model", str(tmp_path / "no")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: model ")
    assert "no such directory" in err[0] and str(tmp_path / "no") in err[0]
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "transformers" else real(name, *a))
    with pytest.raises(ModelLoadError, match=r"pip install -e '\.\[hf\]'"):
        model_spec(HFModelSpec(str(model_dir)))


def test_a_prompt_past_the_models_context_is_refused(model_dir: Path) -> None:
    from scheduler import RequestFailed
    with Engine("ring", model_dir) as engine:
        with pytest.raises(RequestFailed) as info:
            engine.generate([5] * 4097, SamplingParams(max_new_tokens=1), timeout=60)
        assert info.value.code == "invalid_request" and "at most 4096" in str(info.value)
        with pytest.raises(RequestFailed, match="outside the vocabulary"):
            engine.generate([384], SamplingParams(max_new_tokens=1), timeout=60)


def test_a_request_that_fills_the_context_ends_length_and_fails_no_other(
        tmp_path: Path) -> None:
    # GPT-2's positions are a table: reading past it raised IndexError, and the step
    # failed every request in the batch (without it: 9 answers of 500 for one).
    gpt2 = build_tiny_hf(tmp_path / "gpt2", arch="gpt2", max_positions=32, layers=1)
    def greedy(n: int) -> SamplingParams:
        return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)

    with Engine("ring", gpt2) as engine:
        long = engine.submit([5] * 20, greedy(30))
        full = engine.submit([6] * 32, greedy(4))
        short = [engine.submit([7, 8, 9], greedy(10)) for _ in range(3)]
        got = [h.result(timeout=60) for h in (long, full, *short)]
    # prompt + generated never pass the context (as transformers' max_length counts)
    assert [(len(r.token_ids), r.finish_reason) for r in got] == \
        [(12, "length"), (1, "length")] + [(10, "length")] * 3


def test_async_engine_takes_a_model_directory(
        model_dir: Path, reference: Callable[[list[int], int], list[int]]) -> None:
    import asyncio

    from scheduler import AsyncEngine
    prompt = _prompts()[9]

    async def run() -> list[int]:
        async with AsyncEngine("ring", str(model_dir)) as engine:
            result = await engine.generate(prompt, SamplingParams(max_new_tokens=MAX_NEW,
                                                                  temperature=0.0))
            return result.token_ids

    assert asyncio.run(run()) == _expected(reference(prompt, MAX_NEW))[0]


def test_serve_model_dir_answers_like_transformers(
        model_dir: Path, reference: Callable[[list[int], int], list[int]],
        tmp_path: Path) -> None:
    from messages import BatchTokenIDOut, Codec, Output, Request, TokenizedGenerateReqInput
    from tests.scheduler.served import Served
    prompt = _prompts()[10]
    served = Served(tmp_path, "--model", str(model_dir))
    try:
        served.work.send_multipart(Codec(Request).encode(TokenizedGenerateReqInput(
            rid="r", input_ids=token_ids(prompt),
            sampling=SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0))))
        assert served.out.poll(120_000), "no output from serve --model"
        out = Codec(Output).decode(served.out.recv_multipart())
        assert isinstance(out, BatchTokenIDOut) and out.finished_reasons[0] is not None
        assert out.output_ids.tolist() == _expected(reference(prompt, MAX_NEW))[0]
    finally:
        served.close()
