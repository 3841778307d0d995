"""The config form of ``rftstream studio``: fields generated from the config schema.

Pure apart from :func:`check_form`, which writes the YAML it built to a temporary
file and loads it back with :func:`rftstream.config.load_config`, so the page
validates exactly as ``rftstream up --config`` does.

Every key of :class:`rftstream.config.schema.Config` becomes a field (a new key
in the schema shows up on the page without editing it): scalars (``int``,
``float``, ``str``, ``bool``, each optionally ``None``) get typed inputs; lists,
dicts, unions and optional tables are edited as YAML text. Each section lists
the keys of :data:`COMMON_KEYS` first; the others go in its "advanced" part.
"""

from __future__ import annotations

import os
import tempfile
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any

import msgspec
import yaml

from rftstream.config.loader import ConfigYamlLoader, load_config
from rftstream.config.paths import literal_choices
from rftstream.config.schema import MONITOR_TYPES, SYNC_STYLE_ALIASES, Config
from rftstream.errors import ConfigError
from rftstream.plugins.registries import (
    ADVANTAGE_FN,
    ALGORITHM_TYPE,
    POLICY_LOSS_FN,
    REWARD_FUNCTIONS,
)
from rftstream.shaped_models import builtin_names
from rftstream.studio.doctext import DocPart, doc_parts
from rftstream.workflow import WORKFLOWS

__all__ = [
    "COMMON_KEYS",
    "FormCheck",
    "FormField",
    "FormSection",
    "check_form",
    "field_for_key",
    "form_sections",
    "form_values_to_dict",
]

# Sections in page order: (top-level key, title). "general" holds the root's scalars.
SECTIONS: tuple[tuple[str, str], ...] = (
    ("general", "General"),
    ("algorithm", "Algorithm"),
    ("model", "Model"),
    ("buffer", "Buffer and taskset"),
    ("explorer", "Explorer"),
    ("synchronizer", "Synchronizer"),
    ("data_processor", "Operators (experience pipeline)"),
    ("trainer", "Trainer"),
    ("monitor", "Monitor"),
    ("nats", "NATS"),
)

# The keys a person sets for most runs (Trinity-RFT's "essential" and "important" configs),
# shown first in their section in this order; every other key is in the section's advanced part.
COMMON_KEYS: tuple[str, ...] = (
    "name",
    "project",
    "mode",
    "run_dir",
    "algorithm.algorithm_type",
    "algorithm.repeat_times",
    "algorithm.optimizer.lr",
    "model.model_path",
    "model.max_prompt_tokens",
    "model.max_response_tokens",
    "buffer.batch_size",
    "buffer.train_batch_size",
    "buffer.total_epochs",
    "buffer.total_steps",
    "buffer.explorer_input.taskset.path",
    "buffer.explorer_input.taskset.default_workflow_type",
    "buffer.explorer_input.taskset.default_reward_fn_type",
    "buffer.explorer_input.taskset.rollout_args.temperature",
    "buffer.explorer_input.taskset.rollout_args.max_tokens",
    "explorer.runner_num",
    "explorer.rollout_model.engine_type",
    "explorer.rollout_model.engine_num",
    "explorer.eval_interval",
    "synchronizer.sync_method",
    "synchronizer.sync_style",
    "synchronizer.sync_interval",
    "synchronizer.max_staleness",
    "data_processor.experience_pipeline.operators",
    "trainer.save_interval",
    "trainer.zero_stage",
    "trainer.n_gpus_per_node",
    "trainer.ppo_micro_batch_size_per_gpu",
    "trainer.grad_clip",
    "monitor.monitor_type",
    "monitor.plot",
    "nats.url",
)

KINDS = ("int", "float", "str", "bool", "yaml")


@dataclass(frozen=True)
class FormField:
    """One input of the form: the config key ``path`` (dotted), edited as ``kind``.

    ``optional``: an empty input means ``null``. ``default``: the schema's default
    (JSON-able). ``choices``: the only values the loader accepts (a select);
    ``suggestions``: known names (a datalist; other values are allowed).
    """

    path: str
    kind: str
    optional: bool
    default: Any
    common: bool
    choices: tuple[str | int, ...] = ()
    suggestions: tuple[str, ...] = ()


@dataclass(frozen=True)
class FormSection:
    """One section of the form: its fields, common ones first.

    ``help``: the section's docstring as plain text (markup removed); ``help_parts``: the
    same as ``(kind, text)`` runs, ``"text"`` or ``"code"`` (:func:`doc_parts`), which the
    page shows as text nodes and ``<code>`` elements.
    """

    key: str
    title: str
    help: str
    fields: tuple[FormField, ...]
    help_parts: tuple[DocPart, ...] = ()

    def to_json(self) -> dict[str, Any]:
        """The section as JSON-able builtins (what ``/api/schema`` serves)."""
        return asdict(self)


@dataclass
class FormCheck:
    """What :func:`check_form` found.

    ``errors``: key path of a field -> message; ``general``: errors no field
    holds; ``warnings``: the loader's warnings (e.g. a Trinity-RFT key with no
    meaning here). ``yaml``: the config file text (the keys that differ from the
    defaults), set when the values parsed; ``config``: the loaded config, set
    when it is valid.
    """

    errors: dict[str, str] = field(default_factory=dict)
    general: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    yaml: str = ""
    config: Config | None = None

    @property
    def ok(self) -> bool:
        return self.config is not None and not self.errors and not self.general


# ------------------------------------------------------------------ the schema as fields


def _choices(path: str, kind: str | None, optional: bool) -> tuple[str | int, ...]:
    """The values of a scalar key whose schema type is a ``Literal`` (``""`` first, for
    "the default", when it may be null); aliases (``sync_style: explorer_driven``) are
    accepted but not offered. Empty for any other key."""
    if kind is None:
        return ()
    values = tuple(v for v in literal_choices(path.split(".")) if v not in SYNC_STYLE_ALIASES)
    return (("",) if optional and values else ()) + values


def _suggestions() -> dict[str, tuple[str, ...]]:
    """Registered names for keys that take one (plugins add more, so these are hints)."""

    taskset = "buffer.explorer_input.taskset."
    return {
        "algorithm.algorithm_type": tuple(ALGORITHM_TYPE.names()),
        "algorithm.advantage_fn": tuple(ADVANTAGE_FN.names()),
        "algorithm.policy_loss_fn": tuple(POLICY_LOSS_FN.names()),
        taskset + "default_workflow_type": tuple(WORKFLOWS.names()),
        taskset + "default_reward_fn_type": tuple(REWARD_FUNCTIONS.names()),
        taskset + "path": ("builtin:arithmetic",),
        "model.model_path": tuple(builtin_names()),
        "monitor.monitor_type": tuple(MONITOR_TYPES),
    }


def _scalar_kind(info: Any) -> tuple[str | None, bool]:
    """``(kind, optional)`` of a scalar type (``int | None`` and ``Literal`` values of one
    type included); kind None: not a scalar."""
    ins = msgspec.inspect
    optional = False
    if isinstance(info, ins.UnionType):
        members = [t for t in info.types if not isinstance(t, ins.NoneType)]
        if len(members) != 1:
            return None, False
        optional, info = True, members[0]
    if isinstance(info, ins.LiteralType):
        kinds = {type(v) for v in info.values}
        if kinds == {str}:
            return "str", optional
        if kinds == {int}:
            return "int", optional
        return None, False
    for kind, typ in (
        ("bool", ins.BoolType),
        ("int", ins.IntType),
        ("float", ins.FloatType),
        ("str", ins.StrType),
    ):
        if isinstance(info, typ):
            return kind, optional
    return None, False


def _walk(
    info: Any,
    prefix: str,
    defaults: dict[str, Any],
    out: list[tuple[str, str, bool, Any, tuple[str | int, ...]]],
) -> None:
    """Append ``(path, kind, optional, default, choices)`` for every key below the struct
    ``info``."""
    for f in info.fields:
        path = f"{prefix}{f.encode_name}"
        default = defaults.get(f.encode_name)
        if isinstance(f.type, msgspec.inspect.StructType):
            _walk(f.type, path + ".", default or {}, out)
            continue
        kind, optional = _scalar_kind(f.type)
        choices = _choices(path, kind, optional)
        out.append((path, kind or "yaml", optional if kind else True, default, choices))


def form_sections() -> list[FormSection]:
    """The form: one :class:`FormSection` per top-level table of :class:`Config` (and
    "general" for the root's scalars), in :data:`SECTIONS` order, each field's default
    taken from ``Config()``. A top-level table missing from :data:`SECTIONS` gets a
    section of its own at the end, so every key of the schema has a field."""
    info = msgspec.inspect.type_info(Config)
    defaults = msgspec.to_builtins(Config())
    rows: list[tuple[str, str, bool, Any, tuple[str | int, ...]]] = []
    _walk(info, "", defaults, rows)
    suggestions = _suggestions()
    docs = {
        f.encode_name: (f.type.cls.__doc__ or "")
        for f in info.fields
        if isinstance(f.type, msgspec.inspect.StructType)
    }
    order = {key: i for i, key in enumerate(COMMON_KEYS)}
    titles = dict(SECTIONS)
    tops = [k for k, _ in SECTIONS] + [
        f.encode_name
        for f in info.fields
        if f.encode_name not in titles and isinstance(f.type, msgspec.inspect.StructType)
    ]
    sections = []
    for top in tops:
        mine = [
            r
            for r in rows
            if (r[0].split(".")[0] == top if top != "general" else "." not in r[0])
            and (top != "general" or r[0] not in titles)
        ]
        fields = [
            FormField(
                path=path,
                kind=kind,
                optional=optional,
                default=default,
                common=path in order,
                choices=choices,
                suggestions=suggestions.get(path, ()),
            )
            for path, kind, optional, default, choices in mine
        ]
        fields.sort(key=lambda f: (0, order[f.path]) if f.common else (1, 0))
        parts = tuple(doc_parts(docs.get(top, "")))
        help_text = "".join(text for _, text in parts)
        sections.append(
            FormSection(top, titles.get(top, top), help_text, tuple(fields), help_parts=parts)
        )
    return sections


def _fields_by_path() -> dict[str, FormField]:
    return {f.path: f for s in form_sections() for f in s.fields}


def field_for_key(key_path: str, paths: list[str] | tuple[str, ...]) -> str | None:
    """The field of ``paths`` that holds ``key_path`` (itself, or the YAML field of a
    table or list it lies in: ``...operators[1].args`` -> ``...operators``); None if none."""
    best: str | None = None
    for p in paths:
        if key_path == p or key_path.startswith((p + ".", p + "[")):
            if best is None or len(p) > len(best):
                best = p
    return best


# ------------------------------------------------------------------ values -> config


def _parse(f: FormField, raw: Any) -> Any:
    """One input's value as the config value; raises ValueError with the reason."""
    if f.kind == "bool":
        if isinstance(raw, bool):
            return raw
        text = str(raw).strip().lower()
        if text in ("true", "on", "1", "yes"):
            return True
        if text in ("false", "off", "0", "no", ""):
            return False
        raise ValueError(f"must be true or false, not {raw!r}")
    if raw is None:
        if f.optional:
            return None
        raise ValueError("needs a value")
    text = raw if isinstance(raw, str) else str(raw)
    if f.kind == "yaml":
        if not text.strip():
            return f.default
        try:
            return yaml.load(text, Loader=ConfigYamlLoader)
        except yaml.YAMLError as exc:
            raise ValueError(f"is not valid YAML: {' '.join(str(exc).split())}") from exc
    if not text.strip() and f.optional:
        return None
    if f.kind == "str":
        return text
    if not text.strip():
        raise ValueError("needs a value")
    try:
        if f.kind == "int":
            return int(text.strip())
        return float(yaml.load(text.strip(), Loader=ConfigYamlLoader))
    except (TypeError, ValueError):
        raise ValueError(f"must be {'an integer' if f.kind == 'int' else 'a number'}") from None


def form_values_to_dict(values: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """The form's ``values`` (key path -> input value) as a nested config mapping holding the
    keys whose value differs from the schema's default, in schema order; and the errors
    (key path -> message) of values that do not parse (a field not in the schema included)."""
    fields = _fields_by_path()
    errors = {
        key: "is not a key of the config schema (rftstream.config.schema.Config)"
        for key in values
        if key not in fields
    }
    data: dict[str, Any] = {}
    for path, f in fields.items():
        if path not in values:
            continue
        try:
            value = _parse(f, values[path])
        except ValueError as exc:
            errors[path] = str(exc)
            continue
        if value == f.default:
            continue
        node = data
        *parents, leaf = path.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return data, errors


def check_form(values: dict[str, Any]) -> FormCheck:
    """Build the config of the form's ``values`` and validate it as ``rftstream up`` does.

    The YAML (the keys differing from the defaults) is written to a temporary
    file, loaded with :func:`rftstream.config.load_config` (environment
    interpolation, Trinity-RFT translation, unknown keys, types, validation) and
    removed. A :class:`ConfigError` is reported at the field holding its key
    path. Values that do not parse are reported at their fields, and the loader
    still checks the others (without them), so one check shows both kinds of
    error; ``yaml`` and ``config`` stay empty then. Blocks briefly (a small file written and read); raises nothing for bad
    values.
    """
    result = FormCheck()
    data, result.errors = form_values_to_dict(values)
    text = yaml.safe_dump(data, sort_keys=False, allow_unicode=True) if data else "{}\n"
    if not result.errors:
        result.yaml = text
    fd, path = tempfile.mkstemp(prefix="rftstream-studio-", suffix=".yaml")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                config = load_config(path)
            except ConfigError as exc:
                message = str(exc).removeprefix(f"{path}: ")
                holder = field_for_key(exc.key_path, list(_fields_by_path()))
                if holder is None:
                    result.general.append(message)
                else:
                    result.errors.setdefault(holder, message)
            else:
                if not result.errors:
                    result.config = config
        result.warnings = [str(w.message).replace(f"{path}: ", "") for w in caught]
    finally:
        os.unlink(path)
    return result
