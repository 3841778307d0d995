"""``rftstream config explain``: what becomes of every key of a config file.

:func:`explain_file` reads the file (the only I/O), applies ``--set``
overrides and ``${oc.env:...}``, translates Trinity-RFT keys
(:mod:`rftstream.config.trinity`) and returns one line per key plus the
errors that loading and validating would raise. Issues no warnings.
"""

from __future__ import annotations

from typing import Any

from rftstream.config.loader import (
    _read_yaml,
    apply_overrides,
    config_from_dict,
    interpolate_env,
    translate_config,
    upgraded,
)
from rftstream.config.paths import PathPart, config_info, fmt_path, type_at
from rftstream.config.secrets import mask_value
from rftstream.config.stages import (
    STAGES_KEY,
    RawStage,
    StageConfigError,
    has_stages,
    split_with_overrides,
    stage_data,
)
from rftstream.config.trinity import KeyNote
from rftstream.config.validate import validate_config
from rftstream.errors import ConfigError

__all__ = ["explain_file", "explain_lines"]


def explain_lines(data: dict[str, Any], notes: list[KeyNote]) -> list[str]:
    """One line per leaf key of ``data``: ``key = value`` (a key of ours, kept),
    ``key -> ours = value`` (mapped), ``key: ignored (why)``, ``key: replaced ...``."""
    by_path = {n.path: n for n in notes}
    lines: list[str] = []

    def walk(node: Any, parts: tuple[PathPart, ...]) -> None:
        path = fmt_path(parts)
        note = by_path.pop(path, None) if parts else None
        if note is not None:
            lines.append(_note_line(note))
            return
        if isinstance(node, dict) and node and _descend(parts):
            for k, v in node.items():
                walk(v, (*parts, str(k)))
            return
        if isinstance(node, list) and node and all(isinstance(v, dict) for v in node) and parts:
            for i, v in enumerate(node):
                walk(v, (*parts, i))
            return
        if parts:
            known = type_at(config_info(), parts) is not None
            shown = mask_value(path, node)
            lines.append(f"{path} = {shown!r}" + ("" if known else "   (unknown key)"))

    walk(data, ())
    lines += [_note_line(n) for n in by_path.values()]  # notes below an ignored/mapped subtree
    return lines


def _descend(parts: tuple[PathPart, ...]) -> bool:
    import msgspec

    info = type_at(config_info(), parts) if parts else config_info()
    return info is None or not isinstance(info, msgspec.inspect.DictType)


def _note_line(note: KeyNote) -> str:
    if note.action == "ignored":
        return f"{note.path} = {note.value!r}: IGNORED, {note.reason}"
    if note.action == "replaced":
        new = ", ".join(f"{k} = {v!r}" for k, v in note.targets)
        return f"{note.path} = {note.value!r}: REPLACED by {new}, {note.reason}"
    if note.action == "overridden":
        return f"{note.path} = {note.value!r}: not used, {note.reason}"
    if not note.targets:
        return f"{note.path} = {note.value!r}: {note.reason}"
    arrows = ", ".join(f"{k} = {v!r}" for k, v in note.targets)
    return f"{note.path} = {note.value!r} -> {arrows} ({note.reason})"


def explain_file(path: str, overrides: list[str] | None = None) -> tuple[list[str], list[str]]:
    """``(lines, errors)`` for the config file at ``path``. Reads the file; never raises
    :class:`ConfigError` (its message is one of the errors)."""
    import warnings

    try:
        data, overrides = upgraded(_read_yaml(path) or {}, list(overrides or []), path)
        if not isinstance(data, dict):
            raise ConfigError("(root)", "the top level must be a mapping", source=path)
        if has_stages(data):
            return _explain_stages(data, list(overrides or []), path)
        if overrides:
            data = apply_overrides(data, overrides)
        data = interpolate_env(data, path)
        translation = translate_config(data, path)
    except ConfigError as exc:
        return [], [str(exc)]
    lines = explain_lines(data, translation.notes)
    errors: list[str] = []
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            validate_config(config_from_dict(data, path), path)
    except ConfigError as exc:
        errors.append(str(exc))
    return lines, errors


def _explain_stages(
    data: dict[str, Any], overrides: list[str], path: str
) -> tuple[list[str], list[str]]:
    """A staged config: the base's keys, then per stage a header (its run name, the
    sections it replaces) and the keys of those sections as ``stages[i].<key>``; the
    errors of every stage's config. Raises :class:`ConfigError` for a malformed
    ``stages`` list (the caller reports it)."""
    import warnings

    base, stages, others = split_with_overrides(data, overrides, path)
    base = interpolate_env(base, path)
    lines = explain_lines(base, translate_config(base, path).notes)
    lines.append(
        f"{STAGES_KEY}: {len(stages)} stages, run in order by `rftstream up`; a section a "
        "stage sets replaces the base's whole section (as in Trinity-RFT; `model` is merged); "
        "each stage after the first starts from the previous stage's final checkpoint "
        "unless it sets model.model_path"
    )
    errors: list[str] = []
    for stage in stages:
        lines.append(_stage_header(stage))
        try:
            stage_map = stage_data(stage, others, path)
            translation = translate_config(stage_map, path)
            own = {k: stage_map[k] for k in stage.sections if k in stage_map}
            notes = [n for n in translation.notes if stage.owns(n.path)]
            lines += [f"  {stage.prefix}.{line}" for line in explain_lines(own, notes)]
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                validate_config(config_from_dict(stage_map, path), path)
        except ConfigError as exc:
            errors.append(str(StageConfigError(exc, stage)))
    return lines, errors


def _stage_header(stage: RawStage) -> str:
    replaced = ", ".join(stage.sections) or "nothing (the base config as it is)"
    start = (
        "model.model_path set by the stage"
        if stage.sets_model_path
        else "the base model.model_path"
        if stage.index == 0
        else "the previous stage's final checkpoint"
    )
    return (
        f"stage {stage.label}: run `{stage.data.get('name')}`, sets {replaced}; starts from {start}"
    )
