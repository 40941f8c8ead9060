"""One registry, five uses: number formats, recovery methods, rewards, rollout engines
and export formats are each a :class:`Registry` of named objects.

Every registry behaves alike: a name already taken by another object is refused unless
``replace=True`` (silently swapping one would change every recipe, config or result that
names it); registering the same object again is a no-op; an unknown name is one line with
the nearest registered one and the choices; names list in registration order.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from fp4rl.errors import UserError, did_you_mean

T = TypeVar("T")


class Registry(Generic[T]):
    """Objects of one ``kind`` ("recovery method", "reward", ...) by name; mistakes raise
    ``error`` (a :class:`~fp4rl.errors.UserError`). ``hint`` ends the unknown-name message
    (say, how to register one); ``key`` normalizes a name (formats ignore case)."""

    def __init__(self, kind: str, error: type[UserError], hint: str = "",
                 key: Callable[[str], str] = str) -> None:
        self.kind, self.error, self.hint, self.key = kind, error, hint, key
        self._items: dict[str, T] = {}
        _ALL.append(self)

    def register(self, name: str, obj: T, *, replace: bool = False) -> T:
        """Make ``obj`` the one called ``name``; returns ``obj``."""
        key = self.key(name)
        held = self._items.get(key, obj)
        if held is not obj and not replace:
            raise self.error(f"{self.kind} {key!r} is already registered ({_describe(held)}); "
                             "pass replace=True to override it")
        self._items[key] = obj
        return obj

    def unregister(self, name: str) -> None:
        """Remove ``name`` (tests and notebooks that register temporary ones)."""
        self._items.pop(self.key(name), None)

    def names(self) -> list[str]:
        """The registered names, in registration order."""
        return list(self._items)

    def get(self, name: str) -> T:
        """The object called ``name``, or one line naming the nearest and the choices."""
        try:
            return self._items[self.key(name)]
        except (KeyError, TypeError, AttributeError):
            raise self.error(f"unknown {self.kind} {name!r}{did_you_mean(name, self.names())}"
                             f"; choose one of: {', '.join(self._items)}{self.hint}") from None

    def items(self) -> list[tuple[str, T]]:
        """(name, object) pairs, in registration order."""
        return list(self._items.items())

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self.key(name) in self._items


#: every registry made, in creation order (:func:`scratch` restores them all)
_ALL: list[Registry] = []


@contextlib.contextmanager
def scratch() -> Iterator[None]:
    """Every registry (formats, recovery methods, rewards, rollout engines, export
    formats) as it is now, restored on exit: what a notebook cell or a test registers or
    replaces inside is undone, so a temporary plug-in never leaks into the next run."""
    saved = [(table, dict(table._items)) for table in _ALL]
    try:
        yield
    finally:
        for table, items in saved:
            table._items = items


def _describe(obj: object) -> str:
    return getattr(obj, "__qualname__", None) or repr(obj)


__all__ = ["Registry", "scratch"]
