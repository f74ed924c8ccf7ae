"""Structured output in the scheduler: a request's :class:`~messages.Guide`, compiled
once, masks its logits every step.

The library is llguidance (``benchmarks/structured.py`` measured it against
xgrammar: the same mask time, a faster compile, no dependencies). What a
request carries is a spec (:class:`~messages.Guide`: a JSON schema, a regex,
choices, a grammar); here it becomes a grammar (:func:`grammar_of`, shared
with the front door, which validates it before sending), then a matcher
bound to the model's vocabulary:

* :class:`Guides` compiles each distinct ``(kind, spec)`` once against the
  model's tokenizer (its ``tokenizer.json``; read on the first guided request)
  and keeps the compiled matcher in a bounded least-recently-used cache; each
  request gets a copy (:meth:`Guides.start`), its own parser state.
* :func:`mask_logits`, called by the batch just before sampling, sets to
  ``-inf`` the logits of every token a guided row's matcher does not allow.
  A step with no guided request costs one pass over the batch's rows, nothing
  more.
* :func:`advance`, just after sampling, feeds each guided request its token;
  a matcher that can take no more tokens (the answer is complete) ends its
  request ``stop``; one in error (its guide failed while decoding: a limit of
  llguidance's, an empty language) ends its request with an error answer that
  names the request and the guide's error, never ``stop``.

A model with no tokenizer (the built-in ones: their vocabulary is synthetic)
cannot be guided: its requests are refused by name (:class:`GuideError`).
"""

from __future__ import annotations

import json
import logging
import re
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import llguidance
import numpy as np
import torch
from llguidance._tokenizer import TokenizerWrapper
from llguidance.gbnf_to_lark import gbnf_to_lark

from messages import FinishReason, Guide

__all__ = ["LIMITS", "MAX_REFS", "MAX_RULES", "GuideError", "Guides", "Matcher", "advance",
           "check_guide", "grammar_of", "mask_logits"]

log = logging.getLogger(__name__)

#: One request's parser state.
Matcher = llguidance.LLMatcher

#: JSON is written without optional whitespace: OpenAI's strict answers are, and a
#: model free to write spaces may write nothing else until its token budget runs out.
_JSON_OPTIONS: llguidance._lib.JsonCompileOptions = {"whitespace_flexible": False}

#: Distinct specs a scheduler keeps compiled (each a few KB to a few MB).
CACHE_SIZE = 256

#: Most ``$ref`` a guide may hold (a JSON schema's, or one embedded in a grammar).
#: llguidance follows a chain of references by native recursion, and overflows its
#: thread's stack (SIGSEGV: the whole process dies) past about 950 links on an 8 MiB
#: stack (the default main and worker thread here); a quarter of that, any thread.
MAX_REFS = 256
#: Most rules (and terminals) a Lark or GBNF grammar may define: a chain of rules
#: overflows the same way past about 2,500-3,000 on an 8 MiB stack; a sixth of that.
MAX_RULES = 512

#: llguidance's own bounds on a grammar's compile and on each mask step; it fails
#: (``is_error``) a matcher that exceeds one, and the request ends with that error.
#: ``initial_lexer_fuel`` is cut from 1,000,000 to 300,000: ``a{1000000}`` (ten
#: bytes) cost 4-5 s of the scheduler's first mask step for the whole batch at the
#: default, 0.2-0.5 s here before it fails; a 10,000-property schema or a
#: 10,000-value enum still compiles (100,000 refused them). The rest are
#: llguidance's defaults (step_lexer_fuel 200,000, step_max_items 50,000, 2,000
#: alternatives a row). Its error messages leave out the grammar
#: (``verbose_errors``): they go to logs and to clients.
LIMITS = llguidance.LLParserLimits(initial_lexer_fuel=300_000, verbose_errors=False)

#: Steps :func:`check_guide` takes past the first, each on the smallest byte allowed.
CHECK_STEPS = 8

#: Most characters of llguidance's error kept in a log line or an answer.
ERROR_CHARS = 500

#: A JSON schema's numeric bounds past this magnitude are refused. llguidance holds
#: each bound as a 64-bit float (an integer one then as a saturated 64-bit int):
#: past 2^53 it is rounded, and the answers it allows leave the schema's range
#: (``maximum: 2^62 + 1000`` let ``2^62 + 1024`` through; ``minimum: 10^30`` with a
#: ``maximum`` allowed only ``2^63 - 1``).
MAX_EXACT_BOUND = 2**53
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")

_REF = re.compile(r"\$ref")
#: A JSON string's \uXXXX escape (any case), read back to its character before counting.
_UNESCAPE = re.compile(r"\\u([0-9a-fA-F]{4})")
_RULE = re.compile(r"^[ \t]*[?!]?[A-Za-z_][A-Za-z_0-9]*(?:\.-?[0-9]+)?[ \t]*(?::|::=)", re.M)


def _char(m: re.Match[str]) -> str:
    return chr(int(m.group(1), 16))


class GuideError(Exception):
    """A request's guide cannot be served: the model has no tokenizer, or the spec
    does not compile. ``rid`` is the request; the message names it."""

    def __init__(self, rid: str, reason: str) -> None:
        self.rid = rid
        self.reason = reason
        super().__init__(f"request {rid!r}: {reason}")


def grammar_of(guide: Guide) -> str:
    """The llguidance grammar of ``guide`` (not yet checked: :func:`check_guide`),
    bounded: at most :data:`MAX_REFS` references and :data:`MAX_RULES` rules, what
    llguidance's native code can follow without overflowing its stack. The front
    door's check and the scheduler's compile both build it here, so no spec reaches
    llguidance unbounded.

    Raises:
        ValueError: ``spec`` is not what its ``kind`` needs (a schema that is not
            JSON, choices that are not a non-empty JSON array of strings), it is
            over a bound, or it could not be translated at all (any failure: a
            client's spec is never an internal error).
    """
    try:
        grammar = _grammar_of(guide)
    except ValueError:
        raise
    except RecursionError:
        raise ValueError(f"the {guide.kind} is nested too deeply") from None
    except Exception as exc:  # gbnf_to_lark's own parse errors, and any other
        raise ValueError(f"{type(exc).__name__}: {str(exc)[:ERROR_CHARS]}") from None
    # Counted in the text with JSON's \uXXXX escapes read: a key of a Lark %json block
    # reaches llguidance as the client spelled it, and "$r\u0065f" is a $ref there.
    refs = len(_REF.findall(_UNESCAPE.sub(_char, grammar)))
    if refs > MAX_REFS:
        raise ValueError(f"it holds {refs} $ref; at most {MAX_REFS} are served")
    lark = grammar
    if grammar.startswith("{"):  # a JSON grammar (llguidance's): its Lark parts
        parts = json.loads(grammar).get("grammars", [])
        lark = "\n".join(str(g.get("lark_grammar") or "") for g in parts)
    rules = len(_RULE.findall(lark))
    if rules > MAX_RULES:
        raise ValueError(f"it defines {rules} rules; at most {MAX_RULES} are served")
    return grammar


def _grammar_of(guide: Guide) -> str:
    kind, spec = guide.kind, guide.spec
    make = llguidance.LLMatcher
    if kind == "json_schema":
        try:
            schema = json.loads(spec)
        except ValueError as exc:
            raise ValueError(f"the JSON schema is not JSON: {exc}") from None
        if not isinstance(schema, dict | bool):
            raise ValueError("the JSON schema must be an object")
        _check_bounds(schema)
        return make.grammar_from_json_schema(spec, overrides=_JSON_OPTIONS)
    if kind == "json_object":
        return make.grammar_from_json_schema({"type": "object"}, overrides=_JSON_OPTIONS)
    if kind == "regex":
        return make.grammar_from_regex(spec)
    if kind == "choice":
        try:
            choices = json.loads(spec)
        except ValueError as exc:
            raise ValueError(f"the choices are not JSON: {exc}") from None
        if not (isinstance(choices, list) and choices
                and all(isinstance(c, str) and c for c in choices)):
            raise ValueError("the choices must be a non-empty list of non-empty strings")
        # One terminal whose alternatives are the choices: the lexer matches them, so
        # the parser holds one item whatever their number. As alternatives of the
        # rule itself, each was a parser item, and past llguidance's 2,000 items a
        # row every answer failed after its first token.
        return make.grammar_from_lark(
            "start: CHOICE\nCHOICE: " + " | ".join(json.dumps(c) for c in choices))
    return make.grammar_from_lark(gbnf_to_lark(spec) if "::=" in spec else spec)


def _check_bounds(schema: object) -> None:
    """Raises ValueError at a numeric bound in ``schema`` that llguidance cannot keep
    exactly (:data:`MAX_EXACT_BOUND`): every node is looked at, once, without recursion
    (a schema may nest as deep as its JSON)."""
    todo = [schema]
    while todo:
        node = todo.pop()
        if isinstance(node, dict):
            for key in _BOUNDS:
                bound = node.get(key)
                if (isinstance(bound, int | float) and not isinstance(bound, bool) and
                        abs(bound) > MAX_EXACT_BOUND):
                    raise ValueError(f"{key} {bound}: a bound past 2^53 ({MAX_EXACT_BOUND}) "
                                     "in magnitude cannot be kept exactly")
            todo.extend(node.values())
        elif isinstance(node, list):
            todo.extend(node)


class _Bytes:
    """A vocabulary of the 256 bytes and an end token: what :func:`check_guide`
    compiles against (a matcher needs one; any vocabulary spells every answer)."""

    def __init__(self) -> None:
        self.eos_token_id = 256
        self.bos_token_id = None
        self.tokens = [bytes([i]) for i in range(256)] + [b"</s>"]
        self.special_token_ids = [256]

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


_byte_vocab: llguidance.LLTokenizer | None = None


def check_guide(guide: Guide) -> str:
    """Why ``guide`` cannot be served (``""``: it can), without the model's vocabulary:
    what the front door asks before sending a request. The grammar is compiled
    against a byte vocabulary and its first step taken, so a guide that fails
    there (a language with no answer at all, a reference to itself) is refused
    here, not midway through decoding.

    Runs llguidance's native code: call it on a thread with a large stack (the
    door's checker threads), never on an event loop.
    """
    global _byte_vocab
    try:
        grammar = grammar_of(guide)
    except ValueError as exc:
        return str(exc)
    if _byte_vocab is None:
        _byte_vocab = llguidance.LLTokenizer(TokenizerWrapper(_Bytes()))
    matcher = llguidance.LLMatcher(_byte_vocab, grammar, log_level=0, limits=LIMITS)
    if matcher.is_error():
        return matcher.get_error()[:ERROR_CHARS]
    mask = np.zeros((257 + 31) // 32, np.int32)  # (the byte vocabulary's 257 tokens)
    matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
    if matcher.is_error():
        return (f"no answer can begin: the grammar matches no text "
                f"({matcher.get_error()[:ERROR_CHARS]})")
    # A few more steps along the smallest byte allowed each time: a grammar whose
    # rows outgrow llguidance's bounds once its first lexeme begins (thousands of
    # alternatives in one rule, of an object's optional properties) passes the first
    # step and then fails every answer; refused here, it costs no prefill.
    for _ in range(CHECK_STEPS):
        allowed = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")[:256])
        if not len(allowed):
            break
        matcher.consume_token(int(allowed[0]))
        if not matcher.is_error():
            matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
        if matcher.is_error():
            return (f"an answer fails after its first bytes: "
                    f"{matcher.get_error()[:ERROR_CHARS]}")
    return ""


class Guides:
    """Compiled guides of one model, and the matchers of its requests.

    Args:
        model: the scheduler's model; guided requests need its ``tokenizer_dir``
            (a Hugging Face model's directory holding ``tokenizer.json``).
        vocab_size: the width of its logits (a mask covers every column).
        stop_token_ids: the model's end-of-sequence ids, allowed where the grammar
            is complete.
        cache_size: distinct specs kept compiled.
    """

    def __init__(self, model: object, vocab_size: int, stop_token_ids: Sequence[int],
                 cache_size: int = CACHE_SIZE) -> None:
        where = getattr(model, "tokenizer_dir", None)
        self.tokenizer_dir = where if isinstance(where, Path) else None
        self.model_name = str(getattr(model, "name", type(model).__name__))
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.cache_size = cache_size
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._compiled: OrderedDict[tuple[str, str], Matcher] = OrderedDict()
        self.compiles = 0  # cache misses (a spec compiled)

    def start(self, rid: str, guide: Guide) -> Matcher:
        """A fresh matcher for request ``rid`` (its spec compiled once, then cached).

        Raises:
            GuideError: the model has no tokenizer, or the spec does not compile.
        """
        key = (guide.kind, guide.spec)
        compiled = self._compiled.get(key)
        if compiled is None:
            compiled = self._compile(rid, guide)
            self._compiled[key] = compiled
            if len(self._compiled) > self.cache_size:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(key)
        return compiled.deep_copy()

    def _compile(self, rid: str, guide: Guide) -> Matcher:
        tokenizer = self._tokenizer or self._load_tokenizer(rid)
        try:
            grammar = grammar_of(guide)
        except ValueError as exc:
            raise GuideError(rid, f"its {guide.kind} guide does not compile: {exc}") from None
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=LIMITS)
        if matcher.is_error():
            raise GuideError(rid, f"its {guide.kind} guide does not compile: "
                                  f"{matcher.get_error()[:ERROR_CHARS]}")
        self.compiles += 1
        return matcher

    def _load_tokenizer(self, rid: str) -> llguidance.LLTokenizer:
        root = self.tokenizer_dir
        path = None if root is None else root / "tokenizer.json"
        if path is None or not path.is_file():
            raise GuideError(rid, f"structured output needs the model's tokenizer, and model "
                                  f"{self.model_name!r} has none (no tokenizer.json): send "
                                  f"it without a guide")
        try:
            self._tokenizer = llguidance.LLTokenizer(
                path.read_text(), n_vocab=self.vocab_size, eos_token=self.stop_token_ids or None)
        except Exception as exc:  # llguidance's own, as one clear error
            raise GuideError(rid, f"structured output could not read {path}: {exc}") from exc
        return self._tokenizer


class _Guided(Protocol):
    """What the hooks read of a request in the batch (``scheduler.core.batch.Seq``)."""

    matcher: Matcher | None
    finished: FinishReason | None
    stop: frozenset[int]
    guide_error: str | None


def _failed(s: _Guided, matcher: Matcher) -> bool:
    """Whether ``s``'s matcher is in error; if so the request ends (``abort``) with
    :attr:`guide_error` set, which the scheduler answers as an error naming it."""
    if not matcher.is_error():
        return False
    if s.guide_error is None:
        s.guide_error = (f"its structured output (response_format or guided_*) failed while "
                         f"decoding: {matcher.get_error()[:ERROR_CHARS]}")
        s.finished = "abort"
    return True


def mask_logits(seqs: Sequence[_Guided], logits: torch.Tensor) -> None:
    """Set to ``-inf``, in place, the logits (row ``i`` for ``seqs[i]``) of the tokens
    each guided request's matcher does not allow; rows without a guide are untouched.
    A matcher that fails computing its mask ends its request (:func:`_failed`)."""
    rows = [i for i, s in enumerate(seqs) if s.matcher is not None]
    if not rows:
        return
    vocab = logits.shape[1]
    words = (vocab + 31) // 32
    bits = np.zeros((len(rows), words), np.int32)
    for j, i in enumerate(rows):
        matcher = seqs[i].matcher
        assert matcher is not None
        row = bits[j]
        matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        if _failed(seqs[i], matcher):
            row[:] = -1  # ending: nothing masked (a row all -inf is no distribution)
    refused = torch.from_numpy(
        np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")[:, :vocab] == 0)
    # Row by row, each a view: indexing the rows with a tensor (a gather, then a
    # scatter) took 40 ms for 16 rows on a busy 2-core box, the row views 0.1 ms.
    for j, i in enumerate(rows):
        logits[i].masked_fill_(refused[j], float("-inf"))


def advance(seqs: Sequence[_Guided], tokens: torch.Tensor) -> None:
    """Feed each guided request the token it sampled (``tokens[i]`` for ``seqs[i]``);
    one whose answer is complete is marked ``stop``; one whose matcher failed (an
    error of its guide, or a token it refuses) ends with :attr:`guide_error` set,
    never ``stop``: its output does not obey the guide."""
    picked: list[int] | None = None
    for i, s in enumerate(seqs):
        matcher = s.matcher
        if matcher is None or _failed(s, matcher):
            continue
        if picked is None:
            picked = tokens.tolist()
        t = picked[i]
        if t in s.stop:
            continue  # the batch ends it at its stop token
        if not matcher.consume_token(t):
            if not _failed(s, matcher):
                s.guide_error = (f"its structured output (response_format or guided_*) "
                                 f"refused the sampled token id {t}")
                s.finished = "abort"
            log.warning("a guided request ends on a failed guide: %s", s.guide_error)
        elif matcher.is_stopped():
            s.finished = "stop"
