"""``HFCausalLM``: a Hugging Face causal LM from a local directory, behind the ``Model`` protocol.

Loaded with ``transformers`` (``AutoModelForCausalLM``, local files only,
safetensors only: a ``.bin`` checkpoint is unpickled by torch, and nothing
here unpickles). Each request's KV cache lives here, under the key the
scheduler's batch gives it, and is dropped by :meth:`HFCausalLM.free`.

How a step runs (measured on CPU, ``benchmarks/hf.py``):

* **decode**: the running requests form one *resident* batch: their KV
  caches left-padded to a common length in one ``DynamicCache``, with a 2D
  attention mask and per-row positions (what ``generate`` does with a padded
  batch). While the batch keeps its members the cache is reused step after
  step and grows by ``transformers``' own append; a request that leaves is
  dropped by selecting rows, and one that joins rebuilds the batch once.
  16 prompts, 32 tokens each, the tiny test model on 2 busy cores: 0.75 s
  resident; 1.18 s rebuilding the padded cache every step; 7.3 s decoding
  one request at a time. Passing sdpa a ready boolean mask (not the 2D one
  ``transformers`` expands every step) saves about 1.5 ms a step.
* **prefill**: new prompts read whole in the step are one left-padded batch;
  chunks that continue a prompt (after a cached prefix, or chunked prefill)
  are another, per group of similar length (none padded past twice its
  size), each row its own cache left-padded then its chunk: 8 hits of 32
  tokens after a 1,024-token prefix, 18.8 ms instead of 26.7 one by one. A
  first chunk of a long prompt and embedding prompts run one at a time.
* **embedding**: the mean of the last hidden states (after the final norm)
  over the whole prompt, unit-normed.
* **prefix cache** (:meth:`HFCausalLM.set_prefix_cache`): a generate
  prompt read whole leaves its per-layer keys and values in a
  :class:`~scheduler.models.radix.RadixTree` (each node a copy of its span's
  slice, bounded in bytes, least recently used evicted first); a new prompt
  starts from a copy of its longest cached prefix and reads only the rest.
  When a request is freed, its prompt and the tokens it decoded since (all
  but the last sampled, which no step read) join the tree too, so a
  conversation's next turn starts from the previous answer; a decode step
  that raised leaves its requests out (a layer may hold the step's token).
  Embedding prompts neither read nor fill it: their answer is a mean over
  every position's hidden state, which keys and values do not give back.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    DynamicCache,
    PretrainedConfig,
    PreTrainedModel,
)
from transformers.cache_utils import DynamicLayer
from transformers.utils import logging as hf_logging

from scheduler.models.files import ModelLoadError, check_model_dir
from scheduler.models.protocol import Empty, PromptChunk, RequestState, check_state
from scheduler.models.radix import Hit, RadixTree, TreeStats

__all__ = ["HFCausalLM", "held_log", "load_config"]

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values (1, heads, n, dim)

_DTYPES = {"float32": torch.float32, "float16": torch.float16,
           "bfloat16": torch.bfloat16, "float64": torch.float64}


def _left_padded(rows: Sequence[torch.Tensor], width: int) -> torch.Tensor:
    """Rows ``(1, heads, n, dim)`` as one batch ``(len(rows), heads, width, dim)``, each
    row at the right end of its zeroed line (left padding, as the mask has it).

    One zeroed tensor, each row copied in once: padding each row and concatenating
    wrote every byte twice (16 rows of 300 tokens joined by one of 4,000, the float64
    tiny Llama's two layers: 67-73 ms a rebuild, 40 ms so)."""
    first = rows[0]
    out = first.new_zeros((len(rows), first.shape[1], width, first.shape[3]))
    for r, row in enumerate(rows):
        n = row.shape[2]
        if n:
            out[r, :, width - n:] = row[0]
    return out


@dataclass(slots=True)
class _Resident:
    """The decoding batch: one padded cache, its mask, each row's real length."""

    keys: list[int]
    cache: DynamicCache
    buf: torch.Tensor  # (B, capacity) bool: True where a real token is; ``width`` used
    lens: torch.Tensor  # (B,) real tokens per row: the next position
    width: int = 0
    rows: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.rows = {k: i for i, k in enumerate(self.keys)}
        self.width = self.buf.shape[1]
        self.buf = torch.cat([self.buf, torch.zeros_like(self.buf[:, :64])], dim=1)

    @property
    def mask(self) -> torch.Tensor:
        """``(B, width)``: the columns in use."""
        return self.buf[:, :self.width]

    def append_column(self) -> None:
        """One more real token in every row (in place; the buffer doubles when full)."""
        if self.width == self.buf.shape[1]:
            self.buf = torch.cat([self.buf, torch.zeros_like(self.buf)], dim=1)
        self.buf[:, self.width] = True
        self.width += 1


@contextmanager
def held_log() -> Iterator[list[logging.LogRecord]]:
    """``transformers``' log records while the block runs, held back; passed on to its
    handlers when the block ends well, dropped (the caller has them) when it raises.

    A load that fails logs its report (a size mismatch: a table of a dozen lines)
    before it raises "look at the above report": held, a failure is one line made
    of the error and the report's first row. Progress bars are off meanwhile
    when stderr is no terminal (each bar is a line of a log).
    """
    lib = logging.getLogger("transformers")
    held: list[logging.LogRecord] = []
    hold = _Hold(held)
    handlers, propagate = lib.handlers[:], lib.propagate
    bars = hf_logging.is_progress_bar_enabled()
    if bars and not sys.stderr.isatty():
        hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    for handler in handlers:
        lib.removeHandler(handler)
    lib.addHandler(hold)
    lib.propagate = False
    ok = False
    try:
        yield held
        ok = True
    finally:
        lib.removeHandler(hold)
        for handler in handlers:
            lib.addHandler(handler)
        lib.propagate = propagate
        if bars:
            hf_logging.enable_progress_bar()  # type: ignore[no-untyped-call]
        if ok:
            for record in held:
                lib.handle(record)


class _Hold(logging.Handler):
    """Keeps every record it is given."""

    def __init__(self, held: list[logging.LogRecord]) -> None:
        super().__init__()
        self.held = held

    def emit(self, record: logging.LogRecord) -> None:
        self.held.append(record)


def load_config(root: str | os.PathLike[str]) -> PretrainedConfig:
    """A model directory's ``config.json``, as ``transformers`` reads it (local only).

    Raises:
        ValueError, OSError: ``transformers``' own (an unknown ``model_type``, ...).
    """
    config: PretrainedConfig = AutoConfig.from_pretrained(root, local_files_only=True)
    return config


class _KVSpan:
    """Per-layer keys and values of a run of positions: a prefix-cache node's state."""

    __slots__ = ("layers", "size")

    def __init__(self, layers: KV) -> None:
        self.layers = layers
        self.size = sum(k.numel() * k.element_size() + v.numel() * v.element_size()
                        for k, v in layers)

    def split(self, at: int) -> tuple[_KVSpan, _KVSpan]:
        """Copies, so each part owns only its positions' bytes."""
        return (_KVSpan([(k[:, :, :at].clone(), v[:, :, :at].clone()) for k, v in self.layers]),
                _KVSpan([(k[:, :, at:].clone(), v[:, :, at:].clone()) for k, v in self.layers]))


class HFCausalLM:
    """A ``transformers`` causal LM serving the scheduler (see the module docstring).

    Args:
        path: a local directory with ``config.json`` and safetensors weights.
        config: its ``config.json`` read already (:func:`load_config`), else read here.
        dtype: ``"float32"``, ``"bfloat16"``, ... (``None``: the checkpoint's own).
        device: ``"cpu"`` (default) or ``"cuda"``, ``"cuda:1"``, ...

    Raises:
        ModelLoadError: a file is missing, the dtype is unknown, or the model's
            cache is not the full-attention kind this adapter batches.
    """

    def __init__(self, path: str | os.PathLike[str], *, config: PretrainedConfig | None = None,
                 dtype: str | None = None, device: str = "cpu") -> None:
        root = check_model_dir(path)
        if dtype is not None and dtype not in _DTYPES:
            raise ModelLoadError(root, f"unknown dtype {dtype!r} (one of {sorted(_DTYPES)})")
        self.device = torch.device(device)
        hf: PreTrainedModel = AutoModelForCausalLM.from_pretrained(
            root, config=config if config is not None else load_config(root),
            local_files_only=True, use_safetensors=True,
            dtype=_DTYPES[dtype] if dtype is not None else "auto")
        torch.nn.Module.to(hf, self.device)  # in place (a device_map would need accelerate)
        self.hf = hf  # from_pretrained leaves it in eval mode
        self.config = self.hf.config
        probe = DynamicCache(config=self.config)
        if any(type(layer) is not DynamicLayer for layer in probe.layers):
            kinds = sorted({type(layer).__name__ for layer in probe.layers})
            raise ModelLoadError(root, f"its cache layers are {kinds}: only full-attention "
                                       f"decoders are supported (no sliding window, no "
                                       f"linear attention)")
        text = self.config.get_text_config(decoder=True)
        head = self.hf.get_output_embeddings()  # type: ignore[no-untyped-call]
        self._name = root.name
        #: Where its ``tokenizer.json`` is (structured output reads the vocabulary).
        self.tokenizer_dir: Path = root
        self._vocab = int(head.weight.shape[0]) if head is not None else int(text.vocab_size)
        self._stops = _eos_ids(root, getattr(self.config, "eos_token_id", None)
                               or getattr(text, "eos_token_id", None))
        self._max_prompt = getattr(text, "max_position_embeddings", None)
        self._kv: dict[int, KV] = {}  # requests not in the resident batch
        self._sums: dict[int, tuple[torch.Tensor, int]] = {}  # embedding: sum, count
        self._scores: dict[int, list[torch.Tensor]] = {}  # PromptChunk.scores' logits
        self._batch: _Resident | None = None
        self._sdpa = self.config._attn_implementation == "sdpa"
        self._prefixes: RadixTree[_KVSpan] | None = None  # None: no prefix cache
        #: The prefixes requests started from, with their tree (a reload of the
        #: weights starts a new tree; a hold is released on the tree that gave it).
        self._held: dict[int, tuple[RadixTree[_KVSpan], Hit[_KVSpan]]] = {}
        self._read: dict[int, list[torch.Tensor]] = {}  # prompt tokens read so far
        #: Requests whose prompt is cached: its tokens, and each token decoded since
        #: (what the request's keys and values stand for), cached at free.
        self._said: dict[int, tuple[torch.Tensor, list[int]]] = {}
        #: What every export and adoption states and checks, computed once (hashing
        #: the configuration's JSON took 0.44 ms, the shape 36 us, each time).
        self._fingerprint = self._make_fingerprint()
        self._state_shape = self._make_kv_shape()

    # -- what the scheduler reads ----------------------------------------------

    @property
    def name(self) -> str:
        """The directory's name."""
        return self._name

    @property
    def vocab_size(self) -> int:
        """Rows of the output head (may exceed the tokenizer's vocabulary)."""
        return self._vocab

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """End-of-sequence ids: ``generation_config.json``'s, else ``config.json``'s."""
        return self._stops

    @property
    def max_prompt_tokens(self) -> int | None:
        """``max_position_embeddings`` of the config, where it says."""
        return self._max_prompt

    @property
    def live_states(self) -> int:
        """Requests holding a KV cache or an embedding sum."""
        resident = len(self._batch.rows) if self._batch is not None else 0
        return len(self._kv.keys() | self._sums.keys()) + resident

    # -- the protocol ------------------------------------------------------------

    @torch.inference_mode()
    def prefill_chunks(self, chunks: Sequence[PromptChunk]) -> torch.Tensor:
        """Read prompts: new whole ones as one padded batch, the others one by one."""
        logits = torch.zeros(len(chunks), self._vocab, dtype=self.hf.dtype)
        fresh = [i for i, c in enumerate(chunks)
                 if c.start == 0 and c.last and not c.embed and not c.scores]
        if fresh:
            logits[fresh] = self._prefill_fresh([chunks[i] for i in fresh])
        # Chunks continuing a prompt, batched by size; one read for its scores goes
        # one by one (_prefill_one keeps every position's logits).
        more = [i for i, c in enumerate(chunks) if c.start and not c.embed and not c.scores]
        for group in _similar(more, [len(c.token_ids) for c in chunks]):
            if len(group) > 1:
                logits[group] = self._prefill_more([chunks[i] for i in group])
            else:
                logits[group[0]] = self._prefill_one(chunks[group[0]])
        done = set(fresh) | set(more)
        for i, c in enumerate(chunks):
            if c.embed:
                self._embed_chunk(c)
            elif i not in done:
                logits[i] = self._prefill_one(c)  # a first chunk, or one read for its scores
        return logits

    @torch.inference_mode()
    def decode_step(self, keys: Sequence[int], tokens: torch.Tensor) -> torch.Tensor:
        """One token for each request, as one batch over the resident cache."""
        batch = self._resident(list(keys))
        batch.append_column()
        # sdpa takes the (B, 1, 1, kv) boolean mask as it is: building it from the 2D
        # mask in transformers cost ~1.5 ms a step, over 10% of this model's step.
        mask = batch.mask[:, None, None, :] if self._sdpa else batch.mask
        try:
            out = self.hf(input_ids=tokens.to(self.device).view(-1, 1), attention_mask=mask,
                          position_ids=batch.lens.view(-1, 1), cache=batch.cache,
                          use_cache=True, logits_to_keep=1)
        except BaseException:
            for k in keys:  # some layers may hold this step's token: no longer cacheable
                self._said.pop(k, None)
            raise
        batch.lens += 1
        if self._said:  # (ints: a tensor a request a step cost ~200 us at batch 64)
            for k, t in zip(keys, tokens.tolist(), strict=True):
                said = self._said.get(k)
                if said is not None:
                    said[1].append(t)
        return _last(out.logits)

    def embedding(self, key: int) -> torch.Tensor:
        """Mean of the prompt's last hidden states, unit-normed (float32)."""
        total, count = self._sums[key]
        mean = (total / count).float().cpu()
        unit: torch.Tensor = mean / mean.norm().clamp_min(1e-12)
        return unit

    def free(self, key: int) -> None:
        """Drop ``key``'s cache wherever it is (its resident row leaves at the next step),
        and its hold on a cached prefix; with a prefix cache, first cache what it
        decoded after its prompt (so a conversation's next turn reads its answer too)."""
        said = self._said.pop(key, None)
        if said is not None:
            self._cache_answer(key, said)
        self._kv.pop(key, None)
        self._sums.pop(key, None)
        self._scores.pop(key, None)
        self._read.pop(key, None)
        held = self._held.pop(key, None)
        if held is not None:
            tree, hit = held
            tree.release(hit)
        if (self._batch is not None and self._batch.rows.pop(key, None) is not None
                and not self._batch.rows):
            self._batch = None

    def weights(self) -> Mapping[str, torch.Tensor]:
        """The ``transformers`` model's ``state_dict``."""
        state: dict[str, torch.Tensor] = self.hf.state_dict()
        return state

    def load_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """``load_state_dict`` (strict); the prefix cache starts empty (its keys and
        values came from the old weights), and prompts being read are not cached."""
        self.hf.load_state_dict(weights)
        if self._prefixes is not None:
            self._prefixes = RadixTree(self._prefixes.capacity)
            self._read.clear()
            self._said.clear()

    def set_prefix_cache(self, max_bytes: int) -> None:
        """A prefix cache of at most ``max_bytes`` of keys and values (0: none).

        Raises:
            RuntimeError: a request holds a cached prefix (set it before serving).
        """
        if self._held:
            raise RuntimeError(f"{len(self._held)} requests hold cached prefixes")
        self._prefixes = RadixTree(max_bytes) if max_bytes > 0 else None
        self._read.clear()
        self._said.clear()

    def reuse_prefix(self, key: int, token_ids: torch.Tensor) -> int:
        """Copy the longest cached prefix of the prompt (all but its last token) into
        ``key``'s cache; hold it until :meth:`free`."""
        tree = self._prefixes
        if tree is None:
            return 0
        self._read[key] = []
        hit = tree.match(token_ids.numpy(), limit=len(token_ids) - 1)
        if not hit.length:
            tree.release(hit)
            return 0
        n = hit.length
        self._held[key] = (tree, hit)
        layers = [(torch.cat([s.layers[li][0] for s in hit.spans], dim=2)[:, :, :n],
                   torch.cat([s.layers[li][1] for s in hit.spans], dim=2)[:, :, :n])
                  for li in range(len(hit.spans[0].layers))]
        self._kv[key] = layers
        self._read[key].append(token_ids[:n])
        return n

    def flush_prefix_cache(self) -> int:
        """Evict every prefix no request holds."""
        return self._prefixes.clear() if self._prefixes is not None else 0

    def prefix_cache_stats(self) -> TreeStats | None:
        """The tree's counters (``size`` in bytes), ``None`` with no prefix cache."""
        return self._prefixes.stats() if self._prefixes is not None else None

    def prefix_cache_tokens(self) -> int:
        """The cache's byte bound over one token's keys and values (every layer's)."""
        if self._prefixes is None:
            return 0
        layers, pair, heads, _, dim = self._state_shape
        assert layers is not None and pair is not None and heads is not None and dim is not None
        per_token = layers * pair * heads * dim * self.hf.dtype.itemsize
        return self._prefixes.capacity // per_token

    # -- prefill and decode apart (Model.export_state / adopt_state) -----------

    @property
    def fingerprint(self) -> str:
        """The directory's name, a digest of its configuration, and the dtype."""
        return self._fingerprint

    def _make_fingerprint(self) -> str:
        digest = hashlib.blake2b(self.config.to_json_string(use_diff=False).encode(),
                                 digest_size=8).hexdigest()
        return f"{self._name}:{digest}:{str(self.hf.dtype).removeprefix('torch.')}"

    def _make_kv_shape(self) -> tuple[int | None, ...]:
        """``(layers, 2, kv_heads, *, head_dim)``: one hand-off's keys and values."""
        text = self.config.get_text_config(decoder=True)
        heads = int(getattr(text, "num_key_value_heads", None) or text.num_attention_heads)
        dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        return (int(text.num_hidden_layers), 2, heads, None, int(dim))

    def export_state(self, key: int, empty: Empty | None = None) -> RequestState:
        """Every layer's keys and values of ``key``, stacked into one tensor that ``empty``
        makes (a slab of the outbox it will leave by: the only copy on its way)."""
        if key not in self._kv:
            self._evict(list(self._batch.keys) if self._batch is not None else [])
        kv = self._kv[key]
        shape = (len(kv), 2, *kv[0][0].shape[1:])
        dtype = kv[0][0].dtype
        out = empty(shape, dtype) if empty is not None else torch.empty(shape, dtype=dtype)
        for i, (k, v) in enumerate(kv):
            out[i, 0].copy_(k[0])
            out[i, 1].copy_(v[0])
        return RequestState(out, self.fingerprint)

    def adopt_state(self, key: int, state: RequestState, positions: int) -> None:
        """Views of ``state.kv`` become ``key``'s cache (no copy here: the step that
        takes it into the resident batch copies it there, as for any request). It
        holds no cached prefix, and :meth:`free` caches nothing of it: its prompt was
        read elsewhere (under pd every prompt is read on a prefill replica, whose
        cache keeps it)."""
        shape = list(self._state_shape)
        shape[3] = positions
        check_state(state, self.fingerprint, self.hf.dtype, shape)
        kv = state.kv.to(self.device)
        self._kv[key] = [(kv[i, 0].unsqueeze(0), kv[i, 1].unsqueeze(0))
                         for i in range(kv.shape[0])]

    # -- internals ---------------------------------------------------------------

    def _remember(self, c: PromptChunk) -> None:
        """Keep a generate prompt's tokens as it is read; at its end, cache its state."""
        tree = self._prefixes
        if tree is None or c.embed:
            return
        read = self._read.get(c.key)
        if read is None:
            if c.start:  # its start was read before this tree began: not all known
                return
            read = self._read[c.key] = []
        read.append(c.token_ids)
        if not c.last:
            return
        prompt = torch.cat(self._read.pop(c.key))
        kv = self._kv[c.key]
        tree.insert(prompt.numpy(), lambda a, b: _KVSpan([(k[:, :, a:b].clone(),
                                                           v[:, :, a:b].clone()) for k, v in kv]))
        self._said[c.key] = (prompt, [])

    def _cache_answer(self, key: int, said: tuple[torch.Tensor, list[int]]) -> None:
        """Cache ``key``'s prompt and the tokens decoded since: what its keys and values
        hold (all but the last token sampled, never read back)."""
        tree, batch = self._prefixes, self._batch
        if tree is None:
            return
        kv = self._kv.get(key)
        if kv is None and batch is not None and key in batch.rows:
            r, width = batch.rows[key], batch.mask.shape[1]
            n = int(batch.lens[r])
            kv = [(ks[r:r + 1, :, width - n:], vs[r:r + 1, :, width - n:])
                  for ks, vs in _layers(batch.cache)]
        prompt, decoded = said
        tokens = torch.cat([prompt, torch.tensor(decoded, dtype=prompt.dtype)])
        if kv is None or any(k.shape[2] != len(tokens) for k, _ in kv):
            return  # not the state of exactly these tokens: nothing to cache
        tree.insert(tokens.numpy(), lambda a, b: _KVSpan([(k[:, :, a:b].clone(),
                                                           v[:, :, a:b].clone()) for k, v in kv]))

    def _ids(self, c: PromptChunk) -> torch.Tensor:
        return c.token_ids.to(self.device, torch.long).view(1, -1)

    def _prefill_fresh(self, chunks: list[PromptChunk]) -> torch.Tensor:
        """New prompts read whole: one batch, left-padded like ``generate`` pads."""
        width = max(len(c.token_ids) for c in chunks)
        ids = torch.zeros(len(chunks), width, dtype=torch.long, device=self.device)
        mask = torch.zeros_like(ids)
        for i, c in enumerate(chunks):
            n = len(c.token_ids)
            ids[i, width - n:] = c.token_ids
            mask[i, width - n:] = 1
        cache = DynamicCache(config=self.config)
        out = self.hf(input_ids=ids, attention_mask=mask if len(chunks) > 1 else None,
                      position_ids=(mask.cumsum(-1) - 1).clamp_min(0), cache=cache,
                      use_cache=True, logits_to_keep=1)
        for i, c in enumerate(chunks):
            n = len(c.token_ids)
            self._kv[c.key] = [(k[i:i + 1, :, width - n:], v[i:i + 1, :, width - n:])
                               for k, v in _layers(cache)]
            self._remember(c)
        return _last(out.logits)

    def _cache_of(self, c: PromptChunk) -> DynamicCache:
        if c.start == 0:
            return DynamicCache(config=self.config)
        return DynamicCache(ddp_cache_data=self._kv[c.key], config=self.config)

    def _positions(self, c: PromptChunk) -> torch.Tensor:
        return torch.arange(c.start, c.start + len(c.token_ids), device=self.device).view(1, -1)

    def _prefill_one(self, c: PromptChunk) -> torch.Tensor:
        """A chunk of one generate prompt, from that request's cache so far."""
        cache = self._cache_of(c)
        out = self.hf(input_ids=self._ids(c), position_ids=self._positions(c), cache=cache,
                      use_cache=True, logits_to_keep=0 if c.scores else 1)
        self._kv[c.key] = _layers(cache)
        self._remember(c)
        if c.scores:  # every position's, for prompt_scores
            self._scores.setdefault(c.key, []).append(out.logits[0].to("cpu"))
        return _last(out.logits)[0]

    def _prefill_more(self, chunks: list[PromptChunk]) -> torch.Tensor:
        """Chunks continuing prompts (after a cached prefix, or chunked): one batch.

        Each row is ``[pad | its cache | pad | its chunk]``: the caches
        left-padded to the longest, the chunks too, the padding masked out; a
        chunk's positions continue its own cache.
        """
        past = [c.start for c in chunks]
        sizes = [len(c.token_ids) for c in chunks]
        width, depth = max(sizes), max(past)
        ids = torch.zeros(len(chunks), width, dtype=torch.long, device=self.device)
        mask = torch.zeros(len(chunks), depth + width, dtype=torch.long, device=self.device)
        positions = torch.zeros_like(ids)
        for i, c in enumerate(chunks):
            s, n = past[i], sizes[i]
            ids[i, width - n:] = c.token_ids
            mask[i, depth - s:depth] = 1
            mask[i, depth + width - n:] = 1
            positions[i, width - n:] = torch.arange(s, s + n)
        kvs = [self._kv[c.key] for c in chunks]
        layers = [(_left_padded([kv[li][0] for kv in kvs], depth),
                   _left_padded([kv[li][1] for kv in kvs], depth))
                  for li in range(len(kvs[0]))]
        cache = DynamicCache(ddp_cache_data=layers, config=self.config)
        out = self.hf(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache,
                      use_cache=True, logits_to_keep=1)
        for i, c in enumerate(chunks):
            s, n = past[i], sizes[i]
            self._kv[c.key] = [
                (k[i:i + 1, :, depth - s:], v[i:i + 1, :, depth - s:]) if n == width else
                (torch.cat([k[i:i + 1, :, depth - s:depth], k[i:i + 1, :, depth + width - n:]], 2),
                 torch.cat([v[i:i + 1, :, depth - s:depth], v[i:i + 1, :, depth + width - n:]], 2))
                for k, v in _layers(cache)]
            self._remember(c)
        return _last(out.logits)

    def prompt_scores(self, key: int) -> torch.Tensor:
        """The logits of the chunks read with ``scores`` (see the protocol)."""
        kept = self._scores.pop(key, [])
        return torch.cat(kept) if kept else torch.zeros(0, self._vocab, dtype=self.hf.dtype)

    def _embed_chunk(self, c: PromptChunk) -> None:
        """A chunk of an embedding prompt: add its last hidden states to the request's sum."""
        cache = self._cache_of(c)
        out = self.hf.base_model(input_ids=self._ids(c), position_ids=self._positions(c),
                                 cache=cache, use_cache=not c.last)
        total, count = self._sums.get(c.key, (0, 0))
        self._sums[c.key] = (out.last_hidden_state[0].double().sum(0) + total,
                             count + len(c.token_ids))
        if c.last:
            self._kv.pop(c.key, None)  # the sum is all that is left to read
        else:
            self._kv[c.key] = _layers(cache)

    def _resident(self, keys: list[int]) -> _Resident:
        """The resident batch of exactly ``keys``, in this order (reused, cut or rebuilt)."""
        batch = self._batch
        if batch is not None and batch.keys == keys:
            return batch
        if (batch is not None and len(keys) == len(batch.rows) and
                all(k in batch.rows for k in keys) and
                [batch.rows[k] for k in keys] == sorted(batch.rows[k] for k in keys)):
            # Only departures (freed rows): keep the rows that stay, drop all-pad columns.
            idx = torch.tensor([batch.rows[k] for k in keys], device=self.device)
            mask = batch.mask[idx]
            first = int(mask.any(0).nonzero()[0])
            layers = [(k[idx, :, first:], v[idx, :, first:]) for k, v in _layers(batch.cache)]
            self._batch = _Resident(keys, DynamicCache(ddp_cache_data=layers, config=self.config),
                                    mask[:, first:], batch.lens[idx])
            return self._batch
        # Someone joined: rebuild, left-padding every row to the longest.
        self._evict(keys)
        kvs = [self._kv.pop(k) for k in keys]
        lens = [kv[0][0].shape[2] for kv in kvs]
        width = max(lens)
        layers = []
        for li in range(len(kvs[0])):
            layers.append((_left_padded([kv[li][0] for kv in kvs], width),
                           _left_padded([kv[li][1] for kv in kvs], width)))
        lens_t = torch.tensor(lens, device=self.device)
        mask = (torch.arange(width, device=self.device).view(1, -1)
                >= (width - lens_t).view(-1, 1))
        self._batch = _Resident(keys, DynamicCache(ddp_cache_data=layers, config=self.config),
                                mask, lens_t)
        return self._batch

    def _evict(self, keep: list[int]) -> None:
        """Move the resident rows that are still live back to their own caches."""
        batch, self._batch = self._batch, None
        if batch is None:
            return
        width = batch.mask.shape[1]
        for k, r in batch.rows.items():
            n = int(batch.lens[r])
            self._kv[k] = [(ks[r:r + 1, :, width - n:], vs[r:r + 1, :, width - n:])
                           for ks, vs in _layers(batch.cache)]


def _similar(rows: list[int], sizes: list[int]) -> list[list[int]]:
    """``rows`` grouped so that none is padded to more than twice its size (longest first)."""
    groups: list[list[int]] = []
    for i in sorted(rows, key=lambda i: -sizes[i]):
        if groups and 2 * sizes[i] >= sizes[groups[-1][0]]:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def _last(logits: torch.Tensor) -> torch.Tensor:
    """Each row's logits at its last position, on the CPU (where sampling runs)."""
    return logits[:, -1].to("cpu")


def _layers(cache: DynamicCache) -> KV:
    """Each layer's (keys, values): every layer is a filled ``DynamicLayer`` (checked at load)."""
    out: KV = []
    for layer in cache.layers:
        assert isinstance(layer, DynamicLayer)
        assert layer.keys is not None and layer.values is not None
        out.append((layer.keys, layer.values))
    return out


def _eos_ids(root: Path, config_eos: int | list[int] | None) -> tuple[int, ...]:
    """The end-of-sequence ids ``generate`` would stop at."""
    eos: object = config_eos
    gen = root / "generation_config.json"
    if gen.is_file():
        try:
            found = json.loads(gen.read_text()).get("eos_token_id")
        except (OSError, ValueError, AttributeError) as exc:
            raise ModelLoadError(root, f"generation_config.json is unreadable: {exc}") from exc
        if found is not None:
            eos = found
    ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
    if not all(isinstance(i, int) for i in ids):
        raise ModelLoadError(root, f"eos_token_id {eos!r} is not an id or a list of ids")
    return tuple(ids)
