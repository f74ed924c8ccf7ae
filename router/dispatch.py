"""``TypeTable``: class -> value by specificity, the mechanism shared by routing and handling.

Modelled on :func:`functools.singledispatch`: an exact hit, else the first
registered class in the MRO; cached per concrete class; ambiguity raised
rather than guessed. Unlike singledispatch, the table *freezes* once lookups
start, so the cache never needs invalidating mid-run, and it can check that
it covers a given set of types.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Generic, TypeVar

from router.errors import AmbiguousRouteError, NoSinkError, RouterFrozenError

__all__ = ["TypeTable"]

K = TypeVar("K")
V = TypeVar("V")


class TypeTable(Generic[K, V]):
    """A registry from classes under ``base`` to values, resolved most-specific-first.

    Args:
        base: every registered class must be a subclass of it.
        types: the concrete types the table must cover (checked by
            :meth:`freeze`); may be empty to skip the check.
    """

    def __init__(self, base: type[K], types: Iterable[type[K]] = ()) -> None:
        self.base = base
        self.types: tuple[type[K], ...] = tuple(types)
        self._registry: dict[type, V] = {}
        self._cache: dict[type, V] = {}  # cleared in place, never rebound (Router aliases it)
        self._frozen = False

    @property
    def registry(self) -> Mapping[type, V]:
        """The registrations, read-only."""
        return MappingProxyType(self._registry)

    @property
    def frozen(self) -> bool:
        """Whether registration is closed."""
        return self._frozen

    def register(self, cls: type[K], value: V) -> None:
        """Map ``cls`` (and subclasses with no closer registration) to ``value``.

        Raises:
            TypeError: ``cls`` is not a class under ``base``.
            RouterFrozenError: lookups have started.
        """
        if not isinstance(cls, type) or not issubclass(cls, self.base):
            raise TypeError(f"{cls!r} is not a subclass of {self.base.__qualname__}")
        if self._frozen:
            raise RouterFrozenError(cls)
        self._registry[cls] = value
        self._cache.clear()

    def freeze(self) -> None:
        """Close registration, after checking that every type in ``types`` resolves.

        Raises:
            NoSinkError: listing every uncovered type.
            AmbiguousRouteError: a type matches two unrelated registrations.
        """
        if self._frozen:
            return
        missing = [t for t in self.types if self._resolve(t) is None]
        if missing:
            raise NoSinkError(missing, "totality check at start-up")
        self._frozen = True

    def lookup(self, cls: type) -> V:
        """The value for ``cls`` (freezing the table on first use).

        Raises:
            NoSinkError: nothing registered covers ``cls``.
            AmbiguousRouteError: two unrelated registrations tie.
        """
        try:
            return self._cache[cls]
        except KeyError:
            pass
        if not self._frozen:
            self.freeze()
        value = self._resolve(cls)
        if value is None:
            raise NoSinkError([cls])
        self._cache[cls] = value
        return value

    def _resolve(self, cls: type) -> V | None:
        registry = self._registry
        if cls in registry:
            return registry[cls]
        match: type | None = None
        for klass in cls.__mro__:
            if klass not in registry:
                continue
            if match is None:
                match = klass
            elif not issubclass(match, klass):
                raise AmbiguousRouteError(cls, match, klass)
        return None if match is None else registry[match]
