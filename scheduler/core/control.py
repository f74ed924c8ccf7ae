"""The scheduler's rpc methods: checkpoints, cache, load and the token digest.

A mixin of :class:`~scheduler.core.loop.Scheduler`, kept apart so the loop file
holds the loop. Each method runs inside a scheduler step, so each must end
in bounded time: checkpoints read regular files of bounded size only
(:func:`scheduler.core.checkpoint.load_state`).
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import msgspec
from prometheus_client import CollectorRegistry

from messages import MAX_TOKENS, RpcResult, Scalar
from messages.rpc_api import ModelInfoResult
from scheduler.core.admission import Admission
from scheduler.core.checkpoint import MAX_INDEX_BYTES, load_state, save_state
from scheduler.core.metrics import chunks, exposition
from scheduler.models.protocol import Model

__all__ = ["ControlMethods"]


class ControlMethods:
    """The rpc methods every scheduler registers (see :class:`~scheduler.core.loop.Scheduler`)."""

    model: Model
    rank: int
    world_size: int
    _digest: hashlib.blake2b
    _steps: int
    _tokens: int
    _rate_t0: float
    _rate_tokens: int
    _rate: float
    upstream_aborts: int
    upstream_dropped: int
    registry: CollectorRegistry | None
    admission: Admission
    _facts: ModelInfoResult | None = None
    #: (step, exposition) of the last ``metrics`` call: the calls one poll brought in
    #: share one snapshot, taken once.
    _exposed: tuple[int, list[Scalar]] | None = None

    def _queue_sizes(self) -> tuple[int, int]:
        """(running, queued)."""
        raise NotImplementedError

    def _shard(self, path: str) -> Path:
        p = Path(path)
        return p if self.world_size == 1 else p.with_name(
            f"{p.name}.rank{self.rank}-of-{self.world_size}")

    def save_checkpoint(self, path: str) -> RpcResult:
        """Write the model weights atomically to ``path`` (temp file, then rename).

        With several ranks, each writes its own shard ``path.rank<r>-of-<n>``.
        """
        target = self._shard(path)
        size = save_state(dict(self.model.weights()), target)
        return {"path": str(target), "bytes": size}

    def load_checkpoint(self, path: str) -> RpcResult:
        """Load model weights written by :meth:`save_checkpoint` (this rank's shard).

        Only a regular file is read, and no bigger than this model's weights
        plus an index: a FIFO or a device would block the loop or fill
        memory, and a huge file would stall it for seconds.
        """
        target = self._shard(path)
        weights = sum(t.numel() * t.element_size() for t in self.model.weights().values())
        self.model.load_weights(load_state(target, max_bytes=weights + MAX_INDEX_BYTES))
        return {"path": str(target)}

    def model_facts(self) -> ModelInfoResult:
        """What a client may send (the ``model_info`` rpc), read once from the model.

        A model states ``name``, ``vocab_size``, ``stop_token_ids`` and
        ``max_prompt_tokens`` itself (the ``Model`` protocol); one that
        predates it (TinyLM, StubLM) is read through its ``config``, with no
        stop ids and the wire's bound on a prompt. The longest prompt is
        also bounded by what admission would ever queue.
        """
        facts = self._facts
        if facts is None:
            m = self.model
            config = getattr(m, "config", None)
            name = getattr(m, "name", None)
            if not isinstance(name, str) or not name:
                kind = getattr(config, "kind", "")
                name = f"tiny-{kind}" if kind else type(m).__name__
            vocab = getattr(m, "vocab_size", None)
            if not isinstance(vocab, int):
                vocab = int(getattr(config, "vocab_size"))  # noqa: B009 - today's models
            longest = getattr(m, "max_prompt_tokens", None)
            if not isinstance(longest, int):
                longest = MAX_TOKENS
            longest = min(longest, MAX_TOKENS, self.admission.limits.max_queued_tokens)
            stops = [int(t) for t in getattr(m, "stop_token_ids", None) or ()]
            facts = self._facts = ModelInfoResult(model=name, vocab_size=vocab,
                                                  stop_token_ids=stops,
                                                  max_prompt_tokens=longest)
        return facts

    def model_info(self) -> RpcResult:
        """The model's name, vocabulary size, stop ids and longest prompt (see
        :class:`messages.rpc_api.ModelInfoResult`)."""
        result: RpcResult = msgspec.to_builtins(self.model_facts())
        return result

    def token_digest(self) -> RpcResult:
        """A digest of every token this scheduler sampled, in order (ranks must agree)."""
        return {"digest": self._digest.hexdigest(), "tokens": self._tokens, "rank": self.rank}

    def flush_cache(self) -> RpcResult:
        """Empty the model's prefix cache; refused while requests are in flight.

        ``freed_bytes``: what the cache held (0 for a model that caches nothing).
        """
        running, queued = self._queue_sizes()
        if running or queued:
            raise RuntimeError(f"cannot flush while {running} requests run and "
                               f"{queued} wait")
        return {"flushed": True, "freed_bytes": self.model.flush_prefix_cache()}

    def metrics_text(self) -> RpcResult:
        """The Prometheus exposition text, in pieces that fit an rpc string (join them)."""
        if self.registry is None:
            raise RuntimeError("this scheduler records no metrics (metrics=False)")
        # Every call handled in one step answers the same instant's figures: the
        # exposition (about 2 ms) is made once for them, not once a caller (16
        # dashboards scraping at once cost the loop 16 of them).
        exposed = self._exposed
        if exposed is None or exposed[0] != self._steps:
            exposed = self._exposed = (self._steps, list(chunks(exposition(self.registry))))
        return {"text": list(exposed[1])}

    def get_load(self) -> RpcResult:
        """Running and queued requests, the recent token rate, this process's pid
        (which incarnation answers: a dispatcher tells a restart from a return), its
        model's fingerprint (a prefill/decode dispatcher joins replicas of one model)
        and how many tokens its prefix cache holds at most (a ``cache_aware``
        dispatcher bounds its guess of this replica's cache by it)."""
        now = time.monotonic()
        if now - self._rate_t0 >= 1.0:
            self._rate = self._rate_tokens / (now - self._rate_t0)
            self._rate_t0, self._rate_tokens = now, 0
        running, queued = self._queue_sizes()
        return {"running": running, "queued": queued,
                "tokens_per_s": round(self._rate, 1), "steps": self._steps,
                "pid": os.getpid(), "model": self.model.fingerprint,
                "prefix_cache_tokens": self.model.prefix_cache_tokens(),
                "upstream_aborts": self.upstream_aborts,
                "upstream_dropped": self.upstream_dropped}
