"""Structured output: llguidance against xgrammar, side by side, and what guiding costs a batch.

Run: ``python -m benchmarks.structured``. The last line is one JSON object from one run.

Part one (the library choice, :mod:`scheduler.models.guided`): each library
available here (``xgrammar`` is optional: it is measured when importable, its keys
are null otherwise; ``pip install --no-deps xgrammar apache-tvm-ffi`` is enough,
its triton is for GPUs) over
two vocabularies:

* ``tiny``: the byte-level BPE of the float64 tiny Llama the tests build
  (``scheduler.models.tiny_hf``, 384 tokens), read from its ``tokenizer.json``;
* ``32k``: a synthetic byte-level vocabulary of 32,000 tokens (the 256 bytes,
  then seeded random lowercase words of 2-9 letters, half with a leading
  space, and JSON punctuation runs), the width of a Llama 2 / Mistral one.

Figures, per library and vocabulary:

* ``<lib>_compile_ms_p50_<vocab>``: compiling a JSON schema of the kind OpenAI's
  strict mode sends (nested object, array with ``maxItems``, enum, string
  ``pattern``, ``anyOf``, ``$defs``/``$ref``, nullable type lists, every
  property required, ``additionalProperties: false``), a different schema each
  time (a property renamed), so no cache answers;
* ``<lib>_mask_us_p50_<vocab>``: one token mask (the step's cost per guided
  request): a seeded random walk through the grammar, each step computing the
  mask, picking an allowed token at random and advancing the matcher;
* ``<lib>_strict_features_ok``: how many of the strict-mode feature schemas
  (``FEATURES``) the library compiles, out of ``strict_features_total``.

Part two (what the scheduler pays, the issue's figures): ``Engine("ring")`` on
the float64 tiny Llama (one torch thread), a batch of 16 prompts at temperature 1
under a JSON schema (``E2E_SCHEMA``: bounded, its largest answer fits the 48-token
budget), then free (``ignore_eos``) with each prompt's answer as long as its guided
one was: the same prompts and lengths, five rounds interleaved, medians.
``tokens_per_s_ratio_json_schema_vs_free``; ``valid_json_ratio`` (answers that end
``stop`` and parse and validate against the schema, over 16);
``grammar_compile_ms_p50`` (the scheduler's :class:`~scheduler.models.guided.Guides`
compiling a schema it has not seen, the vocabulary already read) and
``grammar_compile_ms_p50_cached`` (the same schema again: a cache hit and a copy).
"""

from __future__ import annotations

import json
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks._timing import print_checked

LIBS = ("llguidance", "xgrammar")
VOCABS = ("tiny", "32k")

KEYS = frozenset(
    {f"{lib}_{what}_{v}" for lib in LIBS for v in VOCABS
     for what in ("compile_ms_p50", "mask_us_p50")}
    | {f"{lib}_strict_features_ok" for lib in LIBS}
    | {"strict_features_total", "tokens_per_s_ratio_json_schema_vs_free",
       "tokens_per_s_free", "tokens_per_s_json_schema", "valid_json_ratio",
       "grammar_compile_ms_p50", "grammar_compile_ms_p50_cached", "batch"})

#: The schema compiled and walked (strict mode's shape: all required, closed objects).
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "kind": {"enum": ["cat", "dog", "fox"]},
        "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"},
        "address": {"$ref": "#/$defs/address"},
        "note": {"type": ["string", "null"], "maxLength": 8},
        "score": {"anyOf": [{"type": "number"}, {"type": "boolean"}]},
    },
    "required": ["name", "age", "tags", "kind", "code", "address", "note", "score"],
    "additionalProperties": False,
    "$defs": {"address": {"type": "object",
                          "properties": {"city": {"type": "string", "maxLength": 10},
                                         "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                          "required": ["city", "zip"], "additionalProperties": False}},
}

#: One schema per JSON-schema feature OpenAI's strict mode accepts.
FEATURES: dict[str, dict[str, Any]] = {
    "nested_object": {"type": "object", "properties": {"a": {
        "type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"],
        "additionalProperties": False}}, "required": ["a"], "additionalProperties": False},
    "array_items": {"type": "array", "items": {"type": "number"}, "minItems": 1,
                    "maxItems": 4},
    "enum": {"enum": ["a", "b", 3, None]},
    "const": {"const": "fixed"},
    "anyOf": {"anyOf": [{"type": "string"}, {"type": "integer"}]},
    "nullable_type_list": {"type": ["string", "null"]},
    "defs_ref": {"$defs": {"n": {"type": "integer"}}, "type": "object",
                 "properties": {"x": {"$ref": "#/$defs/n"}}, "required": ["x"],
                 "additionalProperties": False},
    "recursive_ref": {"$defs": {"node": {"type": "object", "properties": {
        "v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
        "required": ["v", "kids"], "additionalProperties": False}}, "$ref": "#/$defs/node"},
    "pattern": {"type": "string", "pattern": "^[a-z]+-[0-9]{3}$"},
    "format_date_time": {"type": "string", "format": "date-time"},
    "format_email": {"type": "string", "format": "email"},
    "format_uuid": {"type": "string", "format": "uuid"},
    "string_lengths": {"type": "string", "minLength": 2, "maxLength": 5},
    "number_bounds": {"type": "number", "minimum": 0, "maximum": 10,
                      "exclusiveMaximum": 11, "multipleOf": 0.5},
    "integer_bounds": {"type": "integer", "minimum": -5, "maximum": 5},
    "description_title": {"type": "object", "title": "T", "description": "d",
                          "properties": {"a": {"type": "string", "description": "x"}},
                          "required": ["a"], "additionalProperties": False},
}


def synthetic_vocab(n: int = 32000, seed: int = 0) -> list[bytes]:
    """A byte-level vocabulary of ``n`` distinct tokens (see the module docstring)."""
    rng = random.Random(seed)
    vocab = [bytes([b]) for b in range(256)]
    seen = set(vocab)
    punct = [b'{"', b'":', b'",', b'"}', b'["', b'"]', b", ", b": ", b"\n", b"  ", b"null",
             b"true", b"false", b"},", b"],"]
    for p in punct:
        if p not in seen:
            seen.add(p)
            vocab.append(p)
    letters = "abcdefghijklmnopqrstuvwxyz"
    while len(vocab) < n - 1:
        w = "".join(rng.choice(letters) for _ in range(rng.randint(2, 9)))
        tok = ((" " if rng.random() < 0.5 else "") + w).encode()
        if tok not in seen:
            seen.add(tok)
            vocab.append(tok)
    vocab.append(b"</s>")  # the end-of-sequence token, last
    return vocab


def _renamed(i: int) -> dict[str, Any]:
    s: dict[str, Any] = json.loads(json.dumps(SCHEMA))
    s["properties"][f"field{i}"] = s["properties"].pop("name")
    s["required"] = [f"field{i}" if r == "name" else r for r in s["required"]]
    return s


def _walk(mask_of: Callable[[], list[int]], advance: Callable[[int], bool],
          done: Callable[[], bool], seed: int, steps: int = 64) -> list[float]:
    """Time ``mask_of`` along a seeded random walk; returns each mask's seconds."""
    rng = random.Random(seed)
    times: list[float] = []
    for _ in range(steps):
        if done():
            break
        t0 = time.perf_counter()
        allowed = mask_of()
        times.append(time.perf_counter() - t0)
        if not allowed or not advance(rng.choice(allowed)):
            break
    return times


def _allowed(bits: Any, n: int) -> list[int]:
    import numpy as np
    flags = np.unpackbits(np.frombuffer(bits, np.uint8), bitorder="little")[:n]
    allowed: list[int] = np.flatnonzero(flags).tolist()
    return allowed


def bench_llguidance(vocab_name: str, tokenizer_json: str | None, raw: list[bytes] | None
                     ) -> dict[str, float]:
    import llguidance

    if tokenizer_json is not None:
        tok = llguidance.LLTokenizer(tokenizer_json)
    else:
        assert raw is not None
        tok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_RawTok(raw)))
    n = tok.vocab_size
    compile_ms = []
    for i in range(7):
        t0 = time.perf_counter()
        m = llguidance.LLMatcher(tok, llguidance.LLMatcher.grammar_from_json_schema(_renamed(i)))
        m.compute_bitmask()  # the first mask finishes what construction left lazy
        compile_ms.append((time.perf_counter() - t0) * 1e3)
        assert not m.is_error(), m.get_error()
    masks: list[float] = []
    for seed in range(4):
        m = llguidance.LLMatcher(tok, llguidance.LLMatcher.grammar_from_json_schema(SCHEMA))
        masks += _walk(lambda m=m: _allowed(m.compute_bitmask(), n),  # type: ignore[misc]
                       lambda t, m=m: bool(m.consume_token(t)),  # type: ignore[misc]
                       lambda m=m: bool(m.is_stopped() or m.is_error()), seed)  # type: ignore[misc]
    return {f"llguidance_compile_ms_p50_{vocab_name}": round(statistics.median(compile_ms), 3),
            f"llguidance_mask_us_p50_{vocab_name}": round(statistics.median(masks) * 1e6, 1)}


class _RawTok:
    """A tokenizer over a raw byte vocabulary (llguidance asks one to encode text)."""

    def __init__(self, vocab: list[bytes]) -> None:
        self.tokens = vocab
        self.eos_token_id = len(vocab) - 1
        self.bos_token_id = None
        self.special_token_ids = [len(vocab) - 1]

    def __call__(self, text: bytes) -> list[int]:
        return list(text)  # byte tokens are ids 0..255


def bench_xgrammar(vocab_name: str, model_dir: Path | None, raw: list[bytes] | None
                   ) -> dict[str, float]:
    import torch
    import xgrammar as xgr

    if model_dir is not None:
        from transformers import AutoTokenizer
        info = xgr.TokenizerInfo.from_huggingface(
            AutoTokenizer.from_pretrained(model_dir, local_files_only=True))
    else:
        assert raw is not None
        info = xgr.TokenizerInfo(raw, xgr.VocabType.RAW, stop_token_ids=[len(raw) - 1])
    n = info.vocab_size
    compile_ms = []
    for i in range(7):
        compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        t0 = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(_renamed(i)), strict_mode=True)
        compile_ms.append((time.perf_counter() - t0) * 1e3)
    masks: list[float] = []
    compiled = xgr.GrammarCompiler(info, max_threads=1).compile_json_schema(
        json.dumps(SCHEMA), strict_mode=True)
    bitmask = xgr.allocate_token_bitmask(1, n)
    for seed in range(4):
        m = xgr.GrammarMatcher(compiled)

        def mask_of(m: Any = m) -> list[int]:
            m.fill_next_token_bitmask(bitmask, 0)
            return _allowed(bitmask[0].numpy().tobytes(), n)

        masks += _walk(mask_of, lambda t, m=m: bool(m.accept_token(t)),  # type: ignore[misc]
                       lambda m=m: bool(m.is_terminated()), seed)  # type: ignore[misc]
    del torch
    return {f"xgrammar_compile_ms_p50_{vocab_name}": round(statistics.median(compile_ms), 3),
            f"xgrammar_mask_us_p50_{vocab_name}": round(statistics.median(masks) * 1e6, 1)}


def features_llguidance() -> int:
    import llguidance
    ok = 0
    for schema in FEATURES.values():
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
        ok += llguidance.LLMatcher.validate_grammar(grammar) == ""
    return ok


def features_xgrammar(raw: list[bytes]) -> int:
    import xgrammar as xgr
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo(raw[:300], xgr.VocabType.RAW))
    ok = 0
    for schema in FEATURES.values():
        try:
            compiler.compile_json_schema(json.dumps(schema), strict_mode=True)
            ok += 1
        except Exception:  # an unsupported keyword: counted as refused
            pass
    return ok


def libraries(model_dir: Path) -> dict[str, float | None]:
    """Part one: every available library, both vocabularies."""
    raw = synthetic_vocab()
    out: dict[str, float | None] = {"strict_features_total": len(FEATURES)}
    tok_json = (model_dir / "tokenizer.json").read_text()
    out |= bench_llguidance("tiny", tok_json, None)
    out |= bench_llguidance("32k", None, raw)
    out["llguidance_strict_features_ok"] = features_llguidance()
    try:
        import xgrammar  # noqa: F401
    except ImportError:  # its figures are null: not measured here
        print("xgrammar is not installed: only llguidance is measured")
        out |= dict.fromkeys((k for k in KEYS if k.startswith("xgrammar_")), None)
    else:
        out |= bench_xgrammar("tiny", model_dir, None)
        out |= bench_xgrammar("32k", None, raw)
        out["xgrammar_strict_features_ok"] = features_xgrammar(raw)
    return out


#: Part two's batch and answer length.
BATCH = 16
TOKENS = 48
#: Part two's schema: its largest answer is under TOKENS tokens of the tiny Llama's.
E2E_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99},
                   "tag": {"type": "string", "maxLength": 6},
                   "ok": {"type": "boolean"}},
    "required": ["id", "tag", "ok"], "additionalProperties": False,
}


def scheduler_cost(model_dir: Path) -> dict[str, float]:
    """Part two: a batch of 16, free then under a JSON schema, on one engine."""
    import jsonschema
    import torch
    from transformers import AutoTokenizer

    from messages import Guide, SamplingParams
    from scheduler import Engine
    from scheduler.models.guided import Guides

    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 384) for _ in range(rng.randint(8, 32))] for _ in range(BATCH)]
    spec = json.dumps(E2E_SCHEMA)
    guided = SamplingParams(max_new_tokens=TOKENS, temperature=1.0, seed=1,
                            guide=Guide(kind="json_schema", spec=spec))
    out: dict[str, float] = {"batch": BATCH}
    with Engine("ring", model_dir, max_batch=BATCH) as engine:
        for h in engine.submit_many(prompts, guided):  # warm (the first compile included)
            h.result(300)
        results = [h.result(300) for h in engine.submit_many(prompts, guided)]
        valid = 0
        for r in results:
            try:
                text = tok.decode(r.token_ids, skip_special_tokens=True)
                jsonschema.validate(json.loads(str(text)), E2E_SCHEMA)
                valid += r.finish_reason == "stop"
            except (ValueError, jsonschema.ValidationError):
                pass
        out["valid_json_ratio"] = valid / len(results)
        # Free answers of the guided ones' lengths (each prompt its own), so both runs
        # read the same prompts and write as many tokens.
        lengths = [len(r.token_ids) for r in results]
        free = [SamplingParams(max_new_tokens=n, temperature=1.0, seed=1, ignore_eos=True)
                for n in lengths]
        runs: dict[str, list[float]] = {"free": [], "json_schema": []}
        for _ in range(5):  # interleaved: a neighbour's load hurts both alike
            for name in runs:
                t0 = time.perf_counter()
                handles = engine.submit_many(prompts, guided) if name == "json_schema" else \
                    [engine.submit(p, sp) for p, sp in zip(prompts, free, strict=True)]
                n = sum(len(h.result(300).token_ids) for h in handles)
                runs[name].append(n / (time.perf_counter() - t0))
        rates = {k: statistics.median(v) for k, v in runs.items()}
    out["tokens_per_s_free"] = round(rates["free"], 1)
    out["tokens_per_s_json_schema"] = round(rates["json_schema"], 1)
    out["tokens_per_s_ratio_json_schema_vs_free"] = round(
        rates["json_schema"] / rates["free"], 3)

    class Dir:
        tokenizer_dir = model_dir
        name = "tiny"

    first, cached = [], []
    guides = Guides(Dir(), 384, [2])
    guides.start("warm", Guide(kind="json_object"))  # the vocabulary read once
    for i in range(9):
        g = Guide(kind="json_schema", spec=json.dumps(_renamed(i)))
        t0 = time.perf_counter()
        guides.start("r", g)
        first.append((time.perf_counter() - t0) * 1e3)
        t0 = time.perf_counter()
        guides.start("r", g)
        cached.append((time.perf_counter() - t0) * 1e3)
    out["grammar_compile_ms_p50"] = round(statistics.median(first), 3)
    out["grammar_compile_ms_p50_cached"] = round(statistics.median(cached), 4)
    return out


def main() -> None:
    from scheduler.models.tiny_hf import build_tiny_hf

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_hf(Path(tmp) / "tiny")
        results = libraries(model_dir)
        results |= scheduler_cost(model_dir)
    print_checked(results, KEYS, "benchmarks.structured")


if __name__ == "__main__":
    main()
