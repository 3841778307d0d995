"""``data_juicer``: run Data-Juicer operators on experiences, in process.

Trinity-RFT's ``DataJuicerOperator`` sends each batch to a Data-Juicer HTTP
service (``service.data_juicer``); rftstream runs the same Data-Juicer ops
inside the operator host instead, so there is no service to start, no port
and no Arrow round trip. The operator arguments are Trinity-RFT's:

.. code-block:: yaml

    data_processor:
      experience_pipeline:
        operators:
          - name: data_juicer
            args:
              text_key: response          # response | prompt | prompt_response
              operators:                  # Data-Juicer ops, as in a DJ recipe's `process:`
                - text_length_filter: {min_len: 10, max_len: 4000}
                - alphanumeric_filter: {min_ratio: 0.3}
          - name: data_juicer
            args:
              config_path: recipes/clean.yaml   # a Data-Juicer recipe (its `process:` list)

Arguments:

* ``operators``: a list of one-key mappings ``{<dj_op_name>: {<arg>: value}}``
  (args may be empty or null), run in order.
* ``config_path``: a Data-Juicer recipe (``.yaml``/``.yml``/``.json``). Only its
  ``process`` list and ``text_keys`` (the default ``text_key`` of every op, as
  in Data-Juicer) are used; dataset / export / executor keys do not apply to an
  in-process batch and are ignored. Give ``config_path`` or ``operators``, not
  both.
* ``text_key``: what becomes the Data-Juicer sample's ``text`` field:
  ``response`` (``exp.response_text``, the default), ``prompt``
  (``exp.prompt_text``) or ``prompt_response`` (prompt, ``separator``, response).
  An experience whose selected text is None makes the batch fail (a ValueError
  naming the experience): the workflow must set the text. Each sample also
  carries ``prompt_text``, ``response_text`` and ``reward`` columns, so a DJ op
  may read them directly (``text_key: response_text`` in the op's args,
  ``field_key: reward`` for ``specified_numeric_field_filter``).
* ``separator``: joins prompt and response for ``prompt_response`` (``"\\n"``).
* ``np``: Trinity-RFT's worker count, accepted for config compatibility and
  unused: a batch is small, and rftstream scales with operator replicas.
* ``stats_to_info``: copy each kept sample's Data-Juicer stats
  (``__dj__stats__``: ``text_len``, ``alnum_ratio``, ...) into ``exp.info``,
  as Trinity-RFT does (default True). Values are made msgpack-safe.
* ``verbose``: let Data-Juicer's loguru logging through (default: silenced
  with ``loguru.logger.disable("data_juicer")``, process-wide). Importing
  Data-Juicer replaces loguru's sinks with one on stderr (its own doing); the
  ``logging.basicConfig`` one of its op modules runs on import is undone.
* ``auto_install``: let Data-Juicer ``pip install`` an op's missing optional
  package at run time (its LazyLoader does so by default). Off by default:
  the op fails to build with an ImportError naming the package to install
  (e.g. ``selectolax`` for ``clean_html_mapper``). Process-wide once enabled.

Semantics:

* **Filters** drop the experiences whose sample they reject; filters run in
  order and each sees only the survivors of the previous ones.
* **Mappers** rewrite the Data-Juicer sample that later ops in this operator
  see (e.g. ``clean_html_mapper`` before ``words_num_filter``), but never the
  experience: rewriting ``response_text`` would leave ``tokens`` and
  ``logprobs`` describing a different response. A mapper that changes the
  number of samples is an error.
* Deduplicators, selectors, groupers and aggregators work on whole datasets
  and are rejected; use ``duplicate_filter`` for in-batch deduplication.
* Data-Juicer caches a stat by name in the sample: a second op computing the
  same stat (two ``text_length_filter`` with different ``text_key``) reuses
  the first value, as in Data-Juicer itself.
* An exception in a Data-Juicer op fails the batch (the pipeline raises
  OperatorError and the host dead-letters it); Data-Juicer's ``skip_op_error``
  (drop the failing samples) is not applied, so nothing is dropped silently.

Metrics: ``filtered_count`` and ``kept_count`` (experiences), per Data-Juicer
op ``<dj_op>/filtered_count`` (filters) or ``<dj_op>/mapped_count``
(mappers) and ``<dj_op>/time`` (seconds), and ``stats/<key>/mean`` for every
numeric stat computed on this batch (over the samples that reached the op).
A DJ op name used twice gets ``#2``.

Blocking and threads: Data-Juicer is imported lazily, never at
``import operators``. The constructor only checks that the ``data-juicer``
extra is installed (else :class:`DataJuicerNotInstalledError`, naming
``pip install 'rftstream[data-juicer]'``; the extra is ``py-data-juicer`` plus
``ray``, which Data-Juicer 1.6 imports to construct any op) and checks the
config's shape. :meth:`prepare` imports Data-Juicer (seconds) and builds the
DJ ops in a worker thread; there an unknown op name, or an argument close to
a parameter's name (``min_lenn``), is an error, and any other unnamed argument
passes through with a warning (DJ ops take ``**kwargs``). :meth:`process` is synchronous and CPU-bound; the pipeline runs it
in a worker thread (``process_async``), one batch at a time per instance (a
lock serialises concurrent calls). Called without :meth:`prepare`,
:meth:`process` builds the ops on first use.
"""

from __future__ import annotations

import difflib
import importlib.util
import inspect
import json
import logging
import math
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import anyio.to_thread

from rftstream.errors import RftError
from rftstream.experience import Experience
from rftstream.experience_pipeline import EXPERIENCE_OPERATORS, ExperienceOperator

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'rftstream[data-juicer]'"

_TEXT_KEYS = {
    "response": "response",
    "response_text": "response",
    "prompt": "prompt",
    "prompt_text": "prompt",
    "prompt_response": "prompt_response",
    "prompt+response": "prompt_response",
    "prompt_and_response": "prompt_response",
}
_STATS = "__dj__stats__"  # data_juicer.utils.constant.Fields.stats
_META = "__dj__meta__"  # data_juicer.utils.constant.Fields.meta


class DataJuicerNotInstalledError(RftError, ImportError):
    """The ``data-juicer`` extra (``py-data-juicer``) is not installed."""


# Data-Juicer 1.6 imports ray (``data_juicer.core``) to construct any op; without
# it, Data-Juicer pip-installs ray at run time. The extra therefore pins both.
_REQUIRED_MODULES = ("data_juicer", "ray")

# Data-Juicer's LazyLoader pip-installs (with uv) any missing optional package at run
# time. rftstream forbids that unless an operator was built with auto_install=True.
_auto_install = {"allowed": False, "patched": False}


def _missing_modules() -> list[str]:
    missing = []
    for name in _REQUIRED_MODULES:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(name)
    return missing


def _forbid_auto_install() -> None:
    """Make Data-Juicer's run-time ``pip install`` raise ImportError unless allowed."""
    if _auto_install["patched"]:
        return
    from data_juicer.utils.lazy_loader import LazyLoader

    original = LazyLoader.__dict__["_install_package"].__func__

    def _install_package(cls: Any, package_spec: str, pip_args: Any = None) -> Any:
        if _auto_install["allowed"]:
            return original(cls, package_spec, pip_args)
        raise ImportError(
            f"Data-Juicer needs the package {package_spec!r} and would pip-install it at run "
            f"time; install it yourself (pip install {package_spec}) or set "
            f"auto_install: true in the data_juicer operator's args"
        )

    LazyLoader._install_package = classmethod(_install_package)  # type: ignore[method-assign]
    _auto_install["patched"] = True


def _import_data_juicer(verbose: bool, auto_install: bool) -> Any:
    """Import Data-Juicer's op registry and base classes; quiet its loguru output.

    Blocks for seconds on the first call (Data-Juicer imports torch, datasets, ray...).
    """
    root = logging.getLogger()
    root_handlers, root_level = list(root.handlers), root.level
    try:
        from loguru import logger

        # silence before the import too: importing data_juicer may already log
        (logger.enable if verbose else logger.disable)("data_juicer")
        import data_juicer  # noqa: F401  (the top-level package first: see tests)
        import ray  # noqa: F401  (see _REQUIRED_MODULES)
        from data_juicer.ops import base_op
    except ImportError as exc:
        raise DataJuicerNotInstalledError(
            f"the data_juicer operator needs Data-Juicer: {INSTALL_HINT} ({exc})"
        ) from exc
    finally:
        # an op module of Data-Juicer calls logging.basicConfig(level=INFO) on import,
        # which would turn on every library's INFO logs in this process: undo it
        for handler in list(root.handlers):
            if handler not in root_handlers:
                root.removeHandler(handler)
        root.setLevel(root_level)
    # data_juicer's import replaces loguru's handlers; keep the choice made above
    (logger.enable if verbose else logger.disable)("data_juicer")
    _forbid_auto_install()
    if auto_install:
        _auto_install["allowed"] = True
    return base_op


def _load_recipe(config_path: str) -> tuple[list, str | None]:
    """The ``process`` list and the default text key of a Data-Juicer recipe file."""
    path = Path(config_path).expanduser()
    if not path.is_file():
        raise ValueError(f"config_path {config_path!r}: no such file")
    text = path.read_text(encoding="utf-8")
    if path.suffix in (".yaml", ".yml"):
        import yaml

        try:
            recipe = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ValueError(f"config_path {config_path!r}: not valid YAML ({exc})") from exc
    elif path.suffix == ".json":
        try:
            recipe = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"config_path {config_path!r}: not valid JSON ({exc})") from exc
    else:
        raise ValueError(f"config_path {config_path!r}: expected a .yaml, .yml or .json file")
    if not isinstance(recipe, Mapping):
        raise ValueError(f"config_path {config_path!r}: expected a mapping at the top level")
    process = recipe.get("process")
    if not isinstance(process, list) or not process:
        raise ValueError(f"config_path {config_path!r}: needs a non-empty `process:` list")
    text_keys = recipe.get("text_keys")
    if isinstance(text_keys, list):
        text_keys = text_keys[0] if text_keys else None
    if text_keys is not None and not isinstance(text_keys, str):
        raise ValueError(f"config_path {config_path!r}: `text_keys` must be a string or a list")
    return process, text_keys


def _normalise_ops(process: Any, where: str) -> list[tuple[str, dict[str, Any]]]:
    """``[{name: args}, ...]`` -> ``[(name, args), ...]``, checking the shape only."""
    if not isinstance(process, Sequence) or isinstance(process, (str, bytes)):
        raise ValueError(f"{where}: expected a list of {{op_name: {{args}}}}, got {process!r}")
    ops: list[tuple[str, dict[str, Any]]] = []
    for i, item in enumerate(process):
        if isinstance(item, str):  # a bare op name, as DJ recipes allow
            item = {item: None}
        if not isinstance(item, Mapping) or len(item) != 1:
            raise ValueError(
                f"{where}[{i}]: expected a one-key mapping {{op_name: {{args}}}}, got {item!r}"
            )
        ((name, args),) = item.items()
        if not isinstance(name, str) or not name:
            raise ValueError(f"{where}[{i}]: the op name must be a string, got {name!r}")
        if args is None:
            args = {}
        if not isinstance(args, Mapping):
            raise ValueError(f"{where}[{i}] {name!r}: args must be a mapping, got {args!r}")
        ops.append((name, dict(args)))
    if not ops:
        raise ValueError(f"{where}: needs at least one Data-Juicer op")
    return ops


def _known_params(cls: type) -> set[str]:
    """Named parameters of ``cls.__init__`` along its MRO, plus DJ's base parameters."""
    names: set[str] = set(getattr(cls, "_BASE_PARAMS", {}) or {})
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        try:
            params = inspect.signature(init).parameters.values()
        except (TypeError, ValueError):
            continue
        names.update(
            p.name
            for p in params
            if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        )
    return names


def _plain(value: Any) -> Any:
    """A msgpack-safe copy of a Data-Juicer stat (numpy scalars and arrays become Python)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if hasattr(value, "tolist"):  # numpy scalar / array
        return _plain(value.tolist())
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return str(value)


def _is_number(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, (int, float)):
        return True
    return hasattr(value, "dtype") and getattr(value, "ndim", 1) == 0 and value.dtype.kind in "iuf"


@EXPERIENCE_OPERATORS.register_module("data_juicer")
class DataJuicerOperator(ExperienceOperator):
    """Run Data-Juicer filters (and sample-local mappers) on each batch; see the module doc."""

    def __init__(
        self,
        operators: list[dict[str, Any]] | None = None,
        config_path: str | None = None,
        np: int = 4,
        text_key: str = "response",
        separator: str = "\n",
        stats_to_info: bool = True,
        verbose: bool = False,
        auto_install: bool = False,
    ) -> None:
        missing = _missing_modules()
        if missing:
            raise DataJuicerNotInstalledError(
                f"the data_juicer operator needs Data-Juicer (packages py-data-juicer and "
                f"ray); not installed: {', '.join(missing)}. Install the extra: {INSTALL_HINT}"
            )
        if (config_path is None) == (operators is None):
            raise ValueError(
                "give exactly one of `config_path` (a Data-Juicer recipe) or `operators` "
                "(a list of {dj_op_name: {args}})"
            )
        default_text_key: str | None = None
        if config_path is not None:
            process, default_text_key = _load_recipe(str(config_path))
            self._ops_spec = _normalise_ops(process, f"config_path {config_path!r}: process")
        else:
            self._ops_spec = _normalise_ops(operators, "operators")
        if default_text_key is not None:
            for _, args in self._ops_spec:
                if args.get("text_key") is None:
                    args["text_key"] = default_text_key
        if text_key not in _TEXT_KEYS:
            raise ValueError(f"text_key must be one of {sorted(set(_TEXT_KEYS))}, got {text_key!r}")
        if not isinstance(np, int) or isinstance(np, bool) or np <= 0:
            raise ValueError(f"np must be a positive integer, got {np!r}")
        self.config_path = config_path
        self.np = np
        self.text_key = _TEXT_KEYS[text_key]
        self.separator = str(separator)
        self.stats_to_info = bool(stats_to_info)
        self.verbose = bool(verbose)
        self.auto_install = bool(auto_install)
        names: list[str] = []
        seen: dict[str, int] = {}
        for name, _ in self._ops_spec:
            seen[name] = seen.get(name, 0) + 1
            names.append(name if seen[name] == 1 else f"{name}#{seen[name]}")
        self.op_names = names
        self._ops: list[Any] | None = None
        self._kinds: list[str] = []
        self._base: Any = None
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ building

    def _build(self) -> None:
        """Import Data-Juicer and instantiate the ops (blocking; runs once)."""
        if self._ops is not None:
            return
        base = _import_data_juicer(self.verbose, self.auto_install)
        registry = base.OPERATORS.modules
        ops: list[Any] = []
        kinds: list[str] = []
        for i, (name, args) in enumerate(self._ops_spec):
            where = f"Data-Juicer op [{i}] {name!r}"
            cls = registry.get(name)
            if cls is None:
                close = difflib.get_close_matches(name, list(registry), n=3)
                hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
                raise ValueError(f"{where}: not a registered Data-Juicer operator{hint}")
            if issubclass(cls, base.Filter):
                kind = "filter"
            elif issubclass(cls, base.Mapper):
                kind = "mapper"
            else:
                raise ValueError(
                    f"{where}: only Data-Juicer filters and mappers run on experience "
                    f"batches ({cls.__bases__[0].__name__} ops work on whole datasets)"
                )
            known = _known_params(cls)
            for arg in args:
                if arg in known:
                    continue
                close = difflib.get_close_matches(arg, sorted(known), n=1, cutoff=0.75)
                if close:
                    raise ValueError(
                        f"{where}: unknown argument {arg!r}; did you mean {close[0]!r}?"
                    )
                log.warning("%s: %r is not a named parameter; passed through", where, arg)
            try:
                op = cls(**args)
            except Exception as exc:
                raise ValueError(f"{where}: {type(exc).__name__}: {exc}") from exc
            op._op_cfg = {name: args}  # as data_juicer.ops.load_ops does
            ops.append(op)
            kinds.append(kind)
        self._base = base
        self._kinds = kinds
        self._ops = ops

    async def prepare(self) -> None:
        """Import Data-Juicer and build the ops in a worker thread (seconds, once)."""
        await anyio.to_thread.run_sync(self._build_locked)

    def _build_locked(self) -> None:
        with self._lock:
            self._build()

    async def close(self) -> None:
        """Release Data-Juicer's cached models (model-based ops), if any were loaded."""
        if self._ops is None:
            return
        from data_juicer.utils.model_utils import free_models

        await anyio.to_thread.run_sync(free_models)

    # ------------------------------------------------------------------ processing

    def _text(self, exp: Experience) -> str:
        prompt, response = exp.prompt_text, exp.response_text
        if self.text_key == "response":
            missing, text = ["response_text"] if response is None else [], response
        elif self.text_key == "prompt":
            missing, text = ["prompt_text"] if prompt is None else [], prompt
        else:
            missing = [
                n for n, v in (("prompt_text", prompt), ("response_text", response)) if v is None
            ]
            text = None if missing else f"{prompt}{self.separator}{response}"
        if missing:
            raise ValueError(
                f"experience {exp.eid} has no {' / '.join(missing)}: the data_juicer operator "
                f"(text_key={self.text_key!r}) needs the workflow to set it"
            )
        assert text is not None
        return text

    def process(self, exps: list[Experience]) -> tuple[list[Experience], dict]:
        """Run the Data-Juicer ops over ``exps``; blocking, CPU-bound (call it off the loop)."""
        with self._lock:
            self._build()
            return self._process(exps)

    def _process(self, exps: list[Experience]) -> tuple[list[Experience], dict]:
        samples: dict[str, list[Any]] = {
            "text": [self._text(e) for e in exps],
            "prompt_text": [e.prompt_text for e in exps],
            "response_text": [e.response_text for e in exps],
            "reward": [e.reward for e in exps],
        }
        index, samples, metrics = self._run_ops(samples, len(exps))
        kept = [exps[j] for j in index]
        if self.stats_to_info and _STATS in samples:
            for exp, stat in zip(kept, samples[_STATS], strict=True):
                for key, value in stat.items():
                    exp.info[str(key)] = _plain(value)
        metrics["filtered_count"] = float(len(exps) - len(kept))
        metrics["kept_count"] = float(len(kept))
        return kept, metrics

    def run_samples(
        self, samples: dict[str, list[Any]]
    ) -> tuple[list[int], dict[str, list[Any]], dict[str, float]]:
        """Run the ops over a batch of samples (columns of equal length, as Data-Juicer's
        batched ops take them): ``(kept row indices, the kept samples as the mappers left
        them, metrics)``. Blocking, CPU-bound; builds the ops on first use. The task
        pipeline (:mod:`rftstream.task_pipeline`) runs its rows through it."""
        n = len(next(iter(samples.values()), []))
        with self._lock:
            self._build()
            return self._run_ops(dict(samples), n)

    def _run_ops(
        self, samples: dict[str, list[Any]], total: int
    ) -> tuple[list[int], dict[str, list[Any]], dict[str, float]]:
        assert self._ops is not None
        base = self._base
        metrics: dict[str, float] = {}
        index = list(range(total))  # samples row -> position in the input
        stat_sums: dict[str, list[float]] = {}
        for name, op, kind in zip(self.op_names, self._ops, self._kinds, strict=True):
            n = len(index)
            start = time.perf_counter()
            if n:
                if op._name in base.TAGGING_OPS.modules and _META not in samples:
                    samples[_META] = [{} for _ in range(n)]
                if kind == "filter":
                    if op._name not in base.NON_STATS_FILTERS.modules and _STATS not in samples:
                        samples[_STATS] = [{} for _ in range(n)]
                    had = [set(s) for s in samples.get(_STATS, [])]
                    samples = self._check_rows(op.compute_stats_batched(samples), n, name)
                    keep = [bool(k) for k in op.process_batched(samples)]
                    if len(keep) != n:
                        raise ValueError(
                            f"Data-Juicer op {name!r} returned {len(keep)} decisions for {n} samples"
                        )
                    for old, stat in zip(had, samples.get(_STATS, []), strict=False):
                        for key, value in stat.items():  # stats this op computed, once per sample
                            if key not in old and _is_number(value):
                                stat_sums.setdefault(key, []).append(float(value))
                    if not all(keep):
                        samples = {
                            k: [v for v, ok in zip(col, keep, strict=True) if ok]
                            for k, col in samples.items()
                        }
                        index = [j for j, ok in zip(index, keep, strict=True) if ok]
                else:
                    samples = self._check_rows(op.process_batched(samples), n, name)
            if kind == "filter":
                metrics[f"{name}/filtered_count"] = float(n - len(index))
            else:
                metrics[f"{name}/mapped_count"] = float(n)
            metrics[f"{name}/time"] = time.perf_counter() - start
        for key, values in stat_sums.items():
            finite = [v for v in values if math.isfinite(v)]
            if finite:
                metrics[f"stats/{key}/mean"] = sum(finite) / len(finite)
        return index, samples, metrics

    @staticmethod
    def _check_rows(samples: Any, n: int, name: str) -> dict[str, list[Any]]:
        if not isinstance(samples, Mapping):
            raise ValueError(
                f"Data-Juicer op {name!r} returned {type(samples).__name__}, expected a batch dict"
            )
        bad = {k: len(v) for k, v in samples.items() if len(v) != n}
        if bad:
            raise ValueError(
                f"Data-Juicer op {name!r} changed the number of samples ({n} -> {bad}); "
                f"only sample-preserving mappers can run on experiences"
            )
        return dict(samples)
