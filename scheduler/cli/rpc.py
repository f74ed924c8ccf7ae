"""``python -m scheduler rpc DIR METHOD [key=value ...]``: call a running scheduler.

DIR is what ``serve --endpoint DIR`` or ``python -m frontend --endpoint DIR``
was given (the call goes to ``ipc://DIR/rpc``), or a ``tcp://`` rpc
endpoint. Each ``key=value`` is a parameter; a value is read as JSON when
it is a JSON scalar (``n=3``, ``flag=true``, ``x=null``, ``s="3"``), else
as a plain string (``path=/tmp/model.ckpt``). The reply is printed as one
JSON object; the exit status is 1 when ``success`` is false (2 when no
reply came, at once when nothing listens at an ``ipc://`` endpoint).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence

import msgspec
import zmq

from bus import RpcClient
from bus.sockets import ipc_listening
from messages import BusError, Scalar

__all__ = ["parse_params", "rpc_endpoint", "run_rpc"]


def rpc_endpoint(target: str) -> str:
    """``ipc://DIR/rpc`` for a directory; a ``tcp://`` or ``ipc://`` endpoint as given."""
    if target.startswith(("tcp://", "ipc://")):
        return target
    return f"ipc://{os.path.abspath(target)}/rpc"


def _unreachable(endpoint: str) -> str:
    """Why nothing can answer at an ``ipc://`` endpoint (``""``: something may)."""
    if not endpoint.startswith("ipc://"):
        return ""
    path = endpoint[len("ipc://"):]
    folder = os.path.dirname(path) or "."
    if ((os.path.isdir(folder) and not os.access(folder, os.X_OK)) or
            (os.path.exists(path) and not os.access(path, os.W_OK))):
        return f"permission denied at {path} (the scheduler's directory is private to " \
               f"the user that started it)"
    if not ipc_listening(endpoint):
        return f"nothing listens at {path} (no such socket, or one left by a server " \
               f"that exited): is the scheduler running with --endpoint " \
               f"{os.path.dirname(path)}?"
    return ""


def parse_params(pairs: Sequence[str]) -> dict[str, Scalar]:
    """``["path=/tmp/x", "n=3"]`` -> ``{"path": "/tmp/x", "n": 3}``.

    Raises:
        ValueError: an item has no ``=``, or an empty key.
    """
    params: dict[str, Scalar] = {}
    for pair in pairs:
        key, eq, raw = pair.partition("=")
        if not eq or not key:
            raise ValueError(f"parameter {pair!r} is not key=value")
        if key in ("timeout", "alive"):
            raise ValueError(f"parameter {key!r}: the rpc client's own option, not a "
                             f"method's parameter (use --timeout)")
        try:
            parsed = json.loads(raw)
        except ValueError:
            parsed = raw
        if parsed is None or isinstance(parsed, bool | int | float | str):
            params[key] = parsed
        else:  # (a list or an object: taken as the text it is)
            params[key] = raw
    return params


def run_rpc(target: str, method: str, pairs: Sequence[str], *, timeout: float = 30.0) -> int:
    """Call ``method`` on the scheduler at ``target``, print the reply; the exit status."""
    try:
        params = parse_params(pairs)
    except ValueError as exc:
        print(f"rpc: {exc}", file=sys.stderr)
        return 2
    if not target:
        print("rpc: no endpoint: give the --endpoint DIR the scheduler serves (or a "
              "tcp:// rpc endpoint)", file=sys.stderr)
        return 2
    endpoint = rpc_endpoint(target)
    unreachable = _unreachable(endpoint)
    if unreachable:  # zmq would wait out the whole timeout for a peer that cannot come
        print(f"rpc: {method}: {unreachable}", file=sys.stderr)
        return 2
    try:
        with RpcClient(endpoint, name="rpc-cli") as client:
            # (``params`` holds neither "timeout" nor "alive": refused above)
            reply = client.call(method, timeout=timeout, **params)  # type: ignore[arg-type]
    # (ValueError, ZMQError: an endpoint that is not one, as tcp://host:abc)
    except (BusError, OSError, ValueError, zmq.ZMQError) as exc:
        print(f"rpc: {method} at {endpoint}: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(msgspec.json.encode({"rid": reply.rid, "success": reply.success,
                                          "message": reply.message,
                                          "result": reply.result}).decode() + "\n")
    return 0 if reply.success else 1
