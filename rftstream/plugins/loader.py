"""Load user plugins: modules that register workflows, operators, algorithms...

A plugin is an ordinary Python module whose import has side effects (typically
``WORKFLOWS.register_module("my_workflow")`` decorators). Plugins come from
directories (every ``*.py`` not starting with ``_``) and from installed
distributions that declare an entry point in group ``rftstream.plugins``.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import sys
import threading
import types
from collections.abc import Iterable
from pathlib import Path

from rftstream.errors import PluginError

__all__ = ["ENTRY_POINT_GROUP", "PLUGIN_PACKAGE", "load_plugins", "plugin_module_name"]

ENTRY_POINT_GROUP = "rftstream.plugins"
PLUGIN_PACKAGE = "rftstream_plugins"

_LOCK = threading.RLock()


def _dir_hash(directory: Path) -> str:
    return "d" + hashlib.sha1(str(directory).encode()).hexdigest()[:12]


def plugin_module_name(file: str | Path) -> str:
    """The ``sys.modules`` name a plugin file is loaded under.

    ``rftstream_plugins.<dirhash>.<stem>``, where ``dirhash`` is derived from the
    file's resolved directory, so equal stems in different dirs do not clash.
    """
    path = Path(file).resolve()
    return f"{PLUGIN_PACKAGE}.{_dir_hash(path.parent)}.{path.stem}"


def _ensure_package(name: str, path: list[str]) -> types.ModuleType:
    """Make an (empty) parent package ``name`` importable, so pickle finds children."""
    module = sys.modules.get(name)
    if module is None:
        module = types.ModuleType(name)
        module.__path__ = list(path)
        module.__package__ = name
        sys.modules[name] = module
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, module)
    return module


def _already_imported(file: Path) -> types.ModuleType | None:
    for module in list(sys.modules.values()):
        if getattr(module, "__file__", None) == str(file):
            return module
    return None


def _load_file(file: Path) -> str:
    name = plugin_module_name(file)
    existing = sys.modules.get(name)
    if existing is not None and getattr(existing, "__file__", None) == str(file):
        return name
    _ensure_package(PLUGIN_PACKAGE, [])
    package = name.rpartition(".")[0]
    _ensure_package(package, [str(file.parent)])
    imported = _already_imported(file)
    if imported is not None:  # a sibling plugin imported it by its plain name
        sys.modules[name] = imported
        setattr(sys.modules[package], file.stem, imported)
        return name
    spec = importlib.util.spec_from_file_location(name, file)
    if spec is None or spec.loader is None:
        raise PluginError(f"plugin {file}: cannot create an import spec")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException as exc:
        sys.modules.pop(name, None)
        if not isinstance(exc, Exception):
            raise
        raise PluginError(f"plugin {file} failed to import: {type(exc).__name__}: {exc}") from exc
    setattr(sys.modules[package], file.stem, module)
    return name


def _load_dir(directory: str | Path) -> list[str]:
    path = Path(directory).expanduser()
    if not path.is_dir():
        raise PluginError(
            f"plugin directory {str(directory)!r} does not exist or is not a directory"
        )
    path = path.resolve()
    if str(path) not in sys.path:
        sys.path.append(str(path))
    return [
        _load_file(file)
        for file in sorted(path.glob("*.py"))
        if file.is_file() and not file.name.startswith("_")
    ]


def _load_entry_points() -> list[str]:
    names: list[str] = []
    seen: set[str] = set()
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.value in seen:
            continue
        seen.add(ep.value)
        try:
            ep.load()
        except Exception as exc:
            raise PluginError(
                f"plugin entry point {ep.name!r} = {ep.value!r} (group {ENTRY_POINT_GROUP!r}) "
                f"failed to load: {type(exc).__name__}: {exc}"
            ) from exc
        if ep.module not in names:
            names.append(ep.module)
    return names


def load_plugins(plugin_dirs: Iterable[str | Path] = (), entry_points: bool = True) -> list[str]:
    """Import every plugin module and return their module names, in load order.

    Blocks while it imports: each ``*.py`` (not starting with ``_``) of every
    directory in ``plugin_dirs``, in sorted order, as module
    ``rftstream_plugins.<dirhash>.<stem>`` (inserted into ``sys.modules`` before
    it executes, so dataclasses and pickle work); the directory is appended to
    ``sys.path`` so plugins can import sibling helper modules by their plain name.
    Keep such helpers in ``_``-prefixed files (they are not loaded as plugins);
    a plugin file that a sibling already imported by plain name is reused, not
    executed again, but one imported by plain name after it was loaded here is
    a second module object. With
    ``entry_points`` true it then loads every entry point in group
    ``rftstream.plugins`` (``EntryPoint.load()``, nothing is called).

    Idempotent: a file or entry point loaded before is not executed again; its
    name is still returned. Raises :class:`PluginError` naming the directory if
    it does not exist, or the file / entry point and the exception if an import
    fails; the failed module is removed from ``sys.modules`` (a later call tries
    it again) and plugins loaded before it stay loaded.
    """
    if isinstance(plugin_dirs, (str, Path)):
        plugin_dirs = [plugin_dirs]
    names: list[str] = []
    with _LOCK:
        for directory in plugin_dirs:
            names.extend(n for n in _load_dir(directory) if n not in names)
        if entry_points:
            names.extend(n for n in _load_entry_points() if n not in names)
    return names
