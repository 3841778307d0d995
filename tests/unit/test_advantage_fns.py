"""Advantage functions against plain numpy / Python references."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from algorithms import ADVANTAGE_FN, GroupAdvantage
from algorithms.advantage_fn import (
    GRPOGroupedAdvantage,
    OPMDGroupAdvantage,
    PPOAdvantageFn,
    REINFORCEGroupAdvantage,
    RLOOGroupAdvantage,
    compute_gae_advantage_return,
)
from rftstream.experience import EID, Experience


def mk(reward, task="t0", run=0, resp=4, prompt=2, mask=None, batch=0, **kw) -> Experience:
    return Experience(
        tokens=list(range(prompt + resp)),
        prompt_length=prompt,
        reward=reward,
        action_mask=mask,
        eid=EID(batch=batch, task=task, run=run),
        **kw,
    )


def check_broadcast(exp: Experience, score: float) -> None:
    mask = exp.action_mask.numpy().astype(np.float32)
    assert exp.advantages.dtype == torch.float32
    assert exp.returns.dtype == torch.float32
    assert exp.advantages.shape == (exp.response_length,)
    np.testing.assert_allclose(exp.advantages.numpy(), score * mask, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(exp.returns.numpy(), exp.advantages.numpy())
    assert exp.returns.data_ptr() != exp.advantages.data_ptr()


def ref_grpo(rewards: list[float], eps: float = 1e-6, norm: bool = True) -> list[float]:
    if len(rewards) == 1:
        return [0.0]
    mean = sum(rewards) / len(rewards)
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (len(rewards) - 1))  # unbiased
    return [(r - mean) / (std + eps) if norm else r - mean for r in rewards]


# ------------------------------------------------------------------ GRPO


def test_grpo_matches_reference_and_respects_mask():
    rewards = [1.0, 0.0, 0.5, 0.25]
    masks = [None, [True, False, True, False], [False] * 4, [True, True, True, False]]
    exps = [mk(r, run=i, mask=m) for i, (r, m) in enumerate(zip(rewards, masks, strict=True))]
    out, metrics = GRPOGroupedAdvantage()(exps)
    assert out == exps
    for exp, score in zip(out, ref_grpo(rewards), strict=True):
        check_broadcast(exp, score)
    assert metrics["reward_mean"] == pytest.approx(np.mean(rewards))
    assert metrics["reward_std"] == pytest.approx(np.std(rewards, ddof=1), rel=1e-6)
    assert metrics["group_count"] == 1
    assert "skipped_count" not in metrics


def test_grpo_several_groups_order_and_metric_means():
    a = [mk(1.0, task="a", run=0), mk(0.0, task="a", run=1)]
    b = [mk(3.0, task="b", run=0), mk(1.0, task="b", run=1), mk(2.0, task="b", run=2)]
    interleaved = [a[0], b[0], a[1], b[1], b[2]]
    out, metrics = GRPOGroupedAdvantage()(interleaved)
    assert out == [a[0], a[1], b[0], b[1], b[2]]  # grouped, first-seen order
    for exp, s in zip(a, ref_grpo([1.0, 0.0]), strict=True):
        check_broadcast(exp, s)
    for exp, s in zip(b, ref_grpo([3.0, 1.0, 2.0]), strict=True):
        check_broadcast(exp, s)
    assert metrics["reward_mean"] == pytest.approx((0.5 + 2.0) / 2)
    assert metrics["reward_std"] == pytest.approx((np.std([1, 0], ddof=1) + 1.0) / 2)
    assert metrics["group_count"] == 2


def test_grpo_group_of_one_and_all_equal_give_zero():
    single = mk(0.7, task="s")
    equal = [mk(1.0, task="e", run=i) for i in range(3)]
    out, metrics = GRPOGroupedAdvantage()([single, *equal])
    for exp in out:
        check_broadcast(exp, 0.0)
    assert metrics["group_count"] == 2


def test_grpo_without_std_normalisation():
    rewards = [2.0, 0.0, 1.0]
    exps = [mk(r, run=i) for i, r in enumerate(rewards)]
    GRPOGroupedAdvantage(norm_adv_by_std_in_grpo=False)(exps)
    for exp, s in zip(exps, ref_grpo(rewards, norm=False), strict=True):
        check_broadcast(exp, s)


def test_grpo_std_threshold_zeroes_and_counts():
    low = [mk(1.0, task="low", run=0), mk(1.1, task="low", run=1)]  # std 0.0707
    high = [mk(0.0, task="high", run=0), mk(1.0, task="high", run=1)]  # std 0.707
    out, metrics = GRPOGroupedAdvantage(std_threshold=0.1)(low + high)
    assert len(out) == 4
    for exp in low:
        check_broadcast(exp, 0.0)
    for exp, s in zip(high, ref_grpo([0.0, 1.0]), strict=True):
        check_broadcast(exp, s)
    assert metrics["skipped_count"] == 2


def test_grpo_empty_and_missing_reward():
    assert GRPOGroupedAdvantage()([]) == ([], {})
    with pytest.raises(ValueError, match="invalid_reward_filter"):
        GRPOGroupedAdvantage()([mk(None, run=0), mk(1.0, run=1)])
    with pytest.raises(ValueError):
        GRPOGroupedAdvantage()([mk(float("nan"), run=0), mk(1.0, run=1)])


def test_grpo_is_registered_group_advantage():
    assert ADVANTAGE_FN.get("grpo") is GRPOGroupedAdvantage
    assert issubclass(GRPOGroupedAdvantage, GroupAdvantage)
    assert GRPOGroupedAdvantage.compute_in_trainer() is False
    assert GRPOGroupedAdvantage.default_args()["epsilon"] == 1e-6
    with pytest.raises(TypeError):
        GRPOGroupedAdvantage(bogus=1)


# ------------------------------------------------------------------ OPMD


def test_opmd_mean_baseline():
    rewards = [1.0, 0.0, 0.5]
    exps = [mk(r, run=i) for i, r in enumerate(rewards)]
    _, metrics = OPMDGroupAdvantage()(exps)
    base = sum(rewards) / 3
    for exp, r in zip(exps, rewards, strict=True):
        check_broadcast(exp, r - base)
    assert metrics["group_baseline"] == pytest.approx(base)


def test_opmd_logavgexp_baseline():
    rewards, tau = [1.0, 0.0, 0.5, 2.0], 0.5
    exps = [mk(r, run=i) for i, r in enumerate(rewards)]
    OPMDGroupAdvantage(opmd_baseline="logavgexp", tau=tau)(exps)
    base = tau * (math.log(sum(math.exp(r / tau) for r in rewards)) - math.log(len(rewards)))
    for exp, r in zip(exps, rewards, strict=True):
        check_broadcast(exp, r - base)


def test_opmd_group_of_one_has_zero_baseline():
    exp = mk(0.8)
    _, metrics = OPMDGroupAdvantage()([exp])
    check_broadcast(exp, 0.8)
    assert metrics["group_baseline"] == 0.0
    assert OPMDGroupAdvantage.default_args() == {"opmd_baseline": "mean", "tau": 1.0}


# ------------------------------------------------------------------ RLOO / REINFORCE


def test_rloo_leave_one_out():
    rewards = [1.0, 0.0, 0.5, 0.25]
    exps = [mk(r, run=i) for i, r in enumerate(rewards)]
    RLOOGroupAdvantage()(exps)
    for i, exp in enumerate(exps):
        others = [r for j, r in enumerate(rewards) if j != i]
        check_broadcast(exp, rewards[i] - sum(others) / len(others))
    single = mk(0.3, task="one")
    RLOOGroupAdvantage()([single])
    check_broadcast(single, 0.3)


def test_reinforce_is_raw_reward():
    exps = [mk(r, run=i, mask=[True, False, True, True]) for i, r in enumerate([2.0, -1.0])]
    _, metrics = REINFORCEGroupAdvantage()(exps)
    check_broadcast(exps[0], 2.0)
    check_broadcast(exps[1], -1.0)
    assert metrics["reward_mean"] == pytest.approx(0.5)


def test_none_advantage_is_identity():
    exps = [mk(1.0)]
    fn = ADVANTAGE_FN.get("none")()
    assert fn(exps) == (exps, {})
    assert exps[0].advantages is None


# ------------------------------------------------------------------ PPO / GAE


def ref_gae(rewards, values, masks, gamma, lam):
    """Per-row numpy GAE on unpadded rows, then whitening over all masked tokens."""
    advs, rets = [], []
    for r, v in zip(rewards, values, strict=True):
        n = len(r)
        adv = np.zeros(n)
        last = 0.0
        for t in reversed(range(n)):
            nv = v[t + 1] if t + 1 < n else 0.0
            delta = r[t] + gamma * nv - v[t]
            last = delta + gamma * lam * last
            adv[t] = last
        advs.append(adv)
        rets.append(adv + np.asarray(v))
    flat = np.concatenate([a[np.asarray(m)] for a, m in zip(advs, masks, strict=True)])
    mean, std = flat.mean(), math.sqrt(flat.var(ddof=1) + 1e-8)
    out_adv = [(a - mean) / std * np.asarray(m) for a, m in zip(advs, masks, strict=True)]
    out_ret = [rt * np.asarray(m) for rt, m in zip(rets, masks, strict=True)]
    return out_adv, out_ret


def test_ppo_gae_with_values_kwarg_and_ragged_lengths():
    gamma, lam = 0.9, 0.8
    e1 = mk(1.0, resp=4, mask=[True, True, False, True])
    e2 = mk(-0.5, resp=2, task="t1")
    values = [torch.tensor([0.1, 0.2, 0.3, 0.4]), torch.tensor([0.5, -0.2])]
    fn = ADVANTAGE_FN.get("ppo")(gamma=gamma, lam=lam)
    assert fn.compute_in_trainer() is True
    out, metrics = fn([e1, e2], values=values)
    rewards = [[0, 0, 0, 1.0], [0, -0.5]]
    masks = [[True, True, False, True], [True, True]]
    ref_a, ref_r = ref_gae(rewards, [v.tolist() for v in values], masks, gamma, lam)
    for exp, a, r in zip(out, ref_a, ref_r, strict=True):
        np.testing.assert_allclose(exp.advantages.numpy(), a, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(exp.returns.numpy(), r, rtol=1e-5, atol=1e-6)
        assert exp.advantages.dtype == torch.float32
    assert "advantages/mean" in metrics


def test_ppo_gae_reads_info_values_and_token_level_reward():
    e = mk(None, resp=3, token_level_reward=[0.5, 0.0, 1.0])
    e.info["values"] = [0.0, 0.1, 0.2]
    PPOAdvantageFn(gamma=1.0, lam=1.0)([e, mk(0.0, resp=3, task="x", info={"values": [0, 0, 0]})])
    ref_a, _ = ref_gae(
        [[0.5, 0.0, 1.0], [0, 0, 0.0]],
        [[0.0, 0.1, 0.2], [0, 0, 0]],
        [[True, True, True]] * 2,
        1.0,
        1.0,
    )
    np.testing.assert_allclose(e.advantages.numpy(), ref_a[0], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="critic values"):
        PPOAdvantageFn()([mk(1.0)])


def test_gae_function_skips_whitening_for_single_token():
    adv, ret = compute_gae_advantage_return(
        torch.tensor([[1.0]]), torch.tensor([[0.25]]), torch.tensor([[True]]), 1.0, 1.0
    )
    assert adv.item() == pytest.approx(0.75)
    assert ret.item() == pytest.approx(1.0)
