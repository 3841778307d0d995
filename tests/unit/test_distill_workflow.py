"""On-policy distillation workflows: the teacher's log-probs of the student's response tokens
checked against an independent transformers forward of the teacher, rewards, and the errors
for a missing / unusable teacher; ``construct_workflow`` hands workflows the model wrappers
of the auxiliary models."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anyio
import pytest
import torch

from algorithms.advantage_fn import ADVANTAGE_FN
from rftstream.config.schema import AuxiliaryModelConfig
from rftstream.engines.auxiliary_models import serve_auxiliary_models
from rftstream.engines.model_wrapper import wrapper_of
from rftstream.errors import RftError, WorkflowError
from rftstream.experience import EID
from rftstream.workflow import construct_workflow
from tests.unit._util import ScriptedModel, task_for, wrapper
from workflows import (
    WORKFLOWS,
    Experience,
    OnPolicyDistillMathWorkflow,
    OnPolicyDistillWorkflow,
    Workflow,
    WorkflowRunner,
)
from workflows.distill_workflow import response_slice

ROW = {"question": "3+4=", "answer": "7"}


def reference_teacher_logprobs(
    model_path: str, exp: Experience, temperature: float
) -> torch.Tensor:
    """log_softmax(logits / T) of the teacher on prompt + response, gathered at the response
    tokens: a plain transformers forward, independent of the engines."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=torch.float32)
    model.eval()
    ids = torch.as_tensor(exp.tokens, dtype=torch.long)[None]
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    start = exp.prompt_length
    logp = torch.log_softmax(logits[start - 1 : -1] / temperature, dim=-1)
    return logp.gather(-1, ids[0, start:, None]).squeeze(-1)


async def _distill(
    tiny_model_path: str, workflow: str, temperature: float, **cfg: Any
) -> list[Experience]:
    teacher_cfg = AuxiliaryModelConfig(model_path=tiny_model_path, max_response_tokens=8)
    async with wrapper(tiny_model_path) as student, serve_auxiliary_models([teacher_cfg]) as aux:
        task = task_for(ROW, workflow, repeat=3, workflow_args={"temperature": temperature}, **cfg)
        runner = WorkflowRunner(student, max_timeout=60, max_retry_times=0, auxiliary_models=aux)
        res = await runner.run_task(task)
    assert res.error is None, res.error
    return res.experiences


@pytest.mark.anyio
@pytest.mark.parametrize("temperature", [1.0, 0.7])
async def test_teacher_logprobs_equal_an_independent_forward(
    tiny_model_path: str, temperature: float
) -> None:
    exps = await _distill(tiny_model_path, "on_policy_distill_workflow", temperature)
    assert len(exps) == 3
    for exp in exps:
        teacher = torch.tensor(exp.info["teacher_logprobs"])
        assert teacher.shape == (exp.response_length,) and exp.response_length > 0
        expected = reference_teacher_logprobs(tiny_model_path, exp, temperature)
        assert torch.allclose(teacher, expected, atol=1e-4), (teacher, expected)
        student = exp.logprobs.to(torch.float32)
        assert exp.metrics["kl_divergence"] == pytest.approx(
            float((student - expected).sum()), abs=1e-3
        )
        assert exp.reward == 0.0  # no reward fn named: the teacher alone sets the advantage
    assert sorted(e.eid.run for e in exps) == [0, 1, 2]


@pytest.mark.anyio
async def test_teacher_logprobs_feed_the_distillation_advantage(tiny_model_path: str) -> None:
    """Same teacher and student weights at temperature 1: the advantage (teacher - student)
    is close to 0 on every token, as the two compute the same probabilities."""
    exps = await _distill(tiny_model_path, "on_policy_distill_workflow", 1.0)
    fn = ADVANTAGE_FN.get("on_policy_distill")(kl_coef=1.0)
    out, metrics = fn(exps)
    for exp in out:
        assert torch.allclose(exp.advantages, torch.zeros_like(exp.advantages), atol=1e-3)
    assert abs(metrics["kl/mean"]) < 1e-2


@pytest.mark.anyio
async def test_reward_fn_named_in_the_taskset_scores(tiny_model_path: str) -> None:
    exps = await _distill(
        tiny_model_path,
        "on_policy_distill_workflow",
        1.0,
        default_reward_fn_type="accuracy_reward",
    )
    for exp in exps:
        expected = 1.0 if (exp.response_text or "").strip() == "7" else 0.0
        assert exp.reward == expected
        assert "accuracy" in exp.metrics


@pytest.mark.anyio
async def test_math_variant_prompts_for_boxed_answers_and_scores_them(
    tiny_model_path: str,
) -> None:
    exps = await _distill(tiny_model_path, "on_policy_distill_math_workflow", 1.0)
    for exp in exps:
        assert len(exp.info["teacher_logprobs"]) == exp.response_length
        assert exp.reward is not None  # math_boxed_reward ran (the tiny model never boxes)
        assert "\\boxed{}" in (exp.prompt_text or "")


def test_registered_under_trinity_names() -> None:
    assert WORKFLOWS.get("on_policy_distill_workflow") is OnPolicyDistillWorkflow
    assert WORKFLOWS.get("on_policy_distill_math_workflow") is OnPolicyDistillMathWorkflow


def test_no_teacher_is_an_error_naming_the_key() -> None:
    task = task_for(ROW, "on_policy_distill_workflow")
    with pytest.raises(WorkflowError, match=r"explorer\.auxiliary_models\[0\]"):
        construct_workflow(OnPolicyDistillWorkflow, task, ScriptedModel(["7"]), [])


def test_external_base_url_teacher_is_an_error() -> None:
    task = task_for(ROW, "on_policy_distill_workflow")
    client = SimpleNamespace(model_path="teacher")  # an openai client of a base_url server
    with pytest.raises(WorkflowError, match="base_url"):
        construct_workflow(OnPolicyDistillWorkflow, task, ScriptedModel(["7"]), [client])


class _SmallVocabTeacher:
    tokenizer = ["a", "b"]  # two tokens: the student's ids 1..3 do not all fit

    async def logprobs_async(self, tokens: Any, temperature: float | None = None) -> torch.Tensor:
        raise AssertionError("must not be asked")


@pytest.mark.anyio
async def test_token_outside_the_teacher_vocabulary_is_an_error() -> None:
    task = task_for(ROW, "on_policy_distill_workflow", repeat=1)
    wf = OnPolicyDistillWorkflow(
        task=task,
        model=ScriptedModel(["7"]),
        auxiliary_models=[],
        auxiliary_model_wrappers=[_SmallVocabTeacher()],
    )
    with pytest.raises(WorkflowError, match="vocabulary"):
        await wf.run_async()


def test_non_positive_temperature_is_an_error_naming_the_key() -> None:
    task = task_for(ROW, "on_policy_distill_workflow", workflow_args={"temperature": 0})
    with pytest.raises(WorkflowError, match=r"workflow_args\.temperature"):
        OnPolicyDistillWorkflow(
            task=task, model=ScriptedModel(["7"]), auxiliary_model_wrappers=[_SmallVocabTeacher()]
        )


def test_response_slice_aligns_and_checks_length() -> None:
    exp = Experience(tokens=[5, 6, 7, 8, 9], prompt_length=2, eid=EID(0, 0, 0))
    seq = torch.tensor([-1.0, -2.0, -3.0, -4.0])  # scores of tokens 1..4
    assert response_slice(exp, seq).tolist() == [-2.0, -3.0, -4.0]  # tokens 2..4
    with pytest.raises(WorkflowError, match="scored 2 response tokens, the response has 3"):
        response_slice(exp, seq[:3])


class _TakesWrappers(Workflow):
    def __init__(self, *, task: Any, model: Any, auxiliary_models: Any = None,
                 auxiliary_model_wrappers: Any = None) -> None:  # fmt: skip
        super().__init__(task=task, model=model, auxiliary_models=auxiliary_models)
        self.given = auxiliary_model_wrappers

    def run(self) -> list[Experience]:
        return []


class _Plain(Workflow):
    def run(self) -> list[Experience]:
        return []


@pytest.mark.anyio
async def test_construct_workflow_hands_over_the_wrappers_of_served_models(
    tiny_model_path: str,
) -> None:
    task = task_for(ROW)
    external = SimpleNamespace(model_path="x")
    async with serve_auxiliary_models([AuxiliaryModelConfig(model_path=tiny_model_path)]) as aux:
        clients = [*aux, external]
        wf = construct_workflow(_TakesWrappers, task, ScriptedModel(["7"]), clients)
        served = wf.given[0]
        assert wf.given == [served, None] and served is not None
        assert served.served_model_name == aux[0].model_path
        plain = construct_workflow(_Plain, task, ScriptedModel(["7"]), clients)
        assert plain.auxiliary_model_wrappers == [served, None]
        assert wf.auxiliary_model_wrappers == [served, None]


@pytest.mark.anyio
async def test_auxiliary_model_paths(tiny_model_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``builtin:tiny`` serves the embedded tiny model; a missing directory names the entry."""
    monkeypatch.setenv("RFTSTREAM_CACHE", str(Path(tiny_model_path).parent))
    async with serve_auxiliary_models([AuxiliaryModelConfig(model_path="builtin:tiny")]) as aux:
        assert wrapper_of(aux[0]).model_path == tiny_model_path
    missing = AuxiliaryModelConfig(model_path=str(Path(tiny_model_path) / "nope"))
    with pytest.raises(RftError, match=r"explorer\.auxiliary_models\[1\]\.model_path"):
        async with serve_auxiliary_models([AuxiliaryModelConfig(base_url="http://x/v1"), missing]):
            pass


@pytest.mark.anyio
async def test_blocking_run_records_the_same_teacher_logprobs(tiny_model_path: str) -> None:
    """``run()`` in a worker thread (the form a sync caller uses) scores like ``run_async``."""
    teacher_cfg = AuxiliaryModelConfig(model_path=tiny_model_path, max_response_tokens=8)
    async with wrapper(tiny_model_path) as student, serve_auxiliary_models([teacher_cfg]) as aux:
        task = task_for(ROW, "on_policy_distill_workflow", repeat=2)
        wf = construct_workflow(OnPolicyDistillWorkflow, task, student, aux)
        wf.set_repeat_times(2, 0)
        exps = await anyio.to_thread.run_sync(wf.run)
    assert len(exps) == 2
    for exp in exps:
        expected = reference_teacher_logprobs(tiny_model_path, exp, 1.0)
        teacher = torch.tensor(exp.info["teacher_logprobs"])
        assert torch.allclose(teacher, expected, atol=1e-4), (teacher, expected)
