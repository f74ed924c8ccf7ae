"""Engine errors (the ``scheduler`` branch of the tree drawn in :mod:`messages.errors`)."""

from __future__ import annotations

from messages.errors import BusError

__all__ = [
    "EngineClosed",
    "EngineError",
    "EngineForked",
    "InvalidRequest",
    "Overloaded",
    "RequestFailed",
    "SchedulerGone",
]


class EngineError(BusError):
    """A request could not be served by the engine."""


class RequestFailed(EngineError):
    """The scheduler answered a request with an error (``ErrorOut``).

    Attributes:
        rid: the request.
        code: why (``invalid_request``, ``decode_error``, ``shutdown``, ...).
    """

    def __init__(self, rid: str, code: str, message: str) -> None:
        self.rid = rid
        self.code = code
        super().__init__(f"request {rid!r} failed ({code}): {message}")


class Overloaded(RequestFailed):
    """The scheduler refused the request as overloaded (code ``overloaded``).

    Its queue was past ``max_queued_requests`` / ``max_queued_tokens``, or the
    request's outputs were stuck behind a consumer that stopped reading.
    Nothing of it runs any more: retry later, or elsewhere.
    """


class InvalidRequest(EngineError, ValueError):
    """The engine refused a request before sending it: it would break the wire's rules.

    Raised at submit time (a rid too long or not valid text, sampling out of
    range, ...), so a request is either refused here or answered later, never
    lost in between. A ``ValueError`` too.

    Attributes:
        rid: the request id as given.
        reason: which field breaks which rule.
    """

    def __init__(self, rid: str, reason: str) -> None:
        self.rid = rid
        self.reason = reason
        super().__init__(f"request {rid!r} refused: {reason}")


class SchedulerGone(EngineError):
    """The scheduler (thread or process) is gone; pending requests cannot finish."""


class EngineClosed(EngineError):
    """The engine was closed; it accepts no new request."""


class EngineForked(EngineError):
    """The engine was used in a child made by ``os.fork``: it belongs to its parent.

    Its threads did not survive the fork, and its sockets, rings and request
    ids are its parent's, so the child must make an engine of its own. Every
    call in the child raises this at once; the parent's engine is untouched.

    Attributes:
        owner: the pid of the process that made the engine.
        pid: the pid of the child that called it.
    """

    def __init__(self, owner: int, pid: int) -> None:
        self.owner = owner
        self.pid = pid
        super().__init__(f"this engine belongs to process {owner}; a forked child "
                         f"(pid {pid}) must make its own")
