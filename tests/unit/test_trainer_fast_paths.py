"""PolicyTrainer's two savings must not change a step (real DeepSpeed, the tiny model).

* ``old_logprob`` from the gradient pass itself (no no-grad recompute pass) where
  that is provably the same: one optimizer step per batch, no dropout, no KL
  penalty on rewards. A step with it and a step with the recompute pass leave
  the same weights and report the same losses.
* The LM head on the response positions only (``logits_to_keep``): the same
  step as with logits for every position.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from rftstream.experience import EID, Experience
from rftstream.training.engine import PolicyTrainer, _has_active_dropout
from tests.unit.test_trainer_steps import trainer_for


def batch(n: int = 8) -> list[Experience]:
    out = []
    for i in range(n):
        resp = 1 + i % 4
        out.append(
            Experience(
                tokens=[5 + (i % 7), 6, 8] + [7 + ((i + j) % 9) for j in range(resp)],
                prompt_length=3,
                reward=float(i % 2),
                logprobs=[-0.5 - 0.1 * j for j in range(resp)],  # a stale behaviour policy
                advantages=[1.0 - 0.3 * i] * resp,
                eid=EID(0, f"t{i}", 0),
            )
        )
    return out


def grpo(tmp_path: Path, tiny_model_path: str, **trainer: object) -> PolicyTrainer:
    return trainer_for(
        tmp_path,
        tiny_model_path,
        algorithm={
            "algorithm_type": "grpo",
            "kl_loss_fn": "none",
            "policy_loss_fn": "decoupled_ppo",
            "optimizer": {"lr": 1e-2},
        },
        buffer={"train_batch_size": 8},
        trainer={"ppo_micro_batch_size_per_gpu": 4, **trainer},
    )


def params(trainer: PolicyTrainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.engine.module.named_parameters()}


def test_reused_old_logprob_and_kept_logits_give_the_same_step(
    tmp_path: Path, tiny_model_path: str
) -> None:
    fast = grpo(tmp_path / "a", tiny_model_path)
    assert fast.reuse_old_logprob and fast.keep_kwarg == "logits_to_keep"
    slow = grpo(tmp_path / "b", tiny_model_path)
    slow.reuse_old_logprob = False  # the no-grad recompute pass
    slow.keep_kwarg = None  # logits for every position
    before = params(fast)
    for k, v in params(slow).items():
        assert torch.equal(v, before[k])  # same start
    m_fast = fast.train_step(batch())
    m_slow = slow.train_step(batch())
    after_fast, after_slow = params(fast), params(slow)
    assert any(not torch.equal(after_fast[k], before[k]) for k in before)  # it trained
    for k in after_fast:
        torch.testing.assert_close(after_fast[k], after_slow[k], atol=1e-6, rtol=1e-5, msg=k)
    for key in ("actor/pg_loss", "actor/ppo_kl", "actor/behav_imp_weight", "actor/loss"):
        assert abs(m_fast[key] - m_slow[key]) < 1e-5, key
    assert abs(m_fast["actor/ppo_kl"]) < 1e-6  # old_logprob is the current policy's


def test_old_logprob_is_recomputed_when_it_could_differ(
    tmp_path: Path, tiny_model_path: str
) -> None:
    assert not grpo(tmp_path, tiny_model_path, ppo_epochs=2).reuse_old_logprob
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    assert not _has_active_dropout(model)
    model.config.attention_dropout = 0.1  # functional dropout inside attention
    assert _has_active_dropout(model)
    model.config.attention_dropout = 0.0
    model.model.layers[0].mlp.add_module("drop", torch.nn.Dropout(0.2))
    assert _has_active_dropout(model)
