"""Command-line options that ``python -m scheduler`` and ``python -m frontend`` share.

Each option that means the same thing in both commands is defined here once, so both
spell it, default it and document it alike (``tests/scheduler/test_cli_options.py``
compares the parsers). An option's older spelling stays accepted as a deprecated alias
for one release; its help says which.
"""

from __future__ import annotations

import argparse

from bus import CurveKeys
from scheduler.core.admission import Limits

__all__ = ["DEPRECATED_ALIASES", "add_backlog_option", "add_curve_options",
           "add_dp_policy_option", "add_handoff_options", "add_pd_option",
           "add_scheduler_options", "curve_options", "limits_from", "pd_ratio"]

#: Old spelling -> the option it is an alias of (accepted for one release, then removed).
DEPRECATED_ALIASES: dict[str, str] = {"--dp": "--dp-size", "--policy": "--dp-policy"}

_DTYPES = ["auto", "float32", "bfloat16", "float16", "float64"]


def _deprecated(option: str) -> str:
    """The help's note on ``option``'s deprecated aliases (empty when it has none)."""
    old = [alias for alias, new in DEPRECATED_ALIASES.items() if new == option]
    return f" ({', '.join(old)}: deprecated alias, removed in the next release)" if old else ""


def _option_strings(option: str) -> list[str]:
    """``option`` and its deprecated aliases, as argparse takes them."""
    return [option, *(alias for alias, new in DEPRECATED_ALIASES.items() if new == option)]


def add_dp_policy_option(p: argparse.ArgumentParser) -> None:
    """``--dp-size``'s companion: how the dispatcher picks a replica for a request."""
    p.add_argument(*_option_strings("--dp-policy"), dest="dp_policy",
                   choices=["least_loaded", "round_robin", "cache_aware"],
                   default="least_loaded",
                   help="how a request's replica is picked (default: least_loaded; "
                        "cache_aware: prompts sharing a prefix go where it is cached)"
                        + _deprecated("--dp-policy"))


def add_backlog_option(p: argparse.ArgumentParser) -> None:
    """``--max-backlog``: outputs kept for a consumer that is not reading."""
    p.add_argument("--max-backlog", type=int, default=Limits().max_backlog,
                   help="outputs kept for a consumer that is not reading before its "
                        "requests are aborted")


def pd_ratio(text: str) -> tuple[int, int]:
    """``--pd P:D``: prefill and decode replica counts, each at least 1.

    Raises:
        argparse.ArgumentTypeError: ``text`` is not ``P:D`` with both at least 1.
    """
    p, sep, d = text.partition(":")
    if not sep or not p.isdigit() or not d.isdigit() or int(p) < 1 or int(d) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not P:D with P, D >= 1 (e.g. 1:1)")
    return int(p), int(d)


def add_pd_option(p: argparse.ArgumentParser) -> None:
    """``--pd P:D``: prefill and decode apart (``serve``, the frontend and ``dispatch``)."""
    p.add_argument("--pd", type=pd_ratio, default=None, metavar="P:D",
                   help="prefill and decode apart: P replicas read prompts and hand each "
                        "request to one of D that decode it (serve, frontend: each its own "
                        "process, in place of a replica count; the frontend needs --mode zmq; "
                        "dispatch: the first P --replica read prompts)")


def add_handoff_options(p: argparse.ArgumentParser) -> None:
    """``--pd``'s bounds on hand-offs (``serve``, the frontend and ``dispatch``)."""
    p.add_argument("--max-handoff-bytes", type=int, default=Limits().max_handoff_bytes,
                   help="with --pd: most bytes of hand-offs (KV caches) sent on a hop and "
                        "not yet taken; past it a read prompt waits (default: 512 MiB; a "
                        "larger hand-off alone is refused)")
    p.add_argument("--handoff-deadline", type=float, default=Limits().handoff_deadline,
                   metavar="SECONDS",
                   help="with --pd: seconds a hand-off may wait unread by its decode "
                        "replica before its memory is freed and its request fails "
                        "(default: 60)")


def add_scheduler_options(p: argparse.ArgumentParser) -> None:
    """The scheduler's own options: its batch and queue bounds, its data-parallel
    replicas and their policy, and its model."""
    p.add_argument("--max-batch", type=int, default=64,
                   help="requests decoded together in one step")
    p.add_argument("--max-queued-requests", type=int, default=Limits().max_queued_requests,
                   help="requests waiting beyond this are refused as overloaded (HTTP 503 "
                        "with Retry-After)")
    p.add_argument("--max-queued-tokens", type=int, default=Limits().max_queued_tokens,
                   help="tokens (prompt + max_new_tokens) waiting beyond this: overloaded")
    p.add_argument("--prefix-cache-bytes", type=int, default=Limits().prefix_cache_bytes,
                   help="bytes of prompts' keys and values kept for reuse (0: off)")
    p.add_argument(*_option_strings("--dp-size"), dest="dp_size", type=int, default=1,
                   help="data-parallel replicas: that many local schedulers, each its own "
                        "process, behind one dispatcher" + _deprecated("--dp-size"))
    add_dp_policy_option(p)
    add_pd_option(p)
    add_handoff_options(p)
    p.add_argument("--model", metavar="DIR", default=None,
                   help="a Hugging Face causal LM in a local directory (config.json and "
                        "safetensors; needs the [hf] extra); default: the built-in tiny model")
    p.add_argument("--dtype", choices=_DTYPES, default="auto",
                   help="--model's weights dtype (auto: the checkpoint's)")
    p.add_argument("--device", default="cpu", help="--model's device: cpu or cuda[:N]")


def add_curve_options(p: argparse.ArgumentParser, *, what: str) -> None:
    """``--allow-remote``, ``--curve-keys`` and ``--curve-allow`` for the server of ``what``."""
    p.add_argument("--allow-remote", action="store_true",
                   help=f"allow {what} on tcp beyond loopback (with --curve-keys and "
                        "--curve-allow, which it requires)")
    p.add_argument("--curve-keys", metavar="SECRET_FILE",
                   help=f"{what}'s CURVE key pair (a zmq .key_secret file)")
    p.add_argument("--curve-allow", metavar="PUBLIC_FILE", nargs="*", default=None,
                   help="client public key files admitted (with --curve-keys)")


def curve_options(args: argparse.Namespace) -> tuple[CurveKeys | None, list[bytes] | None]:
    """The key pair and the admitted clients' public keys the options name (or None).

    Raises:
        ValueError: one of ``--curve-keys`` and ``--curve-allow`` without the other,
            ``--allow-remote`` without them, or a key file that does not read as one.
        OSError: a key file that cannot be read.
    """
    if args.allow_remote and not (args.curve_keys or args.curve_allow is not None):
        # Without CURVE the endpoint serves whoever reaches its port: shutdown, and
        # save_checkpoint to any path this user may write.
        raise ValueError("--allow-remote needs --curve-keys and --curve-allow: without "
                         "them any host that reaches the port could call shutdown or "
                         "save_checkpoint(path=...)")
    keys = CurveKeys.load(args.curve_keys) if args.curve_keys else None
    if (args.curve_allow is not None) != (keys is not None):
        raise ValueError("--curve-keys and --curve-allow go together")
    allowed = [CurveKeys.public_of(f) for f in args.curve_allow] if keys is not None else None
    return keys, allowed


def limits_from(args: argparse.Namespace) -> Limits:
    """The :class:`Limits` the shared options (and ``--max-backlog``) give.

    Raises:
        ValueError: a bound out of range, naming its flag and the value given.
    """
    try:
        return Limits(max_queued_requests=args.max_queued_requests,
                      max_queued_tokens=args.max_queued_tokens, max_backlog=args.max_backlog,
                      prefix_cache_bytes=args.prefix_cache_bytes,
                      max_handoff_bytes=args.max_handoff_bytes,
                      handoff_deadline=args.handoff_deadline)
    except ValueError as exc:  # its message begins with the field: say the flag given
        field, _, rest = str(exc).partition(" ")
        raise ValueError(f"--{field.replace('_', '-')} {rest}") from None
