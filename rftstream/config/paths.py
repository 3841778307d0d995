"""Key paths of a config and the schema type at a path. Pure, no I/O.

A key path is a tuple of parts: a ``str`` for a mapping key, an ``int`` for a
list item. :func:`fmt_path` writes it dotted with ``[i]`` for list items
(``data_processor.experience_pipeline.operators[1].args``).
"""

from __future__ import annotations

from typing import Any

import msgspec

from rftstream.config.schema import Config

__all__ = ["ROOT", "PathPart", "config_info", "fmt_path", "lookup", "type_at"]

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
