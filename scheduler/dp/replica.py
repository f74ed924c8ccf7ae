"""One replica as the dispatcher sees it: its three channels, its liveness, its generation.

A replica is an unchanged scheduler served by :func:`~scheduler.launch.wiring.serve_zmq`,
local or remote. The dispatcher holds, per replica, a PUSH to its work
endpoint, a PULL for its outputs and an :class:`~bus.RpcCaller` to its rpc
endpoint; every inbox is named after the replica, so the origin of each
output says who sent it (never the payload).

Death is seen two ways:

* **process gone** (local replicas, when their pids are known): a
  ``pidfd`` per process becomes readable the moment it exits, whoever its
  parent is; checked every dispatcher tick, so within tens of milliseconds;
* **silence**: a heartbeat (``get_load``, which also reports its load)
  goes out every ``heartbeat_interval``; no reply for ``heartbeat_timeout``
  of the dispatcher's *awake* time means lost (:mod:`scheduler.dp.liveness`).
  This covers remote replicas and a local one that hangs.

A lost replica's connections are closed (whatever they still hold from
that incarnation is dropped) and reopened at once for the next one: a probe
goes out every ``heartbeat_interval`` and the first answer makes the
replica live again with ``generation + 1``. Entries of the ledger carry the
generation they were dispatched under, so an output from an earlier
incarnation is refused as stale.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field

import zmq

from bus import ChannelError, PullInbox, PushOutbox, RpcCaller, SocketOptions
from bus.fdwait import wait_readable
from messages import OUT, WORK, AbortReq, Output, Request
from scheduler.dp.liveness import Health
from scheduler.launch.wiring import Endpoints

__all__ = ["Replica", "ReplicaSpec", "check_distinct"]

log = logging.getLogger("scheduler.dp")


@dataclass(frozen=True, slots=True)
class ReplicaSpec:
    """Where a replica serves, and how to reach it.

    Attributes:
        endpoints: its work, rpc and out endpoints (``ipc://`` or ``tcp://``).
        pids: its processes (every tensor-parallel rank), when local: their
            exit is seen at once. Empty for a remote replica (heartbeat only).
        options: socket options to reach it (CURVE: this dispatcher's keys
            and the replica's ``curve_server_public``).
    """

    endpoints: Endpoints
    pids: tuple[int, ...] = ()
    options: SocketOptions = field(default_factory=SocketOptions)


def _scheduler_at(endpoints: Endpoints) -> tuple[str, frozenset[str]]:
    """Where ``endpoints``' scheduler is, spelled one way: its ``ipc://`` directory
    with links resolved, or its ``tcp://`` port with every address its host names."""
    work = endpoints.work
    if work.startswith("tcp://"):
        host, port = work[len("tcp://"):].rsplit(":", 1)
        host = host.strip("[]")
        try:
            found = {str(info[4][0]) for info in socket.getaddrinfo(host, None)}
        except (OSError, UnicodeError):  # not resolvable here: compared as written
            found = set()
        return f"tcp:{port}", frozenset(found | {host.lower()})
    directory = os.path.dirname(work.removeprefix("ipc://"))
    return "ipc", frozenset({os.path.realpath(directory)})


def check_distinct(specs: Sequence[ReplicaSpec]) -> None:
    """Refuse two replicas that are one scheduler (its endpoints named twice, as
    written or spelled otherwise: ``localhost`` and ``127.0.0.1``, a link to its
    directory). Its outputs would go to two consumers by turns, and each request's
    tokens that reached the other would be dropped as another replica's.

    Raises:
        ValueError: naming both replicas and the endpoint they share.
    """
    seen: list[tuple[str, frozenset[str]]] = []
    for i, spec in enumerate(specs):
        kind, where = _scheduler_at(spec.endpoints)
        for j, (other_kind, other) in enumerate(seen):
            if kind == other_kind and where & other:
                raise ValueError(
                    f"replica{j} ({specs[j].endpoints.work}) and replica{i} "
                    f"({spec.endpoints.work}) are the same scheduler: name each replica once")
        seen.append((kind, where))


class Replica:
    """The dispatcher's handle on replica ``index``."""

    def __init__(self, index: int, spec: ReplicaSpec, *,
                 unclaimed_timeout: float | None = None) -> None:
        self.index = index
        #: Seconds a large message to it may stay unread in shared memory before
        #: its slab is taken back (``None``: the pool's own default).
        self.unclaimed_timeout = unclaimed_timeout
        self.name = f"replica{index}"
        self.spec = spec
        self.generation = 0
        self.live = False  # until its first heartbeat answers
        self.joined = False  # has been live at least once
        #: The model it last reported (``get_load``'s ``model``), when it did.
        self.model: str | None = None
        #: The model for which it was last refused a join (logged once per model).
        self.refused_model: str | None = None
        self.health = Health()  # what it showed us (see scheduler.dp.liveness)
        self.next_beat = 0.0
        self.pid: int | None = None  # the pid its heartbeat reports (which incarnation)
        #: Rids lost to this replica's silence: it may still be running them. They
        #: are aborted when it returns, their outputs are stale, and a new request
        #: under one of these rids goes elsewhere (here it would be a duplicate).
        self.orphans: set[str] = set()
        self._pids: list[int] = list(spec.pids)
        self._pidfds: list[int] = []
        for pid in spec.pids:
            try:
                self._pidfds.append(os.pidfd_open(pid))
            except ProcessLookupError:
                self._pidfds.append(-1)  # already gone: reported on the first check
        self.work: PushOutbox[Request]
        self.out: PullInbox[Output]
        self.rpc: RpcCaller
        self._open()

    def _open(self, out: bool = True) -> None:
        ep, opts = self.spec.endpoints, self.spec.options
        self.work = PushOutbox(WORK.inbound_codec(), ep.work, name=f"{self.name}.work",
                               options=opts)
        if self.work.shm_frames is not None and self.unclaimed_timeout is not None:
            self.work.shm_frames.unclaimed_timeout = self.unclaimed_timeout
        if out:
            self.out = PullInbox(OUT.outbound_codec(), ep.out, name=f"{self.name}.out",
                                 options=opts, bind=not ep.server_binds_out)
        self.rpc = RpcCaller(ep.rpc, name=f"{self.name}.rpc", options=opts)

    def reopen(self) -> None:
        """Drop this incarnation's connections (and all they hold); open fresh ones.

        An output endpoint this dispatcher *binds* (``ipc://``) stays: closing
        a listener is asynchronous, so binding the path again at once could
        find the old one still there, and the next incarnation connects to it
        anyway. What the old one left in it is stale by the ledger's rules.
        """
        rebind = self.spec.endpoints.server_binds_out
        self._close_channels(out=rebind)
        self._open(out=rebind)

    def process_exit(self) -> str | None:
        """Why the replica's processes say it is gone, or ``None`` (never blocks)."""
        if not self._pidfds:
            return None
        if -1 in self._pidfds:
            return "its process was gone at start-up"
        ready = wait_readable(self._pidfds, 0)
        if not ready:
            return None
        return f"its process {self._pids[self._pidfds.index(ready[0])]} exited"

    @property
    def local(self) -> bool:
        """Whether its processes are known (and so can be watched and stopped)."""
        return bool(self._pidfds)

    def cpu_wait(self) -> float:
        """Seconds its (main) process has spent runnable but waiting for a CPU; 0 if
        not known (a remote replica, or no ``/proc/<pid>/schedstat``)."""
        if not self._pids:
            return 0.0
        try:
            with open(f"/proc/{self._pids[0]}/schedstat", "rb") as f:
                return int(f.read().split()[1]) / 1e9
        except (OSError, ValueError, IndexError):
            return 0.0

    def abort_orphans(self) -> None:
        """Back after a silence: abort what it may still run for the requests it lost."""
        for rid in sorted(self.orphans):
            try:
                self.work.send_nowait(AbortReq(rid=rid))
            except ChannelError as exc:
                log.warning("abort of orphan %r on %s not sent: %s", rid, self.name, exc)

    def watch(self, pid: int) -> None:
        """A local replica answers from process ``pid`` (a restart): watch its exit.

        Only for a replica started local (its spec names pids); a remote one's
        pid means nothing here. Stops watching an earlier incarnation's pids.
        """
        if not self.spec.pids or pid in self._pids:
            return
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            return  # gone already, or not ours to see: its heartbeat tells
        for old in self._pidfds:
            if old >= 0:
                os.close(old)
        self._pids, self._pidfds = [pid], [fd]

    def bury(self) -> None:
        """Its processes exited: SIGKILL the ranks still running (a rank left alone
        would wait for its dead peer forever), and stop watching those pids. A
        replica restarted in their place is watched by its heartbeat."""
        for fd in self._pidfds:
            if fd >= 0:
                with contextlib.suppress(ProcessLookupError):
                    signal.pidfd_send_signal(fd, signal.SIGKILL)
                os.close(fd)
        self._pidfds, self._pids = [], []
        self.orphans.clear()  # whatever it was running died with it

    def _close_channels(self, linger: bool = False, out: bool = True) -> None:
        if not linger and not self.work.closed:
            self.work.socket.setsockopt(zmq.LINGER, 0)  # a dead peer holds nothing back
        self.work.close()
        if out:
            self.out.close()
        self.rpc.close()

    def abort(self, rid: str) -> None:
        """Ask it to abort ``rid`` (its work channel full or gone: its own backlog ends it)."""
        with contextlib.suppress(ChannelError):
            self.work.send_nowait(AbortReq(rid=rid))

    def close(self, linger: bool = True) -> None:
        """Close its channels and pidfds. Idempotent."""
        self._close_channels(linger)
        for fd in self._pidfds:
            if fd >= 0:
                os.close(fd)
        self._pidfds = []
