"""Tasksets: the built-in arithmetic set and JSON / JSONL files.

:func:`load_taskset` reads ``buffer.explorer_input.taskset``: ``path`` empty or
``"builtin:arithmetic"`` gives :func:`builtin_arithmetic_tasks`; a ``.jsonl`` or
``.json`` file gives its rows; a directory gives the rows of its JSON / JSONL
files (only those named after ``split`` when there are such, e.g.
``train.jsonl`` or ``train-00001.jsonl``), in sorted order. Shuffling per epoch
is the caller's job (``shuffle`` / ``seed``). Reading blocks: call it from a
worker thread in async code. Errors raise :class:`ConfigError` naming the key,
the file and the line.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rftstream.config.schema import TasksetConfig
from rftstream.errors import ConfigError

__all__ = ["BUILTIN_TASKSETS", "builtin_arithmetic_tasks", "load_taskset"]

KEY = "buffer.explorer_input.taskset.path"


def builtin_arithmetic_tasks() -> list[dict[str, str]]:
    """Single-digit addition: ``{"question": "3+4=", "answer": "7"}`` for a, b in 0..9 (100 rows).

    Deterministic, and exactly the problems the embedded tiny model was
    pre-trained on (see :mod:`rftstream.engines.tiny`).
    """
    from rftstream.engines.tiny import arithmetic_problems

    return [{"question": q, "answer": a} for q, a in arithmetic_problems()]


BUILTIN_TASKSETS = {"arithmetic": builtin_arithmetic_tasks}


def load_taskset(cfg: TasksetConfig) -> list[dict[str, Any]]:
    """The rows of the taskset ``cfg`` names (see the module docstring). Blocks (file I/O)."""
    path = (cfg.path or "").strip()
    if not path:
        return builtin_arithmetic_tasks()
    if path.startswith("builtin:"):
        name = path.split(":", 1)[1]
        if name not in BUILTIN_TASKSETS:
            raise ConfigError(
                KEY,
                f"unknown built-in taskset {name!r}; known: {sorted(BUILTIN_TASKSETS)}",
                value=path,
            )
        return BUILTIN_TASKSETS[name]()
    p = Path(path).expanduser()
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in (".jsonl", ".json"))
        named = [
            f
            for f in files
            if f.stem == cfg.split
            or f.stem.startswith(f"{cfg.split}-")
            or f.stem.startswith(f"{cfg.split}.")
        ]
        files = named or files
        if not files:
            raise ConfigError(KEY, f"directory {p} holds no .jsonl or .json files", value=path)
        rows = [row for f in files for row in _read_file(f)]
    elif p.is_file():
        if p.suffix not in (".jsonl", ".json"):
            raise ConfigError(KEY, f"{p}: expected a .jsonl or .json file", value=path)
        rows = _read_file(p)
    else:
        raise ConfigError(KEY, f"no such file or directory: {p}", value=path)
    if not rows:
        raise ConfigError(KEY, f"taskset {p} is empty", value=path)
    return rows


def _read_file(f: Path) -> list[dict[str, Any]]:
    try:
        text = f.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(KEY, f"cannot read {f}: {exc}", value=str(f)) from exc
    if f.suffix == ".jsonl":
        rows = []
        for lineno, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError(
                    KEY, f"{f}, line {lineno}: invalid JSON: {exc.msg}", value=str(f)
                ) from exc
            if not isinstance(row, dict):
                raise ConfigError(
                    KEY,
                    f"{f}, line {lineno}: expected a JSON object, got {type(row).__name__}",
                    value=str(f),
                )
            rows.append(row)
        return rows
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            KEY, f"{f}, line {exc.lineno}: invalid JSON: {exc.msg}", value=str(f)
        ) from exc
    if isinstance(data, dict):
        data = data.get("data", data.get("rows", [data]))
    if not isinstance(data, list):
        raise ConfigError(KEY, f"{f}: expected a list of JSON objects", value=str(f))
    for i, row in enumerate(data):
        if not isinstance(row, dict):
            raise ConfigError(
                KEY,
                f"{f}, item {i}: expected a JSON object, got {type(row).__name__}",
                value=str(f),
            )
    return data
