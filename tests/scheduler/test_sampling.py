"""Choosing next tokens: a temperature too small to divide by samples greedily."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from messages import SamplingParams
from scheduler.models.sampling import GREEDY_BELOW, sample_next


@given(temperature=st.floats(min_value=0.0, max_value=GREEDY_BELOW, exclude_max=True),
       seed=st.integers(0, 2**32 - 1))
def test_a_temperature_below_the_floor_is_greedy(temperature: float, seed: int) -> None:
    # Without this: 1e-300 became 0.0 in float32; logits / 0 -> inf, softmax -> NaN, and
    # the search over a NaN cdf picked tokens far from the argmax.
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(seed)) * 30
    params = [SamplingParams(temperature=temperature, seed=seed)] * 3
    tokens, logprobs = sample_next(logits, params, [torch.Generator().manual_seed(seed)
                                                    for _ in range(3)])
    assert torch.equal(tokens, logits.argmax(dim=-1))
    assert torch.isfinite(logprobs).all()


def test_a_temperature_at_the_floor_samples_finitely() -> None:
    logits = torch.tensor([[0.0, 1e-4, -50.0]])
    tokens, logprobs = sample_next(logits, [SamplingParams(temperature=GREEDY_BELOW)],
                                   [torch.Generator().manual_seed(0)])
    assert tokens.tolist() in ([0], [1]) and torch.isfinite(logprobs).all()
