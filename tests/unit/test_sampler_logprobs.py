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

from rftstream.experience import EID, Experience, decode_group, encode_group
from rftstream.training.batch import TokenBan, collate, response_token_stats, target_logprobs
from rftstream.training.policy_trainer import PolicyTrainer
from tests.unit.test_trainer_fast_paths import grpo as decoupled  # decoupled_ppo, batch 12

PROMPTS = [[5, 6, 8], [9, 10], [11, 12, 13, 14]]


def masked_stats(logits: torch.Tensor, ids: torch.Tensor, at: torch.Tensor) -> dict:
    """The sampler's distribution built the plain way: the banned ids set to -inf where
    ``at`` holds, then the log-softmax; its log-probs over the vocabulary, entropy and
    ``nec`` per position (differentiable)."""
    ban = torch.zeros(logits.shape, dtype=torch.bool)
    for index in at.nonzero().tolist():
        for t in ids[tuple(index)].tolist():
            if t >= 0:
                ban[(*index, t)] = True
    lp = torch.log_softmax(logits.masked_fill(ban, -torch.inf), -1)
    p = lp.exp()
    finite = lp.masked_fill(ban, 0.0)
    entropy = -(p * finite).sum(-1)
    p2 = p * p
    return {"all": lp, "entropy": entropy, "nec": entropy * p2.sum(-1) + (p2 * finite).sum(-1)}


def test_the_sampler_distribution_leaves_the_banned_ids_out() -> None:
    """Per token: the log-prob, entropy, ``nec`` and their gradients are those of the
    distribution without the banned ids where the token was sampled under the ban, the
    model's elsewhere (both ways of measuring the kept mass: under and over half banned,
    one and two banned ids); the mass outside the banned ids is all of it (0)."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 5, 11, generator=gen, dtype=torch.float64)
    logits[0, :, 2] += 6.0  # the end token holds most of the mass in row 0
    logits[2, :3, 2] += 6.0  # and at row 2's first three tokens; elsewhere a little
    logits[1, 0, 2] += 3.0  # row 1 bans 2 and 7: together over half at its first token
    logits[1, 0, 7] += 3.0
    logits.requires_grad_(True)
    targets = torch.randint(3, 11, (3, 5), generator=gen)
    ids = torch.tensor([[2, -1], [2, 7], [-1, 2]])[:, None, :].expand(-1, 5, -1)
    at = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    probs = torch.softmax(logits.detach(), -1).gather(-1, ids.clamp(min=0))
    p_banned = probs.mul(ids >= 0).sum(-1)[at]
    assert bool((p_banned > 0.5).any()) and bool((p_banned < 0.5).any())
    assert float(p_banned[3]) > 0.5  # row 1, token 0: two ids, over half
    want = masked_stats(logits, ids, at)
    want_logp = want["all"].gather(-1, targets[..., None]).squeeze(-1)

    ban = TokenBan(ids, at, exclude=True)
    logp, entropy, allowed = target_logprobs(logits, targets, 1.0, with_entropy=True, ban=ban)
    assert entropy is not None and allowed is not None and allowed.abs().sum() == 0.0
    assert torch.allclose(logp, want_logp, atol=1e-12)
    assert torch.allclose(entropy, want["entropy"], atol=1e-12)
    # the gradients too (a weighted sum, so each position's share counts), to the logits
    weights = torch.randn(3, 5, generator=gen, dtype=torch.float64)
    (got,) = torch.autograd.grad((weights * (logp + 0.3 * entropy)).sum(), logits)
    (ref,) = torch.autograd.grad((weights * (want_logp + 0.3 * want["entropy"])).sum(), logits)
    assert torch.allclose(got, ref, atol=1e-12)
    # where banned, no gradient reaches the banned ids' logits
    for b, r in at.nonzero().tolist():
        for t in ids[b, r].tolist():
            if t >= 0:
                assert abs(float(got[b, r, t])) < 1e-12

    model_logp, _, model_allowed = target_logprobs(
        logits, targets, 1.0, with_entropy=False, ban=TokenBan(ids, at)
    )
    assert model_allowed is not None
    assert torch.allclose(logp[~at], model_logp[~at], atol=1e-12)
    assert torch.allclose(logp[at], (model_logp - model_allowed)[at], atol=1e-10)
    (model_grad,) = torch.autograd.grad(model_logp.sum(), logits)
    assert model_grad[0, 0, 2] < -0.5  # the model's log-probs push the end token down

    # the no-grad statistics pass (rows, per-row ban ids) gives the same values, nec too
    stats = response_token_stats(
        torch.cat([logits.detach(), torch.zeros(3, 1, 11, dtype=torch.float64)], 1),  # t: t + 1
        torch.cat([torch.ones(3, 1, dtype=torch.long), targets], 1),
        1,
        1.0,
        with_nec=True,
        ban=TokenBan(ids[:, 0], at, exclude=True),
    )
    # (float32: the pass casts its logits)
    assert torch.allclose(stats.logprob.double(), want_logp.detach(), atol=1e-5)
    assert torch.allclose(stats.entropy.double(), want["entropy"].detach(), atol=1e-5)
    assert stats.nec is not None
    assert torch.allclose(stats.nec.double(), want["nec"].detach(), atol=1e-5)
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


@pytest.mark.parametrize("path", ["lean_shared", "lean", "hf_shared", "hf"])
@pytest.mark.parametrize("logprobs_of", ["sampler", "model"])
def test_every_pass_of_every_path_measures_the_chosen_distribution(
    tmp_path: Path, tiny_model_path: str, path: str, logprobs_of: str
) -> None:
    """The gradient pass's log-probs and entropies, the reference pass's log-probs and the
    token-statistics pass of every path equal the HF model's log-softmax with the end token
    masked where it was banned (``sampler``) or not (``model``); with every token sampled
    under the ban, ``sampler`` sends no gradient to the end token's row."""
    lean = path.startswith("lean")
    trainer = decoupled(
        tmp_path, tiny_model_path, lean_forward=lean, share_prompts=path.endswith("shared")
    )
    trainer.sampler_logprobs = logprobs_of == "sampler"
    assert bool(trainer._lean) == lean
    end = int(trainer.tokenizer.eos_token_id)
    exps = banned_rollouts(trainer, banned_tokens=99)
    batch = collate(exps, trainer.pad_token_id, temperature=trainer.temperature)
    model = trainer.engine.module
    logp, entropy, _ = trainer._forward(model, batch, with_entropy=True)
    assert entropy is not None
    embeddings = model.get_input_embeddings().weight
    (grad,) = torch.autograd.grad(logp.sum(), embeddings)
    reference = trainer._logprobs_no_grad(model, batch)  # as for a reference model
    stats = trainer._token_stats_no_grad(batch, with_nec=False)
    for row, e in enumerate(exps):
        prompt, response = e.tokens[: e.prompt_length], e.tokens[e.prompt_length :]
        with torch.no_grad():
            logits = model(input_ids=e.tokens[None].long()).logits[0, len(prompt) - 1 : -1]
        if logprobs_of == "sampler":
            logits = logits.clone()
            logits[:, end] = -torch.inf
        lp_all = torch.log_softmax(logits, -1)
        lp = lp_all.gather(-1, response[:, None].long()).squeeze(-1)
        ent = -(lp_all.exp() * lp_all.masked_fill(torch.isinf(lp_all), 0.0)).sum(-1)
        n = len(response)
        for name, got in [
            ("logprob", logp[row, :n].detach()),
            ("reference", reference[row, :n]),
            ("stats", stats.logprob[row, :n]),
        ]:
            assert torch.allclose(got, lp, atol=1e-4), (name, row, got, lp)
        for name, got in [
            ("entropy", entropy[row, :n].detach()),
            ("stats", stats.entropy[row, :n]),
        ]:
            assert torch.allclose(got, ent, atol=1e-4), (name, row, got, ent)
    # the end token is never an input here: its row's gradient comes from the softmax only
    assert all(end not in e.tokens.tolist() for e in exps)
    if logprobs_of == "sampler":
        assert grad[end].abs().max() < 1e-6  # zero, to float32 rounding
    else:
        assert grad[end].abs().max() > 1e-3


def test_rows_whose_rollout_logprobs_cannot_serve_keep_their_ban(tiny_model_path: str) -> None:
    """A row flagged inexact (or sampled at another temperature) gets no behaviour weight,
    but its tokens were still drawn under the ban: the batch keeps where."""
    inexact = Experience(
        tokens=[1, 2, 3, 4, 5],
        prompt_length=2,
        logprobs=[-1.0, -2.0, -3.0],
        allowed_logprobs=[-9.5, -0.25, 0.0],
        banned_ids=[4],
        info={"logprobs_exact": False},
    )
    batch = collate([inexact], pad_token_id=0, temperature=1.0)
    assert batch.rollout_logprob_mask.sum() == 0.0
    ban = batch.token_ban()
    assert ban is not None and ban.at.tolist() == [[True, True, False]]


def test_a_ban_the_trainer_cannot_train_is_refused_by_name(
    tmp_path: Path, tiny_model_path: str
) -> None:
    """``check_experience`` (the trainer's dead-letter check) names bad ``banned_ids``."""
    trainer = decoupled(tmp_path, tiny_model_path)

    def exp(banned: list[int], tokens: list[int] | None = None) -> Experience:
        return Experience(
            tokens=tokens or [5, 6, 20, 21, 22],
            prompt_length=2,
            logprobs=[-1.0, -1.0, -1.0],
            allowed_logprobs=[-0.5, -0.5, 0.0],
            banned_ids=banned,
            eid=EID(0, "t", 0),
        )

    assert trainer.check_experience(exp([2])) is None
    assert "banned_ids outside" in (trainer.check_experience(exp([trainer.vocab_size])) or "")
    assert "repeats an id" in (trainer.check_experience(exp([2, 2])) or "")
    # token 21 drawn at the second response position, where 21 was banned
    assert "[21] were drawn" in (trainer.check_experience(exp([2, 21])) or "")
    # the same read off the wire, as the trainer's feed gets it
    (wired,) = decode_group(encode_group([exp([2, 21])]))
    assert "[21] were drawn" in (trainer.check_experience(wired) or "")
    # token 22 at the third position, after the ban: fine
    assert trainer.check_experience(exp([2, 22])) is None
