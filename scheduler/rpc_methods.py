"""Rpc methods by name: a registry the scheduler consults for every ``RpcReqInput``."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Mapping
from types import MappingProxyType

from messages import RpcReqInput, RpcReqOutput, RpcResult, Scalar

__all__ = ["RpcMethod", "RpcMethods"]

#: An rpc method: keyword parameters (plain scalars) in, a flat result (or None) out.
RpcMethod = Callable[..., RpcResult | None]


class RpcMethods:
    """Name -> method. :meth:`answer` turns any request into exactly one reply.

    An unknown method, parameters the method does not take, or a method that
    raises all answer ``success=False`` with a message saying which; the
    caller's loop goes on.
    """

    def __init__(self) -> None:
        self._methods: dict[str, RpcMethod] = {}

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
        """Run ``req``'s method and build its reply (never raises)."""
        fn = self._methods.get(req.method)
        if fn is None:
            return RpcReqOutput(rid=req.rid, success=False,
                                message=f"unknown rpc method {req.method!r}; known: "
                                        f"{', '.join(sorted(self._methods))}")
        params: dict[str, Scalar] = req.parameters
        try:
            inspect.signature(fn).bind(**params)
        except TypeError as exc:
            return RpcReqOutput(rid=req.rid, success=False,
                                message=f"bad parameters for {req.method!r}: {exc}")
        try:
            result = fn(**params)
        except Exception as exc:
            return RpcReqOutput(rid=req.rid, success=False,
                                message=f"{req.method} failed: {type(exc).__name__}: {exc}")
        return RpcReqOutput(rid=req.rid, success=True, message="ok", result=result)
