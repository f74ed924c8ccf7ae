"""Command line: ``python -m scheduler demo``, ``serve``, ``dispatch``, ``top`` and ``rpc``."""

from __future__ import annotations

import _thread
import argparse
import os
import shutil
import signal
import stat
import sys
from collections.abc import Callable, Sequence

from bus import CurveKeys, EndpointInUse, SocketOptions, check_endpoint
from bus.fdlimit import raise_open_files_limit
from scheduler.cli.demo import demo
from scheduler.cli.options import (
    add_backlog_option,
    add_curve_options,
    add_dp_policy_option,
    add_handoff_options,
    add_pd_option,
    add_scheduler_options,
    curve_options,
    limits_from,
)
from scheduler.cli.rpc import run_rpc
from scheduler.cli.signals import StopSignals, ignore_stop_signals
from scheduler.cli.top import run_top
from scheduler.core.admission import Limits
from scheduler.dp import ReplicaSpec, serve_dispatch
from scheduler.dp.replica import check_distinct
from scheduler.launch.leftovers import make_run_dir
from scheduler.launch.processes import LOCAL_HEARTBEAT_TIMEOUT, start_replicas, supervise
from scheduler.launch.respawn import NoReplicaLeft
from scheduler.launch.wiring import Endpoints, serve_zmq
from scheduler.models.loading import (
    HFModelSpec,
    ModelLoadError,
    ModelSpec,
    check_model_loads,
    load_model,
    model_spec,
    own_process_threads,
)
from scheduler.models.protocol import Model


def private_dir(path: str, sockets: Sequence[str] = ()) -> str:
    """Make ``path`` a directory only this user can enter, or refuse one that is not;
    returns it resolved (symlinks and ``..``), as it was checked.

    The ipc sockets inside are the scheduler's whole surface: whoever can
    replace one can call ``shutdown`` or write files through
    ``save_checkpoint`` as this user. So a new directory is made 0700
    (whatever the umask), and an existing one must be owned by this user
    and writable by nobody else. ``sockets`` names those to be bound inside:
    a path too long for one of them is refused before anything is made.

    Raises:
        ValueError: a socket's path would be too long for a Unix socket.
        PermissionError: the directory is another user's, or group- or
            world-writable.
        NotADirectoryError: ``path`` exists and is not a directory.
    """
    for name in sockets:
        check_endpoint(f"ipc://{os.path.realpath(path)}/{name}", bind=True, allow_remote=False)
    try:
        os.mkdir(path, 0o700)
        os.chmod(path, 0o700)  # mkdir's mode is filtered by the umask; make it exact
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(f"endpoint directory {path!r} is not a directory")
    if st.st_uid != os.geteuid():
        raise PermissionError(f"endpoint directory {path!r} belongs to uid {st.st_uid}, "
                              f"not to this user (uid {os.geteuid()}): refusing it")
    if st.st_mode & 0o022:
        raise PermissionError(f"endpoint directory {path!r} is group- or world-writable "
                              f"(mode {stat.S_IMODE(st.st_mode):04o}): refusing it; "
                              f"chmod 700 it or use a new directory")
    # The directory just checked, as the kernel found it: a symlink and ".." in
    # ``path`` resolve there, where abspath's text would name another (``L/../d``
    # would bind the sockets in an unchecked 0777 directory).
    return os.path.realpath(path)


def _metrics_url(host: str, port: int) -> str:
    """The metrics endpoint's URL as a client writes it: an IPv6 host in brackets."""
    return f"http://{f'[{host}]' if ':' in host else host}:{port}/metrics"


def _add_upstream(p: argparse.ArgumentParser) -> None:
    """The options of whatever serves clients: its endpoint, limits, CURVE."""
    p.add_argument("--endpoint", required=True,
                   help="a directory for ipc:// endpoints (work, rpc, out), or a tcp base "
                        "like tcp://127.0.0.1:5550 (work=+0, rpc=+1, out=+2, all bound "
                        "here; one output consumer connects)")
    p.add_argument("--hwm", type=int, default=SocketOptions().hwm,
                   help="zmq high-water mark per socket and direction (messages)")
    add_backlog_option(p)
    add_curve_options(p, what="this server's endpoints")
    p.add_argument("--curve-out-server", metavar="PUBLIC_FILE",
                   help="the output receiver's public key, when outputs connect to it")


def _endpoints(base: str, *, bind: bool, allow_remote: bool) -> Endpoints:
    """The endpoints of a ``tcp://host:port`` base, each checked as its socket will check
    it (the base's form, then each port after it), so that a base no socket can use is
    one line before anything starts, not a traceback once the first one is bound.

    Raises:
        ValueError: no port, or 0 or ``*`` (the others follow it: it is no base), a
            port past 65535 (the base's or one after it), or a host beyond loopback
            to bind without ``allow_remote``.
    """
    check_endpoint(base, bind=False, allow_remote=allow_remote)
    endpoints = Endpoints.parse(base)
    for each in (endpoints.work, endpoints.rpc, endpoints.out):
        check_endpoint(each, bind=bind, allow_remote=allow_remote)
    return endpoints


def _upstream(parser: argparse.ArgumentParser, args: argparse.Namespace
              ) -> tuple[Endpoints, SocketOptions, list[bytes] | None]:
    ep: str = args.endpoint
    try:
        endpoints = (_endpoints(ep, bind=True, allow_remote=args.allow_remote)
                     if ep.startswith("tcp://") else
                     Endpoints.parse(private_dir(ep, Endpoints.SOCKETS)))
    except (OSError, ValueError) as exc:
        parser.error(str(exc))
    try:
        keys, allowed = curve_options(args)
    except ValueError as exc:
        parser.error(str(exc))
    out_server = CurveKeys.public_of(args.curve_out_server) if args.curve_out_server else None
    options = SocketOptions(hwm=args.hwm, allow_remote=args.allow_remote, curve_keys=keys,
                            curve_server_public=out_server)
    print(f"starting on: work={endpoints.work} rpc={endpoints.rpc} out={endpoints.out}"
          f"{' (CURVE)' if keys else ''}", file=sys.stderr)
    return endpoints, options, allowed


def _replica_specs(parser: argparse.ArgumentParser, args: argparse.Namespace
                   ) -> list[ReplicaSpec]:
    """``dispatch``'s replicas, each reached with this dispatcher's CURVE keys."""
    keys = CurveKeys.load(args.replica_curve_keys) if args.replica_curve_keys else None
    publics: list[str] = args.replica_key or []
    if bool(publics) != (keys is not None):
        parser.error("--replica-key and --replica-curve-keys go together")
    if len(publics) not in (0, 1, len(args.replica)):
        parser.error("give one --replica-key for all replicas, or one per --replica")
    specs = []
    for i, spec in enumerate(args.replica):
        if not spec.startswith("tcp://") and not os.path.isdir(spec):
            # (the dispatcher binds a replica's out socket in its directory)
            parser.error(f"--replica {spec}: no such directory (a replica's "
                         f"'serve --endpoint DIR', or a tcp://host:port base)")
        public = CurveKeys.public_of(publics[min(i, len(publics) - 1)]) if publics else None
        opts = SocketOptions(hwm=args.hwm, allow_remote=args.allow_remote,
                             curve_keys=keys if public is not None else None,
                             curve_server_public=public)
        try:
            endpoints = (_endpoints(spec, bind=False, allow_remote=True)
                         if spec.startswith("tcp://") else Endpoints.parse(spec))
        except ValueError as exc:
            parser.error(f"--replica {spec}: {exc}")
        specs.append(ReplicaSpec(endpoints, options=opts))
    try:
        check_distinct(specs)
    except ValueError as exc:
        parser.error(f"--replica: {exc}")
    return specs


def build_parser() -> argparse.ArgumentParser:
    """The command line's parser (see ``python -m scheduler --help``)."""
    parser = argparse.ArgumentParser(prog="python -m scheduler")
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="run a generate workload and print a summary")
    d.add_argument("--mode", choices=["ring", "zmq"], default="ring")
    d.add_argument("--requests", type=int, default=200)
    d.add_argument("--max-new-tokens", type=int, default=32)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--async", dest="use_async", action="store_true",
                   help="send the requests from concurrent asyncio tasks (AsyncEngine)")
    s = sub.add_parser("serve", help="run a scheduler for outside clients (zmq mode)")
    s.add_argument("--mode", choices=["zmq"], default="zmq")
    _add_upstream(s)
    add_scheduler_options(s)
    s.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus metrics on http://HOST:PORT/metrics (0: a free "
                        "port; the 'metrics:' line on stderr names it once bound)")
    s.add_argument("--metrics-host", default="127.0.0.1",
                   help="address the metrics endpoint binds (default: loopback)")
    x = sub.add_parser("dispatch", help="serve one endpoint over scheduler replicas that "
                                        "already run (data parallel)")
    _add_upstream(x)
    x.add_argument("--replica", action="append", required=True, metavar="ENDPOINT",
                   help="a replica's ipc directory or tcp base (repeat per replica)")
    x.add_argument("--replica-key", action="append", metavar="PUBLIC_FILE",
                   help="a replica's CURVE public key (once for all, or once per replica)")
    x.add_argument("--replica-curve-keys", metavar="SECRET_FILE",
                   help="the key pair this dispatcher presents to CURVE replicas")
    add_dp_policy_option(x)
    add_pd_option(x)
    add_handoff_options(x)
    x.add_argument("--heartbeat-timeout", type=float, default=2.0,
                   help="seconds of silence after which a replica is lost (a replica "
                        "answers between steps: keep it above the longest step)")
    x.add_argument("--rpc-timeout", type=float, default=30.0,
                   help="seconds a broadcast rpc waits for every replica")
    t = sub.add_parser("top", help="a live view of a scheduler's metrics endpoint")
    t.add_argument("endpoint", help="PORT, HOST:PORT or the /metrics URL")
    t.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    t.add_argument("--frames", type=int, default=None, help="stop after this many screens")
    r = sub.add_parser("rpc", help="call a running scheduler's rpc method; print the reply")
    r.add_argument("endpoint", help="the --endpoint DIR it serves (or a tcp:// rpc endpoint)")
    r.add_argument("method")
    r.add_argument("params", nargs="*", metavar="key=value")
    r.add_argument("--timeout", type=float, default=30.0)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "rpc":
        return run_rpc(args.endpoint, args.method, args.params, timeout=args.timeout)
    if args.command == "top":
        return run_top(args.endpoint, interval=args.interval, frames=args.frames)
    if args.command == "demo":
        return demo(args.mode, args.requests, args.max_new_tokens, args.seed,
                    use_async=args.use_async)
    if args.command == "dispatch":
        specs = _replica_specs(parser, args)
        if args.pd is not None and sum(args.pd) != len(specs):
            parser.error(f"--pd {args.pd[0]}:{args.pd[1]} needs {sum(args.pd)} --replica "
                         f"(the prefill ones first), not {len(specs)}")
        try:  # (the hand-off bounds, checked as a scheduler's are)
            Limits(max_handoff_bytes=args.max_handoff_bytes,
                   handoff_deadline=args.handoff_deadline)
        except ValueError as exc:
            parser.error(str(exc))
        endpoints, options, allowed = _upstream(parser, args)
        raise_open_files_limit("scheduler dispatch")  # each client holds sockets
        signals = StopSignals()
        return _until_stopped(lambda: serve_dispatch(
            endpoints, specs, options=options, curve_clients=allowed, policy=args.dp_policy,
            heartbeat_timeout=args.heartbeat_timeout, rpc_timeout=args.rpc_timeout,
            max_backlog=args.max_backlog, pd=args.pd,
            max_handoff_bytes=args.max_handoff_bytes, handoff_deadline=args.handoff_deadline,
            stop_requested=signals.requested), signals)
    if args.pd is not None:
        if args.dp_size not in (1, sum(args.pd)):
            parser.error(f"--pd {args.pd[0]}:{args.pd[1]} runs {sum(args.pd)} replicas: "
                         f"leave --dp-size out")
        args.dp_size = sum(args.pd)
    for flag, value in (("--max-batch", args.max_batch), ("--dp-size", args.dp_size)):
        if value < 1:  # checked before anything starts: no replica could ever serve
            parser.error(f"{flag} must be at least 1, not {value}")
    try:
        model = _model(args)
        # One scheduler here: its model is loaded before anything is bound or printed,
        # so a model that does not load is one line (replicas load their own).
        loaded = model if args.dp_size > 1 else _load(model)
    except ModelLoadError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    endpoints, options, allowed = _upstream(parser, args)
    # After the checks above: a start that fails says one line, not this one too.
    raise_open_files_limit("scheduler serve")  # each client holds sockets
    try:
        limits = limits_from(args)
    except ValueError as exc:
        parser.error(str(exc))
    if args.dp_size > 1:
        return _serve_dp(args, endpoints, options, allowed, limits, model)

    def metrics_bound(port: int) -> None:  # once it listens: port 0's pick is known
        print(f"metrics: {_metrics_url(args.metrics_host, port)}", file=sys.stderr, flush=True)

    signals = StopSignals()

    def serve() -> bool:
        serve_zmq(endpoints, loaded, max_batch=args.max_batch, options=options,
                  curve_clients=allowed, limits=limits, metrics_port=args.metrics_port,
                  metrics_host=args.metrics_host, metrics_bound=metrics_bound,
                  stop_requested=signals.requested)
        return True

    return _until_stopped(serve, signals)


def _until_stopped(serve: Callable[[], bool], signals: StopSignals | None = None) -> int:
    """Run ``serve`` (True once a ``shutdown`` reached all it serves) as a command,
    stopped by ``signals`` (given: ``serve``'s loop also asks its ``requested``).

    SIGTERM unwinds like Ctrl-C, so the channels close and remove their socket
    files (Python's default SIGTERM would leave them), even when its first
    ``KeyboardInterrupt`` lands where Python cannot raise; a second signal is
    ignored (:class:`~scheduler.cli.signals.StopSignals`). Asked to stop is exit
    0, not a failure; a shutdown that did not reach every replica is 1; an
    endpoint another process serves is one line and 1, not a traceback.
    """
    with signals or StopSignals():
        try:
            return 0 if serve() else 1
        except KeyboardInterrupt:
            ignore_stop_signals()
            print("interrupted: stopping", file=sys.stderr)
            return 0
        except (EndpointInUse, NoReplicaLeft) as exc:
            print(f"scheduler: {exc}", file=sys.stderr)
            return 1


def _load(model: ModelSpec) -> Model:
    """``serve``'s model, loaded in this process (sized as a scheduler process's own).

    Raises:
        ModelLoadError: it did not load (one line: the file and the cause).
    """
    own_process_threads(model)
    return load_model(model)


def _model(args: argparse.Namespace) -> ModelSpec:
    """``serve``'s model: the built-in one, or ``--model DIR`` (checked here, that it would
    load, before any scheduler starts: one line if wrong)."""
    if args.model is None:
        return model_spec(None)
    spec = model_spec(HFModelSpec(args.model, None if args.dtype == "auto" else args.dtype,
                                  args.device))
    check_model_loads(spec)
    return spec


def _serve_dp(args: argparse.Namespace, endpoints: Endpoints, options: SocketOptions,
              allowed: list[bytes] | None, limits: Limits, model: ModelSpec) -> int:
    """``serve --dp-size N``: N local replicas (private ipc) behind a dispatcher on ``endpoints``.

    A replica that dies is restarted (:mod:`scheduler.launch.respawn`).
    Exits 0 once a ``shutdown`` reached every replica, 1 if one was down;
    SIGINT or SIGTERM to this process alone stops its replicas at once and
    exits 0 (a stop asked for is not a failure). Once every replica has been
    given up on, nothing can serve: one line says so and it exits 1.
    """
    directory = make_run_dir("dp")  # named for us: the replicas sweep it if we are killed
    none_left: list[str] = []

    def give_up(reason: str) -> None:  # (the supervisor's thread): stop the dispatcher,
        none_left.append(reason)  # which runs in the main thread, as Ctrl-C would
        _thread.interrupt_main(signal.SIGINT)

    procs, specs = start_replicas(directory, args.dp_size, model, max_batch=args.max_batch,
                                  limits=limits)
    sup = supervise(procs, directory, model, max_batch=args.max_batch, limits=limits,
                    none_left=give_up)
    reached = [False]  # a shutdown reached every replica: they exit by themselves
    signals = StopSignals()

    def serve() -> bool:
        try:
            reached[0] = serve_dispatch(endpoints, specs, options=options,
                                        curve_clients=allowed, policy=args.dp_policy,
                                        max_backlog=limits.max_backlog,
                                        heartbeat_timeout=LOCAL_HEARTBEAT_TIMEOUT,
                                        pd=args.pd, handoff_deadline=limits.handoff_deadline,
                                        max_handoff_bytes=limits.max_handoff_bytes,
                                        stop_requested=signals.requested)
        except KeyboardInterrupt:
            if none_left:
                raise NoReplicaLeft(none_left[0]) from None
            raise
        return reached[0]

    try:
        return _until_stopped(serve, signals)
    finally:
        sup.stop()
        ranks = [p for r in procs for p in r]
        if not reached[0]:  # no shutdown reached them: do not wait out a grace for nothing
            for proc in ranks:
                proc.terminate()
        for proc in ranks:
            proc.join(5.0)
            if proc.is_alive():
                proc.kill()
                proc.join()
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
