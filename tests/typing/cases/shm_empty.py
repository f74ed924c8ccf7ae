"""PushOutbox.empty: a plain torch.Tensor out, a shape and keyword dtype in."""

from __future__ import annotations

import torch

from bus import PushOutbox
from messages import Output


def build(out: PushOutbox[Output]) -> None:
    t = out.empty((2, 4096), dtype=torch.bfloat16)
    reveal_type(t)  # R: torch._tensor.Tensor
    out.empty([3, 3])
    out.empty((2, 2), torch.float16)  # E: dtype is keyword-only
    out.empty(4)  # E: a shape is a sequence
