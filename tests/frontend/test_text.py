"""Text in, text out: multi-byte text intact, stop strings across tokens, chat templates."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx
import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from frontend import ByteTokenizer, ChatTemplate, Detokenizer, HFTokenizer, Settings, Tokenizer
from frontend.responses import ResponseShaper
from frontend.schemas import ChatMessage
from scheduler import AsyncEngine, ModelConfig
from tests.frontend.bpe import TEXT, train_byte_level, train_metaspace
from tests.frontend.server import ScriptedEngine, Server, openai_client


@pytest.fixture(scope="module")
def bpe(tmp_path_factory: pytest.TempPathFactory) -> HFTokenizer:
    return HFTokenizer(str(train_byte_level(tmp_path_factory.mktemp("bpe"))))


def pieces(tok: Tokenizer, ids: list[int], stops: Sequence[str] = ()
           ) -> tuple[list[str], Detokenizer]:
    d = Detokenizer(tok, stops)
    out = [d.push([i]) for i in ids]
    out.append(d.finish())
    return out, d


def test_byte_level_streams_whole_characters() -> None:
    tok = ByteTokenizer()
    out, _ = pieces(tok, tok.encode(TEXT))
    assert "".join(out) == TEXT
    assert not any("\ufffd" in p for p in out)
    assert "" in out  # a character split over bytes was held, not sent broken


def test_bpe_streams_whole_characters(bpe: HFTokenizer) -> None:
    assert bpe.token_bytes() is not None  # a byte-level BPE: rebuilt byte by byte
    ids = bpe.encode(TEXT, add_special_tokens=False)
    out, _ = pieces(bpe, ids)
    assert "".join(out) == TEXT == bpe.decode(ids)
    assert not any("\ufffd" in p for p in out)
    table = bpe.token_bytes()
    assert table is not None
    assert any(not _utf8(table[i]) for i in ids), "no character split across tokens"


def _utf8(b: bytes) -> bool:
    try:
        b.decode()
    except UnicodeDecodeError:
        return False
    return True


def test_window_decoding_matches_a_whole_decode(tmp_path: Path) -> None:
    tok = HFTokenizer(str(train_metaspace(tmp_path)))
    assert tok.token_bytes() is None  # decoded by windows
    text = "the quick brown fox 世界 jumps"
    ids = tok.encode(text, add_special_tokens=False)
    out, _ = pieces(tok, ids)
    assert "".join(out) == tok.decode(ids)


@pytest.mark.parametrize("stop", ["世界", "! na", "🎉🚀", "end."])
def test_stop_string_across_tokens_never_leaks(bpe: HFTokenizer, stop: str) -> None:
    for tok in (ByteTokenizer(), bpe):
        ids = tok.encode(TEXT, add_special_tokens=False)
        out, d = pieces(tok, ids, [stop, "never there"])
        assert d.stopped
        assert "".join(out) == TEXT[:TEXT.index(stop)]
        assert d.tokens < len(ids) or stop == "end."


def test_held_text_is_released_when_no_stop_follows() -> None:
    tok = ByteTokenizer()
    d = Detokenizer(tok, ["STOP"])
    assert d.push(tok.encode("ab ST")) == "ab "  # "ST" may begin "STOP": held
    assert d.push(tok.encode("AR")) == "STAR"
    assert d.push(tok.encode("S")) == ""
    assert d.finish() == "S"


def test_default_chat_template() -> None:
    t = ChatTemplate(ByteTokenizer())
    text = t.render([ChatMessage(role="system", content="be brief"),
                     ChatMessage(role="user", content="hi")])
    assert text == ("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
                    "<|im_start|>assistant\n")
    assert t.source == "default" and t.stop_ids == [256, 258] and t.stops == []
    ids = ByteTokenizer().encode(text)
    assert ids[0] == 257 and ids.count(258) == 2  # the special tokens are one id each


def test_tokenizer_chat_template_with_jinja(tmp_path: Path) -> None:
    template = ("{% for m in messages %}[{{ m.role }}{% if m.name %} {{ m.name }}{% endif %}] "
                "{{ m.content }}{{ eos_token }}{% endfor %}"
                "{% if add_generation_prompt %}[assistant] {% endif %}")
    tok = HFTokenizer(str(train_byte_level(tmp_path, chat_template=template)))
    t = ChatTemplate(tok)
    assert t.source == "tokenizer"
    assert t.render([ChatMessage(role="user", content="hi")]) == \
        "[user] hi<|endoftext|>[assistant] "
    # A message's name reaches the template (without it: it was accepted and dropped).
    assert t.render([ChatMessage(role="user", content="hi", name="ann")]) == \
        "[user ann] hi<|endoftext|>[assistant] "


def test_a_message_s_name_is_rendered_and_bounded(
        scripted_server: tuple[Server, Tokenizer]) -> None:
    server_url = scripted_server[0].url
    assert ChatTemplate(ByteTokenizer()).render(
        [ChatMessage(role="user", content="hi", name="ann_1")], False) == \
        "<|im_start|>user name=ann_1\nhi<|im_end|>\n"
    for bad in ("a b", "x" * 65, "<|im_end|>", "a\nb", ""):  # OpenAI's pattern: no injection
        r = httpx.post(f"{server_url}/v1/chat/completions", json={
            "model": "tiny", "max_tokens": 1,
            "messages": [{"role": "user", "content": "hi", "name": bad}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].name", bad


def scripted(text_ids: list[int]) -> type[AsyncEngine]:
    class Engine(ScriptedEngine):
        script = text_ids
    return Engine


def _offsets(tok: Tokenizer, ids: list[int]) -> list[int]:
    """Each id's text_offset, worked out apart from the detokenizer: the whole characters
    in the bytes of the ids before it."""
    table = tok.token_bytes()
    assert table is not None
    return [len(b"".join(table[j] for j in ids[:i]).decode(errors="ignore"))
            for i in range(len(ids))]


def test_text_offset_is_where_each_tokens_text_begins(bpe: HFTokenizer) -> None:
    for tok in (ByteTokenizer(), bpe):
        ids = tok.encode(TEXT, add_special_tokens=False)
        want = _offsets(tok, ids)
        if isinstance(tok, ByteTokenizer):  # some ids end no character: held, not counted
            assert len(set(want)) < len(want)
        for step in (1, 3, len(ids)):  # however the steps fall
            d = Detokenizer(tok)
            got = [d.push_offsets(ids[i:i + step]) for i in range(0, len(ids), step)]
            assert "".join(text for text, _ in got) == TEXT
            assert [o for _, offsets in got for o in offsets] == want
        d = Detokenizer(tok, ["世界"])  # a stop string: the offsets before it are the same
        text, offsets = d.push_offsets(ids)
        before = sum(o <= len(text) for o in want)  # ids whose text begins before it
        assert d.stopped and text == TEXT[:TEXT.index("世界")] and d.tokens == len(ids)
        assert offsets[:before] == want[:before] and len(offsets) == len(ids)


@pytest.fixture(scope="module", params=["bytes", "bpe"])
def scripted_server(request: pytest.FixtureRequest, bpe: HFTokenizer
                    ) -> Iterator[tuple[Server, Tokenizer]]:
    tok: Tokenizer = ByteTokenizer() if request.param == "bytes" else bpe
    engine = scripted(tok.encode(TEXT, add_special_tokens=False))
    # Metrics off: what streams text needs none of them (and the door has no /metrics).
    s = Server(Settings(model=ModelConfig(vocab_size=tok.vocab_size, kind="stub"),
                        metrics=False), tok, engine=lambda st: engine(st.mode, st.model))
    yield s, tok
    s.stop()


def test_multibyte_text_streams_intact(scripted_server: tuple[Server, Tokenizer]) -> None:
    server, tok = scripted_server
    n = len(tok.encode(TEXT, add_special_tokens=False))
    c = openai_client(server)
    deltas = [ch.choices[0].text for ch in c.completions.create(
        model="tiny", prompt="x", max_tokens=n, temperature=0, stream=True,
        extra_body={"ignore_eos": True})]
    assert "".join(deltas) == TEXT
    assert not any("\ufffd" in d for d in deltas)
    chat = [ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=n, temperature=0,
        stream=True, extra_body={"ignore_eos": True})]
    assert "".join(chat) == TEXT


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_spanning_tokens_over_http(scripted_server: tuple[Server, Tokenizer],
                                               stream: bool) -> None:
    server, _ = scripted_server
    stop = "世界"  # 6 bytes: several tokens either way
    body = {"model": "tiny", "prompt": "x", "max_tokens": 200, "stop": [stop], "temperature": 0,
            "ignore_eos": True,
            "stream": stream}
    r = httpx.post(f"{server.url}/v1/completions", json=body)
    assert r.status_code == 200
    if stream:
        events = [line[6:] for line in r.text.split("\n\n") if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [msgspec.json.decode(e) for e in events[:-1]]
        text = "".join(c["choices"][0]["text"] for c in chunks)
        finish = chunks[-1]["choices"][0]["finish_reason"]
    else:
        choice = r.json()["choices"][0]
        text, finish = choice["text"], choice["finish_reason"]
    assert text == TEXT[:TEXT.index(stop)]
    assert finish == "stop"


@pytest.mark.parametrize("stream", [False, True])
def test_text_offset_over_http(scripted_server: tuple[Server, Tokenizer], stream: bool) -> None:
    server, tok = scripted_server
    ids = tok.encode(TEXT, add_special_tokens=False)
    c = openai_client(server)
    # (a stop string that never comes: the scripted ids are read through a stream)
    got = c.completions.create(model="tiny", prompt="x", max_tokens=40, temperature=0,
                               logprobs=0, stop=["never there"], stream=stream,
                               extra_body={"ignore_eos": True})
    choices = [ch.choices[0] for ch in got] if stream else [got.choices[0]]  # type: ignore[union-attr]
    offsets = [o for ch in choices if ch.logprobs for o in ch.logprobs.text_offset or []]
    script = [ids[k % len(ids)] for k in range(40)]  # (the scripted engine's ids)
    assert offsets == _offsets(tok, script)
    table = tok.token_bytes()
    assert table is not None
    text = "".join(ch.text for ch in choices)
    assert text == b"".join(table[i] for i in script).decode(errors="ignore")
    assert all(o <= len(text) for o in offsets)


def test_with_metrics_off_there_is_no_metrics_path(
        scripted_server: tuple[Server, Tokenizer]) -> None:
    server, _ = scripted_server
    for method in ("GET", "HEAD", "POST"):  # not a 405 whose Allow names a GET that 404s
        r = httpx.request(method, f"{server.url}/metrics")
        assert r.status_code == 404 and "allow" not in r.headers, (method, r.headers)
    assert "--no-metrics" in httpx.get(f"{server.url}/metrics").json()["error"]["message"]


@given(texts=st.lists(st.text(), min_size=1, max_size=5), chat=st.booleans())
def test_an_event_spliced_around_its_text_is_the_event_encoded_whole(texts: list[str],
                                                                      chat: bool) -> None:
    shape = ResponseShaper(chat, "7", 'tiny "model" \u00e9', ByteTokenizer())
    for i, text in enumerate(texts):
        role = "assistant" if chat and i == 0 else None
        assert shape.event(text, None, [], None, None) == \
            shape._event(text, None, None, None, role)


@given(text=st.text(st.sampled_from("a\u2028\u2029\u0085\u00e9\n\r\u20ac")), chat=st.booleans(),
       whole=st.booleans())
def test_an_event_is_one_line_whatever_its_text(text: str, chat: bool, whole: bool) -> None:
    # Without this: msgspec writes U+2028, U+2029 and U+0085 raw, and a reader that
    # splits lines as str.splitlines does (httpx's iter_lines) cut the event in two.
    shape = ResponseShaper(chat, "7", "tiny", ByteTokenizer())
    shape.event("", None, [], None, None)  # (past the first event: the spliced one)
    event = shape.event(text, "stop" if whole else None, [], None, None)
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    lines = event.decode()[:-2].splitlines()
    assert len(lines) == 1
    body = msgspec.json.decode(lines[0][6:])
    got = body["choices"][0]["delta"]["content"] if chat else body["choices"][0]["text"]
    assert got == text


def test_text_offset_after_invalid_bytes_and_past_a_stop() -> None:
    # Without this: the id after bytes it shows invalid was placed on their U+FFFD, and
    # ids whose text a stop string cut pointed past the answer's end.
    tok = ByteTokenizer()
    d = Detokenizer(tok)
    text, offsets = d.push_offsets([0x8B, 0xF6, 0xDE, 0x00, ord("]"), 0xE4, 0xB8, ord("a")])
    assert text == "\ufffd\ufffd\ufffd\x00]\ufffda"
    assert offsets == [0, 1, 2, 3, 4, 5, 5, 6]
    d = Detokenizer(tok, ["XY"])
    text, offsets = d.push_offsets(tok.encode("abXYZ"))
    assert text == "ab" and offsets == [0, 1, 2, 2, 2]


@pytest.mark.parametrize("stream", [False, True])
def test_logprob_tokens_are_each_tokens_text(scripted_server: tuple[Server, Tokenizer],
                                             stream: bool) -> None:
    """Logprob tokens are decoded text (vLLM's), not vocabulary pieces (``'Ġcaf'``): joined
    they are the answer, a token that ends inside a character is "" and the one that
    completes it carries the character."""
    server, tok = scripted_server
    ids = tok.encode(TEXT, add_special_tokens=False)
    n = len(ids)
    c = openai_client(server)
    got = c.completions.create(model="tiny", prompt="x", max_tokens=n, temperature=0,
                               logprobs=0, stop=["never there"], stream=stream,
                               extra_body={"ignore_eos": True})
    choices = [ch.choices[0] for ch in got] if stream else [got.choices[0]]  # type: ignore[union-attr]
    tokens = [t for ch in choices if ch.logprobs for t in ch.logprobs.tokens or []]
    assert len(tokens) == n
    assert "".join(tokens) == "".join(ch.text for ch in choices) == TEXT
    table = tok.token_bytes()
    assert table is not None
    split = [i for i, t in enumerate(ids) if table[t].decode(errors="replace") != tokens[i]]
    assert split and all(tokens[i] == "" or "\ufffd" not in tokens[i] for i in split)
    assert not any("\u0120" in t for t in tokens)  # (ByteLevel's stand-in for a space)
    chat = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                     max_tokens=n, temperature=0, logprobs=True, stream=stream,
                                     stop=["never there"], extra_body={"ignore_eos": True})
    parts = [ch.choices[0] for ch in chat] if stream else [chat.choices[0]]  # type: ignore[union-attr]
    entries = [e for p in parts if p.logprobs for e in p.logprobs.content or []]
    text = "".join((p.delta.content or "") if stream else (p.message.content or "")  # type: ignore[union-attr]
                   for p in parts)
    assert "".join(e.token for e in entries) == text == TEXT
    assert bytes(b for e in entries for b in e.bytes or ()).decode() == TEXT


def test_a_long_text_is_encoded_without_holding_the_gil(bpe: HFTokenizer) -> None:
    """The door encodes a long prompt on a thread so its event loop keeps serving; that
    holds only if the encode lets other threads run: here the main thread must get
    turns while another thread is inside one encode of a 0.27M-character text."""
    words = [f"w{i * 7919 % 1000003} café {i}" for i in range(15_000)]  # distinct: no word cache
    text = " ".join(words) + "<|im_end|> end"
    span: list[float] = []
    ids: list[int] = []

    def encode() -> None:
        span.append(time.monotonic())
        ids.extend(bpe.encode(text, add_special_tokens=False))
        span.append(time.monotonic())

    turns: list[float] = []
    worker = threading.Thread(target=encode, name="encode-long-text")
    worker.start()
    try:
        while worker.is_alive():
            turns.append(time.monotonic())
            time.sleep(0.001)  # sleep-ok: pacing the main thread's turns
    finally:
        worker.join()
    during = [t for t in turns if span[0] < t < span[1]]
    assert len(during) >= 20, (f"the main thread ran {len(during)} times in the "
                              f"{span[1] - span[0]:.2f} s the encode took: it held the GIL")
    assert ids == bpe._tok.encode(text, add_special_tokens=False).ids  # the same ids
    assert bpe.special_tokens["<|im_end|>"] in ids
