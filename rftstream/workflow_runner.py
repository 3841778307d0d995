"""``WorkflowRunner``: runs one task's workflow with a timeout and retries.

The explorer calls :meth:`WorkflowRunner.run_task` for each task (many at once;
the runner is safe for concurrent use). A task yields its whole group of
``repeat_times`` rollouts, in one of two ways (Trinity-RFT's):

* a ``can_repeat`` workflow (every built-in one) runs ONCE, after
  ``set_repeat_times(repeat_times, 0)``, and returns the whole group (the
  built-in ones ask the engine for ``n = repeat_times`` completions in one
  call);
* any other workflow (``can_repeat`` False, the default of the base class,
  e.g. an agent written against the ``openai`` package that returns one
  experience per conversation) runs ``repeat_times`` times, one run after
  the other. Each run sees a single-run view of the task (``repeat_times``
  1, ``rollout_args.n`` 1, a fresh copy) and ``run_id_base`` = the run
  index; the experiences of run ``i`` get ``eid.run = i``. A ``can_reset``
  instance is reset and reused for the next run, any other one is rebuilt.

Whether a class repeats is read from its ``can_repeat`` class attribute;
when it is a property or an older ``repeatable()`` method, the first
instance decides for the class.

Each attempt (the one run, or all ``repeat_times`` runs) runs under one
``max_timeout`` deadline (``explorer.max_timeout``); an exception or a
timeout in any run fails the attempt, which is retried (from its first run) up to
``max_retry_times`` (``explorer.max_retry_times``) times. After the last
failure :class:`TaskResult` carries the error text and no experiences;
``run_task`` never raises, except on cancellation, which propagates.

Instances are cached per workflow class: a ``can_reset`` workflow that
finished cleanly is reused for a later task via ``reset(task)``; one that
raised or timed out is dropped (a timed-out sync workflow may still be running
in its abandoned thread). Construction and ``reset`` can block, so they run in
a worker thread.

Model history and the OpenAI API: when the model has ``enable_history``, every
workflow instance gets its own ``model.clone()`` (same engine, its own history
and its own OpenAI session URL), so concurrent tasks never mix their calls; a
reused instance's leftover history is cleared before its next task. When the
model has ``enable_openai_api``, its OpenAI server is started (once) before
the first task. ``auxiliary_models`` (a list of ``openai.OpenAI`` clients, see
:func:`rftstream.engines.auxiliary_models.serve_auxiliary_models`) are passed to
every workflow, and their model wrappers to one that takes
``auxiliary_model_wrappers`` (:func:`~rftstream.workflow.construct_workflow`).
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import math
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.to_thread
import msgspec

from rftstream.errors import WorkflowError, error_text
from rftstream.experience import Experience
from rftstream.workflow import Task, Workflow, _workflow_limiter, construct_workflow

log = logging.getLogger(__name__)

__all__ = ["TaskResult", "WorkflowRunner"]

_MAX_IDLE_PER_CLASS = 64


@dataclass
class TaskResult:
    """What running one task produced.

    ``metrics``: ``run_time`` (seconds, all attempts), ``attempts``,
    ``num_experiences``, ``reward_mean`` (NaN without rewards) and the mean of
    every key of the experiences' ``metrics``. ``error`` is ``None`` on success,
    else ``"<ExceptionType>: <message>"`` of the last attempt.
    """

    task: Task
    experiences: list[Experience] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    attempts: int = 0

    @property
    def ok(self) -> bool:
        return self.error is None


class WorkflowRunner:
    """Runs tasks' workflows against one :class:`~rftstream.engines.model_wrapper.ModelWrapper`."""

    def __init__(
        self,
        model: Any,
        *,
        max_timeout: float,
        max_retry_times: int,
        auxiliary_models: list[Any] | None = None,
    ) -> None:
        if max_timeout <= 0:
            raise WorkflowError(f"explorer.max_timeout must be > 0, got {max_timeout}")
        if max_retry_times < 0:
            raise WorkflowError(f"explorer.max_retry_times must be >= 0, got {max_retry_times}")
        self.model = model
        self.max_timeout = float(max_timeout)
        self.max_retry_times = int(max_retry_times)
        self.auxiliary_models = list(auxiliary_models) if auxiliary_models is not None else []
        self._idle: dict[type, list[Workflow]] = defaultdict(list)
        self._repeats: dict[type, bool] = {}
        self._api_started = False

    async def run_task(self, task: Task) -> TaskResult:
        """Run ``task``'s workflow with timeout and retries; see the module docstring.

        Never raises except on cancellation (then no instance is kept for reuse).
        """
        t0 = time.perf_counter()
        result = TaskResult(task=task)
        try:
            cls = task.workflow_cls
        except WorkflowError as exc:
            result.error = error_text(exc)
            result.metrics = self._metrics([], 0, time.perf_counter() - t0)
            return result
        exps: list[Experience] | None = None
        if not self._api_started and getattr(self.model, "enable_openai_api", False):
            try:
                await self.model.start_openai_server()
                self._api_started = True
            except Exception as exc:  # noqa: BLE001 - reported as the task's error
                result.error = f"cannot start the OpenAI API server: {error_text(exc)}"
                result.metrics = self._metrics([], 0, time.perf_counter() - t0)
                return result
        for attempt in range(1, self.max_retry_times + 2):
            result.attempts = attempt
            version0 = int(getattr(self.model, "model_version", 0) or 0)
            try:
                with anyio.move_on_after(self.max_timeout) as scope:
                    exps = await self._attempt(cls, task)
                if scope.cancelled_caught:
                    exps = None
                    result.error = (
                        f"TimeoutError: workflow {cls.__name__} did not finish task {task.task_id} "
                        f"within {self.max_timeout:g} s (explorer.max_timeout)"
                    )
            except Exception as exc:  # noqa: BLE001 - a workflow may raise anything; cancellation is BaseException
                exps = None
                result.error = error_text(exc)
                log.debug(
                    "workflow %s raised on task %s", cls.__name__, task.task_id, exc_info=True
                )
            if exps is not None:
                result.error = None
                self._finish(exps, task, version0)
                break
            log.warning(
                "workflow %s, task %s: attempt %d/%d failed: %s",
                cls.__name__,
                task.task_id,
                attempt,
                self.max_retry_times + 1,
                result.error,
            )
        result.experiences = exps or []
        result.metrics = self._metrics(
            result.experiences, result.attempts, time.perf_counter() - t0
        )
        return result

    async def _attempt(self, cls: type[Workflow], task: Task) -> list[Experience]:
        """The task's group: one run of a repeating workflow, else ``repeat_times`` runs."""
        repeats = self._repeats.get(cls)
        if repeats is None:
            repeats = _class_flag(cls, "can_repeat", "repeatable")
        if repeats is None:  # a property or an older repeatable(): an instance tells
            wf = await self._acquire(cls, task)
            repeats = self._repeats[cls] = _flag(wf, "can_repeat")
            if repeats:
                return await self._run_group(cls, wf, task)
            self._release(cls, wf)  # reset for the first single run, or dropped
        else:
            self._repeats[cls] = repeats
        if repeats:
            return await self._run_group(cls, await self._acquire(cls, task), task)
        out: list[Experience] = []
        for i in range(task.repeat_times):
            single = _single_run(task)
            wf = await self._acquire(cls, single)
            wf.repeat_times, wf.run_id_base = 1, i
            exps = await self._run_once(cls, wf)
            for exp in exps:
                exp.eid.run = i
            out.extend(exps)
            self._release(cls, wf)
        return out

    async def _run_group(self, cls: type[Workflow], wf: Workflow, task: Task) -> list[Experience]:
        wf.set_repeat_times(task.repeat_times, 0)
        exps = await self._run_once(cls, wf)
        if len(exps) > 1 and all(e.eid.run == 0 and e.eid.step == 0 for e in exps):
            for i, exp in enumerate(exps):  # the workflow did not number its rollouts
                exp.eid.run = i
        self._release(cls, wf)
        return exps

    @staticmethod
    async def _run_once(cls: type[Workflow], wf: Workflow) -> list[Experience]:
        exps = await wf.run_async()
        if not isinstance(exps, list) or not all(isinstance(e, Experience) for e in exps):
            raise WorkflowError(
                f"{cls.__name__}.run() must return a list of Experience, got {type(exps).__name__}"
            )
        return exps

    def _release(self, cls: type[Workflow], wf: Workflow) -> None:
        """Keep an instance that finished cleanly for reuse, if it can reset."""
        if _flag(wf, "can_reset"):
            idle = self._idle[cls]
            if len(idle) < _MAX_IDLE_PER_CLASS:
                idle.append(wf)

    async def _acquire(self, cls: type[Workflow], task: Task) -> Workflow:
        """A cached idle instance reset for ``task`` (on the event loop where
        ``reset_is_cheap(task)``, else in a worker thread), else a new one (built in a
        worker thread)."""
        idle = self._idle.get(cls)
        if idle:
            wf = idle.pop()
            own = getattr(wf, "model", None)
            if own is not None and own is not self.model and hasattr(own, "history"):
                own.history.clear()  # a clone of ours: leftovers of the previous task
            cheap = getattr(wf, "reset_is_cheap", None)
            if callable(cheap) and cheap(task):
                wf.reset(task)
            else:
                await anyio.to_thread.run_sync(
                    wf.reset, task, abandon_on_cancel=True, limiter=_workflow_limiter()
                )
            return wf
        aux = list(self.auxiliary_models)
        model = self._model_for_new_workflow()
        return await anyio.to_thread.run_sync(
            lambda: construct_workflow(cls, task, model, aux),
            abandon_on_cancel=True,
            limiter=_workflow_limiter(),
        )

    def _model_for_new_workflow(self) -> Any:
        """The model itself, or (with history on) a clone with a history of its own."""
        model = self.model
        if getattr(model, "enable_history", False) and callable(getattr(model, "clone", None)):
            return model.clone()
        return model

    @staticmethod
    def _finish(exps: list[Experience], task: Task, version0: int) -> None:
        for exp in exps:
            exp.eid.batch = task.batch_id
            exp.eid.task = task.task_id
            exp.info["task_index"] = task.index
            exp.info["epoch"] = task.epoch
            if exp.model_version == 0 and version0 > 0:
                # rebuilt Experience(...) objects lose the version: use the one at start (a lower bound)
                exp.model_version = version0

    @staticmethod
    def _metrics(exps: list[Experience], attempts: int, run_time: float) -> dict[str, float]:
        rewards = [e.reward for e in exps if e.reward is not None and not math.isnan(e.reward)]
        metrics: dict[str, float] = {
            "run_time": run_time,
            "attempts": float(attempts),
            "num_experiences": float(len(exps)),
            "reward_mean": sum(rewards) / len(rewards) if rewards else math.nan,
        }
        sums: dict[str, list[float]] = defaultdict(list)
        for e in exps:
            for k, v in (e.metrics or {}).items():
                if isinstance(v, (int, float)):
                    sums[k].append(float(v))
        for k, vals in sums.items():
            metrics.setdefault(k, sum(vals) / len(vals))
        return metrics


def _flag(wf: Any, name: str) -> bool:
    value = getattr(wf, name, False)
    return bool(value() if callable(value) else value)


def _class_flag(cls: type, attr: str, older: str) -> bool | None:
    """A capability the class declares (``can_repeat = True``); None when only an instance
    can tell (a property, or an overridden older method such as ``repeatable()``)."""
    static = inspect.getattr_static(cls, attr, None)
    if isinstance(static, bool):
        return static
    if static is inspect.getattr_static(Workflow, attr) and inspect.getattr_static(
        cls, older, None
    ) is inspect.getattr_static(Workflow, older):
        return False  # the base class's defaults
    return None


def _single_run(task: Task) -> Task:
    """A fresh copy of ``task`` for one run of a workflow that does not repeat itself."""
    return dataclasses.replace(
        task,
        repeat_times=1,
        rollout_args=msgspec.structs.replace(task.rollout_args, n=1),
        raw_task=dict(task.raw_task),
        workflow_args=dict(task.workflow_args),
        reward_fn_args=dict(task.reward_fn_args),
    )
