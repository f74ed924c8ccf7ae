"""Hypothesis strategies for every message type."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import strategies as st

from messages import (
    AbortReq,
    BatchEmbeddingOut,
    BatchTokenIDOut,
    ErrorOut,
    FinishReason,
    Message,
    RpcReqInput,
    RpcReqOutput,
    SamplingParams,
    TokenizedEmbeddingReqInput,
    TokenizedGenerateReqInput,
    token_ids,
)

rids = st.text(min_size=1, max_size=40)
ids = st.lists(st.integers(0, 2**32 - 1), max_size=300).map(token_ids)
scalars = st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.floats(
    allow_nan=False) | st.text(max_size=20)
finite = st.floats(0.0, 1e4, allow_nan=False)


def _tensor(rows: int) -> st.SearchStrategy[torch.Tensor]:
    return st.integers(0, 2000).map(
        lambda n: torch.arange(rows * n, dtype=torch.float32).reshape(rows, n))


sampling = st.builds(
    SamplingParams,
    max_new_tokens=st.integers(0, 4096),
    temperature=finite,
    top_p=st.floats(1e-6, 1.0),
    top_k=st.integers(0, 100),
    stop_token_ids=st.none() | ids,
    seed=st.none() | st.integers(0, 2**63 - 1),
    ignore_eos=st.booleans(),
)

generate = st.builds(
    TokenizedGenerateReqInput,
    rid=rids,
    input_ids=ids,
    sampling=sampling,
    stream=st.booleans(),
    return_logprob=st.booleans(),
    input_embeds=st.none() | st.integers(0, 3).flatmap(_tensor),
)


@st.composite
def batch_out(draw: st.DrawFn) -> BatchTokenIDOut:
    n = draw(st.integers(0, 70))
    per = draw(st.lists(st.lists(st.integers(0, 2**31), max_size=3), min_size=n, max_size=n))
    choices: list[FinishReason | None] = [None, "stop", "length", "abort"]
    fin = draw(st.lists(st.sampled_from(choices),
                        min_size=n, max_size=n))
    names = draw(st.lists(rids, min_size=n, max_size=n))
    lp = [[-float(i) for i in range(len(p))] for p in per] if draw(st.booleans()) else None
    return BatchTokenIDOut.from_lists(names, per, fin, logprobs=lp)


@st.composite
def embedding_out(draw: st.DrawFn) -> BatchEmbeddingOut:
    n = draw(st.integers(0, 5))
    names = draw(st.lists(rids, min_size=n, max_size=n))
    return BatchEmbeddingOut(rids=names, embeddings=draw(_tensor(n)))


messages: st.SearchStrategy[Message] = st.one_of(
    generate,
    st.builds(TokenizedEmbeddingReqInput, rid=rids, input_ids=ids),
    st.builds(AbortReq, rid=rids),
    st.builds(RpcReqInput, rid=rids, method=st.from_regex(r"[A-Za-z_]\w{0,20}", fullmatch=True),
              parameters=st.dictionaries(st.text(max_size=10), scalars, max_size=5)),
    st.builds(RpcReqOutput, rid=rids, success=st.booleans(), message=st.text(max_size=50),
              result=st.none() | st.dictionaries(st.text(max_size=10),
                                                 scalars | st.lists(scalars, max_size=4),
                                                 max_size=5)),
    batch_out(),
    embedding_out(),
    st.builds(ErrorOut, rid=rids, code=st.sampled_from(["invalid_request", "internal"]),
              message=st.text(max_size=50)),
)

__all__ = ["messages", "np"]
