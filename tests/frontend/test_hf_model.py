"""The front door over a real Hugging Face model: ``python -m frontend --model DIR``'s
settings, driven by the official ``openai`` client, answer what ``transformers``'
own greedy ``generate`` answers, decoded by the model's own tokenizer."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

pytest.importorskip("transformers")

import torch

from frontend.__main__ import parse, settings_from
from tests.frontend.server import Server, openai_client


@pytest.fixture(scope="module")
def model_dir(tiny_hf: Path) -> Path:
    return tiny_hf


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    settings, app = settings_from(parse(["--model", str(model_dir), "--served-model-name",
                                         "tiny", "--endpoint",
                                         str(tmp_path_factory.mktemp("ep") / "ep")]))
    s = Server(settings, app.tokenizer)
    yield s
    s.stop()


def test_completion_is_transformers_greedy_text(server: Server, model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    prompt = "the scheduler reads a long prompt"
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                             do_sample=False, pad_token_id=0)
    new = out[0, ids.shape[1]:].tolist()
    if 2 in new:  # the model's end of sequence: not part of the text
        new = new[:new.index(2)]
    client = openai_client(server)
    answer = client.completions.create(model="tiny", prompt=prompt, max_tokens=12,
                                       temperature=0.0)
    assert answer.choices[0].text == tok.decode(new)
    assert answer.usage is not None and answer.usage.prompt_tokens == ids.shape[1]


def test_ignore_eos_gives_exactly_max_tokens_where_the_model_would_stop(
        model_dir: Path, tmp_path: Path) -> None:
    """``ignore_eos`` reaches the scheduler: the model's own EOS (its
    ``generation_config.json``, not the tokenizer's) no longer ends the answer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    n = 12
    prompt = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)(
        "a model loads its weights").input_ids
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt)),
                             max_new_tokens=n, do_sample=False, pad_token_id=0)
    ref = out[0, len(prompt):].tolist()
    assert len(ref) == n and 2 not in ref, ref
    at = next(i for i in range(n - 1, 0, -1) if ref[i] not in ref[:i])  # its first time
    eos_dir = tmp_path / "tiny"  # the model's name: the directory's
    shutil.copytree(model_dir, eos_dir)
    gen = json.loads((eos_dir / "generation_config.json").read_text())
    gen["eos_token_id"] = [2, ref[at]]  # the model's stop ids, where the tokenizer's is 2
    (eos_dir / "generation_config.json").write_text(json.dumps(gen))
    settings, app = settings_from(parse(["--model", str(eos_dir), "--served-model-name",
                                         "tiny", "--endpoint",
                                         str(tmp_path / "ep")]))
    server = Server(settings, app.tokenizer)
    try:
        client = openai_client(server)
        stopped, ignored = (client.completions.create(
            model="tiny", prompt=prompt, max_tokens=n, temperature=0.0,
            extra_body={"ignore_eos": True} if ignore else None) for ignore in (False, True))
    finally:
        server.stop()
    assert stopped.usage is not None and ignored.usage is not None
    assert (stopped.choices[0].finish_reason, stopped.usage.completion_tokens) == ("stop", at)
    assert (ignored.choices[0].finish_reason, ignored.usage.completion_tokens) == ("length", n)


def test_the_models_context_bounds_max_tokens_as_openai_does(server: Server) -> None:
    # Without this: past the context a request failed its whole batch (500), and a
    # chat without max_tokens (256 by default) always failed on a 128-position model.
    models = httpx.get(f"{server.url}/v1/models").json()
    assert models["data"][0]["max_model_len"] == 4096  # build_tiny_hf's context
    client = openai_client(server)
    cases: list[tuple[list[int], int | None, str]] = [
        ([5] * 10, 4090, "max_tokens"), ([5] * 4096, None, "prompt")]
    for prompt, asked, param in cases:
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model="tiny", prompt=prompt, max_tokens=asked)
        error = info.value.body
        assert isinstance(error, dict), error
        assert (error["code"], error["param"]) == ("context_length_exceeded", param), error
        assert "maximum context length is 4096 tokens" in error["message"]
    with pytest.raises(openai.BadRequestError) as info:  # named by the field a chat used
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content":
                                                                "hi"}],
                                       max_completion_tokens=5000)
    assert isinstance(info.value.body, dict)
    assert info.value.body["param"] == "max_completion_tokens", info.value.body
    with pytest.raises(openai.BadRequestError) as info:  # an embedding's input, as well
        client.embeddings.create(model="tiny", input="a scheduler reads " * 2000)
    assert isinstance(info.value.body, dict)
    assert (info.value.body["code"], info.value.body["param"]) == \
        ("context_length_exceeded", "input"), info.value.body
    # No max_tokens: the default (16) is cut to the room the prompt leaves.
    answer = client.completions.create(model="tiny", prompt=[5] * 4090, temperature=0.0,
                                       extra_body={"ignore_eos": True})
    assert answer.usage is not None and answer.usage.completion_tokens == 6
    assert answer.choices[0].finish_reason == "length"


def test_a_missing_model_directory_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as info:
        settings_from(parse(["--model", str(tmp_path / "nowhere"),
                             "--endpoint", str(tmp_path / "ep")]))
    assert "nowhere" in str(info.value)
