"""Load a :class:`~rftstream.config.schema.Config` from YAML, with key-path errors.

Steps of :func:`load_config`: read the YAML file (``yaml.safe_load``, with OmegaConf's float spellings), apply
``key.path=value`` overrides, resolve ``${oc.env:VAR,default}`` interpolation,
report every unknown key by its full dotted path, convert with
``msgspec.convert`` (type errors become :class:`~rftstream.errors.ConfigError`
naming the key path, the value and the file; a value outside a key's ``Literal``
lists the allowed ones), check with :func:`rftstream.config.validate.validate_config`
and derive the values left to other keys with
:func:`rftstream.config.resolve.resolve_config`.

Key paths are dotted, with ``[i]`` for list items:
``data_processor.experience_pipeline.operators[1].args``.

Only :func:`load_config` does I/O (it reads one file).
"""

from __future__ import annotations

import copy
import difflib
import os
import re
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import yaml

from rftstream.config.legacy import moving_overrides, upgrade_layout
from rftstream.config.paths import (
    ROOT,
    PathPart,
    choice_message,
    config_info,
    fmt_path,
    literal_choices,
    lookup,
    type_at,
)
from rftstream.config.resolve import resolve_config
from rftstream.config.schema import Config
from rftstream.config.trinity import Translation, TrinityConfigWarning, translate_trinity
from rftstream.config.validate import ConfigWarning, validate_config
from rftstream.errors import ConfigError

__all__ = [
    "apply_overrides",
    "config_from_dict",
    "config_to_dict",
    "dump_config_yaml",
    "interpolate_env",
    "load_config",
    "translate_config",
]


# ${oc.env:VAR} or ${oc.env:VAR,default}; the default runs to the closing brace.
_ENV_RE = re.compile(r"\$\{oc\.env:\s*([A-Za-z_][A-Za-z0-9_]*)\s*(?:,([^}]*))?\}")
_MSGSPEC_PATH_RE = re.compile(r"^(?P<msg>.*) - at `\$(?P<path>[^`]*)`$", re.DOTALL)
_PATH_TOKEN_RE = re.compile(r"\.([^.\[\]]+)|\[(\d+|\.\.\.)\]")
_OVERRIDE_TOKEN_RE = re.compile(r"([^.\[\]]+)|\[(\d+)\]")
_WILDCARD = "..."
_ENUM_ERROR = "Invalid enum value"  # msgspec's message for a value no Literal allows
_NOT_TEXT = "not a text file (UTF-8 YAML)"


class ConfigYamlLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that reads ``1e-6`` and ``1.0e6`` as floats, as OmegaConf does.

    YAML 1.1 (PyYAML) wants a dot and a signed exponent (``1.0e+6``); Trinity-RFT
    reads its configs with OmegaConf, whose loader accepts both spellings, and its
    example configs use them (``lr: 1e-6``, ``clip_ratio_c: 1.0e6``).
    """


ConfigYamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+
        |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


# --------------------------------------------------------------------------- paths


def _parse_msgspec_path(path: str) -> list[PathPart]:
    """``.a.b[0][...].c`` (msgspec's path after ``$``) -> ``["a", "b", 0, "...", "c"]``."""
    parts: list[PathPart] = []
    for m in _PATH_TOKEN_RE.finditer(path):
        key, idx = m.group(1), m.group(2)
        if key is not None:
            parts.append(key)
        elif idx == _WILDCARD:
            parts.append(_WILDCARD)
        else:
            parts.append(int(idx))
    return parts


def _accepts_str(info: Any) -> bool:
    ins = msgspec.inspect
    if isinstance(info, ins.UnionType):
        return any(_accepts_str(t) for t in info.types)
    return isinstance(info, ins.StrType)


def _pick_member(info: Any, value: Any) -> Any | None:
    """For a union, the member type whose container kind matches ``value``."""
    ins = msgspec.inspect
    if not isinstance(info, ins.UnionType):
        return info
    for t in info.types:
        if isinstance(value, dict) and isinstance(t, (ins.StructType, ins.DictType)):
            return t
        if isinstance(value, list) and isinstance(t, (ins.ListType, ins.VarTupleType)):
            return t
    return None


def _unknown_keys(value: Any, info: Any, path: tuple[PathPart, ...]) -> Iterator[tuple[str, str]]:
    """Yield ``(key_path, report)`` for every key in ``value`` that ``info`` does not declare."""
    ins = msgspec.inspect
    info = _pick_member(info, value)
    if isinstance(info, ins.StructType) and isinstance(value, dict):
        fields = {f.encode_name: f.type for f in info.fields}
        for key, sub in value.items():
            if key in fields:
                yield from _unknown_keys(sub, fields[key], (*path, key))
                continue
            shown = fmt_path((*path, str(key)))
            close = difflib.get_close_matches(str(key), list(fields), n=1, cutoff=0.6)
            hint = f"did you mean `{close[0]}`?" if close else f"valid keys: {', '.join(fields)}"
            yield shown, f"unknown key `{shown}` ({hint})"
    elif isinstance(info, ins.DictType) and isinstance(value, dict):
        for key, sub in value.items():
            yield from _unknown_keys(sub, info.value_type, (*path, str(key)))
    elif isinstance(info, (ins.ListType, ins.VarTupleType)) and isinstance(value, list):
        for i, sub in enumerate(value):
            yield from _unknown_keys(sub, info.item_type, (*path, i))


# --------------------------------------------------------------------------- interpolation


def _substitute(text: str, parts: tuple[PathPart, ...], source: str | None) -> str:
    def repl(m: re.Match[str]) -> str:
        var, default = m.group(1), m.group(2)
        value = os.environ.get(var)
        if value is not None:
            return value
        if default is not None:
            return default
        raise ConfigError(
            fmt_path(parts),
            f"environment variable `{var}` is not set and `{m.group(0)}` gives no default",
            source=source,
        )

    return _ENV_RE.sub(repl, text)


def interpolate_env(data: Any, source: str | None = None) -> Any:
    """Resolve ``${oc.env:VAR}`` / ``${oc.env:VAR,default}`` in every string of ``data``.

    Returns a new structure; ``data`` is not modified. A string that is exactly
    one interpolation is YAML-typed (``"${oc.env:N,3}"`` becomes ``3``) unless the
    config field there is a string field; an interpolation embedded in a longer
    string is substituted as text. Raises :class:`ConfigError` naming the key
    path when a variable is unset and has no default.
    """
    info = config_info()

    def walk(node: Any, parts: tuple[PathPart, ...]) -> Any:
        if isinstance(node, dict):
            return {k: walk(v, (*parts, str(k))) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v, (*parts, i)) for i, v in enumerate(node)]
        if not isinstance(node, str) or "${oc.env:" not in node:
            return node
        text = _substitute(node, parts, source)
        if not _ENV_RE.fullmatch(node.strip()) or text == "":
            return text
        target = type_at(info, parts)
        if target is not None and _accepts_str(target):
            return text
        try:
            return yaml.load(text, Loader=ConfigYamlLoader)
        except yaml.YAMLError:
            return text

    return walk(data, ())


# --------------------------------------------------------------------------- overrides


def _parse_override_key(key: str, item: str) -> list[PathPart]:
    parts: list[PathPart] = []
    for segment in key.split("."):
        if not segment:
            raise ConfigError(key or ROOT, f"malformed override {item!r}: empty key segment")
        for m in _OVERRIDE_TOKEN_RE.finditer(segment):
            parts.append(int(m.group(2)) if m.group(2) is not None else m.group(1))
    rebuilt = fmt_path(parts)
    if rebuilt != key:
        raise ConfigError(key, f"malformed override {item!r}: expected `a.b[0].c=value`")
    return parts


def _override_value(key: str, raw: str) -> Any:
    """An override's value: YAML where it is clearly meant as YAML (``3`` an int, ``true``,
    ``null``, ``[a, b]``, ``{k: v}``), else the text itself: ``Answer: $Answer`` and
    ``- x`` stay strings (a block mapping or list is never written on one line on purpose),
    as does a value with `` #`` (YAML would drop the rest as a comment); empty is ``""``.
    Raises :class:`ConfigError` for a flow value that is not valid YAML."""
    text = raw.strip()
    if not text:
        return ""
    try:
        value = yaml.load(raw, Loader=ConfigYamlLoader)
    except yaml.YAMLError as exc:
        if text[0] in "[{":
            raise ConfigError(key, f"override value is not valid YAML: {exc}", value=raw) from exc
        return raw
    if isinstance(value, dict | list) and text[0] not in "[{":
        return raw
    if " #" in raw and not isinstance(value, dict | list):
        return raw
    return value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Return a copy of ``data`` with dotted ``key.path=value`` overrides applied.

    The value is YAML where it is clearly meant so (``buffer.total_steps=3`` sets an
    int, ``model.model_path=`` sets ``""``, ``x=Answer: $Answer`` a string: see
    :func:`_override_value`). Missing intermediate mappings are created; ``[i]`` (or
    ``.i.``) indexes an existing list item. ``data`` is not modified.
    Raises :class:`ConfigError` for a malformed override or a path that goes
    through a non-mapping value.
    """
    result = copy.deepcopy(data)
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(
                key or ROOT, f"malformed override {item!r}: expected `key.path=value`"
            )
        parts = _parse_override_key(key, item)
        value = _override_value(key, raw)
        node: Any = result
        for depth, part in enumerate(parts):
            last = depth == len(parts) - 1
            here = fmt_path(parts[:depth]) if depth else ROOT
            if isinstance(part, str) and part.isdigit() and isinstance(node, list):
                part = int(part)  # `tasksets.0.path`, as OmegaConf and Hydra write it
                parts[depth] = part
            if isinstance(part, int):
                if not isinstance(node, list) or not 0 <= part < len(node):
                    raise ConfigError(
                        fmt_path(parts[: depth + 1]),
                        f"override {item!r}: no list item {part} at `{here}`",
                    )
                if last:
                    node[part] = value
                else:
                    node = node[part]
                continue
            if not isinstance(node, dict):
                hint = (
                    f" but a list of {len(node)}: index it, `{here}[0].{fmt_path(parts[depth:])}` "
                    f"or `{here}.0.{fmt_path(parts[depth:])}`"
                    if isinstance(node, list)
                    else ""
                )
                raise ConfigError(
                    here,
                    f"override {item!r}: `{here}` is not a mapping{hint}",
                    value=node,
                    has_value=True,
                )
            if last:
                node[part] = value
            else:
                if node.get(part) is None:
                    node[part] = [] if isinstance(parts[depth + 1], int) else {}
                node = node[part]
    return result


# --------------------------------------------------------------------------- conversion


def _resolve_wildcards(data: Any, parts: list[PathPart]) -> list[PathPart]:
    """Replace msgspec's ``[...]`` (a dict key it does not name) by the failing key."""
    if _WILDCARD not in parts:
        return parts
    i = parts.index(_WILDCARD)
    found, container = lookup(data, parts[:i])
    if not found or not isinstance(container, dict):
        return parts
    target = type_at(config_info(), tuple(p for p in parts[:i]) + ("_",))
    cls = getattr(target, "cls", None)
    candidates = list(container)
    if cls is not None:
        bad = []
        for key in candidates:
            try:
                msgspec.convert(container[key], cls, strict=False)
            except msgspec.ValidationError:
                bad.append(key)
        candidates = bad or candidates
    for key in candidates:
        resolved = _resolve_wildcards(data, [*parts[:i], str(key), *parts[i + 1 :]])
        if lookup(data, resolved)[0]:
            return resolved
    return parts


def _as_mapping(data: Any, what: str, source: str | None) -> dict[str, Any]:
    """``data`` itself if a mapping, ``{}`` for ``None`` (an empty document); else a
    :class:`ConfigError` at the root: "``what`` must be a mapping, not <type>"."""
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            ROOT,
            f"{what} must be a mapping, not {type(data).__name__}",
            value=data,
            has_value=True,
            source=source,
        )
    return data


def config_from_dict(
    data: dict[str, Any],
    source: str | None = None,
    *,
    cuda_available: Callable[[], bool] | None = None,
) -> Config:
    """Convert a plain mapping (already interpolated) into a :class:`Config`.

    Trinity-RFT 0.6 keys are translated first
    (:func:`rftstream.config.trinity.translate_trinity`): a mapped key is
    converted, a key without meaning here gives one
    :class:`~rftstream.config.trinity.TrinityConfigWarning` naming it and why.
    Every key in neither schema is reported in one :class:`ConfigError` by its
    full dotted path, with the closest valid key suggested. A type error names
    the key path, the offending value and ``source`` (the file it came from).
    Does not run :func:`~rftstream.config.validate.validate_config`.
    """
    data = _as_mapping(data, "the config", source)
    data = _without_stages(data, source)
    translation = translate_config(data, source, cuda_available=cuda_available)
    for note in translation.warnings:
        warnings.warn(note.message(), TrinityConfigWarning, stacklevel=2)
    data = translation.data
    unknown = translation.unknown + list(_unknown_keys(data, config_info(), ()))
    if unknown:
        reports = [report for _, report in unknown]
        message = (
            reports[0]
            if len(reports) == 1
            else f"{len(reports)} unknown keys: " + "; ".join(reports)
        )
        raise ConfigError(unknown[0][0], message, source=source)
    try:
        return msgspec.convert(data, Config, strict=False)
    except msgspec.ValidationError as exc:
        text = str(exc)
        m = _MSGSPEC_PATH_RE.match(text)
        if m is None:
            raise ConfigError(ROOT, text, source=source) from exc
        parts = _resolve_wildcards(data, _parse_msgspec_path(m.group("path")))
        found, value = lookup(data, parts)
        message = m.group("msg")
        choices = literal_choices(parts)
        if choices and message.startswith(_ENUM_ERROR):
            message = choice_message(value, choices)
        raise ConfigError(
            fmt_path(parts), message, value=value, has_value=found, source=source
        ) from exc


def _without_stages(data: dict[str, Any], source: str | None) -> dict[str, Any]:
    """``data`` without an empty ``stages``; raises :class:`ConfigError` for a non-empty one
    (a staged config is several runs: :func:`rftstream.config.stages.stages_from_dict`)."""
    if "stages" not in data:
        return data
    stages = data["stages"]
    if stages is not None and stages != []:
        count = f"{len(stages)} stages" if isinstance(stages, list) else "stages"
        raise ConfigError(
            "stages",
            f"this config has {count}, each a run of its own: `rftstream up` runs them in "
            "order (in Python: rftstream.config.load_stages gives each stage's config)",
            source=source,
        )
    return {k: v for k, v in data.items() if k != "stages"}


def translate_config(
    data: dict[str, Any],
    source: str | None = None,
    *,
    cuda_available: Callable[[], bool] | None = None,
) -> Translation:
    """:func:`~rftstream.config.trinity.translate_trinity`: what each Trinity-RFT key becomes.

    Issues no warning (:func:`config_from_dict` does); raises :class:`ConfigError`
    naming ``source`` for a Trinity value that cannot run here.
    """
    return translate_trinity(data, source=source, cuda_available=cuda_available)


def config_to_dict(cfg: Config) -> dict[str, Any]:
    """The config as plain builtins (``msgspec.to_builtins``), every key present."""
    return msgspec.to_builtins(cfg)


def dump_config_yaml(cfg: Config) -> str:
    """The config as YAML text, keys in schema order; loads back to an equal Config."""
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False, allow_unicode=True)


# --------------------------------------------------------------------------- files


def upgraded(data: Any, overrides: list[str], source: str | None) -> tuple[Any, list[str]]:
    """A config file's raw mapping in today's layout (Trinity-RFT's pre-0.3 layouts,
    :mod:`rftstream.config.legacy`) and the overrides still to apply: those naming keys
    that move are applied first."""
    moving = moving_overrides(data, overrides)
    if moving:
        data = apply_overrides(data, moving)
        overrides = [o for o in overrides if o not in moving]
    return upgrade_layout(data, source), overrides


def _read_yaml(path: str) -> Any:
    """The YAML document in the file at ``path`` (``None`` for an empty one). Blocks (reads it).

    Raises :class:`ConfigError` naming the file for a missing or unreadable file, one
    that is not UTF-8 text (a binary file: NUL bytes, bytes that do not decode, control
    characters YAML refuses) and a YAML syntax error (with its line and column). Warns
    (:class:`~rftstream.config.validate.ConfigWarning`) for a file with no document
    (empty, or only comments): every key keeps its default.
    """
    try:
        with open(path, "rb") as fh:
            raw = fh.read()
    except FileNotFoundError as exc:
        raise ConfigError(ROOT, "config file not found", source=path) from exc
    except OSError as exc:
        raise ConfigError(ROOT, f"cannot read config file: {exc}", source=path) from exc
    if b"\0" in raw:
        raise ConfigError(ROOT, f"{_NOT_TEXT}: it holds NUL bytes", source=path)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            ROOT, f"{_NOT_TEXT}: byte {exc.start} ({raw[exc.start]:#04x}) is not UTF-8", source=path
        ) from exc
    try:
        data = yaml.load(text, Loader=ConfigYamlLoader)
    except yaml.reader.ReaderError as exc:  # a character YAML does not allow in text
        ch = exc.character
        shown = f"#x{ch:04x}" if isinstance(ch, int) else f"#x{ord(ch):04x}"
        raise ConfigError(
            ROOT,
            f"{_NOT_TEXT}: character {shown} at position {exc.position}: {exc.reason}",
            source=path,
        ) from exc
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark is not None else 0
        col = mark.column + 1 if mark is not None else 0
        problem = " ".join(" ".join(p.split()) for p in (exc.context, exc.problem) if p)
        raise ConfigError(
            ROOT, f"YAML syntax error at line {line}, column {col}: {problem}", source=path
        ) from exc
    except yaml.YAMLError as exc:
        raise ConfigError(ROOT, "YAML error: " + " ".join(str(exc).split()), source=path) from exc
    if data is None:
        # stacklevel 1: load_stages and load_config both read the file, one warning shows
        warnings.warn(
            f"{path} is empty: the defaults run (every key at its default)",
            ConfigWarning,
            stacklevel=1,
        )
    return data


def load_config(
    path: str | os.PathLike[str] | None,
    overrides: list[str] | None = None,
    *,
    validate: bool = True,
) -> Config:
    """Load, interpolate, convert, validate and resolve a config.

    ``path`` ``None`` means all defaults. ``validate`` false: the converted config as
    written, neither checked nor resolved. ``overrides`` are ``key.path=value``
    strings (value parsed as YAML) applied to the raw mapping before
    interpolation and conversion. Reads the file (blocking). Raises
    :class:`ConfigError` naming the file and key path for a missing file, a file that
    is not UTF-8 text, a YAML syntax error (with its line), a non-mapping document,
    unset environment variables, unknown keys, wrong types and failed validation
    (which includes local taskset and dataset paths that do not exist). Warns
    (:class:`~rftstream.config.validate.ConfigWarning`) for an empty file.
    """
    source = os.fspath(path) if path is not None else None
    data: Any = {} if source is None else _read_yaml(source)
    data = _as_mapping(data, "the top level of a config file", source)
    data, overrides = upgraded(data, list(overrides or []), source)
    if overrides:
        data = apply_overrides(data, list(overrides))
    data = interpolate_env(data, source)
    cfg = config_from_dict(data, source)
    if not validate:
        return cfg
    validate_config(cfg, source)
    return resolve_config(cfg)
