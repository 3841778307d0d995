"""Trinity-RFT's task pipeline: Data-Juicer ops over the raw task files, before exploring.

``data_processor.task_pipeline`` (:class:`~rftstream.config.schema.TaskPipelineConfig`)
names Data-Juicer ``operators`` (or a recipe, ``config_path``), the raw ``inputs`` (local
data files or dataset directories, read as tasksets are) and the ``target_fields`` each
output row keeps. :func:`run_task_pipeline` runs the ops in this process, over every input
row at once (a Data-Juicer batch of columns, ``text`` being the row's target fields joined
by newlines, so ops with the default ``text_key`` see the whole task), and writes the kept
rows, with what the mappers made of their fields, as ``tasks.jsonl`` under the output's
``path``: the first training taskset's path unless ``output`` is set (for SFT or DPO in
``mode: train``, the experience buffer's). Trinity-RFT sends the same work to its Data-Juicer
server (``service.data_juicer``); nothing is started or contacted here.

The output directory also gets ``.task_pipeline.json`` (what was run, on which inputs,
and how many rows were kept): a directory made by the same pipeline on the same inputs is
used as it is (a continued run, or a second ``rftstream explorer`` on the machine); any
other existing output path is refused, as Trinity-RFT refuses to overwrite it.

Blocks (file I/O, Data-Juicer; an LLM-scoring op calls its API). Raises
:class:`~rftstream.errors.ConfigError` naming the key for what the config gets wrong and
:class:`~rftstream.errors.RftError` for an op that fails, with the op's error.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from rftstream.config.schema import Config, StorageConfig, TaskPipelineConfig, TasksetConfig
from rftstream.errors import (
    ConfigError,
    CredentialsError,
    RftError,
    error_text,
    lacks_credentials,
)

__all__ = ["OUTPUT_FILE", "RECORD_FILE", "TaskPipelineResult", "run_task_pipeline"]

log = logging.getLogger(__name__)

KEY = "data_processor.task_pipeline"
OUTPUT_FILE = "tasks.jsonl"
RECORD_FILE = ".task_pipeline.json"  # hidden: a taskset directory's reader skips it


@dataclass(frozen=True)
class TaskPipelineResult:
    """What :func:`run_task_pipeline` did: ``rows_in`` read, ``rows_out`` written to
    ``output`` (a directory), ``reused`` when an earlier identical run's output stood, and
    the Data-Juicer metrics (filtered counts per op, stat means)."""

    output: Path
    rows_in: int
    rows_out: int
    reused: bool
    metrics: dict[str, float]


def _output(cfg: Config) -> tuple[str, TasksetConfig | StorageConfig]:
    tp = cfg.data_processor.task_pipeline
    assert tp is not None
    if tp.output is not None:
        return f"{KEY}.output", tp.output
    if cfg.mode in ("explore", "both"):
        inp = cfg.buffer.explorer_input
        if inp.taskset is not None:
            return "buffer.explorer_input.taskset", inp.taskset
        if inp.tasksets:
            return "buffer.explorer_input.tasksets[0]", inp.tasksets[0]
    eb = cfg.buffer.trainer_input.experience_buffer
    if cfg.mode == "train" and cfg.trainer_reads_dataset and eb is not None:
        return "buffer.trainer_input.experience_buffer", eb
    raise ConfigError(
        f"{KEY}.output",
        "names no taskset to write: set it, or a training taskset's path in "
        "buffer.explorer_input (the pipeline writes there by default)",
    )


def _fingerprint(tp: TaskPipelineConfig, inputs: list[Path]) -> str:
    """The pipeline and its inputs (paths, sizes, mtimes): equal -> the same output."""
    spec = {
        "operators": [{"name": o.name, "args": o.args} for o in tp.operators],
        "config_path": tp.config_path,
        "target_fields": tp.target_fields,
        "inputs": [[str(p), p.stat().st_size, p.stat().st_mtime_ns] for p in inputs],
    }
    return hashlib.sha256(json.dumps(spec, sort_keys=True, default=str).encode()).hexdigest()


T = TypeVar("T")


def _named(where: str, read: Callable[..., T], *args: Any) -> T:
    """``read(*args)``, its :class:`ConfigError` about ``<where>.path`` naming ``where``: an
    input of ``inputs`` is the path itself, not a table with a ``path`` key."""
    try:
        return read(*args)
    except ConfigError as exc:
        if exc.key_path == f"{where}.path":
            raise exc.at(where) from exc
        raise


def _input_files(tp: TaskPipelineConfig) -> list[tuple[str, Path]]:
    """``(key of the input, file)`` for every data file the inputs name, in order."""
    from rftstream.tasksets import taskset_files

    if not tp.inputs:
        raise ConfigError(f"{KEY}.inputs", "lists no input file: the raw tasks to process")
    files: list[tuple[str, Path]] = []
    for i, path in enumerate(tp.inputs):
        where = f"{KEY}.inputs[{i}]"
        if not Path(path).expanduser().exists():
            raise ConfigError(where, "no such file or directory", value=path)
        found = _named(where, taskset_files, TasksetConfig(path=path), where)
        files += [(where, f) for f in found]
    return files


def run_task_pipeline(cfg: Config) -> TaskPipelineResult | None:
    """Run ``data_processor.task_pipeline`` when the config has one and the mode explores (or
    trains SFT/DPO on a dataset); None otherwise. See the module docstring. Blocks."""
    tp = cfg.data_processor.task_pipeline
    if tp is None or cfg.mode not in ("explore", "train", "both"):
        return None
    if cfg.mode == "train" and not cfg.trainer_reads_dataset and tp.output is None:
        return None  # a trainer on the experience stream: its explorer half runs it
    if not tp.operators and not tp.config_path:
        raise ConfigError(f"{KEY}.operators", "lists no operator (nor config_path)")
    if tp.operators and tp.config_path:
        raise ConfigError(f"{KEY}.config_path", "give operators or config_path, not both")
    if tp.priority_weights or tp.top_k not in (-1, 0):
        key = f"{KEY}.{'priority_weights' if tp.priority_weights else 'top_k'}"
        raise ConfigError(
            key,
            "ranking tasks by priority is done by Trinity-RFT's Data-Juicer server and not "
            "here: remove priority_weights and top_k (every task the operators keep is written)",
        )
    where, storage = _output(cfg)
    if not storage.path:
        raise ConfigError(f"{where}.path", "is empty: the task pipeline writes its output there")
    out = Path(storage.path).expanduser()
    inputs = _input_files(tp)
    files = [f for _, f in inputs]
    fingerprint = _fingerprint(tp, files)
    record_path = out / RECORD_FILE
    if out.exists():
        try:
            record = json.loads(record_path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            record = None
        if isinstance(record, dict) and record.get("fingerprint") == fingerprint:
            log.info("task pipeline: %s was made from the same inputs; used as it is", out)
            return TaskPipelineResult(
                out, int(record["rows_in"]), int(record["rows_out"]), True, {}
            )
        raise ConfigError(
            f"{where}.path",
            f"{out} exists and is not this task pipeline's output on these inputs: choose "
            "another path (it is not overwritten)",
            value=storage.path,
        )
    from rftstream.tasksets import read_data_file

    rows = [row for w, f in inputs for row in _named(w, read_data_file, f, w)]
    fields = list(tp.target_fields) or sorted({k for row in rows for k in row})
    missing = [f for f in tp.target_fields if rows and all(f not in row for row in rows)]
    if missing:
        raise ConfigError(
            f"{KEY}.target_fields",
            f"no input row has {missing}; the rows have {sorted({k for r in rows for k in r})}",
        )
    samples: dict[str, list[Any]] = {f: [row.get(f) for row in rows] for f in fields}
    samples["text"] = [
        "\n".join(str(row.get(f, "")) for f in (tp.target_fields or fields)) for row in rows
    ]
    from rftstream.experience_pipeline import EXPERIENCE_OPERATORS

    try:
        # the data_juicer operator (plugin package `operators`, registered by name)
        data_juicer = EXPERIENCE_OPERATORS.get("data_juicer")
        if tp.config_path:
            dj = data_juicer(config_path=tp.config_path)
        else:
            dj = data_juicer(operators=[{o.name: dict(o.args)} for o in tp.operators])
        index, kept, metrics = dj.run_samples(samples)
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - a Data-Juicer op may raise anything
        kind = CredentialsError if lacks_credentials(exc) else RftError
        raise kind(f"{KEY}: the Data-Juicer ops failed: {error_text(exc)}") from exc
    out.mkdir(parents=True)
    with (out / OUTPUT_FILE).open("w", encoding="utf-8") as fh:
        for i, j in enumerate(index):
            row = dict(rows[j]) if not tp.target_fields else {}
            row.update({f: kept[f][i] for f in fields})
            fh.write(json.dumps(row, ensure_ascii=False, default=str) + "\n")
    record_path.write_text(
        json.dumps(
            {
                "fingerprint": fingerprint,
                "inputs": [str(f) for f in files],
                "rows_in": len(rows),
                "rows_out": len(index),
                "metrics": metrics,
            },
            indent=1,
        ),
        encoding="utf-8",
    )
    log.info("task pipeline: %d of %d tasks kept in %s", len(index), len(rows), out)
    return TaskPipelineResult(out, len(rows), len(index), False, metrics)
