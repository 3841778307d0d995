"""PolicyTrainer's savings must not change a step (real DeepSpeed, the tiny model).

* ``old_logprob`` from the gradient pass itself (no no-grad recompute pass) where
  that is provably the same: one optimizer step per batch, no dropout, no KL
  penalty on rewards.
* The LM head on the response positions only (``logits_to_keep``).
* Rows with the same prompt (a group) share its forward pass (``trainer.share_prompts``):
  the prompt runs once, its KV cache is repeated for every row, the responses run on
  top; left-padded prompts of several lengths, responses of several lengths.

A step with all of them and a step with none leave the same weights and report the
same losses.
"""

from __future__ import annotations

from pathlib import Path

import torch

from rftstream.experience import EID, Experience
from rftstream.training.policy_trainer import PolicyTrainer, _has_active_dropout
from tests.unit.test_trainer_steps import trainer_for

PROMPTS = [[5, 6, 8], [9, 10], [11, 12, 13, 14]]  # three groups, prompts of three lengths


def batch(n: int = 12) -> list[Experience]:
    out = []
    for i in range(n):
        resp = 1 + i % 4
        prompt = PROMPTS[i // 4]
        out.append(
            Experience(
                tokens=prompt + [7 + ((i + j) % 9) for j in range(resp)],
                prompt_length=len(prompt),
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
        buffer={"train_batch_size": 12},
        trainer={"ppo_micro_batch_size_per_gpu": 6, "balance_batch": False, **trainer},
    )


def params(trainer: PolicyTrainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.engine.module.named_parameters()}


def test_reused_old_logprob_kept_logits_and_shared_prompts_give_the_same_step(
    tmp_path: Path, tiny_model_path: str
) -> None:
    fast = grpo(tmp_path / "a", tiny_model_path, lean_forward=False)  # the HF forward's savings
    assert fast.reuse_old_logprob and fast.keep_kwarg == "logits_to_keep" and fast.share_prompts
    slow = grpo(tmp_path / "b", tiny_model_path, share_prompts=False, lean_forward=False)
    assert not slow.share_prompts
    slow.reuse_old_logprob = False  # the no-grad recompute pass
    slow.keep_kwarg = None  # logits for every position
    shared: list[int] = []
    forward_shared = fast._forward_shared
    fast._forward_shared = lambda *a, **k: shared.append(1) or forward_shared(*a, **k)  # type: ignore[method-assign]
    before = params(fast)
    for k, v in params(slow).items():
        assert torch.equal(v, before[k])  # same start
    m_fast = fast.train_step(batch())
    m_slow = slow.train_step(batch())
    assert shared == [1, 1]  # both micro-batches (rows 0-5, 6-11) share their prompts
    after_fast, after_slow = params(fast), params(slow)
    assert any(not torch.equal(after_fast[k], before[k]) for k in before)  # it trained
    # one Adam step moves every weight by about lr (2e-4) whatever its gradient's size, so
    # a gradient near zero whose rounding differs between the two forwards (kept logits,
    # shared prompts) moves by a different fraction of it: 1.7e-6 seen on an AMD EPYC;
    # a real difference (another old_logprob, another loss) moves weights by lr
    for k in after_fast:
        torch.testing.assert_close(after_fast[k], after_slow[k], atol=1e-5, rtol=1e-5, msg=k)
    for key in ("actor/pg_loss", "actor/ppo_kl", "actor/behav_imp_weight", "actor/loss"):
        assert abs(m_fast[key] - m_slow[key]) < 1e-5, key
    assert abs(m_fast["actor/ppo_kl"]) < 1e-6  # old_logprob is the current policy's


def test_old_logprob_is_recomputed_when_it_could_differ(
    tmp_path: Path, tiny_model_path: str
) -> None:
    assert not grpo(tmp_path, tiny_model_path, ppo_epochs=2).reuse_old_logprob
    from transformers import AutoModelForCausalLM  # here: grpo() is used where it must stay out

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    assert not _has_active_dropout(model)
    model.config.attention_dropout = 0.1  # functional dropout inside attention
    assert _has_active_dropout(model)
    model.config.attention_dropout = 0.0
    model.model.layers[0].mlp.add_module("drop", torch.nn.Dropout(0.2))
    assert _has_active_dropout(model)
