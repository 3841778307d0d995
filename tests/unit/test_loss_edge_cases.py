"""Edge cases of the SFT, OPMD and MIX losses and of the KL loss, against numpy references.

Empty batches, fully masked rows, MIX's sequence-level SFT term and its inner
PPO loss under every aggregation mode; ``calculate_kl_loss`` for k3, abs and
corrected_k3 (with ``old_logprob``). References are written here in numpy.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from algorithms import KL_FN
from algorithms.policy_loss_fn import MIXPolicyLossFn, OPMDPolicyLossFn, SFTLossFn

MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


def t(x, dtype=torch.float64) -> torch.Tensor:
    return torch.tensor(np.asarray(x), dtype=dtype)


def np_agg(v: np.ndarray, m: np.ndarray, mode: str) -> float:
    """verl's aggregation; fully masked rows left out of the seq means; nothing: 0."""
    m = m.astype(bool)
    if not m.any():
        return 0.0
    if mode == "token-mean":
        return float(v[m].sum() / m.sum())
    if mode == "seq-mean-token-sum-norm":
        return float(v[m].sum() / v.shape[-1])
    per_row = []
    for i in range(v.shape[0]):
        if m[i].any():
            s = v[i][m[i]].sum()
            per_row.append(s if mode == "seq-mean-token-sum" else s / m[i].sum())
    return float(np.mean(per_row))


def np_ppo_tokens(lp, old, adv, low=0.2, high=0.2, c=3.0) -> np.ndarray:
    ratio = np.exp(np.clip(lp - old, -20, 20))
    l1 = -adv * ratio
    l2 = -adv * np.clip(ratio, 1 - low, 1 + high)
    c1 = np.maximum(l1, l2)
    return np.where(adv < 0, np.minimum(-adv * c, c1), c1)


# ------------------------------------------------------------------ empty batches


def _empty(width: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(0, width, dtype=torch.float64, requires_grad=True), torch.zeros(
        0, width, dtype=torch.bool
    )


@pytest.mark.parametrize("token_level", [True, False])
def test_sft_empty_batch(token_level: bool) -> None:
    lp, mask = _empty()
    loss, metrics = SFTLossFn(use_token_level_loss=token_level)(lp, mask)
    assert loss.item() == 0.0 and metrics == {"sft_loss": 0.0}
    loss.backward()
    assert lp.grad is not None and lp.grad.shape == (0, 5)


@pytest.mark.parametrize("mode", MODES)
def test_opmd_empty_batch(mode: str) -> None:
    lp, mask = _empty()
    loss, metrics = OPMDPolicyLossFn(tau=0.5, loss_agg_mode=mode)(
        logprob=lp, action_mask=mask, advantages=torch.zeros(0, 5, dtype=torch.float64)
    )
    assert loss.item() == 0.0 and metrics == {"opmd_loss": 0.0}
    loss.backward()
    assert lp.grad is not None and lp.grad.shape == (0, 5)


@pytest.mark.parametrize("mode", MODES)
def test_mix_empty_batch(mode: str) -> None:
    lp, mask = _empty()
    fn = MIXPolicyLossFn(mu=0.3, loss_agg_mode=mode)
    zeros = torch.zeros(0, 5, dtype=torch.float64)
    loss, metrics = fn(
        logprob=lp,
        old_logprob=zeros,
        action_mask=mask,
        advantages=zeros,
        expert_mask=torch.zeros(0, dtype=torch.bool),
    )
    # neither kind has a row: no usual/ or expert/ metrics, a zero loss
    assert loss.item() == 0.0 and metrics == {"loss": 0.0}


# ------------------------------------------------------------------ MIX, numerically

RNG = np.random.default_rng(7)
OLD = RNG.uniform(-3.0, -0.1, size=(6, 5))
LP = OLD + RNG.uniform(-0.4, 0.4, size=(6, 5))
ADV = RNG.normal(size=(6, 5))
MASK = np.array(
    [
        [1, 1, 1, 1, 0],
        [1, 1, 0, 0, 0],
        [0, 0, 0, 0, 0],  # a fully masked usual row
        [1, 1, 1, 1, 1],
        [1, 1, 1, 0, 0],
        [0, 0, 0, 0, 0],  # a fully masked expert row
    ],
    dtype=bool,
)
EXPERT = np.array([False, False, False, True, True, True])
ARGS = dict(
    ppo_mini_batch_size=12,
    ppo_micro_batch_size_per_gpu=6,  # gradient_accumulation 2
    train_batch_size_usual=6,
    train_batch_size_expert=6,
)


def np_mix(mu: float, mode: str, token_level_sft: bool) -> tuple[float, dict, np.ndarray]:
    """Seed 000's MIX loss on (LP, ...): returns (loss, metrics, d loss / d logprob)."""
    ga, tbs_u, tbs_e = 2, 6, 6
    u, e = ~EXPERT, EXPERT
    n_u, n_e = int(u.sum()), int(e.sum())  # rows, fully masked ones included (as the seed)
    w_u, w_e = n_u * ga / tbs_u, n_e * ga / tbs_e
    ppo_tok = np_ppo_tokens(LP[u], OLD[u], ADV[u])
    grpo = np_agg(ppo_tok, MASK[u], mode)
    sft_mode = "token-mean" if token_level_sft else "seq-mean-token-mean"
    sft = np_agg(-LP[e], MASK[e], sft_mode)
    loss = (1 - mu) * grpo * w_u + mu * sft * w_e
    metrics = {
        "usual/pg_loss": grpo * w_u,
        "usual/ppo_kl": np_agg(OLD[u] - LP[u], MASK[u], "token-mean") * w_u,
        "expert/sft_loss": sft * w_e,
        "loss": loss,
    }
    # gradient by finite differences of the numpy loss (independent of autograd)
    grad = np.zeros_like(LP)
    h = 1e-6
    for i in range(LP.shape[0]):
        for j in range(LP.shape[1]):
            for sign in (1, -1):
                lp2 = LP.copy()
                lp2[i, j] += sign * h
                g2 = np_agg(np_ppo_tokens(lp2[u], OLD[u], ADV[u]), MASK[u], mode)
                s2 = np_agg(-lp2[e], MASK[e], sft_mode)
                grad[i, j] += sign * ((1 - mu) * g2 * w_u + mu * s2 * w_e) / (2 * h)
    return loss, metrics, grad


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("token_level_sft", [True, False])
def test_mix_modes_sequence_level_sft_and_fully_masked_rows(
    mode: str, token_level_sft: bool
) -> None:
    mu = 0.3
    fn = MIXPolicyLossFn(
        mu=mu,
        clip_range=0.2,
        loss_agg_mode=mode,
        use_token_level_loss_in_sft=token_level_sft,
        **ARGS,
    )
    lp = t(LP).requires_grad_(True)
    loss, metrics = fn(
        logprob=lp,
        old_logprob=t(OLD),
        action_mask=t(MASK, torch.bool),
        advantages=t(ADV),
        expert_mask=t(EXPERT, torch.bool),
    )
    want, want_metrics, want_grad = np_mix(mu, mode, token_level_sft)
    assert loss.item() == pytest.approx(want, rel=1e-9, abs=1e-12)
    for k, v in want_metrics.items():
        assert metrics[k] == pytest.approx(v, rel=1e-9, abs=1e-12), k
    loss.backward()
    assert lp.grad is not None
    np.testing.assert_allclose(lp.grad.numpy(), want_grad, rtol=1e-5, atol=1e-7)
    # the fully masked rows, usual and expert, get no gradient
    assert (lp.grad[2] == 0).all() and (lp.grad[5] == 0).all()


def test_mix_sequence_level_sft_differs_from_token_level() -> None:
    # expert rows of 5 and 3 tokens: the token mean weights the long row more
    e = EXPERT
    tok = -LP[e][MASK[e]].mean()
    seq = np.mean([-LP[3][MASK[3]].mean(), -LP[4][MASK[4]].mean()])
    assert not math.isclose(tok, seq)
    for token_level, want in ((True, tok), (False, seq)):
        fn = MIXPolicyLossFn(mu=1.0, use_token_level_loss_in_sft=token_level, **ARGS)
        loss, _ = fn(
            logprob=t(LP),
            old_logprob=t(OLD),
            action_mask=t(MASK, torch.bool),
            advantages=t(ADV),
            expert_mask=t(EXPERT, torch.bool),
        )
        assert loss.item() == pytest.approx(want * 3 * 2 / 6, rel=1e-9)


# ------------------------------------------------------------------ KL loss

KL_LP = np.array([[-0.5, -1.0, -2.0, -0.3], [-0.1, -3.0, -0.7, -1.2], [-60.0, 5.0, -9.0, 0.0]])
KL_REF = np.array([[-0.7, -1.0, -1.0, -0.5], [-0.2, -0.5, -0.9, -1.2], [40.0, -70.0, 3.0, 1.0]])
KL_OLD = np.array([[-0.6, -0.9, -2.5, -0.2], [-0.1, -2.0, -0.7, -1.0], [0.0, -80.0, 1.0, 2.0]])
KL_MASK = np.array([[1, 1, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0]], dtype=bool)  # row 2: garbage


def np_kl(name: str, lp: np.ndarray, ref: np.ndarray, old: np.ndarray | None) -> np.ndarray:
    with np.errstate(over="ignore", invalid="ignore"):
        if name == "abs":
            return np.abs(lp - ref)
        k3 = np.exp(ref - lp) - (ref - lp) - 1
        if name == "k3" or old is None:
            return k3
        return np.clip(np.exp(lp - old), 0.0, 2.0) * k3


@pytest.mark.parametrize("name", ["k3", "abs", "corrected_k3"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("with_old", [True, False])
def test_kl_loss_estimators_with_a_fully_masked_row(name: str, mode: str, with_old: bool) -> None:
    coef = 0.05
    fn = KL_FN.get(name)(kl_coef=coef)
    lp = t(KL_LP).requires_grad_(True)
    old = t(KL_OLD) if with_old else None
    loss, metrics = fn.calculate_kl_loss(
        lp, t(KL_REF), t(KL_MASK, torch.bool), mode, old_logprob=old
    )
    kl = np_kl(name, KL_LP, KL_REF, KL_OLD if with_old else None)
    agg = np_agg(kl, KL_MASK, mode)
    assert math.isfinite(loss.item())
    assert loss.item() == pytest.approx(coef * agg, rel=1e-9)
    assert metrics == {"kl_loss": pytest.approx(agg, rel=1e-9), "kl_coef": coef}
    # without the masked garbage row the loss is the same; that row gets no gradient
    keep = [0, 1]
    loss2, _ = fn.calculate_kl_loss(
        t(KL_LP[keep]),
        t(KL_REF[keep]),
        t(KL_MASK[keep], torch.bool),
        mode,
        old_logprob=t(KL_OLD[keep]) if with_old else None,
    )
    assert loss2.item() == pytest.approx(loss.item(), rel=1e-12)
    loss.backward()
    assert lp.grad is not None and torch.isfinite(lp.grad).all() and (lp.grad[2] == 0).all()


def test_corrected_k3_gradient_matches_numpy() -> None:
    # d/dlp [clip(exp(lp - old), 0, 2) * k3]; inside the clip both factors depend on lp
    fn = KL_FN.get("corrected_k3")(kl_coef=1.0)
    lp = t(KL_LP[:2]).requires_grad_(True)
    loss, _ = fn.calculate_kl_loss(
        lp, t(KL_REF[:2]), t(KL_MASK[:2], torch.bool), "token-mean", old_logprob=t(KL_OLD[:2])
    )
    loss.backward()
    r = np.exp(KL_LP[:2] - KL_OLD[:2])
    d = KL_REF[:2] - KL_LP[:2]
    k3 = np.exp(d) - d - 1
    dk3 = -np.exp(d) + 1
    dr = np.where(r < 2.0, r, 0.0)  # clip's gradient is 0 above 2
    m = KL_MASK[:2].astype(float)
    want = (dr * k3 + np.clip(r, 0, 2) * dk3) * m / m.sum()
    np.testing.assert_allclose(lp.grad.numpy(), want, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("name", ["k3", "abs", "corrected_k3"])
@pytest.mark.parametrize("mode", MODES)
def test_kl_loss_empty_and_all_masked(name: str, mode: str) -> None:
    fn = KL_FN.get(name)(kl_coef=0.1)
    lp, mask = _empty(4)
    loss, metrics = fn.calculate_kl_loss(
        lp, torch.zeros(0, 4, dtype=torch.float64), mask, mode, old_logprob=torch.zeros(0, 4)
    )
    assert loss.item() == 0.0 and metrics == {"kl_loss": 0.0, "kl_coef": 0.1}
    loss.backward()
    assert lp.grad is not None and lp.grad.shape == (0, 4)
    lp = t(KL_LP).requires_grad_(True)
    loss, metrics = fn.calculate_kl_loss(
        lp, t(KL_REF), torch.zeros(3, 4, dtype=torch.bool), mode, old_logprob=t(KL_OLD)
    )
    assert loss.item() == 0.0 and metrics["kl_loss"] == 0.0
    loss.backward()
    assert (lp.grad == 0).all()
