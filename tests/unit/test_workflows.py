"""Workflows: the guides' ExampleWorkflow, math_workflow, rewards, runner retries / timeouts / reuse, tasksets."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import anyio
import pytest

from rftstream.config.schema import FormatConfig, TasksetConfig
from rftstream.errors import ConfigError, RftError, WorkflowError
from tests.seed_plugins.example_workflow import ExampleWorkflow  # the guide's seed 004
from tests.unit._util import ScriptedModel, task_for, wrapper
from workflows import (
    REWARD_FUNCTIONS,
    Experience,
    MathWorkflow,
    Task,
    Workflow,
    WorkflowRunner,
    builtin_arithmetic_tasks,
    load_taskset,
)
from workflows.rewards import extract_answer

# ---------------------------------------------------------------------------
# workflows on the tiny model
# ---------------------------------------------------------------------------


@pytest.mark.anyio
async def test_example_workflow_from_the_guide_runs(tiny_model_path: str) -> None:
    task = task_for({"question": "3+4=", "answer": "7"}, "example_workflow", repeat=4)
    assert task.rollout_args.n == 4 and task.workflow_cls is ExampleWorkflow
    async with wrapper(tiny_model_path) as model:
        runner = WorkflowRunner(model, max_timeout=30, max_retry_times=0)
        result = await runner.run_task(task)
        assert result.error is None and result.attempts == 1
        exps = result.experiences
        assert len(exps) == 4
        assert [e.eid.run for e in exps] == [0, 1, 2, 3]
        for e in exps:
            assert e.eid.batch == 7 and e.eid.task == 0
            assert e.info["task_index"] == 0 and e.info["epoch"] == 2
            assert e.reward in (0.0, 1.0)
            assert e.logprobs.shape[0] == e.response_length == e.action_mask.shape[0] > 0
        # the guide's resettable() makes the runner reuse the instance
        result2 = await runner.run_task(
            task_for({"question": "1+1=", "answer": "2"}, "example_workflow", task_id=1)
        )
        assert result2.error is None and len(result2.experiences) == 4
        assert len(runner._idle[ExampleWorkflow]) == 1


@pytest.mark.anyio
async def test_guide_constructor_styles(tiny_model_path: str) -> None:
    task = task_for({"question": "3+4=", "answer": "7"}, "example_workflow")
    async with wrapper(tiny_model_path) as model:
        old = ExampleWorkflow(model, task, [])  # the older guide's positional order
        new = task.to_workflow(model)  # keywords, as the runner does
        for wf in (old, new):
            assert wf.model is model and wf.task is task and wf.can_reset and not wf.can_repeat

        class Plain(Workflow):
            def run(self) -> list[Experience]:
                return []

        assert Plain(model, task).task is task and Plain(task, model).model is model
        assert Plain(model, task=task).model is model
        with pytest.raises(TypeError, match="both"):
            Plain(model, task, model=model)

        class NoRun(Workflow):
            pass

        with pytest.raises(TypeError, match="override run"):
            NoRun(task=task, model=model)


@pytest.mark.anyio
async def test_math_workflow_scores_with_math_reward(tiny_model_path: str) -> None:
    rows = builtin_arithmetic_tasks()[::10]
    reward = REWARD_FUNCTIONS.get("math_reward")()
    async with wrapper(tiny_model_path) as model:
        runner = WorkflowRunner(model, max_timeout=30, max_retry_times=0)
        results = [
            await runner.run_task(task_for(row, repeat=6, task_id=i)) for i, row in enumerate(rows)
        ]
        assert len(runner._idle[MathWorkflow]) == 1  # one instance served every task via reset()
    total = []
    for row, res in zip(rows, results, strict=True):
        assert res.error is None and len(res.experiences) == 6
        for e in res.experiences:
            assert e.reward == reward(e.response_text, row["answer"])["accuracy"]
            assert e.metrics["accuracy"] == e.reward
            assert e.messages[-1] == {"role": "assistant", "content": e.response_text}
            assert e.info["finish_reason"] in ("stop", "length")
            total.append(e.reward)
        assert res.metrics["reward_mean"] == pytest.approx(
            sum(e.reward for e in res.experiences) / 6
        )
        assert res.metrics["attempts"] == 1 and res.metrics["run_time"] > 0
    assert 0 < sum(total) < len(total)  # the tiny model is sometimes right, mostly wrong


@pytest.mark.anyio
async def test_simple_workflow_format_args_and_sync_run(tiny_model_path: str) -> None:
    fmt = FormatConfig(prompt_key="q", response_key="a", system_prompt="Add.", reply_prefix="")
    task = task_for({"q": "2+2=", "a": "4"}, "simple_workflow", repeat=3, format=fmt)
    async with wrapper(tiny_model_path) as model:
        wf = task.to_workflow(model)
        assert wf.format_messages() == [
            {"role": "system", "content": "Add."},
            {"role": "user", "content": "2+2="},
        ]
        exps = await anyio.to_thread.run_sync(wf.run)  # the blocking form, from a worker thread
        assert len(exps) == 3 and all(
            e.reward == float(e.response_text.strip() == "4") for e in exps
        )
        assert exps[0].prompt_text.startswith("<|im_start|>system\nAdd.<|im_end|>")
        with pytest.raises(RftError, match="chat_async"):
            model.chat([{"role": "user", "content": "1+1="}])  # blocking call on the event loop
        with pytest.raises(WorkflowError, match="prompt_key"):
            task_for({"question": "x"}, "simple_workflow", format=fmt).to_workflow(model)


@pytest.mark.anyio
async def test_messages_key_and_reply_prefix_through_the_runner(tiny_model_path: str) -> None:
    """``format.messages_key`` (a chat list per row) and a non-empty ``reply_prefix``
    (the assistant turn is continued, not closed) reach the engine as the template renders
    them; expected prompts come from the tokenizer's own template."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_path)

    def ids(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False)

    conv = [
        {"role": "user", "content": "1+1="},
        {"role": "assistant", "content": "2"},
        {"role": "user", "content": "2+3="},
    ]
    by_messages = task_for(
        {"conv": conv, "a": "5"},
        "simple_workflow",
        repeat=3,
        format=FormatConfig(messages_key="conv", response_key="a", system_prompt="Add."),
    )
    prefix = "The sum is"
    with_prefix = task_for(
        {"q": "3+4=", "a": "7"},
        "math_workflow",
        repeat=2,
        task_id=1,
        format=FormatConfig(prompt_key="q", response_key="a", reply_prefix=prefix),
    )
    async with wrapper(tiny_model_path) as model:
        runner = WorkflowRunner(model, max_timeout=30, max_retry_times=0)
        a = await runner.run_task(by_messages)
        b = await runner.run_task(with_prefix)
    assert a.ok and b.ok, (a.error, b.error)

    sent = [{"role": "system", "content": "Add."}, *conv]
    text = tok.apply_chat_template(sent, tokenize=False, add_generation_prompt=True)
    assert text.endswith("2+3=<|im_end|>\n<|im_start|>assistant\n")
    assert len(a.experiences) == 3
    for e in a.experiences:
        assert e.prompt_text == text
        assert e.tokens[: e.prompt_length].tolist() == ids(text)
        assert e.messages == [*sent, {"role": "assistant", "content": e.response_text}]
        assert e.reward == float(e.response_text.strip() == "5")  # accuracy_reward vs "5"

    shown = [{"role": "user", "content": "3+4="}, {"role": "assistant", "content": prefix}]
    text = tok.apply_chat_template(shown, tokenize=False, continue_final_message=True)
    assert text.endswith("<|im_start|>assistant\n" + prefix)  # the turn is left open
    math_reward = REWARD_FUNCTIONS.get("math_reward")()
    assert len(b.experiences) == 2
    for e in b.experiences:
        assert e.prompt_text == text
        assert e.tokens[: e.prompt_length].tolist() == ids(text)
        # the reply continues the prefix: the recorded assistant turn is prefix + response
        assert e.messages == [shown[0], {"role": "assistant", "content": prefix + e.response_text}]
        assert e.reward == math_reward(response=e.response_text, truth="7")["accuracy"]


@pytest.mark.anyio
async def test_math_workflow_scores_replies() -> None:
    """Fixed replies, rewards written out: math_reward's final answer is the last box, else
    the last <answer> tag, else the last number; the reply_prefix is sent, not scored."""
    replies = ["\\boxed{7}", "<answer>7</answer>", "3+4 = 7.", "7 or \\boxed{8}", "no idea"]
    prefix = "Is it \\boxed{8}? No:"
    fmt = FormatConfig(prompt_key="q", response_key="a", reply_prefix=prefix)
    model = ScriptedModel(replies)
    runner = WorkflowRunner(model, max_timeout=30, max_retry_times=0)
    res = await runner.run_task(task_for({"q": "3+4=", "a": "7"}, "math_workflow", 5, format=fmt))
    assert res.ok, res.error
    assert [e.reward for e in res.experiences] == [1.0, 1.0, 1.0, 0.0, 0.0]
    assert [e.metrics["accuracy"] for e in res.experiences] == [1.0, 1.0, 1.0, 0.0, 0.0]
    assert model.sent == [
        [{"role": "user", "content": "3+4="}, {"role": "assistant", "content": prefix}]
    ]


@pytest.mark.anyio
async def test_model_wrapper_generate_and_history(tiny_model_path: str) -> None:
    async with wrapper(tiny_model_path) as model:
        model.enable_history = True
        exps = await model.generate_async(["ab", "cd"], n=2, max_tokens=3)
        assert [e.prompt_text for e in exps] == ["ab", "ab", "cd", "cd"]
        assert all(e.response_length <= 3 and e.messages is None for e in exps)
        assert len(model.extract_experience_from_history()) == 4
        assert model.extract_experience_from_history() == []
        assert model.get_openai_client().model_path == model.served_model_name


# ---------------------------------------------------------------------------
# runner: retries, timeouts, reuse, cancellation (no model needed)
# ---------------------------------------------------------------------------


class Flaky(Workflow):
    calls = 0
    fail_times = 2

    async def run_async(self) -> list[Experience]:
        type(self).calls += 1
        if type(self).calls <= self.fail_times:
            raise ValueError(f"boom {type(self).calls}")
        return [
            Experience(tokens=[1, 2, 3], prompt_length=2, reward=1.0)
            for _ in range(self.task.repeat_times)
        ]


class AsyncHang(Workflow):
    async def run_async(self) -> list[Experience]:
        await anyio.sleep_forever()
        return []


class SyncHang(Workflow):
    def run(self) -> list[Experience]:
        time.sleep(0.5)
        return []


class Counting(Workflow):
    can_reset = True
    inits = 0
    resets = 0

    def __init__(self, *, task: Task, model: Any, auxiliary_models: Any = None) -> None:
        super().__init__(task=task, model=model, auxiliary_models=auxiliary_models)
        type(self).inits += 1

    def reset(self, task: Task) -> None:
        self.task = task
        type(self).resets += 1

    def run(self) -> list[Experience]:
        return [
            Experience(
                tokens=[1, 2],
                prompt_length=1,
                reward=0.5,
                metrics={"m": 2.0},
                info={"me": id(self)},
            )
        ]


@pytest.mark.anyio
async def test_runner_retries_then_succeeds_or_reports() -> None:
    Flaky.calls, Flaky.fail_times = 0, 2
    runner = WorkflowRunner(None, max_timeout=5, max_retry_times=2)
    res = await runner.run_task(task_for({"question": "q"}, Flaky, repeat=3))
    assert res.error is None and res.attempts == 3 and len(res.experiences) == 3
    assert res.metrics["reward_mean"] == 1.0

    Flaky.calls, Flaky.fail_times = 0, 10
    res = await WorkflowRunner(None, max_timeout=5, max_retry_times=1).run_task(
        task_for({"question": "q"}, Flaky)
    )
    assert res.experiences == [] and res.attempts == 2
    assert res.error is not None and "ValueError" in res.error and "boom 2" in res.error


@pytest.mark.anyio
@pytest.mark.parametrize("workflow", [AsyncHang, SyncHang])
async def test_runner_times_out_hanging_workflows(workflow: type[Workflow]) -> None:
    runner = WorkflowRunner(None, max_timeout=0.1, max_retry_times=1)
    t0 = time.perf_counter()
    res = await runner.run_task(task_for({"question": "q"}, workflow))
    assert time.perf_counter() - t0 < 0.9  # a waited-for SyncHang would take >= 1.0 s
    assert res.experiences == [] and res.attempts == 2
    assert (
        res.error is not None
        and "TimeoutError" in res.error
        and "explorer.max_timeout" in res.error
    )


@pytest.mark.anyio
async def test_runner_reuses_resettable_instances() -> None:
    Counting.inits = Counting.resets = 0
    runner = WorkflowRunner(None, max_timeout=5, max_retry_times=0)
    a = await runner.run_task(task_for({"question": "q"}, Counting, task_id=1))
    b = await runner.run_task(task_for({"question": "q"}, Counting, task_id=2))
    assert a.experiences[0].info["me"] == b.experiences[0].info["me"]
    # Counting does not repeat itself: 4 runs per task (repeat_times 4), one instance for all 8
    assert len(a.experiences) == len(b.experiences) == 4
    assert (Counting.inits, Counting.resets) == (1, 7)
    assert b.experiences[0].eid.task == 2 and b.metrics["m"] == 2.0


@pytest.mark.anyio
async def test_runner_propagates_cancellation_and_reports_unknown_workflow() -> None:
    runner = WorkflowRunner(None, max_timeout=10, max_retry_times=3)
    with anyio.move_on_after(0.05) as scope:
        await runner.run_task(task_for({"question": "q"}, AsyncHang))
    assert scope.cancelled_caught
    res = await runner.run_task(task_for({"question": "q"}, "no_such_workflow"))
    assert res.error is not None and "no_such_workflow" in res.error and res.experiences == []


# ---------------------------------------------------------------------------
# rewards and tasksets (pure)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "response,truth,expected",
    [
        ("so the result is \\boxed{7}.", "7", 1.0),
        ("<think>3+4</think><answer>7</answer>", "7", 1.0),
        ("the answer is 7", "7", 1.0),
        ("7", "7", 1.0),
        ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("It is 1,000.", "1000", 1.0),
        ("I think 3+4=8", "7", 0.0),
        ("\\boxed{8} although 7", "7", 0.0),
        ("no idea", "7", 0.0),
        ("", "7", 0.0),
        ("72 clips", "Natalia sold 48/2 = 24 clips in May.\n#### 72", 1.0),
    ],
)
def test_math_reward(response: str, truth: str, expected: float) -> None:
    assert REWARD_FUNCTIONS.get("math_reward")()(response=response, truth=truth) == {
        "accuracy": expected
    }


@pytest.mark.parametrize(
    "response,truth,kwargs,cheap",
    [
        ("the answer is 7", "7", {}, True),  # two numbers: no math-verify
        ("\\boxed{7}", "#### 7", {}, True),  # GSM8K's truth, a boxed number
        ("no idea", "7", {}, True),  # no answer: 0 at once
        ("", "7", {}, True),
        ("7", None, {}, True),  # no truth
        ("\\boxed{\\frac{1}{2}}", "0.5", {}, True),  # a latex fraction is a number too
        ("\\boxed{\\pi}", "\\pi", {}, False),  # no number: math-verify may be asked
        ("\\boxed{a+b}", "b+a", {}, False),
        ("\\boxed{a+b}", "b+a", {"use_math_verify": False}, True),
        ("7", "7", {"pattern": "default"}, False),  # a format score: not known cheap
        ("7", "7", {"answer_parser": "last_number"}, False),  # a parser of the user's
    ],
)
def test_math_reward_says_when_it_is_cheap(
    response: str, truth: str | None, kwargs: dict[str, Any], cheap: bool
) -> None:
    fn = REWARD_FUNCTIONS.get("math_reward")(**kwargs)
    assert fn.fast_for(response, truth) is cheap
    assert not fn.fast  # the class as a whole is not
    # where it is cheap, no math-verify call: the score stands without it
    if cheap and truth is not None and not kwargs:
        plain = REWARD_FUNCTIONS.get("math_reward")(use_math_verify=False)
        assert fn(response=response, truth=truth) == plain(response=response, truth=truth)


@pytest.mark.anyio
@pytest.mark.parametrize(
    "replies,threaded",
    [(["3+4 = 7.", "8", "no idea"], False), (["\\boxed{\\pi}", "7"], True)],
)
async def test_math_workflow_scores_cheap_replies_on_the_event_loop(
    replies: list[str], threaded: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker thread only where math-verify may be needed: the thread hop costs more
    than scoring a number (about 5% of the default run's steps a second)."""
    import workflows.math_workflow as math_workflow

    hops: list[object] = []
    run_sync = anyio.to_thread.run_sync

    async def counted(fn: Any, *args: Any, **kw: Any) -> Any:
        hops.append(fn)
        return await run_sync(fn, *args, **kw)

    monkeypatch.setattr(math_workflow.anyio.to_thread, "run_sync", counted)
    runner = WorkflowRunner(ScriptedModel(replies), max_timeout=30, max_retry_times=0)
    fmt = FormatConfig(prompt_key="q", response_key="a")
    task = task_for({"q": "3+4=", "a": "7"}, "math_workflow", len(replies), format=fmt)
    res = await runner.run_task(task)
    assert res.ok, res.error
    assert [e.reward for e in res.experiences] == [float(r in ("3+4 = 7.", "7")) for r in replies]
    assert any(getattr(fn, "__name__", "") == "score" for fn in hops) is threaded


def test_scores_inline_for_plain_callables_and_reward_fns() -> None:
    from rftstream.workflow import scores_inline

    def plain(response: str, truth: str) -> float:
        return 1.0

    assert not scores_inline(plain, ["7"], "7")  # a plain function: a worker thread
    math_reward = REWARD_FUNCTIONS.get("math_reward")()
    assert scores_inline(math_reward, ["7", "no idea"], "7")
    assert not scores_inline(math_reward, ["7", "\\boxed{x}"], "7")  # every reply must be cheap
    assert scores_inline(REWARD_FUNCTIONS.get("accuracy_reward")(), ["\\boxed{x}"], "7") is bool(
        REWARD_FUNCTIONS.get("accuracy_reward").fast
    )


def test_accuracy_reward_and_extraction() -> None:
    acc = REWARD_FUNCTIONS.get("accuracy_reward")()
    assert acc(" 7\n", "7") == {"accuracy": 1.0}
    assert acc("7.0", "7") == {"accuracy": 0.0}
    assert extract_answer("a \\boxed{x^{2}} b") == "x^{2}"
    assert extract_answer("nothing here") is None


def test_load_taskset(tmp_path: Path) -> None:
    assert load_taskset(TasksetConfig()) == builtin_arithmetic_tasks()
    assert load_taskset(TasksetConfig(path="builtin:arithmetic"))[0] == {
        "question": "0+0=",
        "answer": "0",
    }
    f = tmp_path / "t.jsonl"
    f.write_text('{"question": "1+1=", "answer": "2"}\n\n{"question": "2+2=", "answer": "4"}\n')
    assert [r["answer"] for r in load_taskset(TasksetConfig(path=str(f)))] == ["2", "4"]
    d = tmp_path / "ds"
    d.mkdir()
    (d / "train.jsonl").write_text('{"question": "a"}\n')
    (d / "test.json").write_text(json.dumps([{"question": "b"}]))
    assert load_taskset(TasksetConfig(path=str(d))) == [{"question": "a"}]
    assert load_taskset(TasksetConfig(path=str(d), split="test")) == [{"question": "b"}]

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "ok"}\n{not json\n')
    with pytest.raises(
        ConfigError, match=r"buffer\.explorer_input\.taskset\.path.*bad\.jsonl, line 2"
    ):
        load_taskset(TasksetConfig(path=str(bad)))
    with pytest.raises(ConfigError, match="no such file"):
        load_taskset(TasksetConfig(path=str(tmp_path / "missing.jsonl")))
    with pytest.raises(ConfigError, match="unknown built-in"):
        load_taskset(TasksetConfig(path="builtin:nope"))
