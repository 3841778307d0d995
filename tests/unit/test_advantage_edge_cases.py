"""Edge cases of the advantage functions, against references written here in plain numpy.

All-equal rewards, a group of one, an empty batch, fully masked rows; and the
metrics that tell the group advantages apart in a run (``rloo_baseline``).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from algorithms import ADVANTAGE_FN
from algorithms.advantage_fn import (
    OPMDGroupAdvantage,
    PPOAdvantageFn,
    REINFORCEGroupAdvantage,
    REMAXAdvantageFn,
    RLOOGroupAdvantage,
    compute_gae_advantage_return,
)
from rftstream.experience import EID, Experience

MASKS = [[True, True, True], [True, False, True], [False, True, True], [True, True, False]]


def mk(reward, task="t0", run=0, resp=3, mask=None) -> Experience:
    return Experience(
        tokens=list(range(2 + resp)),
        prompt_length=2,
        reward=reward,
        action_mask=mask,
        eid=EID(batch=0, task=task, run=run),
    )


def assert_broadcast(exp: Experience, score: float) -> None:
    mask = np.asarray(exp.action_mask.tolist(), dtype=np.float64)
    np.testing.assert_allclose(exp.advantages.numpy(), score * mask, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(exp.returns.numpy(), score * mask, rtol=1e-6, atol=1e-7)
    assert exp.advantages.dtype == torch.float32 and exp.returns.dtype == torch.float32


# ------------------------------------------------------------------ all-equal rewards


@pytest.mark.parametrize("value", [0.0, 1.0, -0.75])
def test_opmd_all_equal_rewards(value: float) -> None:
    for baseline, tau in (("mean", 1.0), ("logavgexp", 1.0), ("logavgexp", 0.3)):
        exps = [mk(value, run=i, mask=m) for i, m in enumerate(MASKS)]
        _, metrics = OPMDGroupAdvantage(opmd_baseline=baseline, tau=tau)(exps)
        # mean: the mean is the value; logavgexp: tau * (log(n * e^(v / tau)) - log n) = v
        n = len(exps)
        want_baseline = (
            value
            if baseline == "mean"
            else tau * (math.log(n * math.exp(value / tau)) - math.log(n))
        )
        for exp in exps:
            assert_broadcast(exp, value - want_baseline)
            assert float(exp.advantages.abs().max()) < 1e-5
        assert metrics["group_baseline"] == pytest.approx(want_baseline, abs=1e-6)
        assert metrics["reward_mean"] == pytest.approx(value)


@pytest.mark.parametrize("value", [0.0, 1.0, -0.75])
def test_rloo_all_equal_rewards(value: float) -> None:
    exps = [mk(value, run=i, mask=m) for i, m in enumerate(MASKS)]
    _, metrics = RLOOGroupAdvantage()(exps)
    for exp in exps:
        assert_broadcast(exp, 0.0)  # every leave-one-out baseline is the value itself
    assert metrics["rloo_baseline"] == pytest.approx(value)
    assert metrics["reward_mean"] == pytest.approx(value)


@pytest.mark.parametrize("value", [0.0, 1.0, -0.75])
def test_reinforce_all_equal_rewards(value: float) -> None:
    exps = [mk(value, run=i, mask=m) for i, m in enumerate(MASKS)]
    _, metrics = REINFORCEGroupAdvantage()(exps)
    for exp in exps:
        assert_broadcast(exp, value)  # no baseline: the raw reward
    assert metrics == {"reward_mean": pytest.approx(value), "group_count": 1.0}


# ------------------------------------------------------------------ groups of one


def test_reinforce_group_of_one() -> None:
    exp = mk(0.6, mask=[True, False, True])
    out, metrics = REINFORCEGroupAdvantage()([exp])
    assert out == [exp]
    assert_broadcast(exp, 0.6)
    assert metrics == {"reward_mean": pytest.approx(0.6), "group_count": 1.0}


def test_rloo_baseline_metric_and_group_of_one() -> None:
    a = [1.0, 0.0, 0.5, 0.25]
    b = [2.0, -1.0]
    exps = [mk(r, task="a", run=i) for i, r in enumerate(a)]
    exps += [mk(r, task="b", run=i) for i, r in enumerate(b)]
    exps += [mk(0.3, task="c")]
    _, metrics = RLOOGroupAdvantage()(exps)

    def loo(rs: list[float]) -> list[float]:
        if len(rs) == 1:
            return [0.0]
        return [sum(rs[:i] + rs[i + 1 :]) / (len(rs) - 1) for i in range(len(rs))]

    per_group = [float(np.mean(loo(g))) for g in (a, b, [0.3])]
    assert metrics["rloo_baseline"] == pytest.approx(float(np.mean(per_group)))
    assert metrics["group_count"] == 3.0
    for exp in exps:
        group = {"a": a, "b": b, "c": [0.3]}[exp.eid.task]
        i = exp.eid.run
        assert_broadcast(exp, group[i] - loo(group)[i])


# ------------------------------------------------------------------ empty batches


@pytest.mark.parametrize("name", ["opmd", "rloo", "reinforce", "grpo", "ppo"])
def test_empty_batch(name: str) -> None:
    fn = ADVANTAGE_FN.get(name)()
    assert fn([]) == ([], {})


def test_ppo_empty_batch_with_values_and_gae_on_zero_rows() -> None:
    assert PPOAdvantageFn()([], values=[]) == ([], {})
    for shape in ((0, 4), (3, 0)):
        adv, ret = compute_gae_advantage_return(
            torch.zeros(shape), torch.zeros(shape), torch.zeros(shape, dtype=torch.bool), 1.0, 1.0
        )
        assert adv.shape == shape and ret.shape == shape


# ------------------------------------------------------------------ fully masked rows


def np_gae(rewards: np.ndarray, values: np.ndarray, gamma: float, lam: float) -> np.ndarray:
    adv = np.zeros_like(rewards)
    last = 0.0
    for t in reversed(range(len(rewards))):
        nv = values[t + 1] if t + 1 < len(rewards) else 0.0
        last = rewards[t] + gamma * nv - values[t] + gamma * lam * last
        adv[t] = last
    return adv


def test_gae_fully_masked_row_is_zero_and_left_out_of_the_whitening() -> None:
    gamma, lam = 0.95, 0.9
    rewards = [np.array([0.0, 0.0, 1.0]), np.array([0.0, 0.0, 5.0]), np.array([0.0, 0.0, -0.5])]
    values = [np.array([0.2, 0.1, 0.4]), np.array([3.0, -2.0, 1.0]), np.array([0.0, 0.3, -0.1])]
    masks = [np.array([1, 1, 1]), np.array([0, 0, 0]), np.array([1, 0, 1])]
    exps = [
        mk(float(r[-1]), task=f"t{i}", mask=m.astype(bool).tolist())
        for i, (r, m) in enumerate(zip(rewards, masks, strict=True))
    ]
    PPOAdvantageFn(gamma=gamma, lam=lam)(exps, values=[torch.tensor(v) for v in values])
    raw = [np_gae(r, v, gamma, lam) for r, v in zip(rewards, values, strict=True)]
    kept = np.concatenate([a[m == 1] for a, m in zip(raw, masks, strict=True)])  # row 1 absent
    mean, std = kept.mean(), math.sqrt(kept.var(ddof=1) + 1e-8)
    for exp, a, v, m in zip(exps, raw, values, masks, strict=True):
        np.testing.assert_allclose(exp.advantages.numpy(), (a - mean) / std * m, atol=1e-5)
        np.testing.assert_allclose(exp.returns.numpy(), (a + v) * m, atol=1e-5)
    assert not exps[1].advantages.any() and not exps[1].returns.any()


def test_gae_every_row_fully_masked() -> None:
    exps = [mk(1.0, task="a", mask=[False] * 3), mk(0.0, task="b", mask=[False] * 3)]
    _, metrics = PPOAdvantageFn()(exps, values=[torch.ones(3), torch.ones(3)])
    for exp in exps:
        assert not exp.advantages.any() and not exp.returns.any()
    assert metrics == {"advantages/mean": 0.0, "returns/mean": 0.0}


def test_remax_fully_masked_row() -> None:
    full = mk(1.0, task="a", mask=[True, True, True])
    masked = mk(2.0, task="b", mask=[False, False, False])
    REMAXAdvantageFn()([full, masked], reward_baselines=[0.25, 0.5])
    # the reward sits on the last token; masked rewards do not count, and masked tokens get 0
    np.testing.assert_allclose(full.advantages.numpy(), [0.75, 0.75, 0.75], rtol=1e-6)
    np.testing.assert_allclose(full.returns.numpy(), [1.0, 1.0, 1.0], rtol=1e-6)
    assert not masked.advantages.any() and not masked.returns.any()
