"""Key paths of a config and the schema type at a path. Pure, no I/O.

A key path is a tuple of parts: a ``str`` for a mapping key, an ``int`` for a
list item. :func:`fmt_path` writes it dotted with ``[i]`` for list items
(``data_processor.experience_pipeline.operators[1].args``).
"""

from __future__ import annotations

import difflib
import functools
import types
import typing
from typing import Any

import msgspec

from rftstream.config.schema import Config

__all__ = [
    "ROOT",
    "PathPart",
    "choice_message",
    "config_info",
    "fmt_path",
    "literal_choices",
    "lookup",
    "type_at",
]

ROOT = "(root)"

PathPart = str | int


def fmt_path(parts: tuple[PathPart, ...] | list[PathPart]) -> str:
    """``("a", "b", 0, "c")`` -> ``a.b[0].c``; the empty path is :data:`ROOT`."""
    out = ""
    for p in parts:
        if isinstance(p, int):
            out += f"[{p}]"
        else:
            out += f".{p}" if out else str(p)
    return out or ROOT


def lookup(data: Any, parts: list[PathPart]) -> tuple[bool, Any]:
    """Follow ``parts`` into ``data``; return ``(found, value)``."""
    node = data
    for p in parts:
        if isinstance(p, int):
            if not isinstance(node, list) or not -len(node) <= p < len(node):
                return False, None
            node = node[p]
        else:
            if not isinstance(node, dict) or p not in node:
                return False, None
            node = node[p]
    return True, node


def type_at(info: Any, parts: tuple[PathPart, ...]) -> Any | None:
    """The msgspec.inspect type at ``parts`` below ``info``, or None if unknown."""
    node = info
    for p in parts:
        node = _child_type(node, p)
        if node is None:
            return None
    return node


def _child_type(info: Any, part: PathPart) -> Any | None:
    ins = msgspec.inspect
    if isinstance(info, ins.UnionType):
        for t in info.types:
            child = _child_type(t, part)
            if child is not None:
                return child
        return None
    if isinstance(info, ins.StructType) and isinstance(part, str):
        for f in info.fields:
            if f.encode_name == part:
                return f.type
        return None
    if isinstance(info, ins.DictType) and isinstance(part, str):
        return info.value_type
    if isinstance(info, (ins.ListType, ins.TupleType, ins.VarTupleType)) and isinstance(part, int):
        if isinstance(info, ins.TupleType):
            return info.item_types[part] if 0 <= part < len(info.item_types) else None
        return info.item_type
    return None


_CONFIG_INFO: Any = None


def config_info() -> Any:
    """``msgspec.inspect.type_info(Config)``, computed once."""
    global _CONFIG_INFO
    if _CONFIG_INFO is None:
        _CONFIG_INFO = msgspec.inspect.type_info(Config)
    return _CONFIG_INFO


def literal_choices(parts: tuple[PathPart, ...] | list[PathPart]) -> tuple[Any, ...]:
    """The values the ``Literal`` type of the config key at ``parts`` allows, in the order the
    schema declares them (``("both", "explore", "train", "bench")`` for ``mode``; list items
    of ``monitor.monitor_type[1]`` included); empty when that key takes no ``Literal``."""
    keys = list(parts)
    while keys and isinstance(keys[-1], int):  # a list item: the list's field
        keys.pop()
    if not keys or not isinstance(keys[-1], str):
        return ()
    parent = type_at(config_info(), tuple(keys[:-1])) if len(keys) > 1 else config_info()
    # an optional section (``experience_buffer: StorageConfig | None``): its Struct
    options = parent.types if isinstance(parent, msgspec.inspect.UnionType) else (parent,)
    for option in options:
        cls = getattr(option, "cls", None)
        if isinstance(cls, type) and keys[-1] in _field_literals(cls):
            return _field_literals(cls)[keys[-1]]
    return ()


@functools.cache
def _field_literals(cls: type) -> dict[str, tuple[Any, ...]]:
    """``{field: its Literal values}`` for every field of the Struct ``cls`` that has some."""
    out: dict[str, tuple[Any, ...]] = {}
    for name, hint in typing.get_type_hints(cls).items():
        values = tuple(dict.fromkeys(_literal_values(hint)))
        if values:
            out[name] = values
    return out


def _literal_values(hint: Any) -> list[Any]:
    """The ``Literal`` values inside ``hint`` (through unions and containers), in order."""
    origin = typing.get_origin(hint)
    if origin is typing.Literal:
        return list(typing.get_args(hint))
    if origin in (typing.Union, types.UnionType, list, tuple):
        return [v for arg in typing.get_args(hint) for v in _literal_values(arg)]
    return []


def choice_message(value: Any, choices: tuple[Any, ...]) -> str:
    """``must be one of a, b, c`` and, for a near miss, `` (did you mean 'b'?)``."""
    close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    # the empty string (a default meaning "decide for me") is shown as ""
    shown = ", ".join('""' if c == "" else str(c) for c in choices)
    return f"must be one of {shown}{hint}"
