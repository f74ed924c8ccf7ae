"""Running a dispatcher: its upstream channels around a :class:`Dispatcher`.

What waits for a caller that does not read its rpc replies is bounded by
:data:`RPC_HWM` as well as by the backlog: the rpc socket keeps at most
``RPC_HWM`` replies per caller (zmq counts messages, so the default is
chosen for bytes: 64 replies of the largest usual one, ``metrics`` at about
20 KB, are about 1.3 MB, where the socket's general mark of 10 000 let
12 000 unread ``metrics`` replies grow the dispatcher by 238 MB); past it,
replies wait in the dispatcher's backlog (``max_backlog`` per caller) and
are then dropped and counted (``dispatcher.*`` in ``get_load``, one
summarized log line). A caller sending faster than it reads is held back at
the same mark on its side (its calls wait in its own socket).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import zmq

from bus import CurveAuthenticator, PullInbox, PushOutbox, RpcServer, SocketOptions
from messages import OUT, WORK
from scheduler.dp.dispatcher import Dispatcher
from scheduler.dp.ledger import Policy
from scheduler.dp.replica import ReplicaSpec
from scheduler.launch.wiring import Endpoints, rpc_codec

__all__ = ["RPC_HWM", "serve_dispatch"]

#: Replies (and calls) the upstream rpc socket keeps per caller (see the module docstring).
RPC_HWM = 64


def serve_dispatch(endpoints: Endpoints, replicas: Sequence[ReplicaSpec], *,
                   options: SocketOptions | None = None,
                   curve_clients: Sequence[bytes] | None = None,
                   policy: Policy = "least_loaded", rpc_timeout: float = 30.0,
                   heartbeat_interval: float = 0.2, heartbeat_timeout: float = 2.0,
                   join_timeout: float = 60.0, max_backlog: int = 1024,
                   pd: tuple[int, int] | None = None, handoff_deadline: float = 60.0,
                   max_handoff_bytes: int = 512 << 20,
                   stop_requested: Callable[[], bool] | None = None) -> bool:
    """Serve ``endpoints`` like one scheduler, dispatching over ``replicas``, until a
    ``shutdown`` rpc (which reaches every replica) has been answered.

    Returns whether that shutdown reached every replica (``False``: one was
    down; a command line should exit non-zero).

    ``options`` and ``curve_clients`` are for the upstream side, as in
    :func:`~scheduler.launch.wiring.serve_zmq`; each replica carries its own
    options in its :class:`ReplicaSpec`. ``stop_requested`` (a command's stop signal,
    asked every step) ends the loop as a ``KeyboardInterrupt`` would. See
    :class:`Dispatcher` for the rest.
    """
    options = options or SocketOptions()
    auth = CurveAuthenticator(zmq.Context.instance(), curve_clients) \
        if curve_clients is not None else None
    try:
        with PullInbox(WORK.inbound_codec(), endpoints.work, options=options) as work, \
                RpcServer(rpc_codec(), endpoints.rpc,
                          options=dataclasses.replace(options, hwm=min(options.hwm, RPC_HWM))
                          ) as rpc, \
                PushOutbox(OUT.outbound_codec(), endpoints.out, options=options,
                           bind=endpoints.server_binds_out, watch_peers=True) as out:
            dispatcher = Dispatcher(work, rpc, out, replicas, policy=policy,
                                    rpc_timeout=rpc_timeout,
                                    heartbeat_interval=heartbeat_interval,
                                    heartbeat_timeout=heartbeat_timeout,
                                    join_timeout=join_timeout, max_backlog=max_backlog,
                                    pd=pd, handoff_deadline=handoff_deadline,
                                    max_handoff_bytes=max_handoff_bytes,
                                    stop_requested=stop_requested)
            try:
                return dispatcher.run()
            finally:
                dispatcher.close()
    finally:
        if auth is not None:
            auth.stop()
