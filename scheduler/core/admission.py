"""Admission control: how much work a scheduler accepts before it answers ``overloaded``.

A request that would push the queue past its bounds is answered at once
with ``ErrorOut(code="overloaded")`` (an :class:`~scheduler.errors.Overloaded`
from ``Engine``), costing the scheduler nothing more: a queued request holds
only its message until it is admitted to the running batch, where its
per-request state (sampler generator, model state) is made. Rpc is never
refused here: control calls must get through an overloaded scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Admission", "Limits"]


@dataclass(frozen=True, slots=True)
class Limits:
    """Bounds on what a scheduler holds.

    Attributes:
        max_queued_requests: most generate requests waiting for a slot.
        max_queued_tokens: most tokens those waiting requests may cost,
            each counting its prompt plus its ``max_new_tokens``.
        max_backlog: most outputs waiting per consumer that is not reading;
            past it, the requests whose outputs are stuck are aborted (see
            :mod:`router.backlog` and :mod:`scheduler.core.backpressure`).
        prefix_cache_bytes: most bytes of prompts' state (a transformer's keys
            and values) the model keeps for reuse by later prompts that
            share a prefix; 0 turns the prefix cache off. The default, 1 GiB,
            holds about a million tokens of a small model (the float64 tiny
            Llama: 1 KiB a token) and ~8k of a 7B one in float16 (128 KiB
            a token); a model that caches no prefix ignores it.
        max_handoff_bytes: most bytes of hand-offs (prefill and decode apart)
            a prefill replica has sent that their receiver has not released
            yet; a request whose prompt is read then waits (its state held
            here, not decoding) until the hand-offs before it are taken. The
            default, 512 MiB, is half the output pool's shared memory (1 GiB),
            so a hand-off under it finds a slab rather than the socket. The
            dispatcher's hop to a decode replica keeps the same bound, and a
            hand-off larger than it alone is refused (``invalid_request``).
        handoff_deadline: seconds a hand-off may wait unread in the shared memory of
            the dispatcher's hop to a decode replica; past it, its memory is freed and
            its request answered ``replica_lost`` (the hand-off expired unadopted).
    """

    max_queued_requests: int = 4096
    max_queued_tokens: int = 1 << 22
    max_backlog: int = 1024
    prefix_cache_bytes: int = 1 << 30
    max_handoff_bytes: int = 512 << 20
    handoff_deadline: float = 60.0

    def __post_init__(self) -> None:
        # Each message begins with the field's name (a command line says its flag).
        for name in ("max_queued_requests", "max_queued_tokens", "max_backlog",
                     "max_handoff_bytes"):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"{name} must be >= 1, not {value}")
        if self.prefix_cache_bytes < 0:
            raise ValueError(f"prefix_cache_bytes must be >= 0, not {self.prefix_cache_bytes}")
        if not self.handoff_deadline > 0:  # (NaN too)
            raise ValueError(f"handoff_deadline must be above 0 seconds, not "
                             f"{self.handoff_deadline}")


class Admission:
    """The queue's running totals against :class:`Limits`."""

    __slots__ = ("limits", "refused_requests", "refused_tokens", "requests", "tokens")

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.requests = 0
        self.tokens = 0
        self.refused_requests = 0  # refused: too many requests waiting
        self.refused_tokens = 0  # refused: too many tokens waiting

    @property
    def refused(self) -> int:
        """Requests refused so far, for either reason."""
        return self.refused_requests + self.refused_tokens

    def refuse(self, cost: int) -> str:
        """Why a request costing ``cost`` tokens cannot queue, or ``""`` if it can."""
        lim = self.limits
        if self.requests >= lim.max_queued_requests:
            why = f"{self.requests} requests wait (max_queued_requests={lim.max_queued_requests})"
            self.refused_requests += 1
        elif self.tokens + cost > lim.max_queued_tokens:
            why = (f"{self.tokens} tokens wait and this request costs {cost} "
                   f"(max_queued_tokens={lim.max_queued_tokens})")
            self.refused_tokens += 1
        else:
            return ""
        return f"overloaded: {why}; retry later"

    def enter(self, cost: int) -> None:
        """A request of ``cost`` tokens joined the queue."""
        self.requests += 1
        self.tokens += cost

    def leave(self, cost: int) -> None:
        """A request of ``cost`` tokens left the queue (admitted, aborted or failed)."""
        self.requests -= 1
        self.tokens -= cost

    def clear(self) -> None:
        """The queue was emptied."""
        self.requests = self.tokens = 0
