"""Tasksets: reading them from files and planning the order of their tasks.

Reading (:func:`load_taskset`, blocks on file I/O: call it from a worker thread
in async code). ``path`` of a taskset config
(``buffer.explorer_input.taskset``, ``...tasksets[i]``, ``...eval_tasksets[i]``):

* empty or ``"builtin:arithmetic"``: :func:`builtin_arithmetic_tasks`;
* a file: ``.jsonl`` (one object per line), ``.json`` (a list of objects, an
  object with a ``data``/``rows`` list, or JSON lines), ``.parquet``, ``.csv``
  (a header row; column types inferred as ``datasets`` does) or ``.arrow``
  (Arrow IPC stream or file). ``split`` does not apply to a single file;
* a directory saved with ``datasets``' ``save_to_disk``: a ``Dataset``
  (``state.json`` + ``*.arrow``, read with pyarrow, no ``datasets`` needed) or
  a ``DatasetDict`` (``dataset_dict.json`` and one such directory per split,
  ``split`` picks one);
* any other directory: its data files (the suffixes above, recursively, in
  sorted order). As with Hugging Face datasets, ``split`` selects the files
  whose path relative to the directory names it as a token (``train.jsonl``,
  ``train-00000-of-00002.parquet``, ``data/train/part-0.json``, ``gsm_test.csv``;
  ``validation`` also matches ``valid``/``val``/``dev``, ``test`` also
  ``eval``/``evaluation``, ``train`` also ``training``). When no file names any
  split, all files are the taskset; when files name other splits but not this
  one, that is an error.

``subset_name`` first descends into the subdirectory of that name (the layout
of multi-config hub datasets). Parquet, arrow and csv need ``pyarrow``
(``pip install 'rftstream[data]'``). Every error is a :class:`ConfigError`
naming the key path (``buffer.explorer_input.tasksets[1].path``), the file and,
for JSON, the line.

Planning (:func:`plan_tasks`, pure): every training taskset is repeated for
its ``total_epochs`` (``None``: ``buffer.total_epochs``), shuffled per epoch
with its ``seed`` (deterministic: the same config gives the same order; each
epoch has its own permutation), and several tasksets are interleaved in
proportion to their sizes, so every explorer batch mixes them.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from rftstream.config.schema import TasksetConfig
from rftstream.errors import ConfigError

__all__ = [
    "BUILTIN_TASKSETS",
    "DATA_SUFFIXES",
    "DataLocation",
    "PlannedTask",
    "TasksetPlan",
    "builtin_arithmetic_tasks",
    "epoch_order",
    "load_taskset",
    "plan_tasks",
    "taskset_files",
]

DEFAULT_KEY = "buffer.explorer_input.taskset"
DATA_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv", ".arrow")
_METADATA_FILES = {"dataset_info.json", "state.json", "dataset_dict.json"}
_SPLIT_ALIASES = {
    "train": ("train", "training"),
    "validation": ("validation", "valid", "val", "dev"),
    "test": ("test", "testing", "eval", "evaluation"),
}
_KNOWN_SPLIT_TOKENS = {tok: split for split, toks in _SPLIT_ALIASES.items() for tok in toks}
_TOKEN_SEP = re.compile(r"[-._ 0-9/\\]+")
_PROMPT_WORKFLOWS = ("simple_workflow", "math_workflow")


def builtin_arithmetic_tasks() -> list[dict[str, str]]:
    """Single-digit addition: ``{"question": "3+4=", "answer": "7"}`` for a, b in 0..9 (100 rows).

    Deterministic, and exactly the problems the embedded tiny model was
    pre-trained on (see :mod:`rftstream.tiny_model`).
    """
    from rftstream.tiny_model import arithmetic_problems

    return [{"question": q, "answer": a} for q, a in arithmetic_problems()]


BUILTIN_TASKSETS = {"arithmetic": builtin_arithmetic_tasks}


# ---------------------------------------------------------------- reading


def load_taskset(cfg: TasksetConfig, key: str = DEFAULT_KEY) -> list[dict[str, Any]]:
    """The rows of the taskset ``cfg`` names (see the module docstring). Blocks (file I/O).

    ``key`` is the config path of ``cfg`` (``buffer.explorer_input.eval_tasksets[0]``),
    used in error messages.
    """
    path = (cfg.path or "").strip()
    if not path or path.startswith("builtin:"):
        name = path.split(":", 1)[1] if path else "arithmetic"
        if name not in BUILTIN_TASKSETS:
            raise ConfigError(
                f"{key}.path",
                f"unknown built-in taskset {name!r}; known: {sorted(BUILTIN_TASKSETS)}",
                value=path,
            )
        rows: list[dict[str, Any]] = list(BUILTIN_TASKSETS[name]())
        source = path or "builtin:arithmetic"
    else:
        files = taskset_files(cfg, key)
        rows = [row for f in files for row in _read_file(f, key)]
        source = str(Path(path).expanduser())
        if not rows:
            raise ConfigError(f"{key}.path", f"taskset {source} has no rows", value=path)
    _check_rows(rows, cfg, key, source)
    return rows


class DataLocation(Protocol):
    """Where a taskset or a trainer dataset lies: a file or a dataset directory, the split
    and the subset (Trinity's ``path``, ``split``, ``subset_name``)."""

    @property
    def path(self) -> str: ...
    @property
    def split(self) -> str: ...
    @property
    def subset_name(self) -> str | None: ...


def read_data_file(f: Path, key: str) -> list[dict[str, Any]]:
    """The rows of one data file (jsonl, json, parquet, csv, arrow). Errors name ``key``'s
    ``path`` and the file. Blocks."""
    return _read_file(f, key)


def hub_hint(path: str) -> str:
    """A sentence for a missing ``path`` that looks like a hub dataset id (``org/name``),
    else "": nothing is downloaded here."""
    if not re.fullmatch(r"[\w.-]+/[\w.-]+", path):
        return ""
    return (
        " (hub dataset ids are not downloaded: save the dataset with `datasets`' "
        "save_to_disk, or download its files, and point path there)"
    )


def taskset_files(cfg: DataLocation, key: str = DEFAULT_KEY) -> list[Path]:
    """The data files a file-based taskset (or trainer dataset) reads, in order (see the
    module docstring).

    Touches only the directory listing (and HF's small JSON metadata), not the data.
    """
    path = (cfg.path or "").strip()
    p = Path(path).expanduser()
    if p.is_file():
        if cfg.subset_name:
            raise ConfigError(
                f"{key}.subset_name",
                f"{p} is a file; subset_name selects a subdirectory of a dataset directory",
                value=cfg.subset_name,
            )
        if p.suffix not in DATA_SUFFIXES:
            raise ConfigError(
                f"{key}.path", f"{p}: expected a {'/'.join(DATA_SUFFIXES)} file", value=path
            )
        return [p]
    if not p.is_dir():
        raise ConfigError(
            f"{key}.path", f"no such file or directory: {p}{hub_hint(path)}", value=path
        )
    return _dir_files(p, cfg, key)


def _dir_files(root: Path, cfg: DataLocation, key: str) -> list[Path]:
    d = root
    if cfg.subset_name:
        d = root / cfg.subset_name
        if not d.is_dir():
            subsets = sorted(x.name for x in root.iterdir() if x.is_dir() and _visible(x.name))
            raise ConfigError(
                f"{key}.subset_name",
                f"{root} has no subset directory {cfg.subset_name!r}; it has {subsets}",
                value=cfg.subset_name,
            )
    dict_meta = d / "dataset_dict.json"
    if dict_meta.is_file():  # a DatasetDict saved with save_to_disk
        splits = _json_meta(dict_meta, key).get("splits") or sorted(
            x.name for x in d.iterdir() if x.is_dir()
        )
        if cfg.split not in splits or not (d / cfg.split).is_dir():
            raise ConfigError(
                f"{key}.split",
                f"{d} (a DatasetDict saved with save_to_disk) has no split {cfg.split!r}; "
                f"it has {list(splits)}",
                value=cfg.split,
            )
        d = d / cfg.split
    state = d / "state.json"
    if state.is_file():  # a Dataset saved with save_to_disk
        listed = [
            f.get("filename")
            for f in _json_meta(state, key).get("_data_files", [])
            if isinstance(f, dict)
        ]
        arrows = [d / str(name) for name in listed if name] or sorted(d.glob("*.arrow"))
        missing = [str(f) for f in arrows if not f.is_file()]
        if missing:
            raise ConfigError(
                f"{key}.path",
                f"{state} lists arrow files that are missing: {missing}",
                value=str(d),
            )
        if arrows:
            return arrows
    files = sorted(
        f
        for f in d.rglob("*")
        if f.is_file()
        and f.suffix in DATA_SUFFIXES
        and f.name not in _METADATA_FILES
        and all(_visible(part) for part in f.relative_to(d).parts)
    )
    if not files:
        raise ConfigError(
            f"{key}.path", f"directory {d} holds no {'/'.join(DATA_SUFFIXES)} files", value=cfg.path
        )
    wanted = cfg.split
    exact = [f for f in files if wanted in _tokens(f, d)]
    if exact:
        return exact
    aliases = set(_SPLIT_ALIASES.get(_KNOWN_SPLIT_TOKENS.get(wanted, ""), ()))
    by_alias = [f for f in files if aliases & set(_tokens(f, d))]
    if by_alias:
        return by_alias
    named = sorted(
        {_KNOWN_SPLIT_TOKENS[t] for f in files for t in _tokens(f, d) if t in _KNOWN_SPLIT_TOKENS}
    )
    if named:
        raise ConfigError(
            f"{key}.split",
            f"no file in {d} belongs to split {wanted!r}; its files name the splits {named}",
            value=wanted,
        )
    return files


def _visible(name: str) -> bool:
    return not name.startswith(".")


def _tokens(f: Path, root: Path) -> list[str]:
    rel = f.relative_to(root)
    text = "/".join([*rel.parts[:-1], f.stem]).lower()
    return [t for t in _TOKEN_SEP.split(text) if t]


def _json_meta(f: Path, key: str) -> dict[str, Any]:
    try:
        data = json.loads(f.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{key}.path", f"cannot read {f}: {exc}", value=str(f)) from exc
    return data if isinstance(data, dict) else {}


def _read_file(f: Path, key: str) -> list[dict[str, Any]]:
    if f.suffix in (".jsonl", ".json"):
        try:
            text = f.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{key}.path", f"cannot read {f}: {exc}", value=str(f)) from exc
        return _json_lines(text, f, key) if f.suffix == ".jsonl" else _json_doc(text, f, key)
    pa = _pyarrow(f, key)
    try:
        if f.suffix == ".parquet":
            import pyarrow.parquet as pq

            table = pq.read_table(f)
        elif f.suffix == ".csv":
            import pyarrow.csv as pcsv

            table = pcsv.read_csv(f)
        else:
            table = _read_arrow(pa, f)
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise ConfigError(f"{key}.path", f"cannot read {f}: {exc}", value=str(f)) from exc
    return table.to_pylist()


def _pyarrow(f: Path, key: str) -> Any:
    try:
        import pyarrow
    except ImportError as exc:
        raise ConfigError(
            f"{key}.path",
            f"{f}: reading {f.suffix} files needs pyarrow (pip install 'rftstream[data]')",
            value=str(f),
        ) from exc
    return pyarrow


def _read_arrow(pa: Any, f: Path) -> Any:
    """An ``.arrow`` file: the IPC stream format (``save_to_disk``), else the IPC file format."""
    with pa.memory_map(str(f), "r") as source:
        try:
            return pa.ipc.open_stream(source).read_all()
        except pa.ArrowInvalid:
            source.seek(0)
            return pa.ipc.open_file(source).read_all()


def _json_lines(text: str, f: Path, key: str) -> list[dict[str, Any]]:
    rows = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(
                f"{key}.path", f"{f}, line {lineno}: invalid JSON: {exc.msg}", value=str(f)
            ) from exc
        if not isinstance(row, dict):
            raise ConfigError(
                f"{key}.path",
                f"{f}, line {lineno}: expected a JSON object, got {type(row).__name__}",
                value=str(f),
            )
        rows.append(row)
    return rows


def _json_doc(text: str, f: Path, key: str) -> list[dict[str, Any]]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        if exc.msg == "Extra data":  # JSON lines in a .json file, as `datasets` accepts
            return _json_lines(text, f, key)
        raise ConfigError(
            f"{key}.path", f"{f}, line {exc.lineno}: invalid JSON: {exc.msg}", value=str(f)
        ) from exc
    if isinstance(data, dict):
        data = data.get("data", data.get("rows", [data]))
    if not isinstance(data, list):
        raise ConfigError(f"{key}.path", f"{f}: expected a list of JSON objects", value=str(f))
    for i, row in enumerate(data):
        if not isinstance(row, dict):
            raise ConfigError(
                f"{key}.path",
                f"{f}, item {i}: expected a JSON object, got {type(row).__name__}",
                value=str(f),
            )
    return data


def _check_rows(rows: list[dict[str, Any]], cfg: TasksetConfig, key: str, source: str) -> None:
    """The built-in prompt workflows need ``prompt_key`` (or ``messages_key``) in the rows."""
    fmt = cfg.format
    if cfg.default_workflow_type not in _PROMPT_WORKFLOWS or fmt.workflow_key:
        return
    first = rows[0]
    if fmt.prompt_key in first or (fmt.messages_key and fmt.messages_key in first):
        return
    wanted = repr(fmt.prompt_key) + (f" or {fmt.messages_key!r}" if fmt.messages_key else "")
    raise ConfigError(
        f"{key}.format.prompt_key",
        f"the rows of {source} have no column {wanted} ({cfg.default_workflow_type} reads "
        f"the prompt from it); columns: {sorted(first)}",
        value=fmt.prompt_key,
    )


# ---------------------------------------------------------------- planning


@dataclass(frozen=True)
class TasksetPlan:
    """What the order of one training taskset depends on."""

    name: str
    rows: int
    epochs: int
    shuffle: bool = True
    seed: int = 42


@dataclass(frozen=True)
class PlannedTask:
    """One task in publishing order: row ``index`` of taskset ``taskset`` in ``epoch``."""

    taskset: str
    epoch: int
    index: int
    seq: int


def epoch_order(rows: int, epoch: int, *, shuffle: bool, seed: int) -> list[int]:
    """Row indices of one epoch: ``0..rows-1``, permuted by ``(seed, epoch)`` if ``shuffle``."""
    order = list(range(rows))
    if shuffle:
        random.Random(f"rftstream-taskset:{seed}:{epoch}").shuffle(order)
    return order


def plan_tasks(plans: Sequence[TasksetPlan]) -> list[PlannedTask]:
    """Every task of every epoch of ``plans``, in publishing order. Pure and deterministic.

    One taskset: its epochs one after the other. Several: each taskset's own
    sequence (all its epochs) is spread evenly over the whole run, the k-th of
    ``n`` tasks at position ``(k + 0.5) / n``, ties going to the earlier
    taskset, so each stretch of the run holds them in proportion to their sizes.
    """
    keyed: list[tuple[float, int, int, str, int, int]] = []
    for t, plan in enumerate(plans):
        total = plan.rows * plan.epochs
        k = 0
        for epoch in range(plan.epochs):
            for index in epoch_order(plan.rows, epoch, shuffle=plan.shuffle, seed=plan.seed):
                keyed.append(((k + 0.5) / total, t, k, plan.name, epoch, index))
                k += 1
    if len(plans) > 1:
        keyed.sort(key=lambda x: (x[0], x[1]))
    return [
        PlannedTask(taskset=name, epoch=epoch, index=index, seq=seq)
        for seq, (_, _, _, name, epoch, index) in enumerate(keyed)
    ]
