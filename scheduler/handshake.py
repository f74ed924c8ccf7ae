"""The ``hello`` handshake: peers compare wire layouts before any request is sent.

Messages are array-like, so a client one field behind its scheduler would
mis-read fields or fail message by message. ``hello`` settles it once, up
front. The client sends its protocol version, its layout's fingerprint and
the layout itself (about 3 KB of JSON); the scheduler compares them with its
own (:func:`messages.compare_peers`: the client's read as old, the
scheduler's as new, and an optional trailing field on either side alone is
compatible) and answers:

* the same fingerprint: accepted (the common case: no layout is parsed);
* compatible differences only: accepted, each logged on both sides;
* a breaking difference or another protocol version: refused; logged on the
  scheduler as a :class:`~messages.ProtocolMismatch`, raised on the client
  as one, naming every type and field.

The reply is an ordinary rpc reply (``success=True``: the call worked) whose
result says ``accepted`` and lists the ``differences``, so an outside client
can read it without knowing this module. A client that never says hello is
served as before: the handshake is a check, not a gate (the scheduler
cannot tell which requests come from which client).

Client side: :func:`hello`. Scheduler side: :func:`answer_hello`, which
every :class:`~scheduler.core.rpc_methods.RpcMethods` registers as ``hello``.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Final

import msgspec

from bus import RpcClient
from messages import (
    PROTOCOL_VERSION,
    ProtocolMismatch,
    RpcReqOutput,
    RpcResult,
    Scalar,
    compare_peers,
    fingerprint,
    fit_text,
    layout_from_json,
    layout_to_json,
    wire_layout,
)

__all__ = ["HELLO_METHOD", "HelloReply", "answer_hello", "hello", "hello_answer", "hello_params",
           "local_protocol"]

log = logging.getLogger("scheduler.handshake")

#: The rpc method name of the handshake.
HELLO_METHOD: Final = "hello"
#: Most differences one reply lists (each names a type and field).
_MAX_LISTED: Final = 256
#: Most characters one hello logs.
_MAX_LOGGED: Final = 1000


class HelloReply(msgspec.Struct, frozen=True):
    """What a scheduler answered to an accepted ``hello``.

    Attributes:
        protocol_version: the scheduler's framing version.
        fingerprint: the scheduler's layout fingerprint.
        differences: the compatible differences (empty when the layouts
            are equal), one line each, naming type and field.
    """

    protocol_version: int
    fingerprint: str
    differences: tuple[str, ...] = ()


@functools.cache
def local_protocol() -> tuple[str, str]:
    """(fingerprint, layout JSON) of this process's catalogue, computed once."""
    layout = wire_layout()
    return fingerprint(layout), layout_to_json(layout)


def answer_hello(protocol_version: int, fingerprint: str, layout: str = "") -> RpcResult:
    """The scheduler's answer to a ``hello``: accepted or not, and the differences.

    Its parameters are the rpc's, exactly (:class:`messages.rpc_api.HelloParams`):
    any other fails the call. Logs a refusal as an error (the
    :class:`~messages.ProtocolMismatch` text) and compatible differences as a
    warning. Never raises on a
    mismatch: the answer says it (``accepted=False``), so the caller can
    name every difference too.

    Raises:
        ValueError: ``layout`` is needed (the fingerprints differ) but is not
            a layout, or a parameter has the wrong type (``True`` is not a
            version); the rpc reply then says so (``success=False``).
    """
    if (type(protocol_version) is not int or type(fingerprint) is not str
            or type(layout) is not str):
        raise ValueError("hello takes protocol_version (int), fingerprint (str) and "
                         "layout (str)")
    ours, our_layout = local_protocol()
    result: RpcResult = {"protocol_version": PROTOCOL_VERSION, "fingerprint": ours}
    if protocol_version == PROTOCOL_VERSION and fingerprint == ours:
        result["accepted"] = True
        return result
    lines: list[str] = []
    breaking = False
    if protocol_version != PROTOCOL_VERSION:
        breaking = True
        lines.append(f"breaking: protocol version {protocol_version} (client) vs "
                     f"{PROTOCOL_VERSION} (scheduler)")
    if fingerprint != ours:
        if not layout:
            raise ValueError(f"fingerprint {fingerprint!r} differs from ours ({ours!r}) and "
                             "no layout was sent to compare")
        diffs = compare_peers(layout_from_json(layout), wire_layout())
        breaking = breaking or any(d.breaking for d in diffs)
        lines.extend(str(d) for d in diffs)
        result["layout"] = our_layout
    listed: list[Scalar] = list(lines[:_MAX_LISTED])
    result["accepted"] = not breaking
    result["differences"] = listed
    # One line each, bounded: a peer saying hello in a loop must not flood the log.
    if breaking:
        log.error("hello refused: %s", fit_text(str(ProtocolMismatch(
            "client", [line for line in lines if line.startswith("breaking")],
            (PROTOCOL_VERSION, protocol_version))), _MAX_LOGGED))
    else:
        log.warning("hello from a client accepted with compatible differences: %s",
                    fit_text("; ".join(lines), _MAX_LOGGED))
    return result


def hello(client: RpcClient, timeout: float = 5.0, *,
          alive: Callable[[], bool] | None = None) -> HelloReply:
    """Say hello to the scheduler behind ``client``; raise if it refuses our layout.

    Call it once, after connecting and before the first request. Costs one
    rpc round trip (well under a millisecond locally, see
    ``hello_ms_p50`` in ``python -m benchmarks.bus``).

    Raises:
        ProtocolMismatch: the scheduler refused: its ``.differences`` name
            each breaking type and field (and ``.peer`` the endpoint).
        RpcTimeout, PeerGone, ChannelClosed: as :meth:`bus.RpcClient.call`.
    """
    reply = client.call(HELLO_METHOD, timeout=timeout, alive=alive, **hello_params())
    return hello_answer(reply, f"scheduler at {client.endpoint}")


def hello_params() -> dict[str, Scalar]:
    """The ``hello`` rpc's parameters: our protocol version, fingerprint and layout (for
    a caller that makes the call its own way, as ``AsyncEngine`` does)."""
    fp, layout = local_protocol()
    return {"protocol_version": PROTOCOL_VERSION, "fingerprint": fp, "layout": layout}


def hello_answer(reply: RpcReqOutput, peer: str) -> HelloReply:
    """What ``peer``'s answer to our ``hello`` says; raise if it refused our layout.

    Raises:
        ProtocolMismatch: as :func:`hello`.
    """
    if not reply.success:  # a scheduler that predates hello, or a bad layout
        raise ProtocolMismatch(peer, [f"hello failed: {reply.message}"])
    result = reply.result or {}
    version = _one(result, "protocol_version")
    their_fp = _one(result, "fingerprint")
    accepted = _one(result, "accepted")
    differences = [str(d) for d in _many(result, "differences")]
    if accepted is not True or not isinstance(version, int) or not isinstance(their_fp, str):
        raise ProtocolMismatch(
            peer, [d for d in differences if d.startswith("breaking")] or
            [f"hello refused: {reply.message}"],
            (PROTOCOL_VERSION, version) if isinstance(version, int) else None)
    if differences:
        log.warning("%s accepted our hello with compatible differences: %s", peer,
                    "; ".join(differences))
    return HelloReply(version, their_fp, tuple(differences))


def _one(result: RpcResult, key: str) -> Scalar:
    """A scalar result; from several tp ranks (a list, one per rank) they must agree."""
    value = result.get(key)
    if isinstance(value, list):
        return value[0] if value and all(v == value[0] for v in value) else None
    return value


def _many(result: RpcResult, key: str) -> list[Scalar]:
    """A list result, or its ``key.rank<r>`` lists from several tp ranks, merged."""
    value = result.get(key)
    if isinstance(value, list):
        return value
    merged: list[Scalar] = []
    for k, v in result.items():
        if k.startswith(f"{key}.rank") and isinstance(v, list):
            merged.extend(x for x in v if x not in merged)
    return merged
