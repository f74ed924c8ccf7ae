"""The frontend's errors, and how each becomes an HTTP answer in OpenAI's shape.

The ``frontend`` branch of the tree drawn in :mod:`messages.errors`::

    BusError
    └── FrontendError            (frontend)
        ├── ApiError             .status, .type, .param, .code: one HTTP error answer
        └── TokenizerError       .path: a tokenizer could not be loaded

An :class:`ApiError` is what a handler raises to answer a request with an
error; the app turns it into ``{"error": {"message", "type", "param", "code"}}``
with its status (and ``Retry-After`` when it carries one). Engine errors are
converted at one place, :func:`from_engine`.
"""

from __future__ import annotations

import msgspec

from messages.errors import BusError
from scheduler import (
    EngineClosed,
    EngineError,
    InvalidRequest,
    Overloaded,
    RequestFailed,
    SchedulerGone,
)

__all__ = ["ApiError", "FrontendError", "TokenizerError", "from_engine"]

#: Seconds a client is told to wait before retrying an overloaded server.
RETRY_AFTER_S = 1


class FrontendError(BusError):
    """Root of every error the frontend raises."""


class ApiError(FrontendError):
    """A request answered with an HTTP error, in OpenAI's shape.

    Differs from :class:`TokenizerError` in that it concerns one HTTP request,
    not the server's set-up.

    Attributes:
        status: the HTTP status (400, 404, 413, 503, ...).
        type: OpenAI's error type (``invalid_request_error``, ...).
        param: the request field at fault, or None.
        code: a short machine-readable cause, or None.
        retry_after: seconds for a ``Retry-After`` header, or None.
        allow: the methods an ``Allow`` header names (a 405 must have one), or None.
    """

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 retry_after: int | None = None, allow: str | None = None) -> None:
        self.status = status
        self.allow = allow
        self.type = type
        self.param = param
        self.code = code
        self.retry_after = retry_after
        self.message = message
        super().__init__(f"HTTP {status} ({type}{f', param {param}' if param else ''}): "
                         f"{message}")

    def body(self) -> bytes:
        """The JSON body OpenAI clients read (``{"error": {...}}``)."""
        return msgspec.json.encode({"error": {"message": self.message, "type": self.type,
                                              "param": self.param, "code": self.code}})


class TokenizerError(FrontendError):
    """A tokenizer could not be loaded from ``path`` (missing or unreadable files).

    Attributes:
        path: what was given to ``--tokenizer``.
    """

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        super().__init__(f"tokenizer {path!r}: {reason}")


#: Most characters of a client's own text (a path, a name, a header's value) an error
#: message quotes: enough to recognise it, never the 64 KiB a head may hold.
QUOTED = 200


def clip(text: str) -> str:
    """``text`` as an error message quotes it: its first :data:`QUOTED` characters, an
    ellipsis where it was cut."""
    return text if len(text) <= QUOTED else text[:QUOTED] + "…"


def bad_request(message: str, param: str | None = None,
                code: str | None = "invalid_value") -> ApiError:
    """A 400 naming the field at fault."""
    return ApiError(400, message, param=param, code=code)


def from_engine(exc: EngineError) -> ApiError:
    """The HTTP answer to an engine error (the one place they are converted).

    ``Overloaded`` is a 503 with ``Retry-After``; a scheduler that is gone or
    an engine that closed is a 503, and so is a request the scheduler ended
    by going away (``shutdown``: an operator's rpc) or with the replica that
    ran it (``replica_lost``, with ``Retry-After``: another replica serves);
    a request the engine refused is a 400; any other failure of the request
    is a 500 that says why.
    """
    if isinstance(exc, Overloaded):
        return ApiError(503, f"the server is overloaded; retry later ({exc})",
                        type="server_overloaded", code="overloaded",
                        retry_after=RETRY_AFTER_S)
    if isinstance(exc, SchedulerGone | EngineClosed):
        return ApiError(503, f"the scheduler is not available: {exc}", type="server_error",
                        code="scheduler_unavailable")
    if isinstance(exc, InvalidRequest):
        return ApiError(400, exc.reason, code="invalid_request")
    if isinstance(exc, RequestFailed) and exc.code in ("shutdown", "replica_lost"):
        return ApiError(503, str(exc), type="server_error", code=exc.code,
                        retry_after=RETRY_AFTER_S if exc.code == "replica_lost" else None)
    if isinstance(exc, RequestFailed):
        status = 400 if exc.code in ("invalid_request", "decode_error") else 500
        return ApiError(status, str(exc), type="server_error" if status == 500
                        else "invalid_request_error", code=exc.code)
    return ApiError(500, str(exc), type="server_error", code="engine_error")
