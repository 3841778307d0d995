"""The Trinity-RFT 0.6 presets and functions added here, against numpy / plain-Python references.

Policy losses: ``importance_sampling``, ``sapo``, ``sft_is``, ``sft_phi``,
``mix_chord`` (with CHORD's ``mu`` schedule). Advantages: ``on_policy_distill``,
``jsd`` (teacher log-probs in ``info["teacher_logprobs"]``), ``gigpo``. Presets:
``mix_chord``, ``sapo``, ``gigpo``, ``on_policy_distill``, ``jsd``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from algorithms import ADVANTAGE_FN, POLICY_LOSS_FN, resolve_algorithm
from algorithms.policy_loss_fn import mu_schedule
from rftstream.config.schema import AlgorithmConfig
from rftstream.errors import ConfigError
from rftstream.experience import EID, Experience

LP = np.array([[-0.5, -1.0, -2.0, -0.1], [-0.3, -0.7, -3.0, -3.0], [-1.5, -0.2, -0.4, -0.9]])
OLD = LP + np.array([[0.1, -0.2, 0.3, 0.0], [0.05, 0.0, -0.1, 0.2], [-0.3, 0.2, 0.0, 0.1]])
MASK = np.array([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=bool)
ADV = np.array([[1.0, 1.0, 1.0, 1.0], [-0.5, -0.5, -0.5, -0.5], [0.7, -0.2, 0.0, 2.0]])
N = MASK.sum()


def t(a: np.ndarray, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    return torch.tensor(a, dtype=dtype)


def token_mean(values: np.ndarray, mask: np.ndarray = MASK) -> float:
    return float((values * mask).sum() / mask.sum())


def seq_mean_token_mean(values: np.ndarray, mask: np.ndarray) -> float:
    return float(np.mean([(values[i] * mask[i]).sum() / mask[i].sum() for i in range(len(mask))]))


def grad_of(fn, **tensors) -> tuple[float, np.ndarray]:
    lp = t(LP).requires_grad_(True)
    loss, _ = fn(logprob=lp, action_mask=t(MASK, torch.bool), **tensors)
    loss.backward()
    return loss.item(), lp.grad.numpy()


# ------------------------------------------------------------------ policy losses


def test_importance_sampling_loss_and_gradient() -> None:
    fn = POLICY_LOSS_FN.get("importance_sampling")()
    loss, grad = grad_of(fn, old_logprob=t(OLD), advantages=t(ADV))
    ratio = np.exp(LP - OLD)
    assert loss == pytest.approx(token_mean(-ADV * ratio), rel=1e-9)
    np.testing.assert_allclose(grad, np.where(MASK, -ADV * ratio / N, 0.0), rtol=1e-9)
    _, metrics = fn(t(LP), t(OLD), t(MASK, torch.bool), t(ADV))
    assert metrics["ratio/mean"] == pytest.approx(token_mean(ratio))
    assert metrics["approx_kl"] == pytest.approx(token_mean(OLD - LP))


def test_sapo_loss_and_gradient() -> None:
    tau_pos, tau_neg = 1.0, 1.5
    fn = POLICY_LOSS_FN.get("sapo")(tau_pos=tau_pos, tau_neg=tau_neg)
    loss, grad = grad_of(fn, old_logprob=t(OLD), advantages=t(ADV))
    ratio = np.exp(LP - OLD)
    tau = np.where(ADV > 0, tau_pos, tau_neg)
    gate = 1.0 / (1.0 + np.exp(-tau * (ratio - 1.0))) * 4.0 / tau
    assert loss == pytest.approx(token_mean(-ADV * gate * LP), rel=1e-9)
    # the gate is detached: d loss / d logprob = -A * gate / N
    np.testing.assert_allclose(grad, np.where(MASK, -ADV * gate / N, 0.0), rtol=1e-9)
    with pytest.raises(ValueError, match="tau_pos <= tau_neg"):
        POLICY_LOSS_FN.get("sapo")(tau_pos=1.2, tau_neg=1.0)


def test_sft_is_weights_tokens_by_their_probability() -> None:
    loss, grad = grad_of(POLICY_LOSS_FN.get("sft_is")())
    p = np.exp(LP)
    assert loss == pytest.approx(token_mean(-LP * p), rel=1e-9)
    np.testing.assert_allclose(grad, np.where(MASK, -p / N, 0.0), rtol=1e-9)


@pytest.mark.parametrize("cutoff", [1.0, 0.5])
def test_sft_phi_weights_by_p_one_minus_p_with_cutoff(cutoff: float) -> None:
    loss, grad = grad_of(POLICY_LOSS_FN.get("sft_phi")(cutoff_prob=cutoff))
    p = np.exp(LP)
    phi = p * (1 - p)
    clamped = np.minimum(LP, math.log(cutoff)) if cutoff < 1 else LP
    assert loss == pytest.approx(token_mean(-clamped * phi), rel=1e-9)
    live = LP < math.log(cutoff) if cutoff < 1 else np.ones_like(MASK)
    np.testing.assert_allclose(grad, np.where(MASK & live, -phi / N, 0.0), rtol=1e-9)
    with pytest.raises(ValueError, match="cutoff_prob"):
        POLICY_LOSS_FN.get("sft_phi")(cutoff_prob=1.5)


def ref_mu(step: int, warm: int, decay: int, peak: float, valley: float) -> float:
    if step < warm:
        return step / warm * peak
    if step >= warm + decay:
        return valley
    frac = (step - warm) / decay
    return valley + (peak - valley) * (1 + math.cos(math.pi * frac)) / 2


@pytest.mark.parametrize("step", [0, 1, 4, 5, 7, 10, 14, 15, 40])
def test_mu_schedule(step: int) -> None:
    assert mu_schedule(step, 5, 10, 0.9, 0.05) == pytest.approx(ref_mu(step, 5, 10, 0.9, 0.05))


@pytest.mark.parametrize("phi", [True, False])
def test_mix_chord_matches_reference(phi: bool) -> None:
    expert = np.array([False, True, False])
    args = {
        "mu_warmup_steps": 2,
        "mu_decay_steps": 6,
        "mu_peak": 0.8,
        "mu_valley": 0.1,
        "enable_phi_function": phi,
        "clip_range": 0.2,
        "train_batch_size_usual": 4,
        "train_batch_size_expert": 2,
        "ppo_mini_batch_size": 6,
        "ppo_micro_batch_size_per_gpu": 3,
        "sft_loss_agg_mode": "seq-mean-token-mean",
    }
    fn = POLICY_LOSS_FN.get("mix_chord")(**args)
    step = 5
    loss, metrics = fn(
        logprob=t(LP),
        old_logprob=t(OLD),
        action_mask=t(MASK, torch.bool),
        advantages=t(ADV),
        expert_mask=torch.tensor(expert),
        step=torch.full((3,), step, dtype=torch.int32),
    )
    usual = ~expert
    ratio = np.exp(LP - OLD)[usual]
    a = ADV[usual]
    clipped = np.maximum(-a * ratio, -a * np.clip(ratio, 0.8, 1.2))
    pg = np.where(a < 0, np.minimum(clipped, -a * 3.0), clipped)
    grpo = token_mean(pg, MASK[usual])
    p = np.exp(LP[expert])
    weight = p * (1 - p) if phi else np.ones_like(p)
    sft = seq_mean_token_mean(-LP[expert] * weight, MASK[expert])
    grad_acc = 6 // 3
    mu = ref_mu(step, 2, 6, 0.8, 0.1)
    want = (1 - mu) * grpo * usual.sum() * grad_acc / 4 + mu * sft * expert.sum() * grad_acc / 2
    assert loss.item() == pytest.approx(want, rel=1e-9)
    assert metrics["mu"] == pytest.approx(mu)
    with pytest.raises(ValueError, match="one step per batch"):
        fn(
            t(LP),
            t(OLD),
            t(MASK, torch.bool),
            t(ADV),
            torch.tensor(expert),
            torch.tensor([1, 2, 2]),
        )


# ------------------------------------------------------------------ advantages


def exp_with(
    logprobs: list[float], teacher: list[float] | None, mask: list[bool] | None = None, run: int = 0
) -> Experience:
    info = {} if teacher is None else {"teacher_logprobs": teacher}
    return Experience(
        tokens=list(range(2 + len(logprobs))),
        prompt_length=2,
        reward=0.0,
        logprobs=logprobs,
        action_mask=mask,
        info=info,
        eid=EID(batch=0, task="t", run=run),
    )


STUDENT = [[-0.5, -1.0, -2.0], [-0.1, -3.0, -0.7]]
TEACHER = [[-0.2, -1.5, -0.4], [-0.9, -0.3, -0.7]]
MASKS = [[True, True, False], [True, True, True]]


def test_on_policy_distill_advantage() -> None:
    exps = [
        exp_with(s, te, m, run=i)
        for i, (s, te, m) in enumerate(zip(STUDENT, TEACHER, MASKS, strict=True))
    ]
    fn = ADVANTAGE_FN.get("on_policy_distill")(kl_coef=0.5)
    out, metrics = fn(exps)
    kl_rows = []
    for exp, s, te, m in zip(out, STUDENT, TEACHER, MASKS, strict=True):
        want = 0.5 * (np.array(te) - np.array(s)) * np.array(m)
        np.testing.assert_allclose(exp.advantages.numpy(), want, rtol=1e-6)
        np.testing.assert_allclose(exp.returns.numpy(), want, rtol=1e-6)
        kl_rows.append(float(((np.array(s) - np.array(te)) * np.array(m)).sum()))
    assert metrics["kl/mean"] == pytest.approx(np.mean(kl_rows), rel=1e-6)
    assert metrics["kl/std"] == pytest.approx(np.std(kl_rows, ddof=1), rel=1e-6)
    assert fn.compute_in_trainer()
    with pytest.raises(ValueError, match="teacher_logprobs"):
        fn([exp_with([-1.0, -1.0], None)])
    with pytest.raises(ValueError, match="2 values for 3 response tokens"):
        fn([exp_with([-1.0, -1.0, -1.0], [-1.0, -1.0])])


def ref_jsd(s: np.ndarray, te: np.ndarray, beta: float) -> np.ndarray:
    """From probabilities: beta*log(p_t/m) + (1-beta)*log(p_s/m), m the mixture."""
    ps, pt = np.exp(s), np.exp(te)
    m = beta * pt + (1 - beta) * ps
    return beta * np.log(pt / m) + (1 - beta) * np.log(ps / m)


@pytest.mark.parametrize("beta,temp", [(0.5, 1.0), (0.3, 2.0), (0.0, 1.0), (1.0, 1.0)])
def test_jsd_advantage(beta: float, temp: float) -> None:
    exps = [
        exp_with(s, te, m, run=i)
        for i, (s, te, m) in enumerate(zip(STUDENT, TEACHER, MASKS, strict=True))
    ]
    fn = ADVANTAGE_FN.get("jsd")(lambda_coef=beta, kl_coef=2.0, temperature=temp)
    out, metrics = fn(exps)
    rows = []
    for exp, s, te, m in zip(out, STUDENT, TEACHER, MASKS, strict=True):
        s_, te_ = np.array(s) / temp, np.array(te) / temp
        if beta == 0:
            jsd = s_ - te_
        elif beta == 1:
            jsd = te_ - s_
        else:
            jsd = ref_jsd(s_, te_, beta)
        jsd = jsd * np.array(m)
        np.testing.assert_allclose(exp.advantages.numpy(), -2.0 * jsd, rtol=1e-5, atol=1e-6)
        rows.append(jsd.sum())
    assert metrics["jsd/mean"] == pytest.approx(np.mean(rows), rel=1e-5)
    with pytest.raises(ValueError, match="lambda_coef"):
        ADVANTAGE_FN.get("jsd")(lambda_coef=1.5)


def step_exp(task: str, run: int, step: int, **info) -> Experience:
    reward = info.pop("reward", None)
    return Experience(
        tokens=[1, 2, 3, 4],
        prompt_length=2,
        reward=reward,
        info=dict(info),
        eid=EID(batch=0, task=task, run=run, step=step),
    )


def test_gigpo_episode_and_anchor_advantages() -> None:
    gamma, omega = 0.9, 0.5
    # task a: 3 rollouts with per-step rewards and state hashes; task b: a single rollout
    runs = {
        0: [(1.0, "s0"), (0.0, "s1"), (1.0, "s2")],
        1: [(0.0, "s0"), (2.0, "s1")],
        2: [(0.5, "s0"), (0.0, "s3")],
    }
    exps = [
        step_exp("a", r, k, step_reward=rew, env_state_hash=h)
        for r, steps in runs.items()
        for k, (rew, h) in enumerate(steps)
    ]
    exps.append(step_exp("b", 0, 0, reward=3.0, env_state_hash="s0"))  # sparse reward
    fn = ADVANTAGE_FN.get("gigpo")(omega=omega, gamma=gamma, fnorm="std")
    out, metrics = fn(exps)
    eps = 1e-6

    def returns(rewards: list[float]) -> list[float]:
        return [
            sum(gamma**j * rewards[k + j] for j in range(len(rewards) - k))
            for k in range(len(rewards))
        ]

    episode = {r: sum(x for x, _ in steps) for r, steps in runs.items()}
    mean_e = np.mean(list(episode.values()))
    std_e = np.std(list(episode.values()), ddof=1)
    a_e = {("a", r): (v - mean_e) / (std_e + eps) for r, v in episode.items()}
    a_e[("b", 0)] = 0.0  # a single rollout has no baseline
    disc = {
        ("a", r, k): v
        for r, steps in runs.items()
        for k, v in enumerate(returns([x for x, _ in steps]))
    }
    disc[("b", 0, 0)] = 3.0
    state = {("a", r, k): h for r, steps in runs.items() for k, (_, h) in enumerate(steps)}
    state[("b", 0, 0)] = "s0"
    a_s: dict[tuple, float] = {}
    for h in set(state.values()):
        members = [key for key, hh in state.items() if hh == h]
        if len(members) < 2:
            a_s.update({key: 0.0 for key in members})
            continue
        vals = np.array([disc[key] for key in members])
        for key, v in zip(members, vals, strict=True):
            a_s[key] = (v - vals.mean()) / (vals.std(ddof=1) + eps)
    for exp in out:
        key = (exp.eid.task, exp.eid.run, exp.eid.step)
        want = a_e[key[:2]] + omega * a_s[key]
        np.testing.assert_allclose(exp.advantages.numpy(), [want, want], rtol=1e-5, atol=1e-7)
    assert metrics["gigpo/anchor_groups_total"] == 4.0  # s0, s1, s2, s3
    assert metrics["gigpo/anchor_groups_size_gt1"] == 2.0  # s0 and s1
    assert metrics["group_count"] == 2.0  # tasks a and b
    assert metrics["experience_count"] == float(len(exps))
    assert not fn.compute_in_trainer()
    with pytest.raises(ValueError, match="fnorm"):
        ADVANTAGE_FN.get("gigpo")(fnorm="batch")


# ------------------------------------------------------------------ presets


@pytest.mark.parametrize(
    "preset,advantage,loss",
    [
        ("mix_chord", "GRPOGroupedAdvantage", "MIXCHORDPolicyLossFn"),
        ("sapo", "GRPOGroupedAdvantage", "SAPOPolicyLossFn"),
        ("gigpo", "GiGPOAdvantageFn", "PPOPolicyLossFn"),
        ("on_policy_distill", "OnPolicyDistillAdvantage", "PPOPolicyLossFn"),
        ("jsd", "JSDAdvantage", "PPOPolicyLossFn"),
    ],
)
def test_presets_resolve(preset: str, advantage: str, loss: str) -> None:
    r = resolve_algorithm(AlgorithmConfig(algorithm_type=preset))
    assert type(r.advantage_fn).__name__ == advantage
    assert type(r.policy_loss_fn).__name__ == loss
    trainer_fields = {"logprob", "old_logprob", "action_mask", "advantages", "ref_logprob"}
    names = r.check_loss_inputs(trainer_fields)
    if preset == "mix_chord":
        assert {"expert_mask", "step"} <= set(names)  # the mix sample strategy provides both


def test_distill_presets_take_importance_sampling() -> None:
    r = resolve_algorithm(
        AlgorithmConfig(algorithm_type="on_policy_distill", policy_loss_fn="importance_sampling")
    )
    assert r.config.advantage_fn_args == {"kl_coef": 1.0}
    assert type(r.policy_loss_fn).__name__ == "ImportanceSamplingLossFn"
    with pytest.raises(ConfigError) as ei:
        resolve_algorithm(AlgorithmConfig(algorithm_type="jsd", advantage_fn_args={"beta": 0.5}))
    assert ei.value.key_path == "algorithm.advantage_fn_args"
