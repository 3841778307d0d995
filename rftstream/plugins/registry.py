"""Name → class registries, as in Trinity-RFT (``WORKFLOWS.register_module("x")``).

Lookup accepts a registered name, or a dotted path (``pkg.mod.Class`` or
``pkg.mod:Class``) which is imported on demand, so a user can name their own
class in a config without registering it. No I/O besides those imports.

A registry the core owns names the packages holding its built-ins
(``defaults``, module names as strings): the first lookup imports them, and
their ``register_module`` decorators fill it. So the core finds the plugin
packages (``operators``, ``algorithms``, ``workflows``) by name and never imports
them; they import the core.
"""

from __future__ import annotations

import importlib
import logging
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Generic, TypeVar, overload

from rftstream.errors import RegistryError

log = logging.getLogger(__name__)

T = TypeVar("T")
BUILTIN_PACKAGES = ("rftstream", "operators", "algorithms", "workflows")


def _is_builtin(obj: object) -> bool:
    module = getattr(obj, "__module__", "") or ""
    return module.split(".")[0] in BUILTIN_PACKAGES


class Registry(Generic[T]):
    """A named collection of classes (or callables) registered under string keys."""

    _instances: weakref.WeakSet[Registry[Any]] = weakref.WeakSet()

    def __init__(self, name: str, defaults: Sequence[str] = ()) -> None:
        """``defaults``: modules whose import registers the built-ins, imported by the
        first lookup (``get``, ``names``, ``in``, iteration, ``len``)."""
        self.name = name
        self.defaults = tuple(defaults)
        self._modules: dict[str, T] = {}
        self._defaults_loaded = not self.defaults
        Registry._instances.add(self)

    @classmethod
    def snapshot_all(cls) -> dict[Registry[Any], tuple[dict[str, Any], bool]]:
        """The contents of every registry (tests restore them with :meth:`restore_all`)."""
        return {reg: (dict(reg._modules), reg._defaults_loaded) for reg in list(cls._instances)}

    @classmethod
    def restore_all(cls, snapshot: dict[Registry[Any], tuple[dict[str, Any], bool]]) -> None:
        """Put every registry back to a :meth:`snapshot_all` state."""
        for reg, (modules, defaults_loaded) in snapshot.items():
            reg._modules = dict(modules)
            reg._defaults_loaded = defaults_loaded

    def _load_defaults(self) -> None:
        """Import the :attr:`defaults` modules, until they have finished importing once.

        Blocks while they import; another thread's lookup meanwhile waits for that
        import (Python's per-module import lock) and then sees every built-in. A lookup
        made by the importing thread itself (a built-in registering itself, or reading
        its own registry) returns at once and sees what is registered so far. A failed
        import raises :class:`RegistryError` naming the module; the next lookup tries
        again.
        """
        if self._defaults_loaded:
            return
        for module_name in self.defaults:
            try:
                module = importlib.import_module(module_name)
            except Exception as exc:
                raise RegistryError(
                    f"{self.name}: cannot import {module_name!r}, which registers the "
                    f"built-ins: {type(exc).__name__}: {exc}"
                ) from exc
            if getattr(module.__spec__, "_initializing", False):
                return  # this thread is importing it: not complete yet, look again later
        self._defaults_loaded = True

    def __repr__(self) -> str:
        return f"Registry({self.name!r}, {sorted(self._modules)})"

    def __contains__(self, name: object) -> bool:
        self._load_defaults()
        return isinstance(name, str) and name in self._modules

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        self._load_defaults()
        return len(self._modules)

    def names(self) -> list[str]:
        """The registered names, sorted (the built-ins imported first)."""
        self._load_defaults()
        return sorted(self._modules)

    @overload
    def register_module(self, name: str) -> Callable[[T], T]: ...

    @overload
    def register_module(self, name: str, module: T, *, force: bool = False) -> T: ...

    def register_module(self, name: str, module: T | None = None, *, force: bool = False) -> Any:
        """Register ``module`` under ``name``; without ``module`` act as a decorator.

        Registering a different object under a taken name raises
        :class:`RegistryError` unless ``force`` is true, or unless the taken
        name is a built-in (from rftstream's own packages) and the new object
        is not: a user's plugin may replace a built-in, with a warning. Re-registering the very
        same object (a module imported twice) is allowed.
        """
        if not isinstance(name, str) or not name:
            raise RegistryError(f"{self.name}: a registered name must be a non-empty string")
        self._load_defaults()  # a plugin registered first still replaces the built-in

        def _register(obj: T) -> T:
            existing = self._modules.get(name)
            if existing is not None and existing is not obj and not force:
                same = getattr(existing, "__qualname__", None) == getattr(
                    obj, "__qualname__", 0
                ) and (getattr(existing, "__module__", None) == getattr(obj, "__module__", 0))
                if not same and _is_builtin(existing) and not _is_builtin(obj):
                    log.warning(
                        "%s: %r from %s replaces the built-in %r",
                        self.name,
                        name,
                        getattr(obj, "__module__", "?"),
                        existing,
                    )
                elif not same:
                    raise RegistryError(
                        f"{self.name}: name {name!r} is already registered to {existing!r}; "
                        f"choose another name or pass force=True"
                    )
            self._modules[name] = obj
            return obj

        if module is not None:
            return _register(module)
        return _register

    def unregister(self, name: str) -> T | None:
        """Remove ``name``; returns what was registered (None if nothing was)."""
        self._load_defaults()
        return self._modules.pop(name, None)

    def get(self, name: str) -> T:
        """Return the object registered as ``name``, or import it by dotted path.

        Raises :class:`RegistryError` naming the registry and the known names.
        """
        self._load_defaults()
        if name in self._modules:
            return self._modules[name]
        if "." in name or ":" in name:
            return self._import(name)
        known = ", ".join(self.names()) or "(none)"
        raise RegistryError(f"{self.name}: no module named {name!r}; registered: {known}")

    def _import(self, path: str) -> T:
        if ":" in path:
            module_name, _, attr = path.partition(":")
        else:
            module_name, _, attr = path.rpartition(".")
        if not module_name or not attr:
            raise RegistryError(
                f"{self.name}: bad dotted path {path!r}; expected 'pkg.mod.Class' or 'pkg.mod:Class'"
            )
        try:
            module = importlib.import_module(module_name)
        except Exception as exc:  # ImportError, or anything the module raised while importing
            raise RegistryError(
                f"{self.name}: cannot import module {module_name!r} for {path!r}: {exc}"
            ) from exc
        obj = module
        for part in attr.split("."):
            try:
                obj = getattr(obj, part)
            except AttributeError as exc:
                raise RegistryError(
                    f"{self.name}: {module_name!r} has no attribute {attr!r}"
                ) from exc
        return obj  # type: ignore[return-value]
