"""Built-in workflows on the tiny model: math_boxed, countdown, env (action mask and logprobs
checked independently), code, python tool (a scripted client; and the real loopback API with
the tiny model steered on its first turn, so the sandbox is always reached)."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace
from typing import Any

import anyio
import anyio.lowlevel
import pytest
import torch

from rftstream.config.schema import FormatConfig, GenerationConfig
from rftstream.engines import RolloutEngine, create_engine
from rftstream.errors import WorkflowError
from tests.unit._util import ScriptedModel, task_for, wrapper
from workflows import (
    ENVS,
    REWARD_FUNCTIONS,
    WORKFLOWS,
    CodeWorkflow,
    CountdownWorkflow,
    EnvWorkflow,
    Experience,
    MathBoxedWorkflow,
    ModelWrapper,
    PythonToolWorkflow,
    Task,
    TextEnv,
    WorkflowRunner,
)
from workflows.envs import FrozenLakeEnv, GuessNumberEnv, normalize_step
from workflows.tool_workflow import PYTHON_TOOL, format_tool_result

IM_START, IM_END = "<|im_start|>", "<|im_end|>"


async def run(model: Any, task: Task) -> list[Experience]:
    res = await WorkflowRunner(model, max_timeout=60, max_retry_times=0).run_task(task)
    assert res.error is None, res.error
    return res.experiences


def check_shapes(exps: list[Experience], n: int) -> None:
    assert len(exps) == n
    for e in exps:
        assert e.response_length > 0
        assert e.logprobs.shape[0] == e.action_mask.shape[0] == e.response_length
        assert e.reward is not None


def test_registered_workflows() -> None:
    for name, cls in {
        "simple_workflow": None,
        "math_workflow": None,
        "math_boxed_workflow": MathBoxedWorkflow,
        "countdown_workflow": CountdownWorkflow,
        "countdown": CountdownWorkflow,
        "env_workflow": EnvWorkflow,
        "code_workflow": CodeWorkflow,
        "python_tool_workflow": PythonToolWorkflow,
    }.items():
        assert name in WORKFLOWS
        assert cls is None or WORKFLOWS.get(name) is cls
    assert {"guess_number", "frozen_lake"} <= set(ENVS.names())


# ---------------------------------------------------------------------------
# math_boxed_workflow
# ---------------------------------------------------------------------------


@pytest.mark.anyio
async def test_math_boxed_workflow(tiny_model_path: str) -> None:
    row = {"question": "3+4=", "answer": "7"}
    task = task_for(row, "math_boxed_workflow", repeat=4)
    async with wrapper(tiny_model_path) as model:
        wf = task.to_workflow(model)
        assert wf.format_messages()[0]["content"].endswith("\\boxed{}.")  # the default prompt
        exps = await run(model, task)
        check_shapes(exps, 4)
        fn = REWARD_FUNCTIONS.get("math_boxed_reward")()
        for e in exps:
            expected = fn(response=e.response_text, truth="7")
            assert e.metrics == {**e.metrics, **expected}
            assert e.reward == sum(expected.values())

        # with_think (no system prompt: the tiny model's context is 128 tokens): the tiny
        # model never writes <think>, so every reply pays the format penalty
        think = task_for(
            row,
            "math_boxed_workflow",
            repeat=3,
            format=FormatConfig(system_prompt=""),
            workflow_args={"with_think": True, "format_score_coef": 0.25},
        )
        exps = await run(model, think)
        check_shapes(exps, 3)
        assert all(e.metrics["format_score"] == -0.25 for e in exps)
        assert all(e.reward == e.metrics["accuracy"] - 0.25 for e in exps)

        # use_base: plain text prompt through model.generate
        base = task_for(
            row,
            "math_boxed_workflow",
            repeat=2,
            format=FormatConfig(system_prompt=""),
            workflow_args={"use_base": True},
        )
        exps = await run(model, base)
        check_shapes(exps, 2)
        assert all(e.prompt_text == "User:\n3+4=\nAssistant:\n" for e in exps)
        # and the blocking run() from a worker thread
        wf = base.to_workflow(model)
        exps = await anyio.to_thread.run_sync(wf.run)
        check_shapes(exps, 2)


@pytest.mark.anyio
async def test_math_boxed_workflow_scores_replies() -> None:
    """Fixed replies, rewards written out: only the last box counts, and with_think charges
    format_score_coef to a reply without one <think>...</think> pair."""
    replies = ["so it is \\boxed{7}", "7", "\\boxed{8}", "<think>3+4</think> \\boxed{7}"]
    row = {"question": "3+4=", "answer": "7"}
    exps = await run(ScriptedModel(replies), task_for(row, "math_boxed_workflow", repeat=4))
    assert [e.reward for e in exps] == [1.0, 0.0, 0.0, 1.0]
    assert [e.metrics["accuracy"] for e in exps] == [1.0, 0.0, 0.0, 1.0]
    assert [e.metrics["format_score"] for e in exps] == [0.0, 0.0, 0.0, 0.0]
    assert [e.eid.run for e in exps] == [0, 1, 2, 3]

    think = task_for(
        row,
        "math_boxed_workflow",
        repeat=4,
        workflow_args={"with_think": True, "format_score_coef": 0.25},
    )
    exps = await run(ScriptedModel(replies), think)
    assert [e.reward for e in exps] == [0.75, -0.25, -0.25, 1.0]
    assert [e.metrics["format_score"] for e in exps] == [-0.25, -0.25, -0.25, 0.0]

    # a GSM8K truth: its final answer (after ####) is the one compared
    gsm = task_for(
        {"question": "3+4=", "answer": "3 plus 4 is 7.\n#### 7"}, "math_boxed_workflow", repeat=4
    )
    assert [e.reward for e in await run(ScriptedModel(replies), gsm)] == [1.0, 0.0, 0.0, 1.0]


# ---------------------------------------------------------------------------
# countdown
# ---------------------------------------------------------------------------


@pytest.mark.anyio
async def test_countdown_workflow(tiny_model_path: str) -> None:
    fn = REWARD_FUNCTIONS.get("countdown_reward")()
    async with wrapper(tiny_model_path) as model:
        # prompt from the template, truth from target / nums
        task = task_for(
            {"target": 8, "nums": [3, 5]},
            "countdown",
            repeat=4,
            workflow_args={"prompt_template": "{numbers}->{target}"},
        )
        wf = task.to_workflow(model)
        assert wf.format_messages() == [{"role": "user", "content": "3, 5->8"}]
        assert wf.truth == {"target": 8, "numbers": [3, 5]}
        exps = await run(model, task)
        check_shapes(exps, 4)
        for e in exps:
            assert e.reward == fn(response=e.response_text, truth=wf.truth)["score"]
            assert e.reward in (0.0, 0.1, 1.0)

        # Trinity-RFT's rows: question text, truth as JSON under the response key
        truth = json.dumps({"target": 3, "numbers": [1, 2]})
        task = task_for({"question": "1 2 -> 3", "answer": truth}, "countdown_workflow", repeat=2)
        exps = await run(model, task)
        check_shapes(exps, 2)

        # the built-in prompt names the numbers and the target
        wf = task_for({"target": 24, "nums": [1, 2, 3, 4]}, "countdown").to_workflow(model)
        assert "1, 2, 3, 4" in wf.task_desc and "24" in wf.task_desc
        with pytest.raises(WorkflowError, match="nums"):
            task_for({"question": "x"}, "countdown").to_workflow(model)


@pytest.mark.anyio
async def test_countdown_workflow_scores_replies() -> None:
    """Fixed replies, rewards written out: ``score`` for an equation using each number once
    that makes the target, ``format_score`` for any other answer tag, 0 without one."""
    replies = [
        "<answer>3 + 5</answer>",
        "I think <answer>(5+3)</answer>",
        "<answer>3*5</answer>",  # wrong value
        "<answer>3+5+0</answer>",  # a number that was not given
        "<answer>oops</answer>",
        "3 + 5 = 8",  # no answer tag
    ]
    row = {"target": 8, "nums": [3, 5]}
    exps = await run(ScriptedModel(replies), task_for(row, "countdown", repeat=6))
    assert [e.reward for e in exps] == [1.0, 1.0, 0.1, 0.1, 0.1, 0.0]
    assert [e.metrics["score"] for e in exps] == [1.0, 1.0, 0.1, 0.1, 0.1, 0.0]
    paid = task_for(row, "countdown", repeat=6, reward_fn_args={"format_score": 0.2, "score": 2.0})
    exps = await run(ScriptedModel(replies), paid)
    assert [e.reward for e in exps] == [2.0, 2.0, 0.2, 0.2, 0.2, 0.0]
    # Trinity-RFT's rows: the truth as JSON under the response key
    truth = json.dumps({"target": 3, "numbers": [1, 2]})
    task = task_for({"question": "1 2 -> 3", "answer": truth}, "countdown_workflow", repeat=3)
    replies = ["<answer>1+2</answer>", "<answer>2-1</answer>", "3"]
    assert [e.reward for e in await run(ScriptedModel(replies), task)] == [1.0, 0.1, 0.0]


# ---------------------------------------------------------------------------
# env_workflow
# ---------------------------------------------------------------------------


def test_envs_protocol() -> None:
    env = GuessNumberEnv.from_task({"target": 5, "unrelated": 1}, max_guesses=3)
    assert env.reset() == "Guess my number (0-9)."
    assert env.step("I say 3") == ("Higher.", 0.0, False, {"guesses": 1, "valid": True})
    assert env.step("nothing")[:3] == ("Say a number.", 0.0, False)
    assert env.step("7")[:3] == ("Lower.", 0.0, True)  # out of guesses
    env.reset()
    assert env.step("5") == ("Correct!", 1.0, True, {"guesses": 1, "valid": True, "won": True})
    # without a target, the seed decides: the same for every rollout of a task
    assert GuessNumberEnv(seed=3).target == GuessNumberEnv(seed=3).target

    lake = FrozenLakeEnv(desc="SF/HG")
    assert lake.reset() == "PF\nHG"
    assert lake.step("up")[:3] == ("PF\nHG", 0.0, False)  # the border
    assert lake.step("right")[:3] == ("SP\nHG", 0.0, False)
    assert lake.step("D")[:3] == ("SF\nHP", 1.0, True)
    lake.reset()
    assert lake.step("down")[1:3] == (0.0, True)  # a hole

    assert normalize_step(("o", 1, False, True, {"x": 1})) == ("o", 1.0, True, {"x": 1})
    with pytest.raises(WorkflowError, match="must return"):
        normalize_step(("o", 1.0))


def expected_episode(tokenizer: Any, e: Experience) -> tuple[list[int], list[int]]:
    """Tokens and mask of an episode, rebuilt from its conversation and the tiny model's
    chat format (``<|im_start|>{role}\\n{content}<|im_end|>\\n``), not from the workflow."""

    def enc(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    msgs = e.messages
    assert msgs is not None and msgs[0]["role"] == "user"
    tokens = enc(f"{IM_START}user\n{msgs[0]['content']}{IM_END}\n{IM_START}assistant\n")
    mask: list[int] = []
    finishes = e.info["turn_finish_reasons"]
    turns = [m for m in msgs[1:] if m["role"] == "assistant"]
    observations = [m["content"] for m in msgs[1:] if m["role"] == "user"]
    assert len(turns) == len(finishes) and len(observations) in (len(turns), len(turns) - 1)
    for k, turn in enumerate(turns):
        reply = enc(turn["content"]) + (
            [tokenizer.convert_tokens_to_ids(IM_END)] if finishes[k] == "stop" else []
        )
        tokens += reply
        mask += [1] * len(reply)
        if k < len(observations):
            closing = "\n" if finishes[k] == "stop" else f"{IM_END}\n"
            env = enc(f"{closing}{IM_START}user\n{observations[k]}{IM_END}\n{IM_START}assistant\n")
            tokens += env
            mask += [0] * len(env)
    return tokens, mask


@pytest.mark.anyio
async def test_env_workflow_action_mask_and_logprobs(tiny_model_path: str) -> None:
    from transformers import AutoModelForCausalLM

    task = task_for(
        {"target": 5, "max_guesses": 3},
        "env_workflow",
        repeat=6,
        workflow_args={"env_type": "guess_number", "max_env_steps": 3},
        rollout_args=GenerationConfig(max_tokens=4, temperature=1.0),
    )
    async with wrapper(tiny_model_path, max_response_tokens=100) as model:
        exps = await run(model, task)
        tokenizer = model.tokenizer
    check_shapes(exps, 6)
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    multi_turn = 0
    for e in exps:
        tokens, mask = expected_episode(tokenizer, e)
        assert e.tokens.tolist() == tokens
        assert e.action_mask.int().tolist() == mask
        assert e.prompt_length == len(tokens) - len(mask)
        assert len(tokens) <= 128  # the tiny model's context
        steps = int(e.info["env_steps"])
        multi_turn += steps > 1
        assert e.reward == sum(e.info["step_rewards"]) == e.metrics["env_return"]
        guesses = [
            re.search(r"-?\d+", m["content"]) for m in e.messages if m["role"] == "assistant"
        ]
        won = guesses[-1] is not None and guesses[-1].group() == "5"
        assert e.reward == float(won)
        # logprobs: 0 on environment tokens, the model's own on its tokens
        resp_mask = e.action_mask.bool()
        assert torch.all(e.logprobs[~resp_mask] == 0)
        with torch.no_grad():
            logits = hf(e.tokens.long().unsqueeze(0)).logits[0].float()
        logp = torch.log_softmax(logits[e.prompt_length - 1 : -1], dim=-1)
        ref = logp.gather(-1, e.tokens[e.prompt_length :].long().unsqueeze(-1)).squeeze(-1)
        torch.testing.assert_close(e.logprobs[resp_mask], ref[resp_mask], atol=2e-4, rtol=1e-4)
    assert multi_turn > 0  # the tiny model rarely guesses 5 at once


@pytest.mark.anyio
async def test_env_workflow_keeps_the_banned_mass_of_each_turn(tiny_model_path: str) -> None:
    """With ``rollout_args.min_tokens`` every turn's first tokens were drawn under the ban:
    their ``allowed_logprobs`` are below 0, every other token's 0 (the environment's too)."""
    task = task_for(
        {"target": 5, "max_guesses": 3},
        "env_workflow",
        repeat=3,
        workflow_args={"env_type": "guess_number", "max_env_steps": 3},
        rollout_args=GenerationConfig(max_tokens=4, min_tokens=2, temperature=1.0),
    )
    async with wrapper(tiny_model_path, max_response_tokens=100) as model:
        exps = await run(model, task)
        banned = sorted(model.engine.eos_token_ids)
    for e in exps:
        assert e.banned_ids is not None and e.banned_ids.tolist() == banned
        allowed, mask = e.allowed_logprobs.tolist(), e.action_mask.int().tolist()
        turn_start = [m and (i == 0 or not mask[i - 1]) for i, m in enumerate(mask)]
        for i, m in enumerate(mask):
            in_ban = m and (turn_start[i] or (i > 0 and turn_start[i - 1]))
            assert (allowed[i] < 0) == bool(in_ban), (i, allowed, mask)


class SlowCounter(TextEnv):
    """A user environment without ``fast``: its calls run in a worker thread."""

    fast = False

    def __init__(self, goal: int = 2) -> None:
        self.goal, self.n = goal, 0

    def reset(self) -> tuple[str, dict[str, Any]]:  # gymnasium-style reset
        return "Count.", {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        self.n += 1
        return f"n={self.n}", 0.5, self.n >= self.goal, False, {}


@pytest.mark.anyio
async def test_env_workflow_user_env_and_limits(tiny_model_path: str) -> None:
    ENVS.register_module("slow_counter", SlowCounter)
    task = task_for(
        {"goal": 2},
        "env_workflow",
        repeat=2,
        format=FormatConfig(system_prompt="Go."),
        workflow_args={"env_type": "slow_counter", "action_pattern": r"(\d+)"},
        rollout_args=GenerationConfig(max_tokens=3),
    )
    async with wrapper(tiny_model_path, max_response_tokens=60) as model:
        exps = await run(model, task)
        check_shapes(exps, 2)
        for e in exps:
            assert e.messages[0] == {"role": "system", "content": "Go."}
            assert e.info["env_steps"] == 2 and e.reward == 1.0 and e.info["env_done"] == 1.0
        wf = task.to_workflow(model)
        assert wf.parse_action("guess 12 or 3") == "12" and wf.parse_action("none") == ""

        # a small response budget ends the episode early
        short = task_for(
            {"target": 5, "max_guesses": 9},
            "env_workflow",
            repeat=2,
            workflow_args={"max_env_steps": 9},
            rollout_args=GenerationConfig(max_tokens=3),
        )
        model.max_response_tokens = 20
        for e in await run(model, short):
            assert e.response_length <= 20
            assert e.info["truncated"] == 1.0 or e.info["env_done"] == 1.0

        with pytest.raises(WorkflowError, match="env_type"):
            task_for({}, "env_workflow", workflow_args={"env_type": "nope"}).to_workflow(model)
        with pytest.raises(WorkflowError, match="action_pattern"):
            task_for({}, "env_workflow", workflow_args={"action_pattern": "("}).to_workflow(model)


# ---------------------------------------------------------------------------
# code_workflow
# ---------------------------------------------------------------------------


@pytest.mark.anyio
async def test_code_workflow_on_the_tiny_model(tiny_model_path: str) -> None:
    row = {"question": "add(a,b)", "answer": ["assert add(1, 2) == 3", "assert add(0, 0) == 0"]}
    task = task_for(row, "code_workflow", repeat=3, format=FormatConfig(system_prompt=""))
    async with wrapper(tiny_model_path) as model:
        exps = await run(model, task)
    check_shapes(exps, 3)
    for e in exps:
        assert e.reward in (0.0, 0.5, 1.0) and "code" in e.info
        assert e.metrics["accuracy"] == e.reward


@pytest.mark.anyio
async def test_code_workflow_scores_replies() -> None:
    replies = [
        "```python\ndef add(a, b):\n    return a + b\n```",
        "Here:\n```\ndef add(a, b):\n    return a - b\n```",
        "```python\ndef add(a, b):\n    while True: pass\n```",
        "def add(a, b): return a + b if a > 5 else 0",  # no fence: the whole reply
    ]
    row = {"question": "add", "tests": "assert add(1, 2) == 3\nassert add(0, 0) == 0"}
    task = task_for(
        row,
        "code_workflow",
        repeat=4,
        workflow_args={"tests_key": "tests"},
        reward_fn_args={"timeout": 1.0},
    )
    exps = await run(ScriptedModel(replies), task)
    assert [e.reward for e in exps] == [1.0, 0.5, 0.0, 0.5]
    strict = task_for(
        row,
        "code_workflow",
        repeat=4,
        workflow_args={"tests_key": "tests"},
        reward_fn_args={"timeout": 1.0, "partial_credit": False},
    )
    exps = await run(ScriptedModel(replies), strict)
    assert [e.reward for e in exps] == [1.0, 0.0, 0.0, 0.0]


# ---------------------------------------------------------------------------
# python_tool_workflow with a scripted OpenAI client
# ---------------------------------------------------------------------------


def _message(content: str | None, calls: list[tuple[str, str]] | None = None) -> Any:
    tool_calls = None
    if calls:
        tool_calls = [
            SimpleNamespace(
                id=f"call_{i}", type="function", function=SimpleNamespace(name=n, arguments=a)
            )
            for i, (n, a) in enumerate(calls)
        ]
    return SimpleNamespace(
        choices=[SimpleNamespace(message=SimpleNamespace(content=content, tool_calls=tool_calls))]
    )


class FakeClient:
    """``await client.chat.completions.create(...)`` replaying a script; records each request."""

    def __init__(self, owner: FakeModel, script: list[Any]) -> None:
        self.owner, self.script, self.requests = owner, script, []
        self.model_path = "fake-model"
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self.create))

    async def create(self, **kwargs: Any) -> Any:
        self.requests.append(json.loads(json.dumps(kwargs)))
        self.owner.history.append(Experience(tokens=[1, 2, 3], prompt_length=2))
        await anyio.lowlevel.checkpoint()
        return self.script[(len(self.requests) - 1) % len(self.script)]


class FakeModel:
    """The ModelWrapper surface the tool workflow uses: clone, async client, history."""

    def __init__(self, script: list[Any], *, can_clone: bool = True) -> None:
        self.script = script
        self.enable_history = not can_clone
        self.can_clone = can_clone
        self.history: list[Experience] = []
        self.clones: list[FakeModel] = []
        self.client: FakeClient | None = None
        self.model_version = 0
        if can_clone:
            self.clone = self._clone

    def _clone(self, *, enable_history: bool | None = None) -> FakeModel:
        other = FakeModel(self.script)
        other.enable_history = bool(enable_history)
        self.clones.append(other)
        return other

    def get_openai_async_client(self) -> FakeClient:
        self.client = self.client or FakeClient(self, self.script)
        return self.client

    def extract_experience_from_history(
        self, clear_history: bool = True, *, merge_turns: bool = False
    ) -> list[Experience]:
        exps = list(self.history)
        self.history.clear()
        if merge_turns and exps:  # stand-in for merge_history: one per conversation
            exps[-1].info["merged"] = len(exps)
            return [exps[-1]]
        return exps


@pytest.mark.anyio
async def test_python_tool_workflow_scripted() -> None:
    script = [
        _message(None, [("python", json.dumps({"code": "print(17 * 23)"}))]),
        _message("It is \\boxed{391}."),
    ]
    model = FakeModel(script)
    task = task_for({"question": "17*23?", "answer": "391"}, "python_tool_workflow", repeat=2)
    exps = await run(model, task)
    assert len(exps) == 2 and [e.eid.run for e in exps] == [0, 1]
    # one clone (own history and API session) per rollout
    assert len(model.clones) == 2 and all(c.enable_history for c in model.clones)
    for e in exps:
        assert e.reward == 1.0 and e.info["tool_calls"] == 1 and e.metrics["accuracy"] == 1.0
    for api in model.clones:
        requests = api.client.requests
        assert len(requests) == 2  # two calls per rollout
        assert all(r["tools"] == [PYTHON_TOOL] and r["model"] == "fake-model" for r in requests)
        second = requests[1]["messages"]
        assert second[-2]["tool_calls"][0]["function"]["name"] == "python"
        assert second[-1] == {"role": "tool", "tool_call_id": "call_0", "content": "391"}
    assert exps[0].messages[-1] == {"role": "assistant", "content": "It is \\boxed{391}."}
    # the final reply is what is scored: a wrong one gets nothing, however it used the tool
    wrong = FakeModel([script[0], _message("It is \\boxed{390}.")])
    exps = await run(wrong, task)
    assert [(e.reward, e.metrics["accuracy"], e.info["tool_calls"]) for e in exps] == [
        (0.0, 0.0, 1),
        (0.0, 0.0, 1),
    ]

    # a reused instance keeps its clones
    runner = WorkflowRunner(model, max_timeout=60, max_retry_times=0)
    for task_id in range(2):
        res = await runner.run_task(
            task_for({"question": "q", "answer": "391"}, "python_tool_workflow", 2, task_id)
        )
        assert res.ok and len(res.experiences) == 2
    assert len(model.clones) == 4  # 2 from the first run above, 2 for this runner's instance

    # what a clone's history still holds (say, from a run that raised) is not merged into
    # the next run's experiences: each rollout's experience is made of its own two calls
    wf = PythonToolWorkflow(task=task, model=model)
    assert [e.info["merged"] for e in await wf.run_async()] == [2, 2]
    for r in range(2):
        wf.api_model(r).history.append(Experience(tokens=[9, 9, 9], prompt_length=1))
    wf.reset(task)
    assert [e.info["merged"] for e in await wf.run_async()] == [2, 2]

    # a model without clone(): its rollouts share it and run one after the other
    shared = FakeModel(script, can_clone=False)
    exps = await run(shared, task)
    assert len(exps) == 2 and len(shared.client.requests) == 4
    assert [m["role"] for m in shared.client.requests[2]["messages"]] == ["user"]

    # unknown tools, bad arguments, failing code, and the turn limit
    script = [
        _message(
            "",
            [
                ("search", "{}"),
                ("python", "not json"),
                ("python", json.dumps({"code": "raise SystemExit(3)"})),
                ("python", json.dumps({"src": "1"})),
            ],
        )
    ]
    model = FakeModel(script)
    task = task_for(
        {"question": "q", "answer": "1"},
        "python_tool_workflow",
        repeat=1,
        workflow_args={"max_turns": 2},
    )
    exps = await run(model, task)
    assert exps[0].reward == 0.0 and exps[0].info["tool_calls"] == 8
    tool_msgs = [m for m in exps[0].messages if m["role"] == "tool"][:4]
    assert [m["content"] for m in tool_msgs] == [
        "[unknown tool 'search'; the only tool is `python`]",
        "[the arguments are not a JSON object]",
        "[exit code 3]",
        "[missing string argument `code`]",
    ]


def test_format_tool_result() -> None:
    assert format_tool_result("1\n", "", 0, False, 100) == "1"
    assert format_tool_result("", "boom\n", 1, False, 100) == "stderr:\nboom\n[exit code 1]"
    assert format_tool_result("", "", -9, True, 100) == "[timed out]"
    assert format_tool_result("", "", 0, False, 100) == "[no output]"
    assert format_tool_result("x" * 50, "", 0, False, 20) == "x" * 8 + "\n[truncated]"


# ---------------------------------------------------------------------------
# python_tool_workflow through the model's real OpenAI API
# ---------------------------------------------------------------------------

# The tiny model's format, plus `tools` / `tool_calls` rendered compactly: the default
# rendering of tools (a long system prompt) does not fit its 128-token context.
COMPACT_TOOLS_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\\ntools: python<|im_end|>\\n' }}{% endif %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') }}"
    "{% for call in message.get('tool_calls') or [] %}"
    "{{ '<tool_call>' + call['function']['name'] + '</tool_call>' }}{% endfor %}"
    "{{ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


CALL = '<tool_call>{"name":"python","arguments":{"code":"print(17*23)"}}</tool_call>'


class SteeredEngine(RolloutEngine):
    """The real tiny model, steered on the first turn only.

    A request whose prompt has no tool result yet gets :data:`CALL` as its
    completion, with the real model's logprobs of those tokens; every later
    request is the real model's own sampling. First-turn requests are answered
    only once ``rollouts`` of them have arrived: rollouts that ran one after
    the other would never get there (the wait fails after 60 s).
    """

    def __init__(self, inner: Any, rollouts: int) -> None:
        self.inner = inner
        tok = inner.tokenizer
        self.forced = tok.encode(CALL, add_special_tokens=False) + [tok.eos_token_id]
        self.rollouts = rollouts
        self.first_turns: list[list[int]] = []
        self.all_here = anyio.Event()

    @property
    def tokenizer(self) -> Any:
        return self.inner.tokenizer

    @property
    def model_version(self) -> int:
        return self.inner.model_version

    async def generate(self, prompt_token_ids: list[int], params: Any) -> list[Any]:
        from rftstream.engines.base import Completion

        if "<|im_start|>tool" in self.inner.tokenizer.decode(prompt_token_ids):
            return await self.inner.generate(prompt_token_ids, params)
        self.first_turns.append(list(prompt_token_ids))
        if len(self.first_turns) >= self.rollouts:
            self.all_here.set()
        with anyio.fail_after(60):
            await self.all_here.wait()
        scored = await self.inner.score(
            list(prompt_token_ids) + self.forced,
            start=len(prompt_token_ids),
            temperature=params.temperature,
        )
        return [
            Completion(list(self.forced), list(scored.logprobs), "stop", self.model_version)
            for _ in range(params.n)
        ]

    async def score(self, token_ids: list[int], **kw: Any) -> Any:
        return await self.inner.score(token_ids, **kw)

    async def load_weights(self, state_dict: Any, version: int) -> None:
        await self.inner.load_weights(state_dict, version)

    async def run(self) -> None:
        await self.inner.run()

    async def aclose(self) -> None:
        await self.inner.aclose()


@pytest.mark.anyio
async def test_python_tool_workflow_real_api_sandbox_and_concurrent_rollouts(
    tiny_model_path: str, tmp_path: Any
) -> None:
    """The real loopback OpenAI server parses the model's tool call, the workflow runs it in
    the sandbox, the tool's output reaches the model's next prompt; three rollouts at once."""
    import shutil
    from pathlib import Path

    path = tmp_path / "tiny-tools"
    shutil.copytree(tiny_model_path, path)
    (Path(path) / "chat_template.jinja").write_text(COMPACT_TOOLS_TEMPLATE)
    task = task_for(
        {"question": "17*23=", "answer": "391"},
        "python_tool_workflow",
        repeat=3,
        format=FormatConfig(system_prompt=""),
        workflow_args={"max_turns": 2},
        rollout_args=GenerationConfig(max_tokens=6, temperature=0.8),
    )
    fn = REWARD_FUNCTIONS.get("math_reward")()
    inner = create_engine("transformers", str(path), batch_wait_ms=5)
    engine = SteeredEngine(inner, rollouts=3)
    tok = inner.tokenizer
    async with anyio.create_task_group() as tg:
        await tg.start(inner.run)
        model = ModelWrapper(engine, model_path=str(path), max_response_tokens=6)
        try:
            exps = await run(model, task)
            # the logprobs of each experience, recomputed by a full forward pass
            scores = [
                (await inner.score(e.tokens.tolist(), start=e.prompt_length, temperature=0.8))
                for e in exps
            ]
        finally:
            await model.aclose()
            await inner.aclose()
            tg.cancel_scope.cancel()

    first_prompt = (
        "<|im_start|>system\ntools: python<|im_end|>\n<|im_start|>user\n17*23=<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert len(engine.first_turns) == 3  # all three rollouts were waiting at once
    assert {tuple(p) for p in engine.first_turns} == {
        tuple(tok.encode(first_prompt, add_special_tokens=False))
    }
    # the compact template re-renders the call, so the two calls of a rollout do not chain:
    # one experience per call (eid.step), both with the rollout's reward
    assert sorted((e.eid.run, e.eid.step) for e in exps) == [
        (r, s) for r in range(3) for s in range(2)
    ]
    for e, scored in zip(exps, scores, strict=True):
        assert e.info["tool_calls"] == 1 and e.metrics["tool_calls"] == 1.0
        assert e.action_mask.shape[0] == e.logprobs.shape[0] == e.response_length > 0
        assert e.logprobs.tolist() == pytest.approx(scored.logprobs, abs=1e-4)
        assert e.reward == fn(response=e.info["final_response"], truth="391")["accuracy"]
        if e.eid.step == 0:  # the steered call, parsed by the server into tool_calls
            assert e.prompt_text == first_prompt
            assert e.tokens[e.prompt_length :].tolist() == engine.forced
            (call,) = e.messages[-1]["tool_calls"]
            assert call["function"]["name"] == "python"
            assert json.loads(call["function"]["arguments"]) == {"code": "print(17*23)"}
        else:  # the sandbox's output went back to the model as the tool message
            assert e.prompt_text == (
                first_prompt + "<tool_call>python</tool_call><|im_end|>\n"
                "<|im_start|>tool\n391<|im_end|>\n<|im_start|>assistant\n"
            )
            assert e.info["final_response"] == e.response_text
