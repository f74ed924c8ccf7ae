"""``python -m frontend``: serve the OpenAI-compatible API on 127.0.0.1:8000."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import socket
import sys
from collections.abc import Sequence

import zmq

from bus import EndpointInUse, SocketOptions
from bus.fdlimit import raise_open_files_limit
from bus.sockets import make_socket, refuse_live_ipc
from frontend.app import BODY_TIMEOUT_S, MAX_BODY_BYTES, Frontend, Settings
from frontend.chat import ChatTemplate
from frontend.errors import TokenizerError
from frontend.running import run
from frontend.schemas import MAX_MODEL_NAME
from frontend.serving import HEAD_TIMEOUT_S, MAX_HEAD_BYTES, SEND_TIMEOUT_S, http_protocol
from frontend.tokenizer import load_tokenizer
from messages import MAX_TOKENS
from scheduler import HFModelSpec, ModelConfig, ModelLoadError
from scheduler.cli.options import (
    add_backlog_option,
    add_curve_options,
    add_scheduler_options,
    curve_options,
    limits_from,
)
from scheduler.launch.leftovers import make_run_dir, remove_run_dir
from scheduler.models.loading import check_model_loads

log = logging.getLogger("frontend")


#: The least --max-header-bytes may be: a request line and the headers clients send
#: (the openai client's about 600 bytes); below it every request would be a 431.
MIN_HEAD_BYTES = 1024

def build_parser() -> argparse.ArgumentParser:
    """The command line's parser (see ``python -m frontend --help``)."""
    p = argparse.ArgumentParser(prog="python -m frontend",
                                description="An OpenAI-compatible HTTP server over the bus.")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--mode", choices=["ring", "zmq"], default="ring",
                   help="ring: the scheduler runs in this process (a thread, fed through an "
                        "in-process ring); zmq: in its own process")
    p.add_argument("--tp-size", type=int, default=1)
    add_scheduler_options(p)
    add_backlog_option(p)
    p.add_argument("--max-body-bytes", type=int, default=MAX_BODY_BYTES,
                   help="request bodies past this are answered 413")
    p.add_argument("--body-timeout", type=float, default=BODY_TIMEOUT_S, metavar="SECONDS",
                   help="a request body not read whole this long after its headers is "
                        "answered 408 (a client that dribbles it holds no handler longer)")
    p.add_argument("--max-header-bytes", type=int, default=MAX_HEAD_BYTES,
                   help="a request whose line and headers pass this is answered 431")
    p.add_argument("--header-timeout", type=float, default=HEAD_TIMEOUT_S, metavar="SECONDS",
                   help="a request whose headers are not whole this long after their first "
                        "byte is answered 408 (a client that stops mid-header holds nothing)")
    p.add_argument("--send-timeout", type=float, default=SEND_TIMEOUT_S, metavar="SECONDS",
                   help="a client that reads nothing of its answer this long, once the "
                        "server's buffer for it is full, is disconnected and its request "
                        "aborted (a stream nobody reads holds no slot or memory longer)")
    p.add_argument("--default-max-tokens", type=int, default=256,
                   help="max_tokens of a chat request that gives none")
    p.add_argument("--tokenizer", metavar="DIR_OR_FILE", default=None,
                   help="a Hugging Face tokenizer.json (or a directory with one and its "
                        "tokenizer_config.json); default: --model's directory, else the "
                        "built-in byte-level tokenizer")
    p.add_argument("--tiny-model", choices=["gru", "stub"], default=None,
                   help="without --model: the small seeded GRU (the default), or a "
                        "zero-cost stub (benchmarks)")
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the model names clients may give; answers report the first "
                        "(default: 'tiny', or --model as given, as vLLM and SGLang serve it)")
    p.add_argument("--metrics", action=argparse.BooleanOptionalAction, default=True,
                   help="serve /metrics (the scheduler's families and the HTTP ones)")
    p.add_argument("--endpoint", metavar="DIR_OR_TCP", default=None,
                   help="serve the scheduler's rpc endpoint here: ipc://DIR/rpc (DIR made "
                        "0700), or a tcp:// endpoint; default: a private temporary directory")
    add_curve_options(p, what="the rpc endpoint")
    p.add_argument("--log-level", default="info")
    p.add_argument("--loop", choices=["auto", "asyncio", "uvloop"], default="auto",
                   help="uvicorn's event loop (auto: uvloop when installed)")
    p.add_argument("--http", choices=["auto", "h11", "httptools"], default="auto",
                   help="uvicorn's HTTP parser (auto: httptools when installed)")
    return p


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line (see ``python -m frontend --help``)."""
    return build_parser().parse_args(argv)


def _model(args: argparse.Namespace, vocab_size: int) -> ModelConfig | HFModelSpec:
    """``--model DIR`` (loaded by the scheduler, in whichever process it runs), else the
    tiny model with its vocabulary sized to the tokenizer."""
    if args.model is not None:
        spec = HFModelSpec(os.path.expanduser(args.model),
                           None if args.dtype == "auto" else args.dtype, args.device)
        try:  # one line now (that it would load), before anything is made or started
            check_model_loads(spec)
        except ModelLoadError as exc:
            raise SystemExit(f"error: {exc}") from exc
        return spec
    return ModelConfig(vocab_size=vocab_size, kind=args.tiny_model or "gru")


def _rpc_endpoint(parser_error: type[SystemExit], args: argparse.Namespace) -> str:
    """``ipc://DIR/rpc`` (DIR private, made when missing), or the tcp endpoint as given."""
    spec: str | None = args.endpoint
    if spec is not None and spec.startswith("tcp://"):
        port = spec.rsplit(":", 1)[-1]
        if port in ("0", "*"):  # bound, it would be at a port nobody is told
            raise parser_error(f"--endpoint {spec}: the rpc door needs a fixed port (0 or * "
                               "would pick one that nobody is told)")
        if port.isdigit() and int(port) == args.port:  # the door would take it first
            raise parser_error(f"--endpoint {spec}: the rpc door needs a port other than "
                               f"the HTTP server's (--port {args.port})")
        # Here, not once the engine has started (tcp://host:notaport, a port in
        # use): the door's own bind, tried and let go.
        ctx = zmq.Context()
        try:
            make_socket(ctx, zmq.ROUTER, spec, bind=True, sending=False,
                        options=SocketOptions(allow_remote=args.allow_remote)).close(0)
        except (ValueError, EndpointInUse, zmq.ZMQError) as exc:
            raise parser_error(f"--endpoint: {exc}") from exc
        finally:
            ctx.term()
        return spec
    given = spec is not None
    if spec is None:  # named for this process: removed at close (Settings.run_dir), else
        spec = make_run_dir("frontend")  # swept by a next start once we are gone
    spec = os.path.expanduser(spec)  # (as --model's)
    from scheduler.__main__ import private_dir  # the check `serve --endpoint DIR` makes
    try:
        endpoint = f"ipc://{private_dir(spec, ['rpc'])}/rpc"
        refuse_live_ipc(endpoint)  # another server's door: say so before anything starts
    except (OSError, ValueError, EndpointInUse) as exc:
        if not given:  # the run directory under TMPDIR: ours, and no --endpoint to blame
            with contextlib.suppress(OSError):
                os.rmdir(spec)
            raise parser_error(f"the rpc door's run directory: {exc} (give --endpoint, or "
                               "a shorter TMPDIR)") from exc
        raise parser_error(f"--endpoint: {exc}") from exc
    return endpoint


def _check_listen(host: str, port: int) -> None:
    """Raise SystemExit when ``host:port`` cannot be listened on: uvicorn binds only
    after the engine has started (seconds; a model load), then exits with an error."""
    if not 0 <= port <= 65535:  # (getaddrinfo takes it modulo 65536: 70000 was 4464)
        raise SystemExit(f"--port must be 0-65535, not {port}")
    if port == 0:
        return  # any free port
    from frontend.listening import open_listeners  # (as DoorServer, where it is used)

    try:  # every address the host names, bound as the server will bind them, then closed
        trials = open_listeners(host, port, backlog=1)
    except socket.gaierror as exc:
        raise SystemExit(f"--host {host}: {exc}") from exc
    except OSError as exc:
        raise SystemExit(f"--host/--port: cannot listen on {host}:{port} "
                         f"({exc.filename}): {exc.strerror}") from exc
    for trial in trials:
        trial.close()


def base_url(host: str, port: int) -> str:
    """The API's base URL as a client writes it: an IPv6 host in brackets; port 0 (any
    free one) is not known until uvicorn binds, and its start-up line names it."""
    where = f"[{host}]" if ":" in host else host
    if not port:
        return f"http://{where}:<a free port, in uvicorn's line below>/v1"
    return f"http://{where}:{port}/v1"


def settings_from(args: argparse.Namespace) -> tuple[Settings, Frontend]:
    """The app the arguments describe.

    Raises:
        SystemExit: a bad combination of arguments, or an unreadable tokenizer.
    """
    if args.tiny_model is not None and args.model is not None:
        raise SystemExit(f"--tiny-model {args.tiny_model} chooses the built-in model: "
                         "with --model, that directory's model is served instead")
    if args.pd is not None and args.mode != "zmq":
        raise SystemExit("--pd needs --mode zmq (each replica is a process)")
    if args.pd is not None and args.dp_size not in (1, sum(args.pd)):
        raise SystemExit(f"--pd {args.pd[0]}:{args.pd[1]} runs {sum(args.pd)} replicas: "
                         f"leave --dp-size out")
    if (args.tp_size > 1 or args.dp_size > 1) and args.mode != "zmq":
        raise SystemExit("--tp-size and --dp-size above 1 need --mode zmq (each rank and "
                         "replica is a process)")
    try:
        tokenizer = load_tokenizer(args.tokenizer or args.model)
        # compiled before any directory is made (a template that does not compile)
        template = ChatTemplate(tokenizer)
    except TokenizerError as exc:
        raise SystemExit(f"error: {exc}") from exc
    try:
        keys, allowed = curve_options(args)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"CURVE keys: {exc}") from exc
    try:
        limits = limits_from(args)
    except ValueError as exc:
        raise SystemExit(str(exc)) from exc
    # Checked here, before anything starts: a bad bound is the operator's to fix, not
    # each client's 400 or 413 (--default-max-tokens -5, --max-body-bytes -1).
    for flag, value in (("--body-timeout", args.body_timeout),
                        ("--header-timeout", args.header_timeout),
                        ("--send-timeout", args.send_timeout),
                        ("--max-header-bytes", args.max_header_bytes),
                        ("--max-body-bytes", args.max_body_bytes),
                        ("--max-batch", args.max_batch), ("--tp-size", args.tp_size),
                        ("--dp-size", args.dp_size),
                        ("--default-max-tokens", args.default_max_tokens)):
        if not value > 0:  # (NaN too)
            raise SystemExit(f"{flag} must be above 0, not {value}")
    if args.max_header_bytes < MIN_HEAD_BYTES:  # (every request would be answered 431)
        raise SystemExit(f"--max-header-bytes must be at least {MIN_HEAD_BYTES} (a request "
                         f"line and its usual headers), not {args.max_header_bytes}")
    if args.default_max_tokens > MAX_TOKENS:
        raise SystemExit(f"--default-max-tokens must be at most {MAX_TOKENS} (what a "
                         f"request may ask for), not {args.default_max_tokens}")
    names: list[str] = args.served_model_name or [args.model or "tiny"]
    for name in names:
        if not 0 < len(name) <= MAX_MODEL_NAME:
            raise SystemExit(f"--served-model-name: {name!r} is not a name a request can "
                             f"give (1 to {MAX_MODEL_NAME} characters)")
    model = _model(args, tokenizer.vocab_size)  # checked before the run directory is made
    door = _rpc_endpoint(SystemExit, args)  # made last: nothing after it refuses
    settings = Settings(
        mode=args.mode, model=model, model_name=names[0],
        model_aliases=tuple(n for n in dict.fromkeys(names) if n != names[0]),
        max_batch=args.max_batch, tp_size=args.tp_size, dp_size=args.dp_size,
        dp_policy=args.dp_policy, limits=limits,
        metrics=args.metrics, max_body_bytes=args.max_body_bytes, body_timeout=args.body_timeout,
        default_max_tokens=args.default_max_tokens, rpc_endpoint=door,
        run_dir=os.path.dirname(door[len("ipc://"):]) if args.endpoint is None else None,
        rpc_options=SocketOptions(allow_remote=args.allow_remote, curve_keys=keys),
        curve_clients=allowed, pd=args.pd)
    try:
        return settings, Frontend(settings, tokenizer, template=template)
    except BaseException:
        if settings.run_dir is not None:
            remove_run_dir(settings.run_dir)
        raise


def main(argv: Sequence[str] | None = None) -> int:
    """Serve until interrupted."""
    import uvicorn

    from frontend.listening import DoorServer

    args = parse(argv)
    _check_listen(args.host, args.port)  # before settings_from makes any directory
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: "
                                                               "%(message)s")
    settings, app = settings_from(args)
    try:  # the run directory settings_from made is removed on every way out from here
        # After settings_from's checks: a start refused there says one line, not this too.
        raise_open_files_limit("frontend")  # every client is a connection: a descriptor
        protocol = http_protocol(args.http, max_head_bytes=args.max_header_bytes,
                                 head_timeout=args.header_timeout,
                                 send_timeout=args.send_timeout)
        config = uvicorn.Config(
            app, host=args.host, port=args.port, log_level=args.log_level, access_log=False,
            loop=args.loop, http=protocol, lifespan="on",
            # X-Forwarded-For is a claim from the wire: nothing here reads a client
            # address, and the middleware that would believe it costs every request.
            proxy_headers=False,
            timeout_graceful_shutdown=5)  # open streams get 5 s, then end with an error

        def announce() -> None:  # once the engine runs: a start that fails is one line
            print(f"frontend: model {settings.model_name!r} ({app.tokenizer.name} tokenizer, "
                  f"{settings.mode} mode) on {base_url(args.host, args.port)}; scheduler "
                  f"rpc at {settings.rpc_endpoint}", file=sys.stderr, flush=True)
            if args.http == "h11":
                log.warning("--http h11: --header-timeout applies to httptools (the "
                            "default) alone; under h11 a request's head that stalls is "
                            "closed, unanswered, at the idle timeout (5 s)")

        # Connections are accepted within the open-file limit (frontend.listening): past
        # it, a 503 rather than a close without a word.
        return run(app, DoorServer(config, args.host, args.port), announce)
    finally:
        if settings.run_dir is not None:
            remove_run_dir(settings.run_dir)


if __name__ == "__main__":
    sys.exit(main())
