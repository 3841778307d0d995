"""Behaviour weights of tokens sampled under a ban (``min_tokens``), on the tiny model and
real DeepSpeed.

The sampler may not draw an end token before ``min_tokens``; the log-probs it records are
the unbanned distribution's (vLLM's raw convention, what the trainer computes). Where the
model would end with probability near 1, a drawn token's unbanned log-prob is near -20,
so the unbanned ratio ``pi(a) / mu(a)`` measures how the end token's mass moved, not how
the sampled distribution did: up to e^20. ``Completion.allowed_logprobs`` (the
behaviour's ``log(1 - mu(banned))``) and the trainer's own ``log(1 - pi(banned))`` turn
it into the ratio of the two banned distributions.

Here the behaviour policy is the trainer's own with the end token's logit raised by
``BOOST`` at every position: the banned (sampled) distributions are then the same, the
true weight of every token is 1, and the unbanned ratio is ``(1 - mu(end)) / (1 -
pi(end))``, far above the cap.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rftstream.experience import EID, Experience, decode_group, encode_group
from rftstream.training.batch import allowed_logprob, collate
from rftstream.training.policy_trainer import PolicyTrainer
from tests.unit.test_trainer_fast_paths import grpo as decoupled  # decoupled_ppo, batch 12

BOOST = 12.0  # the behaviour's extra logit on the end token
BANNED_TOKENS = 4  # the first four response tokens of each row were sampled under the ban
PROMPTS = [[5, 6, 8], [9, 10], [11, 12, 13, 14]]


def boosted_rollouts(trainer: PolicyTrainer, *, with_ban: bool = True) -> list[Experience]:
    """Twelve rows of three groups whose rollout log-probs are those of the trainer's
    policy with the end token boosted, as a sampler banning it for the first
    :data:`BANNED_TOKENS` tokens would record them."""
    model = trainer.engine.module
    end = int(trainer.tokenizer.eos_token_id)
    out = []
    for i in range(12):
        prompt = PROMPTS[i // 4]
        response = [20 + (7 * i + 3 * j) % 40 for j in range(6 + i % 3)]
        seq = torch.tensor([prompt + response])
        with torch.no_grad():
            logits = model(input_ids=seq).logits[0, len(prompt) - 1 : -1].double()
        logits[:, end] += BOOST
        logp = torch.log_softmax(logits, -1)
        raw = logp.gather(-1, torch.tensor(response)[:, None]).squeeze(-1)
        allowed = torch.log1p(-logp[:, end].exp())
        allowed[BANNED_TOKENS:] = 0.0
        # after the ban the behaviour sampled from the policy itself
        with torch.no_grad():
            own = torch.log_softmax(model(input_ids=seq).logits[0, len(prompt) - 1 : -1], -1)
        own_raw = own.gather(-1, torch.tensor(response)[:, None]).squeeze(-1)
        rollout = torch.cat([raw[:BANNED_TOKENS].float(), own_raw[BANNED_TOKENS:]])
        out.append(
            Experience(
                tokens=prompt + response,
                prompt_length=len(prompt),
                reward=float(i % 2),
                logprobs=rollout,
                advantages=[1.0 - 0.2 * i] * len(response),
                eid=EID(0, f"t{i // 4}", i),
                allowed_logprobs=allowed.float() if with_ban else None,
                banned_ids=[end] if with_ban else None,
            )
        )
    return out


def test_the_allowed_mass_is_exact_at_both_ends() -> None:
    """``log(1 - p(banned))`` where the banned token holds nearly all the mass (the case
    the fix is for: ``1 - p`` there is rounding) and where it holds almost none."""
    logits = torch.zeros(3, 50, dtype=torch.float64)
    logits[0, 7] = 25.0  # p(7) = 1 - 49 e^-25: log(1 - p) = log(49) - 25
    logits[1, 7] = -25.0  # p(7) tiny
    logits[2, 7], logits[2, 9] = 3.0, 2.0  # two banned ids, a middling mass
    ids = torch.tensor([[7, -1], [7, -1], [7, 9]])
    got = allowed_logprob(torch.log_softmax(logits.float(), -1), ids)
    p = torch.softmax(logits, -1)
    want = torch.stack(
        [
            torch.log(p[0].sum() - p[0, 7]),  # float64: exact enough here
            torch.log1p(-p[1, 7]),
            torch.log(1 - p[2, 7] - p[2, 9]),
        ]
    )
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    assert got[0] == pytest.approx(torch.log(torch.tensor(49.0)).item() - 25.0, abs=1e-4)


def test_the_fields_travel_and_collate(tmp_path: Path, tiny_model_path: str) -> None:
    exp = Experience(
        tokens=[1, 2, 3, 4, 5],
        prompt_length=2,
        logprobs=[-1.0, -2.0, -3.0],
        allowed_logprobs=[-9.5, -0.25, 0.0],
        banned_ids=[4, 0],
    )
    (back,) = decode_group(encode_group([exp]))
    assert back.allowed_logprobs.tolist() == [-9.5, -0.25, 0.0]
    assert back.banned_ids.tolist() == [4, 0] and back.banned_ids.dtype == torch.int32
    plain = Experience(tokens=[1, 2, 3], prompt_length=2, logprobs=[-1.0])
    (again,) = decode_group(encode_group([plain]))
    assert again.allowed_logprobs is None and again.banned_ids is None
    batch = collate([back, again], pad_token_id=0)
    assert batch.ban_ids is not None and batch.ban_ids.tolist() == [[4, 0], [-1, -1]]
    assert batch.rollout_allowed is not None
    assert batch.rollout_allowed.tolist() == [[-9.5, -0.25, 0.0], [0.0, 0.0, 0.0]]
    ban = batch.token_ban()
    assert ban is not None and ban.at.tolist() == [[True, True, False], [False, False, False]]
    # the behaviour log-probs in the policy's terms: rollout - mu's mass + pi's mass
    policy = torch.tensor([[-1.0, -0.5, -7.0], [-3.0, -3.0, -3.0]])
    assert batch.behaviour_logprobs(policy).tolist() == [
        [-1.0 + 9.5 - 1.0, -2.0 + 0.25 - 0.5, -3.0],
        [-1.0, 0.0, 0.0],
    ]
    assert collate([plain], pad_token_id=0).token_ban() is None


@pytest.mark.parametrize("logprobs_of", ["sampler", "model"])
@pytest.mark.parametrize(
    "setup",
    ["reused_lean_shared", "recomputed_lean", "reused_hf", "recomputed_hf"],
)
def test_tokens_drawn_under_a_ban_weigh_what_the_banned_distributions_say(
    tmp_path: Path, tiny_model_path: str, setup: str, logprobs_of: str
) -> None:
    """Every path that measures ``old_logprob`` (the gradient pass's own, or a no-grad
    pass; the lean forward with shared prompts, or the HF forward) gives weight 1 to every
    token, where the unbanned ratio would be capped at 2 on every banned token: with the
    sampler's log-probs (``algorithm.logprobs_of: sampler``, the banned ids left out of
    both sides) and with the model's (the behaviour's corrected by both banned masses)."""
    lean = setup.endswith(("lean", "lean_shared"))
    trainer = decoupled(tmp_path, tiny_model_path, lean_forward=lean)
    assert trainer.sampler_logprobs  # the default
    trainer.sampler_logprobs = logprobs_of == "sampler"
    if setup.startswith("recomputed"):
        trainer.reuse_old_logprob = False
    assert trainer.reuse_old_logprob == setup.startswith("reused")
    assert bool(trainer._lean) == lean
    out = trainer.train_step(boosted_rollouts(trainer))
    assert out["actor/behav_imp_weight_max"] == pytest.approx(1.0, abs=2e-3)
    assert out["actor/behav_imp_weight"] == pytest.approx(1.0, abs=1e-3)
    assert out["actor/behav_imp_weight_capped_frac"] == 0.0


def test_without_the_banned_mass_the_same_tokens_hit_the_cap(
    tmp_path: Path, tiny_model_path: str
) -> None:
    """The same rollouts without ``allowed_logprobs``: what every run with ``min_tokens``
    trained on before (the check above could not pass by accident)."""
    trainer = decoupled(tmp_path, tiny_model_path)
    out = trainer.train_step(boosted_rollouts(trainer, with_ban=False))
    assert out["actor/behav_imp_weight_max"] > 100.0
    # the banned tokens of each row (4 of 6-8) were capped
    assert out["actor/behav_imp_weight_capped_frac"] > 0.4
