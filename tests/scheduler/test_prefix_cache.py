"""The prefix cache of ``HFCausalLM``: greedy answers equal those without it, token for token.

The float64 tiny Llama (see ``tests/scheduler/test_hf_model.py`` for why
float64). Prompts share 0, some and all of a cached prefix; a bound that
forces evictions; an abort while a request holds a cached prefix; the
``flush_cache`` rpc.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from messages import SamplingParams
from scheduler import Engine, Limits
from scheduler.models.hf import HFCausalLM
from scheduler.models.radix import TreeStats
from scheduler.models.tiny_hf import build_tiny_hf
from tests.scheduler.conftest import HFEngines

MAX_NEW = 6
GREEDY = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0)
OFF = Limits(prefix_cache_bytes=0)
KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 8  # layers, keys+values, kv heads, head dim, float64




def _prompts(seed: int = 0) -> list[list[int]]:
    """Two system prompts (one longer than a prefill chunk), each with user turns;
    a prompt equal to a system prompt, one that is part of it, and unrelated ones."""
    rng = np.random.default_rng(seed)

    def ids(n: int) -> list[int]:
        out: list[int] = rng.integers(3, 384, size=n).tolist()
        return out

    short, long = ids(120), ids(700)
    out = [ids(40)]
    for system in (short, long):
        out += [system + ids(n) for n in (1, 9, 30)]
    out += [short, short[:50], long[:600] + ids(5), ids(3)]
    return out


def _answers(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    """One at a time, so every prompt finds the ones before it cached."""
    return [engine.generate(p, GREEDY, timeout=120).token_ids for p in prompts]


@pytest.fixture(scope="module")
def expected(model_dir: Path) -> list[list[int]]:
    with Engine("ring", model_dir, limits=OFF) as engine:
        return _answers(engine, _prompts() * 2)


def _stats(engine: Engine) -> TreeStats | None:
    model = engine._core._loaded
    assert isinstance(model, HFCausalLM)
    return model.prefix_cache_stats()


@pytest.mark.parametrize("mode,dp,policy", [("ring", 1, "least_loaded"),
                                            ("zmq", 1, "least_loaded"),
                                            ("zmq", 2, "least_loaded"),
                                            ("zmq", 2, "cache_aware")])
def test_greedy_answers_are_the_same_with_the_cache(
        model_dir: Path, expected: list[list[int]], hf_engines: HFEngines, mode: str, dp: int,
        policy: str) -> None:
    with contextlib.ExitStack() as own:
        if mode == "zmq" and policy == "least_loaded":  # the engine's default policy
            engine = hf_engines.get(dp)  # the session's shared zmq engines
        else:
            engine = own.enter_context(Engine(mode, model_dir, dp_size=dp,  # type: ignore[arg-type]
                                              dp_policy=policy))  # type: ignore[arg-type]
        before = _hits(engine.metrics())
        got = _answers(engine, _prompts() * 2)
        metrics = engine.metrics()
    assert got == expected
    # The second pass finds every prompt cached, less its last token (counted from
    # before the test: a shared engine has answered other tests' prompts).
    assert _hits(metrics) - before >= sum(len(p) - 1 for p in _prompts()), metrics


def _hits(metrics: str) -> float:
    """The prefix cache's hit tokens, all replicas together, from ``metrics`` text."""
    return sum(float(line.split()[-1]) for line in metrics.splitlines()
               if line.startswith("tsb_prefix_cache_hit_tokens_total"))


def test_the_batch_reads_only_what_is_not_cached(model_dir: Path,
                                                 expected: list[list[int]]) -> None:
    prompts = _prompts()
    with Engine("ring", model_dir) as engine:
        got = _answers(engine, prompts)
        stats = _stats(engine)
        # Concurrent now: several requests start from the same held prefixes at once.
        handles = engine.submit_many(prompts, GREEDY)
        again = [h.result(timeout=120).token_ids for h in handles]
        after = _stats(engine)
    assert got == expected[:len(prompts)] and again == got
    assert stats is not None and after is not None
    # short + 1 shares 119 cached tokens of short's first user turn, and so on:
    # every prompt of a family after the first starts from the system prompt.
    assert stats.hit_tokens >= 2 * 119 + 2 * 699 + 119 + 49 + 600, stats
    assert after.locked_nodes == 0


def test_a_cache_at_its_bound_evicts_and_answers_stay_right(
        model_dir: Path, expected: list[list[int]]) -> None:
    bound = 400 * KV_BYTES_PER_TOKEN  # less than the long system prompt
    with Engine("ring", model_dir, limits=Limits(prefix_cache_bytes=bound)) as engine:
        got = _answers(engine, _prompts() * 2)
        stats = _stats(engine)
    assert got == expected
    assert stats is not None
    assert stats.evictions > 0 and 0 < stats.size <= bound, stats
    assert stats.hit_tokens > 0, stats


def _wait(cond: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)  # sleep-ok: polling another thread's state with a deadline


def test_an_abort_while_a_cached_prefix_is_held_leaves_the_cache_consistent(
        model_dir: Path, expected: list[list[int]]) -> None:
    prompts = _prompts()
    with Engine("ring", model_dir) as engine:
        model = engine._core._loaded
        assert isinstance(model, HFCausalLM)
        first = engine.generate(prompts[4], GREEDY, timeout=120).token_ids
        held = engine.submit(prompts[5], SamplingParams(max_new_tokens=2000, temperature=0.0,
                                                        ignore_eos=True), stream=True)
        next(iter(held))  # decoding: its prefix (prompt 4's) is held
        _wait(lambda: (s := model.prefix_cache_stats()) is not None and s.locked_nodes > 0)
        engine.abort(held.rid)
        assert held.result(timeout=60).finish_reason == "abort"
        _wait(lambda: model.live_states == 0)
        stats = model.prefix_cache_stats()
        assert stats is not None and stats.locked_nodes == 0, stats
        again = _answers(engine, prompts)
        held_bytes = (model.prefix_cache_stats() or stats).size
        flushed = engine.collective_rpc("flush_cache")
        assert flushed.success, flushed.message
        assert isinstance(flushed.result, dict)
        assert flushed.result["freed_bytes"] == held_bytes > 0
        empty = model.prefix_cache_stats()
        assert empty is not None and (empty.nodes, empty.size) == (0, 0)
        after_flush = _answers(engine, prompts)
    assert first == expected[4]
    assert again == expected[:len(prompts)] == after_flush


def test_new_weights_start_an_empty_cache(model_dir: Path, tmp_path: Path) -> None:
    other = build_tiny_hf(tmp_path / "other", seed=1)
    prompt = _prompts()[5]
    with Engine("ring", other, limits=OFF) as engine:
        saved = engine.collective_rpc("save_checkpoint", path=str(tmp_path / "w"))
        assert saved.success, saved.message
        theirs = engine.generate(prompt, GREEDY, timeout=120).token_ids
    with Engine("ring", model_dir) as engine:
        engine.generate(prompt[:-3], GREEDY, timeout=120)  # cached with the first weights
        loaded = engine.collective_rpc("load_checkpoint", path=str(tmp_path / "w"))
        assert loaded.success, loaded.message
        assert engine.generate(prompt, GREEDY, timeout=120).token_ids == theirs


def test_the_tiny_gru_caches_nothing_and_answers_as_before() -> None:
    prompt = list(range(3, 60))
    with Engine("ring") as on, Engine("ring", limits=OFF) as off:
        assert on._core._loaded is not None and on._core._loaded.prefix_cache_stats() is None
        a = [on.generate(prompt, GREEDY, timeout=60).token_ids for _ in range(2)]
        b = off.generate(prompt, GREEDY, timeout=60).token_ids
    assert a == [b, b]


@pytest.mark.parametrize("batched", [False, True])
def test_a_conversations_next_turn_reads_the_previous_answer_from_the_cache(
        model_dir: Path, batched: bool) -> None:
    """Decoded tokens join the cache when a request ends: a second turn (prompt, answer,
    new user turn) starts from all of the first turn's keys and values; the last token
    sampled (never read back) is the one it reads again. ``batched``: the first turns
    decode side by side (their state in the resident batch when they end)."""
    turns = _prompts(seed=3)[1:4]
    long = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    with Engine("ring", model_dir) as engine, Engine("ring", model_dir, limits=OFF) as off:
        if batched:
            firsts = [h.result(timeout=120) for h in engine.submit_many(turns, long)]
        else:
            firsts = [engine.generate(p, long, timeout=120) for p in turns]
        seconds = [p + list(a.token_ids) + [7, 8, 9] for p, a in zip(turns, firsts, strict=True)]
        got = [engine.generate(p, GREEDY, timeout=120) for p in seconds]
        want = [off.generate(p, GREEDY, timeout=120).token_ids for p in seconds]
    assert [a.finish_reason for a in firsts] == ["length"] * 3
    assert [r.token_ids for r in got] == want
    assert [r.cached_tokens for r in got] == [len(p) + 12 - 1 for p in turns]


def test_continued_prompts_read_as_one_batch_equal_those_read_one_by_one(
        model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks after a cached prefix (of several lengths: some padded within the batch)
    give the logits and the keys and values that reading each alone gives."""
    from scheduler.models import hf
    from scheduler.models.protocol import PromptChunk

    prompts = [torch.tensor(p) for p in _prompts(seed=4)[1:7]]
    calls: list[list[int]] = []  # the chunks' lengths, per batch read

    def read() -> tuple[torch.Tensor, list[torch.Tensor]]:
        model = HFCausalLM(model_dir)
        model.set_prefix_cache(64 << 20)
        for k, p in enumerate(prompts):  # each prompt cached less a few tokens, alone
            model.prefill_chunks([PromptChunk(100 + k, p[:-(1 + 3 * k)], 0, True)])
            model.free(100 + k)
        batched = model._prefill_more

        def counted(chunks: list[PromptChunk]) -> torch.Tensor:
            calls.append([len(c.token_ids) for c in chunks])
            return batched(chunks)

        monkeypatch.setattr(model, "_prefill_more", counted)
        chunks = []
        for k, p in enumerate(prompts):
            n = model.reuse_prefix(k, p)
            assert n > 0
            chunks.append(PromptChunk(k, p[n:], n, True))
        logits = model.prefill_chunks(chunks)
        return logits, [torch.cat([keys for keys, _ in model._kv[c.key]]) for c in chunks]

    together = read()
    # Rows of unequal lengths in one batch (the shorter padded), and every row batched.
    assert any(len(set(sizes)) > 1 for sizes in calls), calls
    assert sum(len(sizes) for sizes in calls) == len(prompts), calls
    monkeypatch.setattr(hf, "_similar", lambda rows, sizes: [[r] for r in rows])
    alone = read()
    assert torch.allclose(together[0], alone[0], atol=1e-9)
    for a, b in zip(together[1], alone[1], strict=True):
        assert a.shape == b.shape and torch.allclose(a, b, atol=1e-9)


def test_each_replica_reports_its_cache_in_tokens_and_the_dispatcher_bounds_its_tree_by_it(
        model_dir: Path) -> None:
    tokens = 300
    limits = Limits(prefix_cache_bytes=tokens * KV_BYTES_PER_TOKEN + KV_BYTES_PER_TOKEN // 2)
    rng = np.random.default_rng(5)
    with Engine("zmq", model_dir, dp_size=2, dp_policy="cache_aware",
                limits=limits) as engine:
        load = engine.collective_rpc("get_load").result or {}
        # Each replica tells its cache's capacity; the dispatcher's tree of what each
        # holds is bounded by it (a replica joins on a heartbeat, which carries it).
        assert [load[f"replica{i}.prefix_cache_tokens"] for i in range(2)] == [tokens] * 2
        assert [load[f"replica{i}.affinity_bound"] for i in range(2)] == [tokens] * 2, load
        engine.generate(rng.integers(3, 384, size=500).tolist(), GREEDY, timeout=120)
        engine.generate(rng.integers(3, 384, size=200).tolist(), GREEDY, timeout=120)
        load = engine.collective_rpc("get_load").result or {}
    # The 500-token prompt cannot fit a 300-token cache: its tree keeps only the other.
    held = [load[f"replica{i}.affinity_tokens"] for i in range(2)]
    assert held in ([0, 200], [200, 0]), load
