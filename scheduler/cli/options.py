"""Command-line options that ``python -m scheduler`` and ``python -m frontend`` share."""

from __future__ import annotations

import argparse

from bus import CurveKeys

__all__ = ["add_curve_options", "curve_options"]


def add_curve_options(p: argparse.ArgumentParser, *, what: str) -> None:
    """``--allow-remote``, ``--curve-keys`` and ``--curve-allow`` for the server of ``what``."""
    p.add_argument("--allow-remote", action="store_true",
                   help=f"allow {what} on tcp beyond loopback (use CURVE then)")
    p.add_argument("--curve-keys", metavar="SECRET_FILE",
                   help=f"{what}'s CURVE key pair (a zmq .key_secret file)")
    p.add_argument("--curve-allow", metavar="PUBLIC_FILE", nargs="*", default=None,
                   help="client public key files admitted (with --curve-keys)")


def curve_options(args: argparse.Namespace) -> tuple[CurveKeys | None, list[bytes] | None]:
    """The key pair and the admitted clients' public keys the options name (or None).

    Raises:
        ValueError: one of ``--curve-keys`` and ``--curve-allow`` without the other, or
            a key file that does not read as one.
        OSError: a key file that cannot be read.
    """
    keys = CurveKeys.load(args.curve_keys) if args.curve_keys else None
    if (args.curve_allow is not None) != (keys is not None):
        raise ValueError("--curve-keys and --curve-allow go together")
    allowed = [CurveKeys.public_of(f) for f in args.curve_allow] if keys is not None else None
    return keys, allowed
