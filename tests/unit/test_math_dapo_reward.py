"""``math_dapo_reward`` as Trinity-RFT's: +1/-1 on the last boxed answer after ``</think>``,
DAPO's overlong shaping (section 3.4) computed here from the paper's formula, and
``math_workflow`` passing the response tokens the penalty counts."""

from __future__ import annotations

import pytest
import torch

from rftstream.errors import WorkflowError
from workflows.rewards import REWARD_FUNCTIONS


def dapo_penalty(length: int, max_len: int, cache: int, factor: float) -> float:
    """DAPO's soft overlong punishment, written from the paper."""
    if length <= max_len - cache:
        return 0.0
    if length <= max_len:
        return ((max_len - cache) - length) / cache * factor
    return -factor


def test_accuracy_is_plus_or_minus_one_on_the_last_box_after_think() -> None:
    fn = REWARD_FUNCTIONS.get("math_dapo_reward")()
    assert fn("<think>maybe \\boxed{3}</think> so \\boxed{4}", "4") == {
        "accuracy": 1.0,
        "format_score": 0.0,
    }
    assert fn("<think>\\boxed{4}</think> it is \\boxed{5}", "4")["accuracy"] == -1.0
    assert fn("4", "#### 4")["accuracy"] == 1.0  # no box: the text after </think>; GSM8K truth
    assert fn("no idea", "4")["accuracy"] == -1.0


@pytest.mark.parametrize("length", [0, 10, 12, 13, 15, 17, 20, 21, 40])
def test_overlong_penalty_follows_the_paper(length: int) -> None:
    fn = REWARD_FUNCTIONS.get("math_dapo_reward")(
        enable_overlong_penalty=True, penalty_factor=1.5, max_response_length=20, cache_length=8
    )
    got = fn("\\boxed{1}", "1", response_token=torch.zeros(length, dtype=torch.int32))
    assert got["accuracy"] == 1.0
    assert got["format_score"] == pytest.approx(dapo_penalty(length, 20, 8, 1.5))


def test_penalty_settings_are_required_and_named() -> None:
    cls = REWARD_FUNCTIONS.get("math_dapo_reward")
    with pytest.raises(WorkflowError, match="reward_fn_args.cache_length"):
        cls(enable_overlong_penalty=True, penalty_factor=1.0, max_response_length=20)
    with pytest.raises(WorkflowError, match="max_response_length: must be greater"):
        cls(enable_overlong_penalty=True, penalty_factor=1.0, max_response_length=8, cache_length=8)


def test_math_workflow_gives_the_reward_fn_the_response_tokens() -> None:
    from rftstream.experience import Experience
    from tests.unit._util import ScriptedModel, task_for
    from workflows.math_workflow import MathWorkflow

    task = task_for(
        {"question": "1+1=", "answer": "2"},
        workflow="math_workflow",
        default_reward_fn_type="math_dapo_reward",
        reward_fn_args={
            "enable_overlong_penalty": True,
            "penalty_factor": 1.0,
            "max_response_length": 4,
            "cache_length": 2,
        },
    )
    wf = MathWorkflow(task=task, model=ScriptedModel(["\\boxed{2}"]))
    exp = Experience(tokens=[1, 2, 3, 4, 5, 6], prompt_length=3, response_text="\\boxed{2}")
    wf.score_one(exp)  # 3 response tokens: (2 - 3) / 2 * 1.0 = -0.5
    assert exp.metrics == {"accuracy": 1.0, "format_score": -0.5}
    assert exp.reward == pytest.approx(0.5)
