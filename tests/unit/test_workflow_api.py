"""The workflow API of the developer guide (seed 004, "Workflows"), checked piece by piece.

``Task`` fields, the ``Workflow`` constructor and its two run forms, the reuse
(``can_reset`` / ``resettable()`` / ``reset``) and repeat (``can_repeat`` /
``set_repeat_times``) capabilities, the ``WORKFLOWS`` registry, per-row
workflows (``format.workflow_key``), and how the runner drives them: resettable
instances are reused (constructions counted, also under concurrency), async
workflows run concurrently on the event-loop thread, with no worker thread.
No model: the workflows here build their experiences themselves.
"""

from __future__ import annotations

import inspect
import threading
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from rftstream.config.schema import FormatConfig, GenerationConfig, TasksetConfig
from rftstream.errors import RegistryError, WorkflowError
from workflows import WORKFLOWS, Experience, Task, Workflow, WorkflowRunner, make_task


def _exps(task: Task, **info: Any) -> list[Experience]:
    return [
        Experience(tokens=[1, 2, 3], prompt_length=2, reward=1.0, info=dict(info))
        for _ in range(task.repeat_times)
    ]


def _task(workflow: Any, task_id: int = 0, repeat: int = 2, **cfg: Any) -> Task:
    ts = TasksetConfig(**cfg)
    task = make_task(
        {"question": f"q{task_id}", "answer": "a"},
        ts,
        repeat_times=repeat,
        batch_id=3,
        task_id=task_id,
        index=task_id,
        epoch=1,
    )
    task.workflow = workflow
    return task


# ---------------------------------------------------------------------------
# Task
# ---------------------------------------------------------------------------


def test_task_fields_of_the_guide() -> None:
    names = {f for f in Task.__dataclass_fields__}
    assert {
        "workflow",
        "repeat_times",
        "reward_fn",
        "raw_task",
        "format_args",
        "rollout_args",
        "workflow_args",
        "reward_fn_args",
        "is_eval",
        "batch_id",
        "task_id",
        "index",
    } <= names
    t = Task()
    assert t.workflow == "math_workflow" and t.repeat_times == 1 and t.reward_fn is None
    assert t.raw_task == {} and t.workflow_args == {} and t.reward_fn_args == {}
    assert isinstance(t.format_args, FormatConfig)
    assert isinstance(t.rollout_args, GenerationConfig)
    assert t.is_eval is False and (t.batch_id, t.task_id, t.index) == (0, 0, 0)
    # rollout_args.n always follows repeat_times (the guide's workflow reads rollout_args.n)
    assert Task(repeat_times=5).rollout_args.n == 5
    with pytest.raises(WorkflowError, match="repeat_times"):
        Task(repeat_times=-1)


def test_make_task_copies_the_taskset_settings() -> None:
    ts = TasksetConfig(
        default_workflow_type="simple_workflow",
        default_reward_fn_type="accuracy_reward",
        format=FormatConfig(prompt_key="q", response_key="a"),
        rollout_args=GenerationConfig(temperature=0.7, max_tokens=9),
        workflow_args={"turns": 3},
        reward_fn_args={"scale": 2},
    )
    t = make_task(
        {"q": "1+1=", "a": "2"},
        ts,
        repeat_times=4,
        batch_id=7,
        task_id=11,
        index=11,
        epoch=2,
        is_eval=True,
    )
    assert t.workflow == "simple_workflow" and t.reward_fn == "accuracy_reward"
    assert t.raw_task == {"q": "1+1=", "a": "2"}
    assert t.format_args.prompt_key == "q" and t.task_desc == "1+1=" and t.truth == "2"
    assert t.rollout_args.temperature == 0.7 and t.rollout_args.max_tokens == 9
    assert t.rollout_args.n == 4 == t.repeat_times
    assert t.workflow_args == {"turns": 3} and t.reward_fn_args == {"scale": 2}
    assert t.is_eval and (t.batch_id, t.task_id, t.index, t.epoch) == (7, 11, 11, 2)
    assert t.workflow_cls is WORKFLOWS.get("simple_workflow")
    t.workflow_args["turns"] = 99  # a task's dicts are its own
    assert ts.workflow_args == {"turns": 3}


def test_rows_may_pick_their_workflow_and_reward_fn() -> None:
    ts = TasksetConfig(
        default_workflow_type="math_workflow",
        format=FormatConfig(workflow_key="wf", reward_fn_key="rf"),
    )

    def task(row: dict[str, Any]) -> Task:
        return make_task(row, ts, repeat_times=1, batch_id=0, task_id=5, index=5, epoch=0)

    picked = task({"question": "x", "wf": "simple_workflow", "rf": "accuracy_reward"})
    assert picked.workflow == "simple_workflow" and picked.reward_fn == "accuracy_reward"
    assert picked.raw_task["wf"] == "simple_workflow"  # the row stays whole
    default = task({"question": "x", "wf": ""})
    assert default.workflow == "math_workflow" and default.reward_fn is None
    # without the key configured, a row's field is just data
    plain = make_task(
        {"wf": "simple_workflow"},
        TasksetConfig(),
        repeat_times=1,
        batch_id=0,
        task_id=0,
        index=0,
        epoch=0,
    )
    assert plain.workflow == "math_workflow"
    with pytest.raises(WorkflowError, match=r"task 5: raw_task\['wf'\].*workflow_key.*nope"):
        _ = task({"question": "x", "wf": "nope"}).workflow_cls
    with pytest.raises(WorkflowError, match="default_workflow_type"):
        _ = Task(workflow="nope").workflow_cls


# ---------------------------------------------------------------------------
# Workflow: constructor, run forms, capabilities, registry
# ---------------------------------------------------------------------------


class SyncOnly(Workflow):
    def run(self) -> list[Experience]:
        return _exps(self.task, thread=threading.get_ident())


class AsyncOnly(Workflow):
    async def run_async(self) -> list[Experience]:
        await anyio.lowlevel.checkpoint()
        return _exps(self.task, thread=threading.get_ident())


def test_constructor_is_keyword_only_task_model_auxiliary_models() -> None:
    params = inspect.signature(Workflow.__init__).parameters
    for name in ("task", "model", "auxiliary_models"):
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY
    assert params["auxiliary_models"].default is None
    task, model = _task(SyncOnly), object()
    wf = SyncOnly(task=task, model=model)
    assert wf.task is task and wf.model is model and wf.auxiliary_models == []
    assert wf.repeat_times == task.repeat_times and wf.is_eval is task.is_eval
    aux = [object()]
    assert task.to_workflow(model, aux).auxiliary_models == aux
    with pytest.raises(TypeError, match="must be a Task"):
        SyncOnly(task={"question": "q"}, model=model)


def test_run_forms() -> None:
    task = _task(SyncOnly)
    main = threading.get_ident()
    # run()-only: run_async() runs it in a worker thread
    exps = anyio.run(SyncOnly(task=task, model=None).run_async)
    assert len(exps) == 2 and exps[0].info["thread"] != main
    # run_async()-only: run() works from plain sync code and from a worker thread
    wf = AsyncOnly(task=task, model=None)
    assert wf.is_async and wf.asynchronous and not SyncOnly(task=task, model=None).is_async
    assert wf.run()[0].info["thread"] == main

    async def from_worker() -> list[Experience]:
        return await anyio.to_thread.run_sync(wf.run)

    assert anyio.run(from_worker)[0].info["thread"] == main  # back on the loop thread

    async def on_loop() -> None:
        with pytest.raises(WorkflowError, match="run_async"):
            wf.run()

    anyio.run(on_loop)


def test_reset_and_repeat_capabilities_in_every_spelling() -> None:
    task = _task(SyncOnly)

    class Attr(SyncOnly):
        can_reset = True
        can_repeat = True

        def reset(self, task: Task) -> None:
            self.task = task

    class Method(SyncOnly):  # the seed's older form
        def resettable(self) -> bool:
            return True

        def repeatable(self) -> bool:
            return True

    class Prop(SyncOnly):  # Trinity-RFT's later property form
        @property
        def resettable(self) -> bool:  # type: ignore[override]
            return True

    for cls in (Attr, Method, Prop):
        wf = cls(task=task, model=None)
        assert wf.can_reset and _truthy(wf.resettable), cls
    for cls in (Attr, Method):
        wf = cls(task=task, model=None)
        assert wf.can_repeat and wf.repeatable()

    class NoReset(SyncOnly):
        can_reset = True

    with pytest.raises(TypeError, match="can_reset.*reset"):
        NoReset(task=task, model=None)
    plain = SyncOnly(task=task, model=None)
    assert not plain.can_reset and not plain.resettable() and not plain.can_repeat
    with pytest.raises(NotImplementedError, match="reset"):
        plain.reset(task)
    plain.set_repeat_times(8, 16)
    assert (plain.repeat_times, plain.run_id_base) == (8, 16)


def _truthy(v: Any) -> bool:
    return bool(v() if callable(v) else v)


def test_workflows_registry() -> None:
    @WORKFLOWS.register_module("api_test_workflow")
    class Registered(SyncOnly):
        pass

    assert WORKFLOWS.get("api_test_workflow") is Registered and "api_test_workflow" in WORKFLOWS
    assert {"math_workflow", "simple_workflow"} <= set(WORKFLOWS.names())
    assert _task("api_test_workflow").workflow_cls is Registered
    with pytest.raises(RegistryError, match="already registered"):
        WORKFLOWS.register_module("api_test_workflow", AsyncOnly)
    with pytest.raises(RegistryError):
        WORKFLOWS.get("no_such_workflow_here")


# ---------------------------------------------------------------------------
# the runner: reuse and concurrency (what the explorer does with each task)
# ---------------------------------------------------------------------------


class Resettable(Workflow):
    can_reset = True
    inits = 0
    resets = 0
    fail_on: set[int] = set()

    def __init__(self, *, task: Task, model: Any, auxiliary_models: Any = None) -> None:
        super().__init__(task=task, model=model, auxiliary_models=auxiliary_models)
        type(self).inits += 1

    def reset(self, task: Task) -> None:
        self.task = task
        type(self).resets += 1

    async def run_async(self) -> list[Experience]:
        await anyio.sleep(0.01)
        if self.task.task_id in self.fail_on:
            raise RuntimeError(f"fail {self.task.task_id}")
        return _exps(self.task, instance=id(self))


class NotResettable(Resettable):
    can_reset = False


async def _run_concurrently(
    runner: WorkflowRunner, tasks: list[Task], runner_num: int
) -> list[Any]:
    """As the explorer's step: one task group, at most ``runner_num`` tasks at a time."""
    limiter = anyio.CapacityLimiter(runner_num)
    results: list[Any] = [None] * len(tasks)

    async def one(i: int, task: Task) -> None:
        async with limiter:
            results[i] = await runner.run_task(task)

    async with anyio.create_task_group() as tg:
        for i, task in enumerate(tasks):
            tg.start_soon(one, i, task)
    return results


@pytest.mark.anyio
async def test_runner_reuses_resettable_instances_under_concurrency() -> None:
    Resettable.inits = Resettable.resets = 0
    Resettable.fail_on = set()
    runner = WorkflowRunner(None, max_timeout=5, max_retry_times=0)
    for step in range(3):  # three explorer steps of 4 tasks, 4 at a time
        tasks = [_task(Resettable, task_id=step * 4 + i) for i in range(4)]
        results = await _run_concurrently(runner, tasks, runner_num=4)
        assert all(r.ok for r in results)
    # 4 instances for the first step's 4 concurrent tasks; each task runs twice (Resettable
    # does not repeat itself: repeat_times 2 = 2 runs), so 12 * 2 - 4 = 20 runs reuse them
    assert (Resettable.inits, Resettable.resets) == (4, 20)
    assert all(len(r.experiences) == 2 for r in results)
    assert len(runner._idle[Resettable]) == 4

    NotResettable.inits = NotResettable.resets = 0
    runner = WorkflowRunner(None, max_timeout=5, max_retry_times=0)
    for _step in range(3):
        tasks = [_task(NotResettable, task_id=i) for i in range(4)]
        await _run_concurrently(runner, tasks, runner_num=4)
    assert (NotResettable.inits, NotResettable.resets) == (24, 0)  # a new one for each run


@pytest.mark.anyio
async def test_an_instance_that_raised_is_not_reused() -> None:
    Resettable.inits = Resettable.resets = 0
    Resettable.fail_on = {1}
    runner = WorkflowRunner(None, max_timeout=5, max_retry_times=1)
    ok = await runner.run_task(_task(Resettable, task_id=0))
    bad = await runner.run_task(_task(Resettable, task_id=1))  # reuses, raises, retries new
    assert ok.ok and not bad.ok and bad.attempts == 2 and "fail 1" in (bad.error or "")
    again = await runner.run_task(_task(Resettable, task_id=2))
    assert again.ok
    # task 0: new, reset for its 2nd run; task 1: reset (raised, dropped) then new (raised,
    # dropped); task 2: new, reset for its 2nd run
    assert (Resettable.inits, Resettable.resets) == (3, 3)
    Resettable.fail_on = set()


class ThreadRecording(Resettable):
    """Records the thread of each reset; ``cheap`` answers ``reset_is_cheap``."""

    cheap = False
    reset_threads: list[int] = []

    def reset(self, task: Task) -> None:
        type(self).reset_threads.append(threading.get_ident())
        super().reset(task)

    def reset_is_cheap(self, task: Task) -> bool:
        return self.cheap


@pytest.mark.anyio
@pytest.mark.parametrize("cheap", [False, True])
async def test_a_cheap_reset_runs_on_the_event_loop_others_in_a_worker_thread(
    cheap: bool,
) -> None:
    ThreadRecording.cheap, ThreadRecording.reset_threads = cheap, []
    runner = WorkflowRunner(None, max_timeout=5, max_retry_times=0)
    for i in range(3):
        assert (await runner.run_task(_task(ThreadRecording, task_id=i))).ok
    loop_thread = threading.get_ident()
    assert len(ThreadRecording.reset_threads) == 5  # 3 tasks x 2 runs, the first one new
    assert all((t == loop_thread) is cheap for t in ThreadRecording.reset_threads)


def test_which_builtin_resets_are_cheap() -> None:
    """``SimpleWorkflow.reset``: attribute copies, unless the reward fn changes (a new
    one is constructed: any code); a subclass with a ``reset`` of its own: not known."""
    from workflows.code_workflow import CodeWorkflow
    from workflows.math_workflow import MathWorkflow

    task = _task(MathWorkflow, task_id=0)
    wf = MathWorkflow(task=task, model=None)
    assert wf.reset_is_cheap(_task(MathWorkflow, task_id=1))  # the same reward fn
    other = _task(MathWorkflow, task_id=2, default_reward_fn_type="accuracy_reward")
    assert not wf.reset_is_cheap(other)  # a new reward fn to build
    wf.reset(other)
    assert wf.reset_is_cheap(
        _task(MathWorkflow, task_id=3, default_reward_fn_type="accuracy_reward")
    )
    with_args = _task(MathWorkflow, task_id=4, reward_fn_args={"use_math_verify": False})
    assert not wf.reset_is_cheap(with_args)
    code_task = _task(CodeWorkflow, task_id=0)
    code_task.raw_task["tests"] = "assert True"
    assert not CodeWorkflow(task=code_task, model=None).reset_is_cheap(code_task)
    assert not Resettable(task=task, model=None).reset_is_cheap(task)  # the base: never


class Overlap(Workflow):
    """Records the thread it runs on and its time window (one run per task: it repeats)."""

    can_reset = True
    can_repeat = True
    windows: list[tuple[float, float, int]] = []
    sync_runs = 0

    def reset(self, task: Task) -> None:
        self.task = task

    def run(self) -> list[Experience]:
        type(self).sync_runs += 1
        raise AssertionError("the runner must not call run() of an async workflow")

    async def run_async(self) -> list[Experience]:
        start = anyio.current_time()
        await anyio.sleep(0.2)
        type(self).windows.append((start, anyio.current_time(), threading.get_ident()))
        return _exps(self.task)


@pytest.mark.anyio
async def test_async_workflows_run_concurrently_on_the_event_loop_thread() -> None:
    Overlap.windows, Overlap.sync_runs = [], 0
    loop_thread = threading.get_ident()
    runner = WorkflowRunner(None, max_timeout=5, max_retry_times=0)
    results = await _run_concurrently(runner, [_task(Overlap, task_id=i) for i in range(8)], 8)
    assert all(r.ok for r in results) and Overlap.sync_runs == 0
    assert len(Overlap.windows) == 8
    # no worker thread: every run_async ran on the event loop's own thread
    assert {thread for _, _, thread in Overlap.windows} == {loop_thread}
    # all eight windows overlap: each started before any finished
    assert max(s for s, _, _ in Overlap.windows) < min(e for _, e, _ in Overlap.windows)
    # the explorer's runner_num bounds the overlap
    Overlap.windows = []
    await _run_concurrently(runner, [_task(Overlap, task_id=i) for i in range(4)], 2)
    events = sorted(
        [(s, 1) for s, _, _ in Overlap.windows] + [(e, -1) for _, e, _ in Overlap.windows]
    )
    running = peak = 0
    for _, delta in events:
        running += delta
        peak = max(peak, running)
    assert peak == 2


# ---------------------------------------------------------------------------
# can_repeat: one run for the group, or repeat_times runs (Trinity-RFT's runner)
# ---------------------------------------------------------------------------


class OneRun(Workflow):
    """Does not repeat itself: one experience per run; records what each run saw."""

    seen: list[tuple[int, int, int, int, int]] = []
    inits = 0
    fail_first_second_run = False

    def __init__(self, *, task: Task, model: Any, auxiliary_models: Any = None) -> None:
        super().__init__(task=task, model=model, auxiliary_models=auxiliary_models)
        type(self).inits += 1

    async def run_async(self) -> list[Experience]:
        t = self.task
        type(self).seen.append(
            (id(self), t.repeat_times, t.rollout_args.n, self.repeat_times, self.run_id_base)
        )
        if type(self).fail_first_second_run and self.run_id_base == 1:
            type(self).fail_first_second_run = False
            raise RuntimeError("second run failed once")
        return [Experience(tokens=[1, 2, 3], prompt_length=2, reward=float(len(type(self).seen)))]


class OneRunResettable(OneRun):
    can_reset = True

    def reset(self, task: Task) -> None:
        self.task = task


@pytest.mark.anyio
@pytest.mark.parametrize("cls", [OneRun, OneRunResettable])
async def test_a_workflow_that_does_not_repeat_runs_repeat_times_times(cls: type[OneRun]) -> None:
    cls.seen, cls.inits, cls.fail_first_second_run = [], 0, False
    task = _task(cls, task_id=5, repeat=3)
    res = await WorkflowRunner(None, max_timeout=5, max_retry_times=0).run_task(task)
    assert res.ok and res.attempts == 1
    exps = res.experiences
    assert [e.eid.run for e in exps] == [0, 1, 2]  # a full group, one experience per run
    assert [e.reward for e in exps] == [1.0, 2.0, 3.0]  # in run order
    assert {(e.eid.batch, e.eid.task) for e in exps} == {(3, 5)}
    # each run saw a single-run view: repeat_times 1, n 1, its run index as run_id_base
    assert [s[1:] for s in cls.seen] == [(1, 1, 1, 0), (1, 1, 1, 1), (1, 1, 1, 2)]
    instances = {s[0] for s in cls.seen}
    if cls is OneRunResettable:
        assert len(instances) == 1 and cls.inits == 1  # reset and reused between runs
    else:
        assert len(instances) == 3 and cls.inits == 3
    # the task itself is untouched
    assert (task.repeat_times, task.rollout_args.n) == (3, 3)


@pytest.mark.anyio
async def test_a_failed_run_retries_the_whole_group() -> None:
    OneRun.seen, OneRun.inits, OneRun.fail_first_second_run = [], 0, True
    res = await WorkflowRunner(None, max_timeout=5, max_retry_times=1).run_task(
        _task(OneRun, repeat=3)
    )
    assert res.ok and res.attempts == 2
    assert [e.eid.run for e in res.experiences] == [0, 1, 2]
    # attempt 1: runs 0 and 1 (which raised); attempt 2: runs 0, 1, 2
    assert [s[4] for s in OneRun.seen] == [0, 1, 0, 1, 2]


class WholeGroup(Workflow):
    """Builds ``repeat_times`` experiences itself (no eid numbering)."""

    calls: list[tuple[int, int]] = []

    def set_repeat_times(self, repeat_times: int, run_id_base: int = 0) -> None:
        super().set_repeat_times(repeat_times, run_id_base)
        type(self).calls.append((repeat_times, run_id_base))

    async def run_async(self) -> list[Experience]:
        return [
            Experience(tokens=[1, 2], prompt_length=1, info={"n": self.task.rollout_args.n})
            for _ in range(self.repeat_times)
        ]


class RepeatAttr(WholeGroup):
    can_repeat = True


class RepeatMethod(WholeGroup):  # the older guides' form
    def repeatable(self) -> bool:
        return True


class NoRepeatProperty(WholeGroup):  # Trinity-RFT's property form, saying no
    @property
    def repeatable(self) -> bool:  # type: ignore[override]
        return False


@pytest.mark.anyio
@pytest.mark.parametrize(
    "cls,runs", [(RepeatAttr, 1), (RepeatMethod, 1), (NoRepeatProperty, 4), (WholeGroup, 4)]
)
async def test_repeat_capability_in_every_spelling_decides_the_runs(
    cls: type[WholeGroup], runs: int
) -> None:
    cls.calls = []
    runner = WorkflowRunner(None, max_timeout=5, max_retry_times=0)
    for task_id in range(2):  # the class's answer is remembered: the same on the second task
        cls.calls = []
        res = await runner.run_task(_task(cls, task_id=task_id, repeat=4))
        assert res.ok, res.error
        exps = res.experiences
        assert len(exps) == 4 and [e.eid.run for e in exps] == [0, 1, 2, 3]
        if runs == 1:  # told the group size once; its task asks the engine for n = 4
            assert cls.calls == [(4, 0)]
            assert {e.info["n"] for e in exps} == {4}
        else:  # never told; four single runs of n = 1
            assert cls.calls == []
            assert {e.info["n"] for e in exps} == {1}


class NumbersItself(Workflow):
    """A repeating multi-step workflow: two experiences (turns) per rollout, numbered."""

    can_repeat = True

    async def run_async(self) -> list[Experience]:
        out = []
        for r in range(self.repeat_times):
            for step in range(2):
                e = Experience(tokens=[1, 2], prompt_length=1)
                e.eid.run, e.eid.step = self.run_id_base + r, step
                out.append(e)
        return out


@pytest.mark.anyio
async def test_the_runner_keeps_a_workflows_own_rollout_numbers() -> None:
    res = await WorkflowRunner(None, max_timeout=5, max_retry_times=0).run_task(
        _task(NumbersItself, repeat=2)
    )
    assert [(e.eid.run, e.eid.step) for e in res.experiences] == [(0, 0), (0, 1), (1, 0), (1, 1)]
