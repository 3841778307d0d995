"""The checks of a run about to start that look at files: its tasksets, datasets, model
context and checkpoint directory.

:func:`check_run_inputs` runs them; :func:`rftstream.runtime.prepare_run` calls it once the
model is found, before anything of the run is written, so a missing file fails in a second
instead of inside an actor. Each raises :class:`~rftstream.errors.ConfigError` naming the key
whose file is at fault. Blocks only for ``stat`` calls, directory listings and one small
``config.json`` read; reads no data.
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

from rftstream.config.schema import TRAINER_MODES, Config, StorageConfig, TasksetConfig
from rftstream.config.validate import (
    Checker,
    check_model_context,
    check_output_dirs,
    eval_tasksets,
    placeholder_hint,
    training_tasksets,
)
from rftstream.tasksets import BUILTIN_TASKSETS, hub_hint, taskset_files

__all__ = ["check_data_paths", "check_run_inputs"]

_TRAINER_INPUT = "buffer.trainer_input"
_EXPLORER_MODES = ("both", "explore")  # modes that publish the training tasksets
_EVAL_MODES = ("both", "explore", "bench")  # modes that read the eval tasksets


def check_run_inputs(
    cfg: Config,
    model_path: str,
    *,
    source: str | None = None,
    roles: Collection[str] | None = None,
) -> None:
    """The checks of a run about to start that look at files: :func:`check_data_paths`,
    :func:`~rftstream.config.validate.check_output_dirs` and
    :func:`~rftstream.config.validate.check_model_context`.
    :func:`rftstream.runtime.prepare_run` calls it once
    the model is found, before anything of the run is written. Blocks (``stat`` calls,
    reading the model's ``config.json``). ``roles``: the actors this process runs (None:
    all the mode has); a trainer on a host without the taskset is fine."""
    check_output_dirs(cfg, source=source)
    check_data_paths(cfg, source=source, roles=roles)
    check_model_context(cfg, model_path, source=source)


def check_data_paths(
    cfg: Config, *, source: str | None = None, roles: Collection[str] | None = None
) -> None:
    """The local files the run's actors will read exist now (``stat`` only, no reading);
    a :class:`ConfigError` names the first key whose file is missing.

    Not part of :func:`validate_config`, which checks values only (a config can be
    checked, explained or converted on a machine without its data);
    :func:`rftstream.runtime.prepare_run` runs it (:func:`check_run_inputs`), so a
    missing file fails in a second, before the run directory is written, instead of
    inside an actor.

    Tasksets (read by the explorer in modes both and explore; the eval tasksets in
    bench too): ``path`` empty or ``builtin:<name>`` names a built-in taskset
    (:data:`rftstream.tasksets.BUILTIN_TASKSETS`); any other value is a local file or
    directory (``~`` expanded), as :func:`rftstream.tasksets.load_taskset` reads it.
    Trainer datasets (``buffer.trainer_input``: ``experience_buffer`` when the trainer
    reads a dataset, every ``auxiliary_buffers.<name>`` whenever a trainer runs;
    ``storage_type: queue`` reads no file) are a local data file or dataset directory each.
    Relative paths are relative to the working directory, as the actors read them.
    ``roles`` (the actors this process runs; None: every one): tasksets only where an
    explorer runs, datasets only where a trainer does.
    """
    c = Checker(source)
    explorer = roles is None or "explorer" in roles
    trainer = roles is None or "trainer" in roles
    tasksets: list[tuple[str, TasksetConfig]] = []
    if explorer and cfg.mode in _EXPLORER_MODES:
        tasksets += training_tasksets(cfg.buffer.explorer_input)
    if explorer and cfg.mode in _EVAL_MODES:
        tasksets += eval_tasksets(cfg.buffer.explorer_input)
    for key, ts in tasksets:
        _check_taskset_path(c, f"{key}.path", ts.path)
        if ts.path and not ts.path.startswith("builtin:"):
            taskset_files(ts, key)  # the files it reads (a directory listing, no data)
    tin = cfg.buffer.trainer_input
    datasets: list[tuple[str, StorageConfig]] = []
    if trainer and cfg.trainer_reads_dataset and tin.experience_buffer is not None:
        if tin.experience_buffer.path:  # an empty one: runtime._preset_check_config says why
            datasets.append((f"{_TRAINER_INPUT}.experience_buffer", tin.experience_buffer))
    if trainer and cfg.mode in TRAINER_MODES:
        datasets += [
            (f"{_TRAINER_INPUT}.auxiliary_buffers.{name}", aux)
            for name, aux in tin.auxiliary_buffers.items()
            if aux.storage_type == "file"
        ]
    for key, storage in datasets:
        _check_dataset_path(c, f"{key}.path", storage.path)


def _check_taskset_path(c: Checker, key: str, value: str) -> None:
    path = (value or "").strip()
    if not path or path.startswith("builtin:"):
        name = path.split(":", 1)[1] if path else "arithmetic"
        if name not in BUILTIN_TASKSETS:
            c.fail(
                key, f"unknown built-in taskset {name!r}; known: {sorted(BUILTIN_TASKSETS)}", value
            )
        return
    if not Path(path).expanduser().exists():
        c.fail(key, f"no such file or directory{placeholder_hint(path) or hub_hint(path)}", value)


def _check_dataset_path(c: Checker, key: str, value: str) -> None:
    p = Path(value).expanduser()
    if not value:
        c.fail(key, "names no dataset (a local data file or dataset directory)", value)
    elif not p.exists():
        hint = placeholder_hint(value) or hub_hint(value)
        c.fail(
            key, f"no such file or directory (a local data file or dataset directory){hint}", value
        )
