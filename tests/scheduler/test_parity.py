"""``Engine`` and ``AsyncEngine`` offer the same methods with the same parameters.

The blocking face runs the asyncio one on a loop of its own, so each of its
methods is the other's, waited for; this test fails on any drift between
them: a method or property one face has and the other lacks, or a parameter
(name, kind, default) that differs. Return types differ by nature (a handle
with a queue vs an awaitable) and are not compared.
"""

from __future__ import annotations

import inspect

from scheduler import AsyncEngine, Engine

#: What only one face has, and why.
FACE_ONLY: dict[type, set[str]] = {
    # A blocking Engine starts at construction; a request it failed is in its
    # handle's queue, never an awaitable collected unawaited.
    AsyncEngine: {"start", "unawaited_failures"},
    Engine: set(),
}


def _public(face: type[object]) -> dict[str, inspect.Signature | None]:
    """Each public method's signature (None for a property or an attribute the class
    declares), by name."""
    out: dict[str, inspect.Signature | None] = {}
    for klass in face.__mro__:
        for name in vars(klass).get("__annotations__", {}):
            if not name.startswith("_") and name not in FACE_ONLY[face]:
                out[name] = None
    for name in dir(face):
        if name.startswith("_") or name in FACE_ONLY[face]:
            continue
        attr = inspect.getattr_static(face, name)
        if isinstance(attr, property):
            out[name] = None
        elif callable(attr):
            out[name] = inspect.signature(getattr(face, name))
    return out


def _params(sig: inspect.Signature) -> list[tuple[str, object, object]]:
    return [(p.name, p.kind, p.default) for p in sig.parameters.values()]


def test_both_faces_have_the_same_methods_with_the_same_parameters() -> None:
    sync, aio = _public(Engine), _public(AsyncEngine)
    assert sorted(sync) == sorted(aio), (
        f"only Engine: {sorted(set(sync) - set(aio))}; "
        f"only AsyncEngine: {sorted(set(aio) - set(sync))}")
    drift = {}
    for name, sig in sync.items():
        other = aio[name]
        if (sig is None) != (other is None):
            drift[name] = "a property on one face, a method on the other"
        elif sig is not None and other is not None and _params(sig) != _params(other):
            drift[name] = f"Engine{sig} vs AsyncEngine{other}"
    assert not drift, drift


def test_both_faces_take_the_same_constructor_arguments() -> None:
    assert _params(inspect.signature(Engine.__init__)) == \
        _params(inspect.signature(AsyncEngine.__init__))


def test_the_parity_check_sees_a_parameter_that_drifts() -> None:
    class Drifted(Engine):
        def embed(self, input_ids: object, *, timeout: float | None = None,  # type: ignore[override]
                  dp_rank: int | None = None) -> object:
            raise NotImplementedError

    FACE_ONLY[Drifted] = set()
    try:
        drifted = _public(Drifted)["embed"]
        assert drifted is not None
        embed = _public(AsyncEngine)["embed"]
        assert embed is not None
        assert _params(drifted) != _params(embed)
    finally:
        del FACE_ONLY[Drifted]
