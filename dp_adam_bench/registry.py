"""One registry style for every pluggable piece: optimizer variants, noise mechanisms, tasks, clipping engines,
reports.

A :class:`Registry` maps a name to an object (a class, a function, or a ``"module:attr"`` path imported on first
use, so that registering a task does not import transformers). Config validation reads its lists of valid names
from the registries, never from a hand-kept copy, so a new entry is valid everywhere at once::

    from dp_adam_bench.optim.registry import VARIANTS

    @VARIANTS.register("my_adam")
    class MyAdam(Adam): ...

Unknown names raise :class:`~dp_adam_bench.errors.ConfigError` naming the config field and the valid names.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator
from typing import Any

from dp_adam_bench.errors import ConfigError

_MISSING = object()


class Registry:
    """Names -> objects for one kind of piece (``what``), selected by the config field ``field``."""

    def __init__(self, what: str, field: str):
        self.what, self.field = what, field
        self._entries: dict[str, Any] = {}

    def register(self, name: str, obj: Any = None) -> Any:
        """``register(name, obj)``; or ``@register(name)`` as a decorator. ``obj`` may be ``"module:attr"``.
        Registering a name twice is an error (use :meth:`replaced` in tests)."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"a {self.what} name must be a non-empty string, got {name!r}")

        def add(o: Any) -> Any:
            if name in self._entries:
                raise ValueError(f"{self.what} {name!r} is already registered")
            self._entries[name] = o
            return o

        return add if obj is None else add(obj)

    def unregister(self, name: str) -> None:
        self._entries.pop(name, None)

    @contextlib.contextmanager
    def replaced(self, name: str, obj: Any) -> Iterator[None]:
        """Register ``obj`` under ``name`` for the duration of a ``with`` block (tests, plug-ins)."""
        old = self._entries.get(name)
        self._entries[name] = obj
        try:
            yield
        finally:
            if old is None:
                del self._entries[name]
            else:
                self._entries[name] = old

    def names(self) -> tuple[str, ...]:
        return tuple(sorted(self._entries))

    def items(self) -> list[tuple[str, Any]]:
        """(name, object) pairs, sorted by name, lazy entries imported."""
        return [(n, self.get(n)) for n in self.names()]

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._entries)

    def check(self, name: object) -> str:
        """``name`` if registered, else a ConfigError naming the field, the value and every valid name."""
        if name not in self._entries:
            raise ConfigError(
                f"{self.field}={name!r} is not a known {self.what}; valid: {', '.join(self.names())}"
            )
        return name  # type: ignore[return-value]

    def get(self, name: str, default: Any = _MISSING) -> Any:
        """The registered object, importing ``"module:attr"`` entries on first use; ``default`` (when given) for an
        unknown name instead of the ConfigError."""
        if default is not _MISSING and name not in self._entries:
            return default
        obj = self._entries[self.check(name)]
        if isinstance(obj, str):
            module, attr = obj.split(":")
            obj = getattr(importlib.import_module(module), attr)
            self._entries[name] = obj
        return obj

    # dict-style access, so tests can use ``monkeypatch.setitem(REGISTRY, name, obj)``
    def __getitem__(self, name: str) -> Any:
        return self.get(name)

    def __setitem__(self, name: str, obj: Any) -> None:
        self._entries[name] = obj

    def __delitem__(self, name: str) -> None:
        del self._entries[name]

    def build(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """``get(name)(*args, **kwargs)``."""
        factory: Callable[..., Any] = self.get(name)
        return factory(*args, **kwargs)
