"""The trainer's log-probs of tokens sampled under a ban (``min_tokens``), on the tiny model
and real DeepSpeed: ``algorithm.logprobs_of``.

Before ``min_tokens`` the sampler draws from the model's distribution with the end and stop
tokens left out. ``sampler`` (the default) trains the log-probs of that distribution,
``log p(a) - log(1 - p(banned))``, so the policy gradient is the one of the policy that
sampled; ``model`` trains the model's log-probs over the whole vocabulary, as TRL and verl
do, whose gradient also moves the banned tokens' logits at positions where they could not
be drawn.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rftstream.experience import EID, Experience
from rftstream.training.batch import TokenBan, collate, response_token_stats, target_logprobs
from rftstream.training.policy_trainer import PolicyTrainer
from tests.unit.test_trainer_fast_paths import grpo as decoupled  # decoupled_ppo, batch 12

PROMPTS = [[5, 6, 8], [9, 10], [11, 12, 13, 14]]


def masked_reference(
    logits: torch.Tensor, ids: torch.Tensor, at: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs over the vocabulary and entropy of the sampler's distribution, one position
    at a time: the banned ids set to -inf where ``at`` holds."""
    flat, ban_ids, where = (
        logits.reshape(-1, logits.shape[-1]),
        ids.reshape(-1, ids.shape[-1]),
        at.reshape(-1),
    )
    rows, entropies = [], []
    for i in range(flat.shape[0]):
        row = flat[i].clone()
        if bool(where[i]):
            for t in ban_ids[i].tolist():
                if t >= 0:
                    row[t] = -torch.inf
        lp = torch.log_softmax(row, -1)
        rows.append(lp)
        p = lp.exp()
        entropies.append(-(p * torch.where(p > 0, lp, torch.zeros_like(lp))).sum())
    return torch.stack(rows).view(logits.shape), torch.stack(entropies).view(at.shape)


def test_the_sampler_distribution_leaves_the_banned_ids_out() -> None:
    """Per token: the log-prob and entropy of the distribution without the banned ids where
    the token was sampled under the ban, the model's elsewhere; no gradient reaches a
    banned id's logit there; the mass outside the banned ids is all of it (0)."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 5, 11, generator=gen, dtype=torch.float64)
    logits[0, :, 2] += 6.0  # the end token holds most of the mass in row 0
    logits[2, :3, 2] += 6.0  # and at row 2's first three tokens; elsewhere a little
    logits.requires_grad_(True)
    targets = torch.randint(3, 11, (3, 5), generator=gen)
    ids = torch.tensor([[2, -1], [2, 7], [-1, 2]])[:, None, :].expand(-1, 5, -1)
    at = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    ban = TokenBan(ids, at, exclude=True)
    p_banned = (
        torch.softmax(logits.detach(), -1).gather(-1, ids.clamp(min=0)).mul(ids >= 0).sum(-1)[at]
    )
    # both ways of measuring the kept mass run: log1p(-p) and the masked rows' log-sum-exp
    assert bool((p_banned > 0.5).any()) and bool((p_banned < 0.5).any())
    logp, entropy, allowed = target_logprobs(logits, targets, 1.0, with_entropy=True, ban=ban)
    lp_all, want_entropy = masked_reference(logits.detach(), ids, at)
    want = lp_all.gather(-1, targets[..., None]).squeeze(-1)
    assert torch.allclose(logp.detach(), want, atol=1e-12)
    assert entropy is not None and torch.allclose(entropy, want_entropy, atol=1e-12)
    assert allowed is not None and allowed.abs().sum() == 0.0
    model_logp, _, model_allowed = target_logprobs(
        logits, targets, 1.0, with_entropy=False, ban=TokenBan(ids, at)
    )
    # unbanned positions: the model's log-probs; banned ones: minus the model's allowed mass
    assert torch.allclose(logp.detach()[~at], model_logp.detach()[~at], atol=1e-12)
    assert model_allowed is not None
    assert torch.allclose(logp.detach()[at], (model_logp - model_allowed).detach()[at], atol=1e-10)
    (grad,) = torch.autograd.grad(logp.sum(), logits)
    for b, r in at.nonzero().tolist():
        for t in ids[b, r].tolist():
            if t >= 0:
                assert abs(float(grad[b, r, t])) < 1e-12  # zero, to rounding
    (model_grad,) = torch.autograd.grad(model_logp.sum(), logits)
    assert model_grad[0, 0, 2] < -0.5  # the model's log-probs push the end token down
    # the no-grad statistics pass (rows, per-row ban ids) gives the same values
    stats = response_token_stats(
        torch.cat([logits.detach(), torch.zeros(3, 1, 11, dtype=torch.float64)], 1),  # t: t + 1
        torch.cat([torch.ones(3, 1, dtype=torch.long), targets], 1),
        1,
        1.0,
        ban=TokenBan(ids[:, 0], at, exclude=True),
    )
    assert torch.allclose(stats.logprob.double(), want, atol=1e-6)
    assert torch.allclose(stats.entropy.double(), want_entropy, atol=1e-6)
    assert stats.allowed is not None and stats.allowed.abs().sum() == 0.0


def banned_rollouts(trainer: PolicyTrainer, banned_tokens: int) -> list[Experience]:
    """Twelve rows of three groups, their first ``banned_tokens`` response tokens sampled
    with the end token banned (``allowed_logprobs`` < 0 there)."""
    end = int(trainer.tokenizer.eos_token_id)
    out = []
    for i in range(12):
        prompt = PROMPTS[i // 4]
        response = [20 + (7 * i + 3 * j) % 40 for j in range(6 + i % 3)]
        allowed = [-0.5 if j < banned_tokens else 0.0 for j in range(len(response))]
        out.append(
            Experience(
                tokens=prompt + response,
                prompt_length=len(prompt),
                reward=float(i % 2),
                logprobs=[-3.0] * len(response),
                advantages=[1.0 - 0.2 * i] * len(response),
                eid=EID(0, f"t{i // 4}", i),
                allowed_logprobs=allowed,
                banned_ids=[end],
            )
        )
    return out


@pytest.mark.parametrize("path", ["lean_shared", "lean", "hf"])
@pytest.mark.parametrize("logprobs_of", ["sampler", "model"])
def test_every_forward_path_trains_the_chosen_distribution(
    tmp_path: Path, tiny_model_path: str, path: str, logprobs_of: str
) -> None:
    """The gradient pass's log-probs of every path equal the HF model's log-softmax with the
    end token masked where it was banned (``sampler``) or not (``model``); with every
    token sampled under the ban, ``sampler`` sends no gradient to the end token's row."""
    trainer = decoupled(
        tmp_path, tiny_model_path, lean_forward=path != "hf", share_prompts=path == "lean_shared"
    )
    trainer.sampler_logprobs = logprobs_of == "sampler"
    assert bool(trainer._lean) == (path != "hf")
    end = int(trainer.tokenizer.eos_token_id)
    exps = banned_rollouts(trainer, banned_tokens=99)
    batch = collate(exps, trainer.pad_token_id, temperature=trainer.temperature)
    model = trainer.engine.module
    logp, entropy, _ = trainer._forward(model, batch, with_entropy=True)
    assert entropy is not None
    embeddings = model.get_input_embeddings().weight
    (grad,) = torch.autograd.grad(logp.sum(), embeddings)
    for row, e in enumerate(exps):
        prompt, response = e.tokens[: e.prompt_length], e.tokens[e.prompt_length :]
        with torch.no_grad():
            logits = model(input_ids=e.tokens[None].long()).logits[0, len(prompt) - 1 : -1]
        if logprobs_of == "sampler":
            logits = logits.clone()
            logits[:, end] = -torch.inf
        lp = torch.log_softmax(logits, -1).gather(-1, response[:, None].long()).squeeze(-1)
        got = logp[row, : len(response)].detach()
        assert torch.allclose(got, lp, atol=1e-4), (row, got, lp)
    # the end token is never an input here: its row's gradient comes from the softmax only
    assert all(end not in e.tokens.tolist() for e in exps)
    if logprobs_of == "sampler":
        assert grad[end].abs().max() < 1e-6  # zero, to float32 rounding
    else:
        assert grad[end].abs().max() > 1e-3


@pytest.mark.parametrize("logprobs_of", ["sampler", "model"])
def test_a_training_step_keeps_the_behaviour_weights_at_one(
    tmp_path: Path, tiny_model_path: str, logprobs_of: str
) -> None:
    """Rollout log-probs that are the policy's own under the ban give ``w`` = 1 in either
    mode (each compares like with like), and a step runs."""
    trainer = decoupled(tmp_path, tiny_model_path)
    trainer.sampler_logprobs = logprobs_of == "sampler"
    end = int(trainer.tokenizer.eos_token_id)
    exps = banned_rollouts(trainer, banned_tokens=4)
    model = trainer.engine.module
    for e in exps:  # the policy's own log-probs, as the sampler under the ban records them
        p = e.prompt_length
        with torch.no_grad():
            lp_all = torch.log_softmax(
                model(input_ids=e.tokens[None].long()).logits[0, p - 1 : -1], -1
            )
        response = e.tokens[p:].long()
        raw = lp_all.gather(-1, response[:, None]).squeeze(-1)
        allowed = torch.log1p(-lp_all[:, end].exp())
        allowed[4:] = 0.0
        e.logprobs, e.allowed_logprobs = raw.float(), allowed.float()
    out = trainer.train_step(exps)
    assert out["actor/behav_imp_weight_max"] == pytest.approx(1.0, abs=2e-3)
    assert out["actor/behav_imp_weight_capped_frac"] == 0.0
    assert torch.isfinite(torch.tensor(out["actor/loss"]))
