"""Trainer paths end to end, through the real actors, NATS and DeepSpeed on the tiny model.

* ``kl_penalty_fn`` on the rewards with an adaptive coefficient (REINFORCE++,
  advantage in the trainer): the coefficient moves as verl's controller says.
* ``staleness_control``: the trainer hands the strategy its weight version;
  nothing older than ``max_staleness`` is trained.
* ``multi_step_grpo`` on the multi-turn ``env_workflow`` (guess_number): every
  episode's advantage is its group's GRPO score, on the model's tokens only.
* The reference model stays frozen over the steps, and is absent when the
  preset has ``use_reference`` False.
* A spy loss receives exactly the tensors its ``__call__`` names, a custom
  field from a custom sample strategy among them.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, ClassVar

import anyio
import numpy as np
import pytest
import torch

from algorithms import POLICY_LOSS_FN, SAMPLE_STRATEGY, CustomField, PolicyLossFn
from algorithms.sample_strategy import DefaultSampleStrategy, StalenessControlSampleStrategy
from rftstream.config import config_from_dict
from rftstream.experience import decode_group
from rftstream.runtime import prepare_run
from rftstream.training import policy_trainer as engine_mod
from tests.integration._util import read_stream, run_actors_to_end, small_config

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def _run(data: dict, nats_url: str) -> tuple[Any, list[dict]]:
    run = prepare_run(config_from_dict(data))
    steps = run_actors_to_end(run, nats_url, timeout=300)
    assert [r["step"] for r in steps] == [1, 2]
    return run, steps


def _trained(nats_url: str, run: Any) -> list[Any]:
    async def read() -> list[Any]:
        msgs = await read_stream(nats_url, f"rft.{run.names.run}.exp.train")
        return [e for m in msgs for e in decode_group(m.data)]

    return anyio.run(read, backend="asyncio")


# ------------------------------------------------------------------ KL penalty on rewards


def test_kl_penalty_on_rewards_with_an_adaptive_coefficient(
    tmp_path: Path, tiny_model_path: str, nats_url: str
) -> None:
    coef, target, horizon = 0.1, 0.01, 20.0
    data = small_config(tmp_path, tiny_model_path)
    data["name"] = "klpen"
    data["algorithm"].update(
        {
            "algorithm_type": "reinforceplusplus",
            "kl_penalty_fn": "k3",
            "kl_penalty_fn_args": {
                "kl_coef": coef,
                "adaptive": True,
                "target_kl": target,
                "horizon": horizon,
            },
            # an entropy bonus: a gradient at step 1 even when every reward is equal
            "entropy_loss_fn_args": {"entropy_coef": 0.05},
        }
    )
    run, steps = _run(data, nats_url)
    first, second = steps
    # step 1: the policy is the reference, so the KL is exactly 0 and the coefficient applied
    # is the configured one; verl's controller then lowers it: error clip(0 / target - 1) = -0.2
    assert first["critic/kl"] == 0.0
    assert first["critic/kl_coef"] == pytest.approx(coef)
    n1 = first["experience/trained"]
    want = coef * (1.0 + max(min(0.0 / target - 1.0, 0.2), -0.2) * n1 / horizon)
    assert second["critic/kl_coef"] == pytest.approx(want, rel=1e-9)
    # step 2: the policy has moved away from the frozen reference (k3 > 0 off the reference)
    assert math.isfinite(second["critic/kl"]) and second["critic/kl"] > 1e-7
    # the penalty ran on the trainer's KL fn, whose coefficient now holds the next value
    n2 = second["experience/trained"]
    err = max(min(second["critic/kl"] / target - 1.0, 0.2), -0.2)
    assert run.algorithm.kl_penalty_fn.kl_coef == pytest.approx(want * (1 + err * n2 / horizon))
    for record in steps:
        assert math.isfinite(record["advantage/return_mean"])


# ------------------------------------------------------------------ staleness_control

SAMPLED: list[tuple[int, int]] = []


class RecordingStaleness(StalenessControlSampleStrategy):
    """The built-in strategy; records the version the trainer reports at each sample."""

    async def sample(self, step: int) -> tuple[list, dict, list]:
        assert self.current_version is not None, "the trainer did not wire current_version"
        SAMPLED.append((step, int(self.current_version())))
        return await super().sample(step)


def test_staleness_control_gets_the_trainer_version(
    tmp_path: Path, tiny_model_path: str, nats_url: str
) -> None:
    SAMPLED.clear()
    SAMPLE_STRATEGY.register_module("recording_staleness")(RecordingStaleness)
    data = small_config(tmp_path, tiny_model_path)
    data["name"] = "stale"
    # explorers stay at most one version ahead of the trainer's queue, so the taskset
    # cannot run dry on stale rollouts while step 1 trains
    data["synchronizer"]["max_staleness"] = 1
    data["algorithm"].update(
        {"sample_strategy": "recording_staleness", "sample_strategy_args": {"max_staleness": 0}}
    )
    run, steps = _run(data, nats_url)
    # the trainer holds version step - 1 while it samples step `step`
    assert SAMPLED == [(1, 0), (2, 1)]
    for record in steps:
        step = record["step"]
        assert record["sample/min_model_version"] == step - 1
        assert record["sample/model_version/min"] >= step - 1
        assert record["staleness/max"] <= 0  # nothing older than the trainer's version
        assert record["sample/count"] == record["experience/trained"] > 0
        assert record["sample/stale_dropped_total"] >= record["sample/stale_dropped"] >= 0


# ------------------------------------------------------------------ multi-step GRPO, multi-turn


def test_multi_step_grpo_on_a_multi_turn_env_workflow(
    tmp_path: Path, tiny_model_path: str, nats_url: str
) -> None:
    data = small_config(tmp_path, tiny_model_path)
    data["name"] = "msgrpo"
    data["model"].update({"max_prompt_tokens": 48, "max_response_tokens": 80})
    data["buffer"]["explorer_input"]["taskset"] = {
        "path": str(ROOT / "examples" / "data" / "guess_number.jsonl"),
        "rollout_args": {"temperature": 1.0, "max_tokens": 4},
        "default_workflow_type": "env_workflow",
        "workflow_args": {
            "env_type": "guess_number",
            "env_args": {"low": 0, "high": 9},
            "max_env_steps": 3,
        },
    }
    data["algorithm"].update({"algorithm_type": "multi_step_grpo", "repeat_times": 4})
    data["trainer"]["ppo_micro_batch_size_per_gpu"] = 8
    run, steps = _run(data, nats_url)
    for record in steps:
        assert math.isfinite(record["actor/pg_loss"])
    trained = _trained(nats_url, run)
    assert trained
    # several turns: the environment's replies sit inside the response, masked out
    multi_turn = [e for e in trained if int(e.info["env_steps"]) > 1]
    assert multi_turn, "no episode took more than one turn"
    for e in multi_turn:
        mask = e.action_mask.numpy().astype(bool)
        assert mask.any() and not mask.all()
    groups: dict[str, list[Any]] = {}
    for e in trained:
        groups.setdefault(e.eid.tid, []).append(e)
    for group in groups.values():
        rewards = np.array([e.reward for e in group], dtype=np.float64)
        if len(group) > 1:
            scores = (rewards - rewards.mean()) / (rewards.std(ddof=1) + 1e-6)
        else:
            scores = rewards / (1.0 + 1e-6)  # a single rollout: mean 0, std 1
        for e, score in zip(group, scores, strict=True):
            mask = e.action_mask.numpy().astype(np.float64)
            np.testing.assert_allclose(e.advantages.numpy(), score * mask, rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------ reference model; loss spy

CALLS: list[dict[str, Any]] = []
BATCH_REWARDS: list[list[float]] = []


class RewardCopyStrategy(DefaultSampleStrategy):
    """``default`` plus a custom field: each row's reward as ``reward_copy``."""

    custom_fields: ClassVar[tuple[CustomField, ...]] = (
        CustomField("reward_copy", "reward_copy", torch.float32),
    )

    async def sample(self, step: int) -> tuple[list, dict, list]:
        exps, metrics, samples = await super().sample(step)
        for e in exps:
            e.info["reward_copy"] = float(e.reward)
        BATCH_REWARDS.append(sorted(float(e.reward) for e in exps))
        return exps, metrics, samples


class SpyLoss(PolicyLossFn):
    """REINFORCE with a per-row weight; records what the trainer passed."""

    def __call__(  # type: ignore[override]
        self,
        logprob: torch.Tensor,
        old_logprob: torch.Tensor,
        action_mask: torch.Tensor,
        advantages: torch.Tensor,
        reward_copy: torch.Tensor,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, dict]:
        CALLS.append(
            {
                "extra": sorted(kwargs),
                "shapes": [tuple(t.shape) for t in (logprob, old_logprob, action_mask, advantages)],
                "reward_copy": reward_copy.tolist(),
                "grad": logprob.requires_grad and not old_logprob.requires_grad,
            }
        )
        mask = action_mask.to(logprob.dtype)
        loss = -(advantages * logprob * mask).sum() / mask.sum().clamp(min=1)
        return loss, {"spy_loss": float(loss.detach())}


TRAINERS: list[Any] = []


class CapturedTrainer(engine_mod.PolicyTrainer):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        TRAINERS.append(self)


def test_loss_gets_exactly_its_tensors_and_the_reference_stays_frozen(
    tmp_path: Path, tiny_model_path: str, nats_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import AutoModelForCausalLM

    CALLS.clear()
    BATCH_REWARDS.clear()
    TRAINERS.clear()
    POLICY_LOSS_FN.register_module("spy_loss")(SpyLoss)
    SAMPLE_STRATEGY.register_module("reward_copy")(RewardCopyStrategy)
    monkeypatch.setattr(engine_mod, "PolicyTrainer", CapturedTrainer)
    data = small_config(tmp_path, tiny_model_path)
    data["name"] = "spyref"
    data["algorithm"].update(
        {"algorithm_type": "grpo", "policy_loss_fn": "spy_loss", "sample_strategy": "reward_copy"}
    )
    data["trainer"]["ppo_micro_batch_size_per_gpu"] = 4  # 8 rows a step: 2 micro-batches
    run, steps = _run(data, nats_url)

    assert len(CALLS) == 4  # 2 steps x 2 micro-batches
    for call in CALLS:
        assert call["extra"] == []  # nothing beyond the names in the signature
        assert call["grad"]
        b, r = call["shapes"][0]
        assert call["shapes"] == [(b, r)] * 4 and len(call["reward_copy"]) == b
    per_step = [sorted(CALLS[0]["reward_copy"] + CALLS[1]["reward_copy"])]
    per_step.append(sorted(CALLS[2]["reward_copy"] + CALLS[3]["reward_copy"]))
    assert per_step == BATCH_REWARDS
    for record in steps:
        assert "actor/spy_loss" in record and "actor/kl_loss" in record

    (trainer,) = TRAINERS
    assert trainer.ref_model is not None
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_path, torch_dtype=torch.float32)
    start = initial.state_dict()
    ref = trainer.ref_model.state_dict()
    assert set(ref) == set(start)
    assert all(torch.equal(ref[k].cpu(), start[k]) for k in start)  # frozen over both steps
    assert not any(p.requires_grad for p in trainer.ref_model.parameters())
    policy = trainer.engine.module.state_dict()
    assert any(not torch.equal(policy[k].cpu(), start[k]) for k in start)  # the policy trained


def test_no_reference_model_without_use_reference(
    tmp_path: Path, tiny_model_path: str, nats_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    TRAINERS.clear()
    monkeypatch.setattr(engine_mod, "PolicyTrainer", CapturedTrainer)
    data = small_config(tmp_path, tiny_model_path)
    data["name"] = "noref"
    data["algorithm"].update({"algorithm_type": "dapo", "repeat_times": 4})
    run, steps = _run(data, nats_url)
    assert run.algorithm.use_reference is False
    (trainer,) = TRAINERS
    assert trainer.ref_model is None
    for record in steps:
        assert "actor/kl_loss" not in record and math.isfinite(record["actor/pg_loss"])
