"""CURVE authentication for ``tcp://`` across hosts.

A server socket (one that binds) with :class:`CurveKeys` in its
:class:`~bus.SocketOptions` encrypts and authenticates; a
:class:`CurveAuthenticator` on the same zmq context admits only the listed
client public keys. A client that is not admitted is refused at the
handshake: it is logged, and the scheduler never sees a frame from it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

__all__ = ["CurveAuthenticator", "CurveKeys"]

log = logging.getLogger("bus.curve")


@dataclass(frozen=True, slots=True)
class CurveKeys:
    """A CURVE key pair (Z85-encoded, as zmq uses them)."""

    public: bytes
    secret: bytes

    def __repr__(self) -> str:  # never print a secret
        return f"CurveKeys(public={self.public!r}, secret=...)"

    @classmethod
    def generate(cls) -> CurveKeys:
        """A fresh key pair."""
        public, secret = zmq.curve_keypair()
        return cls(public, secret)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> CurveKeys:
        """Read a key pair from a zmq certificate file (``*.key_secret``).

        Raises:
            ValueError: the file holds no secret key.
        """
        public, secret = zmq.auth.load_certificate(os.fspath(path))
        if secret is None:
            raise ValueError(f"{path} holds no secret key (use the .key_secret file)")
        return cls(public, secret)

    @staticmethod
    def public_of(path: str | os.PathLike[str]) -> bytes:
        """Read just the public key from a zmq certificate file (either file)."""
        public, _ = zmq.auth.load_certificate(os.fspath(path))
        return public

    @staticmethod
    def create_files(directory: str | os.PathLike[str], name: str) -> tuple[str, str]:
        """Write a new key pair as zmq certificate files; returns (public, secret) paths."""
        os.makedirs(directory, exist_ok=True)
        public, secret = zmq.auth.create_certificates(os.fspath(directory), name)
        return public, secret


class CurveAuthenticator:
    """Admits only the given client public keys on every server socket of ``ctx``.

    Start it before binding; :meth:`stop` (or leaving the ``with`` block)
    joins its thread. Refused clients are logged and counted in ``refused``.
    """

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], allowed: Iterable[bytes]) -> None:
        self.allowed = frozenset(allowed)
        self.refused = 0
        self._auth = ThreadAuthenticator(ctx)
        self._auth.start()
        self._auth.configure_curve_callback(domain="*", credentials_provider=self)
        self._stopped = False

    def callback(self, domain: str, key: bytes) -> bool:
        """zmq's ZAP hook: is this client public key admitted?"""
        ok = key in self.allowed
        if not ok:
            self.refused += 1
            log.warning("refused a CURVE client with an unknown public key %r", key)
        return ok

    def stop(self) -> None:
        """Stop authenticating (idempotent)."""
        if not self._stopped:
            self._stopped = True
            self._auth.stop()

    def __enter__(self) -> CurveAuthenticator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
