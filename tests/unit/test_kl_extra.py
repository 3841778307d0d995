"""Adaptive / fixed KL coefficient and the ``apply_kl_penalty_to_reward`` contract.

Expected values come from plain python / numpy below, never from the implementation.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from algorithms import KL_FN
from rftstream.experience import EID, Experience


def ref_kl(name: str, lp: np.ndarray, ref: np.ndarray) -> np.ndarray:
    if name == "k1":
        return lp - ref
    if name == "k2":
        return 0.5 * (lp - ref) ** 2
    if name == "k3":
        logr = ref - lp
        return np.exp(logr) - logr - 1
    raise AssertionError(name)


def verl_adaptive(coef: float, target: float, horizon: float, kls, n_steps) -> list[float]:
    """verl AdaptiveKLController.update, step by step; returns the coefficient before each update."""
    seen = []
    for kl, n in zip(kls, n_steps, strict=True):
        seen.append(coef)
        err = kl / target - 1
        err = -0.2 if err < -0.2 else (0.2 if err > 0.2 else err)
        coef = coef * (1 + err * n / horizon)
    seen.append(coef)
    return seen


def test_adaptive_coefficient_trajectory_matches_verl():
    kls = [0.5, 0.11, 0.0, 0.09, 3.0, 0.1]
    ns = [8, 8, 16, 4, 32, 8]
    fn = KL_FN.get("k2")(kl_coef=0.2, adaptive=True, target_kl=0.1, horizon=500)
    expected = verl_adaptive(0.2, 0.1, 500, kls, ns)
    got = [fn.kl_coef]
    for kl, n in zip(kls, ns, strict=True):
        fn.update_kl_coef(current_kl=kl, batch_size=n)
        got.append(fn.kl_coef)
    np.testing.assert_allclose(got, expected, rtol=1e-12)


def test_fixed_coefficient_never_moves():
    fn = KL_FN.get("k3")(kl_coef=0.05)
    for kl in (0.0, 1.0, 100.0):
        fn.update_kl_coef(current_kl=kl, batch_size=64)
    assert fn.kl_coef == 0.05


@pytest.mark.parametrize(
    "kwargs",
    [
        {"target_kl": None, "horizon": 10},
        {"target_kl": 0.1, "horizon": None},
        {"target_kl": 0.0, "horizon": 10},
        {"target_kl": 0.1, "horizon": 0},
        {"target_kl": -1.0, "horizon": 10},
    ],
)
def test_adaptive_needs_positive_target_and_horizon(kwargs):
    with pytest.raises(ValueError, match="target_kl and horizon"):
        KL_FN.get("k1")(adaptive=True, **kwargs)


# three responses of lengths 4, 2, 3; row 2 fully masked
RESP_LEN = [4, 2, 3]
ROLLOUT = [[-0.5, -1.0, -2.0, -0.3], [-0.2, -0.9], [-1.0, -1.0, -1.0]]
OLD = [[-0.6, -1.1, -1.5, -0.4], [-0.3, -0.7], [-1.2, -0.8, -1.1]]
REF = [[-0.7, -1.0, -1.0, -0.5], [-0.2, -0.5], [-0.9, -1.2, -1.0]]
AMASK = [[1, 1, 0, 1], [1, 1], [0, 0, 0]]
REWARD = [1.0, -0.5, 2.0]


def mk(i: int, token_level_reward=None) -> Experience:
    n = RESP_LEN[i]
    return Experience(
        tokens=list(range(3 + n)),
        prompt_length=3,
        reward=REWARD[i],
        logprobs=ROLLOUT[i],
        action_mask=AMASK[i],
        token_level_reward=token_level_reward,
        eid=EID(task=f"t{i}"),
    )


def padded(rows, width=4, fill=-99.0) -> torch.Tensor:
    out = np.full((len(rows), width), fill)
    for i, r in enumerate(rows):
        out[i, : min(len(r), width)] = r[:width]
    return torch.tensor(out, dtype=torch.float32)


def expected_rewards(name, coef, lps, width=None):
    """token_level_reward and the per-sequence KL means, in numpy (right-padded layout)."""
    rewards, seq = [], []
    for i in range(3):
        n = RESP_LEN[i]
        w = n if width is None else min(n, width)
        scores = np.zeros(n)
        scores[-1] = REWARD[i]
        kl = np.zeros(n)
        m = np.array(AMASK[i], dtype=bool)
        full = ref_kl(name, np.array(lps[i][:w]), np.array(REF[i][:w]))
        kl[:w] = np.where(m[:w], full, 0.0)
        rewards.append(scores - coef * kl)
        mw = m[:w]
        seq.append(kl[:w][mw].mean() if mw.any() else 0.0)
    return rewards, seq


@pytest.mark.parametrize("name", ["k1", "k2", "k3"])
def test_penalty_from_batch_tensors_uses_trainer_logprobs(name):
    coef = 0.3
    fn = KL_FN.get(name)(kl_coef=coef)
    exps = [mk(i) for i in range(3)]
    out, metrics = fn.apply_kl_penalty_to_reward(
        exps, ref_logprobs=padded(REF), logprobs=padded(OLD)
    )
    assert out is exps
    want, seq = expected_rewards(name, coef, OLD)
    for exp, w in zip(exps, want, strict=True):
        assert exp.token_level_reward.dtype == torch.float32
        assert exp.token_level_reward.shape == (exp.response_length,)
        np.testing.assert_allclose(exp.token_level_reward.numpy(), w, rtol=1e-5, atol=1e-6)
    assert metrics["kl"] == pytest.approx(sum(seq) / 3, rel=1e-5)  # masked row counts as 0
    assert metrics["kl_coef"] == coef and fn.kl_coef == coef


def test_penalty_defaults_to_rollout_logprobs_and_info_ref():
    fn = KL_FN.get("k1")(kl_coef=0.1)
    exps = [mk(i) for i in range(3)]
    for e, r in zip(exps, REF, strict=True):
        e.info["ref_logprobs"] = r
    _, metrics = fn.apply_kl_penalty_to_reward(exps)
    want, seq = expected_rewards("k1", 0.1, ROLLOUT)
    for exp, w in zip(exps, want, strict=True):
        np.testing.assert_allclose(exp.token_level_reward.numpy(), w, rtol=1e-5, atol=1e-6)
    assert metrics["kl"] == pytest.approx(sum(seq) / 3, rel=1e-5)


def test_penalty_truncated_width_leaves_tail_alone():
    fn = KL_FN.get("k2")(kl_coef=1.0)
    exps = [mk(i) for i in range(3)]
    ref = padded(REF, width=2)
    lp = padded(OLD, width=2)
    _, metrics = fn.apply_kl_penalty_to_reward(exps, ref_logprobs=ref, logprobs=lp)
    want, seq = expected_rewards("k2", 1.0, OLD, width=2)
    for exp, w in zip(exps, want, strict=True):
        np.testing.assert_allclose(exp.token_level_reward.numpy(), w, rtol=1e-5, atol=1e-6)
    assert exps[0].token_level_reward[-1].item() == pytest.approx(REWARD[0])  # tail untouched
    assert metrics["kl"] == pytest.approx(sum(seq) / 3, rel=1e-5)


def test_penalty_adds_to_existing_token_level_reward_without_mutating_it():
    fn = KL_FN.get("k1")(kl_coef=0.5)
    base = torch.tensor([0.1, 0.2, 0.3, 0.4])
    exps = [mk(0, token_level_reward=base)]
    ref = torch.tensor([REF[0]], requires_grad=True)
    fn.apply_kl_penalty_to_reward(exps, ref_logprobs=ref, logprobs=[OLD[0]])
    kl = (np.array(OLD[0]) - np.array(REF[0])) * np.array(AMASK[0])
    np.testing.assert_allclose(
        exps[0].token_level_reward.numpy(), np.array([0.1, 0.2, 0.3, 0.4]) - 0.5 * kl, rtol=1e-5
    )
    assert not exps[0].token_level_reward.requires_grad
    assert base.tolist() == pytest.approx([0.1, 0.2, 0.3, 0.4])  # input tensor untouched


def test_penalty_updates_adaptive_coefficient_over_steps():
    fn = KL_FN.get("k2")(kl_coef=0.2, adaptive=True, target_kl=0.01, horizon=20)
    coefs, kls = [], []
    for _ in range(3):
        exps = [mk(i) for i in range(3)]
        _, m = fn.apply_kl_penalty_to_reward(exps, ref_logprobs=padded(REF), logprobs=padded(OLD))
        coefs.append(m["kl_coef"])
        kls.append(m["kl"])
    _, seq = expected_rewards("k2", 0.0, OLD)
    kl = sum(seq) / 3
    assert kls == pytest.approx([kl] * 3, rel=1e-5)
    expected = verl_adaptive(0.2, 0.01, 20, [kl] * 3, [3] * 3)
    assert coefs == pytest.approx(expected[:3], rel=1e-6)
    assert fn.kl_coef == pytest.approx(expected[3], rel=1e-6)
    # the penalty of a step uses the coefficient reported for that step
    exps = [mk(i) for i in range(3)]
    _, m = fn.apply_kl_penalty_to_reward(exps, ref_logprobs=padded(REF), logprobs=padded(OLD))
    want, _ = expected_rewards("k2", m["kl_coef"], OLD)
    np.testing.assert_allclose(exps[0].token_level_reward.numpy(), want[0], rtol=1e-5)


def test_penalty_empty_batch_and_no_reference():
    fn = KL_FN.get("k1")(kl_coef=0.2, adaptive=True, target_kl=0.1, horizon=10)
    out, m = fn.apply_kl_penalty_to_reward([], ref_logprobs=torch.zeros(0, 4))
    assert out == [] and m == {"kl": 0.0, "kl_coef": 0.0} and fn.kl_coef == 0.2
    exps = [mk(i) for i in range(3)]
    _, m = fn.apply_kl_penalty_to_reward(exps)  # no info["ref_logprobs"]: no penalty
    assert m == {"kl": 0.0, "kl_coef": 0.0} and fn.kl_coef == 0.2
    for i, exp in enumerate(exps):
        want = np.zeros(RESP_LEN[i])
        want[-1] = REWARD[i]
        np.testing.assert_allclose(exp.token_level_reward.numpy(), want)


def test_penalty_rejects_partial_reference_and_wrong_row_count():
    fn = KL_FN.get("k1")()
    exps = [mk(i) for i in range(3)]
    exps[0].info["ref_logprobs"] = REF[0]
    with pytest.raises(ValueError, match="2 of 3 experiences"):
        fn.apply_kl_penalty_to_reward(exps)
    with pytest.raises(ValueError, match="2 rows of ref_logprobs for 3"):
        fn.apply_kl_penalty_to_reward(exps, ref_logprobs=padded(REF[:2]))
    with pytest.raises(ValueError, match="4 rows of logprobs for 3"):
        fn.apply_kl_penalty_to_reward(exps, ref_logprobs=padded(REF), logprobs=padded(OLD + [[0]]))


def test_none_kl_accepts_the_same_arguments():
    fn = KL_FN.get("none")()
    exps = [mk(i) for i in range(3)]
    out, m = fn.apply_kl_penalty_to_reward(exps, ref_logprobs=padded(REF), logprobs=padded(OLD))
    assert out is exps and m == {}
    for i, exp in enumerate(exps):
        assert exp.token_level_reward[-1].item() == REWARD[i]
        assert math.isclose(float(exp.token_level_reward.sum()), REWARD[i], rel_tol=1e-6)
