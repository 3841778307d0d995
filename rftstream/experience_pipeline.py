"""The experience pipeline: the operator interface, its registry, and the pipeline.

As in Trinity-RFT (``trinity.buffer.operators``): an operator takes the
experiences of one batch and returns the processed list plus a metrics dict.
The experience pipeline runs operators inside an operator host's event loop,
so each operator also has an async face:

* :class:`ExperienceOperator` implements the synchronous :meth:`process`
  (exactly Trinity-RFT's interface). Its default :meth:`process_async` runs
  :meth:`process` in a worker thread (``anyio.to_thread.run_sync``), so a slow
  operator never blocks the event loop; :meth:`prepare` and :meth:`close` do
  nothing.
* :class:`AsyncExperienceOperator` implements :meth:`process_async` directly
  (an operator that awaits I/O, e.g. a reward model server) and may use
  :meth:`prepare` / :meth:`close` to open and release resources.

:func:`create_operators` builds operators from ``data_processor.experience_pipeline
.operators`` (config errors name the entry); :class:`ExperiencePipeline` runs
them in order. Backend-neutral (asyncio or trio): synchronous operators run in
worker threads, asynchronous ones are awaited, so the host's event loop stays free.
Operators register in :data:`EXPERIENCE_OPERATORS`; the built-ins live in the
``operators`` package, which the registry imports by name on its first lookup.

Cancellation: cancelling ``process_async`` of a sync operator (e.g. the
operator host's ``process_timeout``) returns at once and abandons the worker
thread's result; the thread itself runs to completion.
"""

from __future__ import annotations

import inspect
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from types import TracebackType
from typing import Any

import anyio.to_thread

from rftstream.config.schema import OperatorConfig
from rftstream.errors import ConfigError, OperatorError, RegistryError, RftError, error_text
from rftstream.experience import Experience
from rftstream.plugins.registry import Registry

EXPERIENCE_OPERATORS: Registry[type[ExperienceOperator]] = Registry(
    "experience_operators", defaults=("operators",)
)
"""The operators a config names; ``operators`` (the built-ins) registers itself here."""


class ExperienceOperator(ABC):
    """Base class of every experience operator."""

    @abstractmethod
    def process(self, exps: list[Experience]) -> tuple[list[Experience], dict]:
        """Process a list of experiences and return a transformed list.

        Args:
            exps: the experiences of one batch (one or more tasks' groups).

        Returns:
            The processed experiences and a dict of metrics.
        """

    async def prepare(self) -> None:
        """Acquire resources before the first batch (no-op by default)."""
        return None

    async def process_async(self, exps: list[Experience]) -> tuple[list[Experience], dict]:
        """Run :meth:`process` in a worker thread; the event loop stays free meanwhile."""
        return await anyio.to_thread.run_sync(self.process, exps, abandon_on_cancel=True)

    async def close(self) -> None:
        """Release resources after the last batch (no-op by default)."""
        return None

    @classmethod
    def create_operators(cls, operator_configs: list[OperatorConfig]) -> list[ExperienceOperator]:
        """Instantiate operators from configs (Trinity-RFT's classmethod; see :func:`create_operators`)."""
        return create_operators(operator_configs)


class AsyncExperienceOperator(ExperienceOperator):
    """An operator whose work is a coroutine: implement :meth:`process_async`.

    The synchronous :meth:`process` is not available (it raises TypeError):
    run it through an :class:`ExperiencePipeline`.
    """

    @abstractmethod
    async def process_async(self, exps: list[Experience]) -> tuple[list[Experience], dict]:
        """Process one batch; may await I/O. Returns ``(experiences, metrics)``."""

    def process(self, exps: list[Experience]) -> tuple[list[Experience], dict]:
        raise TypeError(
            f"{type(self).__name__} is asynchronous: await process_async() "
            f"(or run it in an ExperiencePipeline)"
        )


_KEY = "data_processor.experience_pipeline.operators"


def create_operators(configs: Sequence[OperatorConfig]) -> list[ExperienceOperator]:
    """Instantiate ``EXPERIENCE_OPERATORS.get(cfg.name)(**cfg.args)`` for each config.

    Raises :class:`ConfigError` at ``data_processor.experience_pipeline.operators[i].name``
    for an unknown name (listing the registered ones) and at ``...operators[i].args``
    when the constructor rejects the arguments.
    """
    ops: list[ExperienceOperator] = []
    for i, cfg in enumerate(configs):
        try:
            cls = EXPERIENCE_OPERATORS.get(cfg.name)
        except RegistryError as exc:
            raise ConfigError(
                f"{_KEY}[{i}].name",
                f"unknown operator {cfg.name!r}; registered: {', '.join(EXPERIENCE_OPERATORS.names())}",
                value=cfg.name,
            ) from exc
        if not (isinstance(cls, type) and issubclass(cls, ExperienceOperator)):
            raise ConfigError(
                f"{_KEY}[{i}].name", f"{cfg.name!r} is not an ExperienceOperator", value=cfg.name
            )
        try:
            ops.append(cls(**(cfg.args or {})))
        except (TypeError, ValueError, RftError) as exc:
            raise ConfigError(
                f"{_KEY}[{i}].args", f"operator {cfg.name!r} ({cls.__name__}): {exc}"
            ) from exc
    return ops


def operator_name(op: ExperienceOperator) -> str:
    """The name ``op``'s class is registered under, else its class name."""
    for name in EXPERIENCE_OPERATORS.names():
        if EXPERIENCE_OPERATORS.get(name) is type(op):
            return name
    return type(op).__name__


async def _maybe_await(value: Any) -> None:
    if inspect.isawaitable(value):
        await value


class ExperiencePipeline:
    """Runs operators in order over each batch.

    ``names`` (default: each operator's registered name) prefix the metrics;
    a repeated name gets ``#2``, ``#3``... Use as ``async with pipeline:`` or
    call :meth:`prepare` / :meth:`close` yourself.
    """

    def __init__(self, operators: Sequence[ExperienceOperator], names: Sequence[str] | None = None):
        self.operators = list(operators)
        raw = list(names) if names is not None else [operator_name(op) for op in self.operators]
        if len(raw) != len(self.operators):
            raise ValueError(f"{len(raw)} names for {len(self.operators)} operators")
        seen: dict[str, int] = {}
        self.names: list[str] = []
        for name in raw:
            seen[name] = seen.get(name, 0) + 1
            self.names.append(name if seen[name] == 1 else f"{name}#{seen[name]}")

    @classmethod
    def from_config(cls, configs: Sequence[OperatorConfig]) -> ExperiencePipeline:
        """Build the operators with :func:`create_operators`, named as in the config."""
        return cls(create_operators(configs), names=[c.name for c in configs])

    async def prepare(self) -> None:
        """Call every operator's ``prepare()`` in order; a failure raises OperatorError."""
        for i, (name, op) in enumerate(zip(self.names, self.operators, strict=True)):
            try:
                await _maybe_await(op.prepare())
            except Exception as exc:
                raise OperatorError(f"operator [{i}] {name!r}: prepare() failed: {exc!r}") from exc

    async def process(self, exps: list[Experience]) -> tuple[list[Experience], dict[str, float]]:
        """Run every operator on ``exps``; return the result and the merged metrics.

        Metrics: ``<name>/<metric>`` for each operator metric,
        ``filtered/<name>`` (experiences that operator dropped),
        ``pipeline/time/<name>`` (seconds), ``pipeline/in``, ``pipeline/out``.
        Each operator gets its own copy of the list. An exception in an
        operator is raised as :class:`OperatorError` naming the operator's
        index and name, with the original exception as ``__cause__``.
        Cancellation propagates unchanged.
        """
        metrics: dict[str, float] = {"pipeline/in": float(len(exps))}
        current = list(exps)
        for i, (name, op) in enumerate(zip(self.names, self.operators, strict=True)):
            n_in = len(current)
            start = time.perf_counter()
            try:
                result = await op.process_async(list(current))
            except Exception as exc:
                raise OperatorError(
                    f"operator [{i}] {name!r} ({type(op).__name__}) failed on a batch of "
                    f"{n_in} experiences: {error_text(exc)}"
                ) from exc
            if not (
                isinstance(result, tuple)
                and len(result) == 2
                and isinstance(result[0], list)
                and isinstance(result[1], dict)
            ):
                raise OperatorError(
                    f"operator [{i}] {name!r} ({type(op).__name__}) must return "
                    f"(list[Experience], dict), got {type(result).__name__}"
                )
            current, op_metrics = result
            for key, value in op_metrics.items():
                metrics[f"{name}/{key}"] = value
            metrics[f"filtered/{name}"] = float(max(n_in - len(current), 0))
            metrics[f"pipeline/time/{name}"] = time.perf_counter() - start
        metrics["pipeline/out"] = float(len(current))
        return current, metrics

    async def close(self) -> None:
        """Call every operator's ``close()`` (sync or async), even after a failure.

        The first failure is raised afterwards as OperatorError.
        """
        first: OperatorError | None = None
        for i, (name, op) in enumerate(zip(self.names, self.operators, strict=True)):
            try:
                await _maybe_await(op.close())
            except Exception as exc:
                if first is None:
                    first = OperatorError(f"operator [{i}] {name!r}: close() failed: {exc!r}")
                    first.__cause__ = exc
        if first is not None:
            raise first

    async def __aenter__(self) -> ExperiencePipeline:
        await self.prepare()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()
