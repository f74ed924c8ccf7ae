"""zmq socket set-up in one place: endpoints, options and their reasons.

Defaults, and why:

* **High-water marks** (``hwm``, default 10 000 messages per direction).
  vLLM and SGLang set HWM=0 (unbounded) so nothing is dropped; that trades a
  lost message for unbounded memory and a silent stall. We keep a finite
  bound: a socket's queue is a second queue beside the scheduler's admission
  queue (``Limits``), held in memory no limit accounts for, so it is kept
  to about twice the default admission queue. Measured (``benchmarks/soak``,
  200k requests offered past the limits): 100 000 let the server's RSS grow
  by ~100 MiB and rpc p99 reach 53 ms; 10 000 held growth to ~7 MiB and rpc
  p99 to 32 ms. Reaching the mark is *visible*: PUSH and DEALER sends block
  at the mark (they never drop) for at most ``send_timeout``, then raise
  :class:`~bus.errors.WouldBlock` naming the channel; ROUTER sockets set
  ``ROUTER_MANDATORY`` so an unroutable or full peer is an error, not a drop.
  The mark counts zmq messages, and a burst (``messages.burst``) is one: a
  socket may then hold up to ``SEND_BURST`` times more requests. The
  scheduler's admission still refuses past ``Limits`` on arrival, so that
  excess is answered ``overloaded``, not kept.
* **LINGER**: 0 for receiving sockets (nothing to flush); ``linger`` (1 s)
  for sending ones, so a close flushes queued outputs without hanging on a
  dead peer.
* **MAXMSGSIZE**: the codec's byte bound plus slack; zmq refuses a bigger
  message before allocating it.
* **tcp binds to loopback** unless ``allow_remote=True``.
* **Handshake interval** (``handshake_ms``, 5 s, zmq's default is 30 s): a
  peer that connects and never completes the ZMTP handshake (a raw socket
  writing garbage) is dropped after it, instead of holding a connection.
* **CURVE** (``curve_keys``): a socket that binds with keys is a CURVE
  server; one that connects with ``curve_server_public`` is a CURVE client
  (it must have keys too). Admit clients with :class:`~bus.CurveAuthenticator`.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import os
import socket
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

import zmq

from bus.curve import CurveKeys
from bus.errors import EndpointInUse
from messages import DEFAULT_MAX_MESSAGE_BYTES

__all__ = ["SocketOptions", "check_endpoint", "close_socket", "ipc_listening", "make_socket",
           "refuse_live_ipc"]


@dataclass(frozen=True, slots=True)
class SocketOptions:
    """Tunables shared by every zmq channel (see the module docstring for the reasons)."""

    hwm: int = 10_000
    linger_ms: int = 1000
    send_timeout_ms: int = 10_000
    handshake_ms: int = 5_000
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    allow_remote: bool = False
    curve_keys: CurveKeys | None = None
    curve_server_public: bytes | None = None


_WILDCARDS = ("tcp://*", "tcp://0.0.0.0", "tcp://[::]", "tcp://::")


def check_endpoint(endpoint: str, *, bind: bool, allow_remote: bool) -> None:
    """Refuse unknown transports, a tcp endpoint with no port, and a non-loopback tcp
    bind unless allowed.

    Raises:
        ValueError: the endpoint is not ipc://, tcp:// or inproc://, a tcp one's
            port is not 1-65535 (``*`` or ``0``, any free port, when binding), or it binds
            beyond loopback without ``allow_remote``.
    """
    if not endpoint.startswith(("ipc://", "tcp://", "inproc://")):
        raise ValueError(f"unsupported endpoint {endpoint!r} (ipc://, tcp:// or inproc://)")
    if endpoint.startswith("ipc://") and not ipc_path_fits(endpoint):
        raise ValueError(f"{endpoint!r}: its path is {len(os.fsencode(endpoint[6:]))} bytes, "
                         f"more than the {IPC_PATH_MAX} a Unix socket's may hold (use a "
                         "shorter directory)")
    port = endpoint.rsplit(":", 1)[-1]
    if (endpoint.startswith("tcp://") and not (port.isdigit() and 0 < int(port) < 65536)
            and not (bind and port in ("*", "0"))):
        raise ValueError(f"{endpoint!r} needs a port (1-65535) after its last ':'")
    if bind and endpoint.startswith("tcp://") and not allow_remote:
        host = endpoint[6:].rsplit(":", 1)[0]
        if endpoint.startswith(_WILDCARDS) or not _loopback(host):
            raise ValueError(
                f"refusing to bind {endpoint!r} beyond loopback; pass allow_remote=True "
                "(--allow-remote on the command line), and configure CURVE keys, to "
                "accept other hosts")


def _loopback(host: str) -> bool:
    """Whether ``host`` (an endpoint's, IPv6 in brackets) names loopback: ``localhost``
    in any case, or an address of 127.0.0.0/8 or ::1 in any spelling (an IPv4-mapped
    one too). A name other than ``localhost`` is not resolved: it could name any host."""
    if host.lower() == "localhost":
        return True
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped.is_loopback
    return address.is_loopback


def make_socket(
    ctx: zmq.Context[zmq.Socket[bytes]],
    kind: int,
    endpoint: str,
    *,
    bind: bool,
    options: SocketOptions,
    sending: bool,
    prepare: Callable[[zmq.Socket[bytes]], None] | None = None,
) -> zmq.Socket[bytes]:
    """Create, configure and bind/connect one socket; ``prepare`` is called with it
    configured, before it binds or connects (a socket monitor attached there sees
    every connection: one attached later can miss the first)."""
    check_endpoint(endpoint, bind=bind, allow_remote=options.allow_remote)
    if bind and endpoint.startswith("ipc://"):
        refuse_live_ipc(endpoint)
    sock = ctx.socket(kind)
    try:
        sock.setsockopt(zmq.SNDHWM, options.hwm)
        sock.setsockopt(zmq.RCVHWM, options.hwm)
        sock.setsockopt(zmq.LINGER, options.linger_ms if sending else 0)
        sock.setsockopt(zmq.SNDTIMEO, options.send_timeout_ms)
        sock.setsockopt(zmq.MAXMSGSIZE, options.max_message_bytes + (1 << 16))
        sock.setsockopt(zmq.HANDSHAKE_IVL, options.handshake_ms)
        if kind == zmq.ROUTER:
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        _apply_curve(sock, bind=bind, options=options)
        if endpoint.startswith("tcp://["):  # an IPv6 literal: zmq refuses it unless told
            sock.setsockopt(zmq.IPV6, 1)
        if prepare is not None:
            prepare(sock)
        if bind:
            try:
                sock.bind(endpoint)
            except zmq.ZMQError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise EndpointInUse(endpoint, "another process listens on this "
                                                  "address") from None
                raise
            if endpoint.startswith("ipc://"):
                path = endpoint[len("ipc://"):]
                with contextlib.suppress(OSError):  # the very file bound: (device, inode)
                    st = os.stat(path)
                    _BOUND_IPC[sock] = (path, st.st_dev, st.st_ino)
        else:
            sock.connect(endpoint)
    except BaseException:
        sock.close(0)
        raise
    return sock


#: The ipc socket file each live socket bound: its path, device and inode (close_socket
#: removes it: libzmq leaves the file).
_BOUND_IPC: weakref.WeakKeyDictionary[zmq.Socket[bytes], tuple[str, int, int]] = \
    weakref.WeakKeyDictionary()


def close_socket(sock: zmq.Socket[bytes], linger: int | None = None) -> None:
    """Close ``sock``; the ipc socket file it bound is removed first, if the path still
    names that very file (libzmq leaves it, so an operator's directory would keep
    ``DIR/rpc`` after a clean exit). A path that names another file now (the
    directory was moved or cleared, and a new server bound there) is left alone."""
    bound = _BOUND_IPC.pop(sock, None)
    if bound is not None:
        path, dev, ino = bound
        with contextlib.suppress(OSError):
            st = os.stat(path)
            if (st.st_dev, st.st_ino) == (dev, ino):
                os.unlink(path)
    sock.close(linger)


#: connect() errors that mean nobody listens at the path.
_NOBODY: Final = frozenset({errno.ECONNREFUSED, errno.ENOENT, errno.ENOTSOCK,
                            errno.ENOTDIR})
#: How long a listener that answers may take to go away (one this process
#: closed a moment ago) before the path counts as another's, and how often to look.
_CLOSING_GRACE: Final = 0.25
_CLOSING_POLL: Final = 0.005


#: The longest path a Unix socket may have (Linux: 108 bytes with the final NUL).
IPC_PATH_MAX: Final = 107


def ipc_path_fits(endpoint: str) -> bool:
    """Whether an ``ipc://`` endpoint's path is short enough for a Unix socket."""
    path = endpoint[len("ipc://"):]
    return path.startswith("@") or len(os.fsencode(path)) <= IPC_PATH_MAX


def ipc_listening(endpoint: str) -> bool:
    """Whether a process accepts connections at ``endpoint`` (an ``ipc://`` path) now.

    False for no file, a file that is not a socket, or a socket left by a
    listener that died (refused). A listener whose backlog is full (a hung
    process) still listens. An abstract-namespace path cannot be probed: True.
    """
    path = endpoint[len("ipc://"):]
    if path.startswith("@"):
        return True
    if not ipc_path_fits(endpoint):
        return False  # nothing can listen there (connect would fail with no errno)
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(path)
    except OSError as exc:
        return exc.errno not in _NOBODY  # EAGAIN / a timeout: a listener, full
    finally:
        probe.close()
    return True


def refuse_live_ipc(endpoint: str) -> None:
    """Raise if a live process listens on ``endpoint`` (an ``ipc://`` path).

    Binding unlinks and replaces the path: the listener already there would
    stop receiving, silently. A stale file (its listener died) is fine.

    Raises:
        EndpointInUse: something accepts connections there.
    """
    if endpoint[len("ipc://"):].startswith("@"):
        return  # abstract namespace: zmq itself refuses one that is taken
    deadline = time.monotonic() + _CLOSING_GRACE
    while ipc_listening(endpoint):
        if time.monotonic() >= deadline:
            raise EndpointInUse(endpoint, "another live process listens here; binding "
                                          "would take its traffic away from it silently")
        # zmq closes a listener asynchronously: one this process just closed
        # answers for a few milliseconds more.
        time.sleep(_CLOSING_POLL)


def _apply_curve(sock: zmq.Socket[bytes], *, bind: bool, options: SocketOptions) -> None:
    keys = options.curve_keys
    if bind and keys is not None:
        sock.curve_secretkey = keys.secret
        sock.curve_publickey = keys.public
        sock.curve_server = True
    elif not bind and options.curve_server_public is not None:
        if keys is None:
            raise ValueError("a CURVE client needs its own curve_keys")
        sock.curve_secretkey = keys.secret
        sock.curve_publickey = keys.public
        sock.curve_serverkey = options.curve_server_public
