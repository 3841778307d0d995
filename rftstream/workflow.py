"""``Task`` and the ``Workflow`` base class, as in Trinity-RFT's developer guide.

A :class:`Task` is one row of the taskset plus the taskset's settings
(``buffer.explorer_input.taskset``); a :class:`Workflow` turns it into a list
of :class:`~rftstream.experience.Experience` by talking to the rollout model.
Register workflows with ``@WORKFLOWS.register_module("name")`` and select them
with ``buffer.explorer_input.taskset.default_workflow_type``.

Both constructor styles of the guides work: the current keyword-only
``__init__(self, *, task, model, auxiliary_models=None)`` and the older
positional ``__init__(self, model, task, auxiliary_models)``, including
``super().__init__(model, task, auxiliary_models)``; the runner always
constructs with keywords (:func:`construct_workflow`). ``auxiliary_models``
are ``openai.OpenAI`` clients; ``self.auxiliary_model_wrappers`` holds, in the
same order, the :class:`~rftstream.engines.model_wrapper.ModelWrapper` of each
one served here (``model_path``; None for an external ``base_url``), for
what the OpenAI API cannot do, e.g. a teacher's log-probs of given tokens. A
workflow whose ``__init__`` takes ``auxiliary_model_wrappers`` (Trinity-RFT's
keyword) also gets them there. Likewise ``can_reset`` / ``can_repeat`` (class
attributes) and the older ``resettable()`` / ``repeatable()`` methods are
equivalent. A workflow may override ``run()`` (blocking), ``run_async()``
(native async) or both; the missing form is derived from the other.

A taskset row may pick its own workflow and reward function: with
``format.workflow_key`` (``format.reward_fn_key``) set, a row that has that key
names a registered workflow (reward fn) for itself; other rows use
``default_workflow_type`` (``default_reward_fn_type``). No I/O here.

The explorer runs workflows, so this interface is the core's; the built-in
workflows live in the ``workflows`` package (``from workflows import Workflow, Task``
re-exports these names).
"""

from __future__ import annotations

import inspect
import weakref
from abc import ABC
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
import anyio.from_thread
import anyio.to_thread
import msgspec
from anyio.lowlevel import RunVar

from rftstream.config.schema import FormatConfig, GenerationConfig, TasksetConfig
from rftstream.errors import RegistryError, WorkflowError
from rftstream.experience import Experience
from rftstream.plugins.registries import REWARD_FUNCTIONS
from rftstream.plugins.registry import Registry

if TYPE_CHECKING:
    from rftstream.engines.model_wrapper import ModelWrapper

__all__ = [
    "WORKFLOWS",
    "Task",
    "Workflow",
    "auxiliary_model_wrappers",
    "call_reward_fn",
    "construct_workflow",
    "make_task",
    "resolve_reward_fn",
    "scores_inline",
]

WORKFLOWS: Registry[type[Workflow]] = Registry("workflows", defaults=("workflows",))
"""Workflows a taskset names (``default_workflow_type``); the built-ins' package,
``workflows``, is imported by name on the first lookup and registers itself here."""

# Sync workflows run in worker threads under their own limiter, so that they
# can never take every thread of anyio's default pool (which the engine and
# tokenisation use) and deadlock waiting for the engine.
_SYNC_WORKFLOW_THREADS = 256
_limiter_var: RunVar[anyio.CapacityLimiter] = RunVar("rftstream_workflow_limiter")


def _workflow_limiter() -> anyio.CapacityLimiter:
    try:
        return _limiter_var.get()
    except LookupError:
        limiter = anyio.CapacityLimiter(_SYNC_WORKFLOW_THREADS)
        _limiter_var.set(limiter)
        return limiter


@dataclass
class Task:
    """One task: a raw taskset row plus everything needed to build its workflow.

    ``workflow`` is a :class:`Workflow` subclass or a name registered in
    :data:`WORKFLOWS`; ``reward_fn`` a :class:`~workflows.RewardFn`
    subclass, a registered name, or ``None`` (the workflow's default).
    ``rollout_args.n`` always equals ``repeat_times`` (set on construction).
    ``batch_id`` / ``task_id`` become the experiences' ``eid.batch`` /
    ``eid.task``; ``index`` is the row's index in the taskset.
    """

    workflow: type[Workflow] | str = "math_workflow"
    repeat_times: int = 1
    reward_fn: Any = None
    raw_task: dict[str, Any] = field(default_factory=dict)
    format_args: FormatConfig = field(default_factory=FormatConfig)
    rollout_args: GenerationConfig = field(default_factory=GenerationConfig)
    workflow_args: dict[str, Any] = field(default_factory=dict)
    reward_fn_args: dict[str, Any] = field(default_factory=dict)
    is_eval: bool = False
    batch_id: int | str = 0
    task_id: int | str = 0
    index: int = 0
    epoch: int = 0

    def __post_init__(self) -> None:
        self.repeat_times = int(self.repeat_times or 1)
        if self.repeat_times < 1:
            raise WorkflowError(
                f"task {self.task_id}: repeat_times must be >= 1, got {self.repeat_times}"
            )
        if self.rollout_args.n != self.repeat_times:
            self.rollout_args = msgspec.structs.replace(self.rollout_args, n=self.repeat_times)

    @property
    def workflow_cls(self) -> type[Workflow]:
        """The workflow class (a registered name is looked up in :data:`WORKFLOWS`)."""
        wf = self.workflow
        if isinstance(wf, str):
            try:
                return WORKFLOWS.get(wf)
            except RegistryError as exc:
                key = self.format_args.workflow_key
                where = (
                    f"task {self.task_id}: raw_task[{key!r}] (buffer.explorer_input.taskset.format.workflow_key)"
                    if key and self.raw_task.get(key) == wf
                    else "buffer.explorer_input.taskset.default_workflow_type"
                )
                raise WorkflowError(f"{where}: {exc}") from exc
        if not isinstance(wf, type):
            raise WorkflowError(
                f"Task.workflow must be a Workflow class or a registered name, got {wf!r}"
            )
        return wf

    @property
    def task_desc(self) -> Any:
        """The prompt of the task: ``raw_task[format_args.prompt_key]`` (``None`` if absent)."""
        return self.raw_task.get(self.format_args.prompt_key)

    @property
    def truth(self) -> Any:
        """The reference answer: ``raw_task[format_args.response_key]`` (``None`` if absent)."""
        return self.raw_task.get(self.format_args.response_key)

    def to_workflow(
        self, model: ModelWrapper, auxiliary_models: list[Any] | None = None
    ) -> Workflow:
        """Construct this task's workflow (:func:`construct_workflow`). May block."""
        return construct_workflow(self.workflow_cls, self, model, auxiliary_models)


def auxiliary_model_wrappers(clients: list[Any]) -> list[ModelWrapper | None]:
    """The :class:`ModelWrapper` behind each auxiliary-model client (None where there is none:
    an external ``base_url`` server). Non-blocking."""
    from rftstream.engines.model_wrapper import wrapper_of

    return [wrapper_of(c) for c in clients]


def construct_workflow(
    cls: type[Workflow], task: Task, model: Any, auxiliary_models: list[Any] | None = None
) -> Workflow:
    """``cls(task=, model=, auxiliary_models=)``, plus ``auxiliary_model_wrappers=`` (see
    :func:`auxiliary_model_wrappers`) when ``cls.__init__`` takes that keyword, as
    Trinity-RFT's on-policy distillation workflow does. May block (the workflow's
    constructor); raises what the constructor raises."""
    aux = list(auxiliary_models) if auxiliary_models is not None else []
    kwargs: dict[str, Any] = {"task": task, "model": model, "auxiliary_models": aux}
    if _takes_keyword(cls, "auxiliary_model_wrappers"):
        kwargs["auxiliary_model_wrappers"] = auxiliary_model_wrappers(aux)
    return cls(**kwargs)


def _takes_keyword(cls: type, name: str) -> bool:
    try:
        params = inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        return False
    param = params.get(name)
    return param is not None and param.kind in (
        inspect.Parameter.KEYWORD_ONLY,
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
    )


class Workflow(ABC):  # noqa: B024 - ABC so subclasses may declare abstract methods
    """Base class of workflows: ``run()`` (sync, in a worker thread) or ``run_async()``.

    Override ``run`` (blocking code; the default ``run_async`` executes it in a
    worker thread, where ``self.model.chat`` blocks that thread, never the event
    loop) or ``run_async`` (native async, using ``self.model.chat_async``), or
    both. Set ``can_reset = True`` and implement ``reset(task)`` to be reused
    for the next task instead of rebuilt; set ``can_repeat = True`` and honour
    ``set_repeat_times(n)`` / ``self.repeat_times`` to declare that one run
    yields the task's whole group. A workflow that does not repeat (the
    default) is run ``repeat_times`` times by the runner, each run on a
    single-run copy of the task (``repeat_times`` and ``rollout_args.n`` 1,
    ``run_id_base`` the run index); see :mod:`rftstream.workflow_runner`.
    """

    def __init__(
        self,
        *args: Any,
        task: Task | None = None,
        model: ModelWrapper | None = None,
        auxiliary_models: list[Any] | None = None,
    ) -> None:
        if args:
            if len(args) > 3:
                raise TypeError(
                    f"{type(self).__name__}: at most 3 positional arguments (model, task, auxiliary_models)"
                )
            # Older guides pass (model, task, auxiliary_models); accept (task, model, ...) too.
            names = (
                ("task", "model", "auxiliary_models")
                if isinstance(args[0], Task)
                else ("model", "task", "auxiliary_models")
            )
            given = {"task": task, "model": model, "auxiliary_models": auxiliary_models}
            for name, value in zip(names, args, strict=False):
                if given[name] is not None:
                    raise TypeError(
                        f"{type(self).__name__}: got `{name}` both positionally and by keyword"
                    )
                given[name] = value
            task, model, auxiliary_models = given["task"], given["model"], given["auxiliary_models"]
        if not isinstance(task, Task):
            raise TypeError(
                f"{type(self).__name__}: `task` must be a Task, got {type(task).__name__}"
            )
        cls = type(self)
        if cls.run is Workflow.run and cls.run_async is Workflow.run_async:
            raise TypeError(f"{cls.__name__} must override run() or run_async()")
        if inspect.getattr_static(cls, "can_reset", False) is True and cls.reset is Workflow.reset:
            raise TypeError(
                f"{cls.__name__} sets can_reset = True but does not implement reset(task)"
            )
        self.task = task
        self.model = model
        self.auxiliary_models = auxiliary_models if auxiliary_models is not None else []
        self.auxiliary_model_wrappers = auxiliary_model_wrappers(self.auxiliary_models)
        self.is_eval = task.is_eval
        self.repeat_times = task.repeat_times
        self.run_id_base = 0

    # ------------------------------------------------------------ capabilities
    @property
    def can_reset(self) -> bool:
        """True if :meth:`reset` may reuse this instance (also: an overridden ``resettable()``)."""
        if type(self).resettable is not Workflow.resettable:
            return _truthy(self.resettable)
        return False

    @property
    def can_repeat(self) -> bool:
        """True if one run yields all ``repeat_times`` rollouts (also: an overridden ``repeatable()``)."""
        if type(self).repeatable is not Workflow.repeatable:
            return _truthy(self.repeatable)
        return False

    @property
    def is_async(self) -> bool:
        """True if the workflow has its own ``run_async()`` (it then runs on the event loop)."""
        return type(self).run_async is not Workflow.run_async

    @property
    def asynchronous(self) -> bool:
        """Older spelling of :attr:`is_async`."""
        return bool(self.is_async)

    def resettable(self) -> bool:
        """Older spelling of :attr:`can_reset`."""
        return bool(self.can_reset)

    def repeatable(self) -> bool:
        """Older spelling of :attr:`can_repeat`."""
        return bool(self.can_repeat)

    def reset(self, task: Task) -> None:
        """Prepare this instance for ``task`` (only called when :attr:`can_reset`)."""
        raise NotImplementedError(f"{type(self).__name__} does not implement reset(task)")

    def reset_is_cheap(self, task: Task) -> bool:
        """True when :meth:`reset` for ``task`` is a few microseconds of Python that cannot
        block: the runner then calls it on the event loop instead of in a worker thread
        (whose hop costs more). False by default. Must not block."""
        return False

    def set_repeat_times(self, repeat_times: int, run_id_base: int = 0) -> None:
        """Ask for ``repeat_times`` rollouts from the next run, numbered from ``run_id_base``
        (only called when :attr:`can_repeat`)."""
        self.repeat_times = int(repeat_times)
        self.run_id_base = int(run_id_base)

    # ------------------------------------------------------------ running
    def run(self) -> list[Experience]:
        """Run the workflow and return its experiences. Blocks (the runner calls it in a worker thread).

        Default, for workflows that only implement :meth:`run_async`: from an
        anyio worker thread, run it on that thread's event loop
        (``anyio.from_thread.run``); from plain synchronous code (no event loop
        in this thread), in a fresh ``anyio.run``. Calling it on an event-loop
        thread is an error (``await run_async()`` there).
        """
        if type(self).run_async is Workflow.run_async:
            raise NotImplementedError(f"{type(self).__name__} must override run() or run_async()")
        try:
            anyio.get_current_task()
        except RuntimeError:
            pass  # no event loop in this thread: good
        else:
            raise WorkflowError(
                f"{type(self).__name__}.run() blocks; on the event loop use `await run_async()`"
            )
        started = False

        async def call() -> list[Experience]:
            nonlocal started
            started = True
            return await self.run_async()

        try:
            return anyio.from_thread.run(call)
        except anyio.NoEventLoopError:
            if started:
                raise
        return anyio.run(call)

    async def run_async(self) -> list[Experience]:
        """Run the workflow without blocking the event loop.

        Default: :meth:`run` in a worker thread. On cancel (timeout) the thread
        is abandoned: it finishes in the background and its result is dropped.
        """
        return await anyio.to_thread.run_sync(
            self.run, abandon_on_cancel=True, limiter=_workflow_limiter()
        )


def _truthy(attr: Any) -> bool:
    return bool(attr() if callable(attr) else attr)


def resolve_reward_fn(spec: Any, args: Mapping[str, Any] | None = None) -> Callable[..., Any]:
    """Turn a reward-fn spec (registered name, ``RewardFn`` class or instance, or a plain
    function) into a callable; classes are instantiated with ``args``."""
    if isinstance(spec, str):
        try:
            spec = REWARD_FUNCTIONS.get(spec)
        except RegistryError as exc:
            raise WorkflowError(
                "buffer.explorer_input.taskset.default_reward_fn_type "
                f"(or a row's format.reward_fn_key): {exc}"
            ) from exc
    if isinstance(spec, type):
        try:
            return spec(**dict(args or {}))
        except TypeError as exc:
            raise WorkflowError(
                f"buffer.explorer_input.taskset.reward_fn_args: cannot build {spec.__name__}: {exc}"
            ) from exc
    if callable(spec):
        return spec
    raise WorkflowError(
        f"reward_fn must be a registered name, a RewardFn class or a callable, got {spec!r}"
    )


_ACCEPTED: weakref.WeakKeyDictionary[Any, frozenset[str] | None] = weakref.WeakKeyDictionary()


def _accepted_kwargs(fn: Callable[..., Any]) -> frozenset[str] | None:
    """The keyword names ``fn`` accepts (None: any, it takes ``**kwargs`` or has no signature).

    Cached per reward fn instance (or function): reading a signature costs more
    than most reward fns.
    """
    try:
        return _ACCEPTED[fn]
    except (KeyError, TypeError):
        pass
    try:
        params = inspect.signature(fn).parameters
        accepts_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        accepted = None if accepts_all else frozenset(params)
    except (TypeError, ValueError):
        accepted = None
    try:
        _ACCEPTED[fn] = accepted
    except TypeError:  # not weak-referenceable: computed every time
        pass
    return accepted


def call_reward_fn(
    fn: Callable[..., Any], *, response: str, truth: Any, **extra: Any
) -> dict[str, float]:
    """Call ``fn(response=, truth=, **extra)`` passing only the extras it accepts; a bare
    number becomes ``{"reward": value}``."""
    accepted = _accepted_kwargs(fn)
    kwargs = {k: v for k, v in extra.items() if accepted is None or k in accepted}
    result = fn(response=response, truth=truth, **kwargs)
    if isinstance(result, Mapping):
        return {str(k): float(v) for k, v in result.items()}
    return {"reward": float(result)}


def scores_inline(fn: Callable[..., Any], responses: Iterable[str], truth: Any) -> bool:
    """Whether an async workflow may call reward fn ``fn`` on ``responses`` on the event
    loop instead of in a worker thread: ``fn.fast``, or ``fn.fast_for(response, truth)``
    for every response (a :class:`~workflows.rewards.RewardFn`; a plain callable: never).
    Calls ``fast_for``, which must not block."""
    if getattr(fn, "fast", False):
        return True
    fast_for = getattr(fn, "fast_for", None)
    return callable(fast_for) and all(fast_for(r, truth) for r in responses)


def make_task(
    raw_task: Mapping[str, Any],
    taskset_cfg: TasksetConfig,
    *,
    repeat_times: int,
    batch_id: int | str,
    task_id: int | str,
    index: int,
    epoch: int,
    is_eval: bool = False,
) -> Task:
    """Build the :class:`Task` of one taskset row (``rollout_args.n = repeat_times``).

    The workflow is ``raw_task[format.workflow_key]`` when that key is set and
    the row has a non-empty value under it, else ``default_workflow_type``;
    likewise the reward fn with ``format.reward_fn_key`` /
    ``default_reward_fn_type``. ``raw_task`` is kept whole (keys included).
    """
    fmt = taskset_cfg.format
    workflow: str = taskset_cfg.default_workflow_type
    reward_fn: str | None = taskset_cfg.default_reward_fn_type
    if fmt.workflow_key and raw_task.get(fmt.workflow_key):
        workflow = str(raw_task[fmt.workflow_key])
    if fmt.reward_fn_key and raw_task.get(fmt.reward_fn_key):
        reward_fn = str(raw_task[fmt.reward_fn_key])
    return Task(
        workflow=workflow,
        repeat_times=int(repeat_times),
        reward_fn=reward_fn,
        raw_task=dict(raw_task),
        format_args=taskset_cfg.format,
        rollout_args=msgspec.structs.replace(taskset_cfg.rollout_args, n=int(repeat_times)),
        workflow_args=dict(taskset_cfg.workflow_args),
        reward_fn_args=dict(taskset_cfg.reward_fn_args),
        is_eval=is_eval,
        batch_id=batch_id,
        task_id=task_id,
        index=index,
        epoch=epoch,
    )
