"""Trinity-RFT's ``stages``: one config file, several runs in order (SFT warm-up, then RFT).

A top-level ``stages:`` list names the stages; each stage has a ``stage_name``
and any of the sections Trinity-RFT's ``StageConfig`` declares (``mode``,
``algorithm``, ``buffer``, ``data_processor``, ``explorer``, ``trainer``).
As in Trinity-RFT (``Config.__iter__``), a section a stage sets **replaces**
the base config's section as a whole (keys the stage leaves out take their
defaults, not the base's values); sections the stage does not set are the
base's. The stage's run is named ``<name>/<stage_name>``. rftstream also
accepts a ``model`` section in a stage (Trinity-RFT's stages have none): it is
merged key by key over the base's ``model``, so a stage can set
``model.model_path`` alone.

:func:`split_stages` does the combining on the raw mapping (pure);
:func:`stages_from_dict` / :func:`load_stages` then convert and validate each
stage's config, reporting errors by key paths that include the stage
(``stages[1].algorithm.algorithm_type``). Running the stages is
:mod:`rftstream.launch.up_stages`.
"""

from __future__ import annotations

import copy
import difflib
import os
import re
import warnings
from dataclasses import dataclass
from typing import Any

from rftstream.config.loader import (
    _parse_override_key,
    _read_yaml,
    apply_overrides,
    config_from_dict,
    interpolate_env,
    upgraded,
)
from rftstream.config.paths import ROOT
from rftstream.config.resolve import resolve_config
from rftstream.config.schema import Config
from rftstream.config.validate import validate_config
from rftstream.errors import ConfigError, RftError

__all__ = [
    "MERGED_STAGE_SECTIONS",
    "STAGES_KEY",
    "STAGE_SECTIONS",
    "RawStage",
    "StageConfig",
    "StageConfigError",
    "has_stages",
    "load_stages",
    "split_stages",
    "split_with_overrides",
    "stage_data",
    "stages_from_dict",
]

STAGES_KEY = "stages"
# the sections of Trinity-RFT's StageConfig: each replaces the base's section as a whole
STAGE_SECTIONS = ("mode", "algorithm", "buffer", "data_processor", "explorer", "trainer")
# rftstream's addition: merged key by key over the base's section
MERGED_STAGE_SECTIONS = ("model",)
_STAGE_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")
_DEFAULT_NAME = Config().name


class StageConfigError(ConfigError):
    """A :class:`ConfigError` of one stage's config: its key path names the stage
    (``stages[1].algorithm.algorithm_type``) when the stage set that section, and the
    message says which stage it is otherwise (a key of the base config that does not
    work in that stage)."""

    def __init__(self, original: ConfigError, stage: RawStage) -> None:
        self.key_path = stage.key_path(original.key_path)
        self.value = original.value
        self.source = original.source
        self.stage_name = stage.stage_name
        text = stage.rewrite_paths(str(original))
        if self.key_path == original.key_path:
            text += f" (in stage {stage.label})"
        RftError.__init__(self, text)


@dataclass(frozen=True)
class RawStage:
    """One stage as a raw mapping: the base config with the stage's sections applied.

    ``index``: position in ``stages`` (0-based); ``count``: how many stages there are;
    ``sections``: the top-level keys the stage set itself; ``data``: the combined
    mapping (``name`` is ``<base name>/<stage_name>``, without ``stages``);
    ``sets_model_path``: the stage set ``model.model_path`` itself.
    """

    index: int
    count: int
    stage_name: str
    sections: tuple[str, ...]
    data: dict[str, Any]
    sets_model_path: bool = False

    @property
    def prefix(self) -> str:
        """``stages[i]``: where this stage is in the file."""
        return f"{STAGES_KEY}[{self.index}]"

    @property
    def label(self) -> str:
        """``\\`sft\\` (1/2, stages[0])``: how messages name the stage."""
        return f"`{self.stage_name}` ({self.index + 1}/{self.count}, {self.prefix})"

    def owns(self, key_path: str) -> bool:
        """Whether ``key_path`` (a dotted path of the combined config) lies in a section
        this stage set itself."""
        head = re.split(r"[.\[]", key_path, maxsplit=1)[0]
        return head in self.sections

    def key_path(self, key_path: str) -> str:
        """``key_path`` as a path of the file: under ``stages[i]`` when the stage set it."""
        return f"{self.prefix}.{key_path}" if self.owns(key_path) else key_path

    def rewrite_paths(self, text: str) -> str:
        """``text`` with every ``config key `P``` / ``unknown key `P``` / leading ```P```
        naming a key this stage set rewritten to ``stages[i].P``."""

        def repl(m: re.Match[str]) -> str:
            return f"{m.group(1)}`{self.key_path(m.group(2))}`"

        return re.sub(r"(^|(?:config|unknown) key )`([^`\s]+)`", repl, text)


@dataclass(frozen=True)
class StageConfig:
    """One stage, converted and validated.

    ``config``: the stage's run config (``name`` is ``<name>/<stage_name>``).
    """

    raw: RawStage
    config: Config

    @property
    def sets_model_path(self) -> bool:
        """The stage set ``model.model_path`` itself, so it does not start from the
        previous stage's final checkpoint."""
        return self.raw.sets_model_path

    @property
    def index(self) -> int:
        return self.raw.index

    @property
    def count(self) -> int:
        return self.raw.count

    @property
    def stage_name(self) -> str:
        return self.raw.stage_name

    @property
    def label(self) -> str:
        return self.raw.label


def has_stages(data: Any) -> bool:
    """Whether the raw mapping ``data`` has a non-empty ``stages`` list."""
    return isinstance(data, dict) and bool(data.get(STAGES_KEY))


def _fail(path: str, message: str, value: Any, source: str | None) -> ConfigError:
    return ConfigError(path, message, value=value, has_value=True, source=source)


def _check_stage(i: int, stage: Any, seen: dict[str, int], source: str | None) -> str:
    """The stage's name, after checking its keys; raises :class:`ConfigError`."""
    where = f"{STAGES_KEY}[{i}]"
    if not isinstance(stage, dict):
        raise _fail(
            where,
            "a stage must be a mapping with `stage_name` and the sections it sets "
            f"({', '.join(STAGE_SECTIONS + MERGED_STAGE_SECTIONS)})",
            stage,
            source,
        )
    allowed = ("stage_name", *STAGE_SECTIONS, *MERGED_STAGE_SECTIONS)
    for key in stage:
        if key in allowed:
            continue
        path = f"{where}.{key}"
        if key in Config.__struct_fields__:
            raise _fail(
                path,
                f"a stage cannot set `{key}` (a stage sets only "
                f"{', '.join(STAGE_SECTIONS)}, as in Trinity-RFT, and `model`); "
                f"set `{key}` at the top level, for every stage",
                stage[key],
                source,
            )
        close = difflib.get_close_matches(str(key), allowed, n=1, cutoff=0.6)
        hint = f"did you mean `{close[0]}`?" if close else f"valid keys: {', '.join(allowed)}"
        raise ConfigError(path, f"unknown key `{path}` ({hint})", source=source)
    name = stage.get("stage_name")
    if not isinstance(name, str) or not _STAGE_NAME_RE.fullmatch(name):
        raise _fail(
            f"{where}.stage_name",
            "every stage needs a `stage_name` of 1 to 64 characters from [A-Za-z0-9_.-], "
            "not starting with `.` or `-` (it names the stage's run, `<name>/<stage_name>`, "
            "and its run directory)",
            name,
            source,
        )
    if name in seen:
        raise _fail(
            f"{where}.stage_name",
            f"stage names must be unique; {STAGES_KEY}[{seen[name]}] has it too",
            name,
            source,
        )
    seen[name] = i
    for key in MERGED_STAGE_SECTIONS:
        if key in stage and stage[key] is not None and not isinstance(stage[key], dict):
            raise _fail(f"{where}.{key}", "must be a mapping", stage[key], source)
    return name


def split_stages(data: dict[str, Any], source: str | None = None) -> list[RawStage]:
    """The stages of the raw mapping ``data``, each combined with the base as Trinity-RFT does.

    Returns ``[]`` when ``data`` has no ``stages`` (or an empty list). A section a stage
    sets (not null) replaces the base's section; ``model`` is merged over the base's; the
    combined ``name`` is ``<name>/<stage_name>`` and a base ``run_dir`` becomes
    ``<run_dir>/<stage_name>``. Pure; ``data`` is not modified. Raises
    :class:`ConfigError` for a ``stages`` that is not a list, a stage that is not a
    mapping, a missing, malformed or repeated ``stage_name``, or a key a stage cannot set.
    """
    stages = data.get(STAGES_KEY)
    if stages is None or stages == []:
        return []
    if not isinstance(stages, list):
        raise _fail(
            STAGES_KEY,
            "must be a list of stages, each a mapping with `stage_name`",
            stages,
            source,
        )
    base = {k: v for k, v in data.items() if k != STAGES_KEY}
    base_name = base.get("name") or _DEFAULT_NAME
    seen: dict[str, int] = {}
    out: list[RawStage] = []
    for i, stage in enumerate(stages):
        name = _check_stage(i, stage, seen, source)
        combined = copy.deepcopy(base)
        sections: list[str] = []
        for key in STAGE_SECTIONS:
            if stage.get(key) is not None:
                combined[key] = copy.deepcopy(stage[key])
                sections.append(key)
        for key in MERGED_STAGE_SECTIONS:
            if stage.get(key):
                merged = dict(combined.get(key) or {})
                merged.update(copy.deepcopy(stage[key]))
                combined[key] = merged
                sections.append(key)
        combined["name"] = f"{base_name}/{name}"
        if base.get("run_dir"):
            combined["run_dir"] = os.path.join(str(base["run_dir"]), name)
        own_model = stage.get("model") or {}
        out.append(
            RawStage(i, len(stages), name, tuple(sections), combined, "model_path" in own_model)
        )
    return out


def _split_overrides(overrides: list[str]) -> tuple[list[str], list[str]]:
    """``(overrides of stages[...], the others)``."""
    staged, others = [], []
    for item in overrides:
        key = item.partition("=")[0].strip()
        (staged if key == STAGES_KEY or key.startswith(STAGES_KEY + "[") else others).append(item)
    return staged, others


def _stage_overrides(overrides: list[str], stage: RawStage) -> list[str]:
    """The overrides that reach into a section ``stage`` set itself (they apply to it too)."""
    out = []
    for item in overrides:
        key = item.partition("=")[0].strip()
        parts = _parse_override_key(key, item) if key else []
        if parts and parts[0] in stage.sections:
            out.append(item)
    return out


def stage_data(stage: RawStage, overrides: list[str], source: str | None = None) -> dict[str, Any]:
    """The stage's combined mapping with the base ``overrides`` that reach into a section
    it set applied, and ``${oc.env:...}`` resolved: what converts to its config."""
    data = apply_overrides(stage.data, _stage_overrides(overrides, stage))
    return interpolate_env(data, source)


def split_with_overrides(
    data: dict[str, Any], overrides: list[str], source: str | None = None
) -> tuple[dict[str, Any], list[RawStage], list[str]]:
    """``(base mapping, stages, base overrides)``: ``overrides`` of ``stages[i]...`` applied
    before splitting, the others applied to the base; those others still have to reach the
    sections each stage replaced (:func:`stage_data`)."""
    staged, others = _split_overrides(list(overrides))
    if staged:
        data = apply_overrides(data, staged)
    base = {k: v for k, v in data.items() if k != STAGES_KEY}
    if others:
        base = apply_overrides(base, others)
    return base, split_stages({**base, STAGES_KEY: data.get(STAGES_KEY)}, source), others


def _convert(stage: RawStage, overrides: list[str], source: str | None, validate: bool) -> Config:
    cfg = config_from_dict(stage_data(stage, overrides, source), source)
    if not validate:
        return cfg
    validate_config(cfg, source)
    return resolve_config(cfg)


def stages_from_dict(
    data: dict[str, Any],
    overrides: list[str] | None = None,
    source: str | None = None,
    *,
    validate: bool = True,
) -> list[StageConfig]:
    """Every stage of the raw (not yet interpolated) mapping ``data``, converted and validated.

    ``overrides`` (``key.path=value``): one under ``stages[i]`` changes that stage; any
    other changes the base config and, where a stage replaced the section it reaches
    into, that stage's section too (``buffer.total_steps=2`` reaches every stage).
    ``${oc.env:...}`` is resolved per stage. Returns ``[]`` when there are no stages.
    Raises :class:`StageConfigError` (a :class:`ConfigError`) naming the stage: the key
    path is ``stages[i].<path>`` when the stage set that section. Trinity-RFT key
    warnings are issued once per distinct message, with the same key paths.
    """
    _, stages, others = split_with_overrides(data, list(overrides or []), source)
    out: list[StageConfig] = []
    shown: set[str] = set()
    for stage in stages:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                cfg = _convert(stage, others, source, validate)
            except ConfigError as exc:
                raise StageConfigError(exc, stage) from exc
        for w in caught:
            text = stage.rewrite_paths(str(w.message))
            if text not in shown:
                shown.add(text)
                warnings.warn(text, w.category, stacklevel=2)
        out.append(StageConfig(stage, cfg))
    return out


def load_stages(
    path: str | os.PathLike[str],
    overrides: list[str] | None = None,
    *,
    validate: bool = True,
) -> list[StageConfig]:
    """Read the config file at ``path`` and return its stages (:func:`stages_from_dict`).

    Reads the file (blocking). Returns ``[]`` for a file without ``stages``. Raises
    :class:`ConfigError` naming the file, and the stage, for every error
    :func:`~rftstream.config.loader.load_config` would report.
    """
    source = os.fspath(path)
    data, overrides = upgraded(_read_yaml(source), list(overrides or []), source)
    if data is None or not has_stages(data):
        return []
    if not isinstance(data, dict):  # pragma: no cover - has_stages needs a mapping
        raise _fail(ROOT, "the top level must be a mapping", data, source)
    return stages_from_dict(data, overrides, source, validate=validate)
