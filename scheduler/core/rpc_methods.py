"""Rpc methods by name: a registry the scheduler consults for every ``RpcReqInput``."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Mapping
from types import MappingProxyType
from typing import Final

from messages import (
    RPC,
    Codec,
    CodecError,
    Output,
    RpcReqInput,
    RpcReqOutput,
    RpcResult,
    Scalar,
    fit_text,
)
from scheduler.handshake import HELLO_METHOD, answer_hello, local_protocol

__all__ = ["RpcMethod", "RpcMethods"]

#: An rpc method: keyword parameters (plain scalars) in, a flat result (or None) out.
RpcMethod = Callable[..., RpcResult | None]

# What the caller's RpcClient decodes with: a reply this codec cannot round-trip
# would reach the caller as garbage, so it is replaced before it is sent.
_WIRE: Final[Codec[Output]] = RPC.outbound_codec()


class RpcMethods:
    """Name -> method. :meth:`answer` turns any request into exactly one reply.

    An unknown method, parameters the method does not take, a method that
    raises, or a result that cannot cross the wire all answer
    ``success=False`` with a message saying which; the caller's loop goes on.
    Every message is cut to fit the wire (:func:`messages.fit_text`), since it
    may quote user input such as a path. ``hello`` (the wire handshake,
    :mod:`scheduler.handshake`) is registered from the start.
    """

    def __init__(self) -> None:
        self._methods: dict[str, RpcMethod] = {}
        # Every rpc server speaks the handshake: it is the wire's, not a model's.
        self.register(HELLO_METHOD, answer_hello)
        local_protocol()  # once per process, at start-up: the first hello stays cheap

    def register(self, name: str, fn: RpcMethod) -> None:
        """Expose ``fn`` as rpc method ``name``.

        Raises:
            ValueError: ``name`` is taken or not an identifier.
        """
        if not name.isidentifier():
            raise ValueError(f"rpc method name {name!r} is not an identifier")
        if name in self._methods:
            raise ValueError(f"rpc method {name!r} is already registered")
        self._methods[name] = fn

    @property
    def methods(self) -> Mapping[str, RpcMethod]:
        """The registered methods, read-only."""
        return MappingProxyType(self._methods)

    def __iter__(self) -> Iterator[str]:
        return iter(self._methods)

    def answer(self, req: RpcReqInput) -> RpcReqOutput:
        """Run ``req``'s method and build its reply (never raises).

        The reply always encodes and decodes as an :class:`RpcReqOutput`
        (given a valid ``req.rid``): a result that would not is replaced by a
        ``success=False`` reply saying so.
        """
        fn = self._methods.get(req.method)
        if fn is None:
            return _failure(req, f"unknown rpc method {req.method!r}; known: "
                                 f"{', '.join(sorted(self._methods))}")
        params: dict[str, Scalar] = req.parameters
        try:
            inspect.signature(fn).bind(**params)
        except TypeError as exc:
            return _failure(req, f"bad parameters for {req.method!r}: {_text(exc)}")
        try:
            result = fn(**params)
        except Exception as exc:
            return _failure(req, f"{req.method} failed: {type(exc).__name__}: {_text(exc)}")
        reply = RpcReqOutput(rid=req.rid, success=True, message="ok", result=result)
        # msgspec checks constraints (max_length, scalar types) only when
        # decoding, so the round trip is the one test of what the caller can
        # read. Rpc is the cold path: the extra encode and decode are cheap.
        try:
            _WIRE.decode(_WIRE.encode(reply))
        except CodecError as exc:
            return _failure(req, f"{req.method} succeeded but its result does not fit in "
                                 f"an rpc reply: {_text(exc)}")
        except Exception as exc:  # answer() must never raise, whatever a result holds
            return _failure(req, f"{req.method} succeeded but its result does not fit in "
                                 f"an rpc reply: {type(exc).__name__}: {_text(exc)}")
        return reply


def _failure(req: RpcReqInput, message: str) -> RpcReqOutput:
    # Exception text and echoed input (a path, a method name) are unbounded.
    return RpcReqOutput(rid=req.rid, success=False, message=fit_text(message))


def _text(exc: BaseException) -> str:
    # A user exception's __str__ can itself raise; answer() must not.
    try:
        return str(exc)
    except Exception:
        return f"<{type(exc).__name__} whose str() failed>"
