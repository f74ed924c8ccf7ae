"""Engine errors (the ``scheduler`` branch of the tree drawn in :mod:`messages.errors`)."""

from __future__ import annotations

from messages.errors import BusError

__all__ = ["EngineClosed", "EngineError", "RequestFailed", "SchedulerGone"]


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


class SchedulerGone(EngineError):
    """The scheduler (thread or process) is gone; pending requests cannot finish."""


class EngineClosed(EngineError):
    """The engine was closed; it accepts no new request."""
