"""AsymRE, REC, REINFORCE++, ReMax and step-wise GRPO against plain numpy / Python references."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from algorithms import ADVANTAGE_FN, GroupAdvantage
from algorithms.advantage_fn import (
    ASYMREGroupAdvantage,
    OPMDGroupAdvantage,
    RECGroupedAdvantage,
    REINFORCEPLUSPLUSAdvantageFn,
    REMAXAdvantageFn,
    StepWiseGRPOAdvantageFn,
)
from operators.advantage import GroupAdvantageOperator
from rftstream.experience import EID, Experience


def mk(reward, task="t0", run=0, step=0, resp=4, prompt=2, mask=None, batch=0, **kw) -> Experience:
    return Experience(
        tokens=list(range(prompt + resp)),
        prompt_length=prompt,
        reward=reward,
        action_mask=mask,
        eid=EID(batch=batch, task=task, run=run, step=step),
        **kw,
    )


def check_broadcast(exp: Experience, score: float) -> None:
    mask = exp.action_mask.numpy().astype(np.float32)
    assert exp.advantages.dtype == torch.float32
    assert exp.returns.dtype == torch.float32
    assert exp.advantages.shape == (exp.response_length,)
    np.testing.assert_allclose(exp.advantages.numpy(), score * mask, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(exp.returns.numpy(), exp.advantages.numpy())
    assert exp.returns.data_ptr() != exp.advantages.data_ptr()


def mean(xs):
    return sum(xs) / len(xs)


def std_unbiased(xs):
    m = mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def std_population(xs):
    m = mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs))


# ------------------------------------------------------------------ registry


@pytest.mark.parametrize(
    ("name", "cls", "in_trainer", "defaults"),
    [
        ("asymre", ASYMREGroupAdvantage, False, {"baseline_shift": -0.1}),
        (
            "rec",
            RECGroupedAdvantage,
            False,
            {"epsilon": 1e-6, "std_normalize": False, "drop": None},
        ),
        (
            "step_wise_grpo",
            StepWiseGRPOAdvantageFn,
            False,
            {
                "epsilon": 1e-6,
                "enable_step_norm": False,
                "std_cal_level": "group",
                "std_threshold": None,
            },
        ),
        ("reinforceplusplus", REINFORCEPLUSPLUSAdvantageFn, True, {"gamma": 1.0}),
        ("remax", REMAXAdvantageFn, True, {}),
    ],
)
def test_registered_with_trinity_names_defaults_and_placement(name, cls, in_trainer, defaults):
    assert ADVANTAGE_FN.get(name) is cls
    assert cls.compute_in_trainer() is in_trainer
    assert cls.default_args() == defaults
    cls(**defaults)  # the defaults are valid constructor arguments
    with pytest.raises(TypeError):
        cls(bogus=1)
    if in_trainer:
        with pytest.raises(ValueError, match="trainer"):
            GroupAdvantageOperator(advantage_fn=name)
    else:
        assert isinstance(GroupAdvantageOperator(advantage_fn=name).advantage_fn, cls)


def test_group_based_ones_are_group_advantages():
    assert issubclass(ASYMREGroupAdvantage, GroupAdvantage)
    assert issubclass(RECGroupedAdvantage, GroupAdvantage)


@pytest.mark.parametrize("name", ["asymre", "rec", "step_wise_grpo", "reinforceplusplus", "remax"])
def test_empty_list(name):
    assert ADVANTAGE_FN.get(name)()([]) == ([], {})


# ------------------------------------------------------------------ AsymRE


def test_asymre_interleaved_groups_single_and_masked_rows():
    shift = -0.25
    a = [mk(1.0, task="a", run=0), mk(0.0, task="a", run=1, mask=[False] * 4)]
    b = [mk(r, task="b", run=i, mask=[True, False, True, True]) for i, r in enumerate([3, 1, 2])]
    single = mk(0.7, task="s")
    out, metrics = ASYMREGroupAdvantage(baseline_shift=shift)(
        [a[0], b[0], single, a[1], b[1], b[2]]
    )
    assert out == [a[0], a[1], b[0], b[1], b[2], single]
    base_a, base_b = mean([1.0, 0.0]) + shift, mean([3, 1, 2]) + shift
    for exp in a:
        check_broadcast(exp, exp.reward - base_a)
    assert not a[1].advantages.any()  # fully masked row
    for exp in b:
        check_broadcast(exp, exp.reward - base_b)
    check_broadcast(single, 0.7)  # group of one: baseline 0
    assert metrics["group_baseline"] == pytest.approx(mean([base_a, base_b, 0.0]))
    assert metrics["reward_mean"] == pytest.approx(mean([0.5, 2.0, 0.7]))
    assert metrics["group_count"] == 3


def test_asymre_all_equal_rewards_get_minus_shift():
    exps = [mk(1.0, run=i) for i in range(3)]
    ASYMREGroupAdvantage()(exps)  # default shift -0.1
    for exp in exps:
        check_broadcast(exp, 0.1)


# ------------------------------------------------------------------ REC


def test_rec_plain_and_std_normalised():
    rewards = [1.0, 0.0, 0.5, 0.25]
    exps = [mk(r, run=i) for i, r in enumerate(rewards)]
    _, metrics = RECGroupedAdvantage()(exps)
    for exp, r in zip(exps, rewards, strict=True):
        check_broadcast(exp, r - mean(rewards))
    assert metrics["reward_mean"] == pytest.approx(mean(rewards))
    assert metrics["reward_std"] == pytest.approx(std_population(rewards), rel=1e-6)
    assert metrics["drop_balance"] == 0.0

    eps = 1e-3
    masked = [mk(r, run=i, mask=[True, False, True, False]) for i, r in enumerate(rewards)]
    RECGroupedAdvantage(epsilon=eps, std_normalize=True)(masked)
    for exp, r in zip(masked, rewards, strict=True):
        check_broadcast(exp, (r - mean(rewards)) / (std_population(rewards) + eps))


def test_rec_group_of_one_all_equal_and_fully_masked():
    single = mk(0.8, task="s")
    equal = [mk(2.0, task="e", run=i) for i in range(3)]
    masked = [mk(1.0, task="m", run=0, mask=[False] * 4), mk(0.0, task="m", run=1)]
    eps = 1e-2
    _, metrics = RECGroupedAdvantage(epsilon=eps, std_normalize=True, drop="balance")(
        [single, *equal, *masked]
    )
    check_broadcast(single, 0.8 / (1.0 + eps))  # mean 0, std 1
    for exp in equal:
        check_broadcast(exp, 0.0)
    check_broadcast(masked[0], 0.0)
    check_broadcast(masked[1], (0.0 - 0.5) / (0.5 + eps))
    assert metrics["group_count"] == 3
    assert metrics["drop_balance"] == 0.0


@pytest.mark.parametrize("seed", range(5))
def test_rec_balance_zeroes_surplus_negatives(seed):
    torch.manual_seed(seed)
    rewards = [1.0, 0.0, 0.0, 0.2, 0.1, 0.9]  # mean 0.366: 2 at-or-above, 4 below
    exps = [mk(r, run=i) for i, r in enumerate(rewards)]
    _, metrics = RECGroupedAdvantage(drop="balance")(exps)
    m = mean(rewards)
    below = [i for i, r in enumerate(rewards) if r < m]
    dropped = [i for i in below if not exps[i].advantages.any()]
    assert len(dropped) == 2  # 4 negatives - 2 positives
    kept = [r for i, r in enumerate(rewards) if i not in dropped]
    for i, exp in enumerate(exps):
        check_broadcast(exp, 0.0 if i in dropped else rewards[i] - mean(kept))
    assert metrics["drop_balance"] == pytest.approx(2 / 6)
    assert metrics["reward_mean"] == pytest.approx(mean(kept))
    assert metrics["reward_std"] == pytest.approx(std_population(kept), rel=1e-6)


def test_rec_balance_leaves_balanced_or_positive_heavy_groups():
    exps = [mk(r, run=i) for i, r in enumerate([1.0, 1.0, 0.0])]  # 2 positives, 1 negative
    _, metrics = RECGroupedAdvantage(drop="balance")(exps)
    for exp in exps:
        check_broadcast(exp, exp.reward - 2 / 3)
    assert metrics["drop_balance"] == 0.0
    with pytest.raises(ValueError, match="drop"):
        RECGroupedAdvantage(drop="random")


# ------------------------------------------------------------------ REINFORCE++


def ref_reinforce_pp(rewards, masks, gamma):
    """Per-row discounted returns, whitened over all masked tokens (unbiased var + 1e-8)."""
    rets = []
    for r in rewards:
        g, acc = np.zeros(len(r)), 0.0
        for t in reversed(range(len(r))):
            acc = r[t] + gamma * acc
            g[t] = acc
        rets.append(g)
    m = [np.asarray(x, dtype=bool) for x in masks]
    flat = np.concatenate([g[mk_] for g, mk_ in zip(rets, m, strict=True)])
    mu, sd = flat.mean(), math.sqrt(flat.var(ddof=1) + 1e-8)
    advs = [(g - mu) / sd * mk_ for g, mk_ in zip(rets, m, strict=True)]
    return advs, [g * mk_ for g, mk_ in zip(rets, m, strict=True)]


def test_reinforce_pp_batch_whitening_ragged_and_masked():
    gamma = 0.9
    e1 = mk(1.0, resp=4, mask=[True, True, False, True])
    e2 = mk(-0.5, resp=2, task="t1")
    e3 = mk(0.3, resp=3, task="t2", mask=[False] * 3)  # fully masked row
    e4 = mk(None, resp=3, task="t3", token_level_reward=[0.5, 0.0, 1.0])
    fn = REINFORCEPLUSPLUSAdvantageFn(gamma=gamma)
    out, metrics = fn([e1, e2, e3, e4])
    assert out == [e1, e2, e3, e4]
    ref_a, ref_r = ref_reinforce_pp(
        [[0, 0, 0, 1.0], [0, -0.5], [0, 0, 0.3], [0.5, 0.0, 1.0]],
        [[1, 1, 0, 1], [1, 1], [0, 0, 0], [1, 1, 1]],
        gamma,
    )
    # metrics: mean / unbiased std of the masked returns the whitening used
    # e1 [0.729, 0.81, (masked), 1], e2 [-0.45, -0.5], e3 none, e4 [0.5 + 0.9 * 0.9, 0.9, 1]
    masked = np.array([0.729, 0.81, 1.0, -0.45, -0.5, 1.31, 0.9, 1.0])
    assert set(metrics) == {"return_mean", "return_std"}
    assert metrics["return_mean"] == pytest.approx(masked.mean(), rel=1e-5)
    assert metrics["return_std"] == pytest.approx(masked.std(ddof=1), rel=1e-5)
    for exp, a, r in zip(out, ref_a, ref_r, strict=True):
        assert exp.advantages.dtype == torch.float32 and exp.returns.dtype == torch.float32
        assert exp.advantages.shape == (exp.response_length,)
        np.testing.assert_allclose(exp.advantages.numpy(), a, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(exp.returns.numpy(), r, rtol=1e-5, atol=1e-6)
    assert not e3.advantages.any() and not e3.returns.any()
    # the whitened advantages have zero mean over the masked tokens of the batch
    flat = torch.cat([e.advantages[e.action_mask] for e in out])
    assert float(flat.mean()) == pytest.approx(0.0, abs=1e-6)


def test_reinforce_pp_default_gamma_is_undiscounted():
    exps = [mk(1.0, resp=3), mk(0.0, resp=3, task="b")]
    REINFORCEPLUSPLUSAdvantageFn()(exps)
    ref_a, ref_r = ref_reinforce_pp([[0, 0, 1.0], [0, 0, 0.0]], [[1, 1, 1]] * 2, 1.0)
    for exp, a, r in zip(exps, ref_a, ref_r, strict=True):
        np.testing.assert_allclose(exp.advantages.numpy(), a, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(exp.returns.numpy(), r, rtol=1e-5, atol=1e-6)


def test_reinforce_pp_fewer_than_two_masked_tokens_and_bad_reward():
    e1 = mk(2.0, resp=3, mask=[False, False, True])
    e2 = mk(1.0, resp=2, task="b", mask=[False, False])
    _, metrics = REINFORCEPLUSPLUSAdvantageFn(gamma=0.5)([e1, e2])
    assert not e1.advantages.any() and not e2.advantages.any()
    np.testing.assert_allclose(e1.returns.numpy(), [0.0, 0.0, 2.0])
    assert metrics == {"return_mean": 2.0, "return_std": 0.0}  # one masked token
    e3 = mk(1.0, resp=2, mask=[False, False])
    _, metrics = REINFORCEPLUSPLUSAdvantageFn()([e3])  # no masked token at all
    assert not e3.advantages.any() and not e3.returns.any()
    assert metrics == {"return_mean": 0.0, "return_std": 0.0}
    with pytest.raises(ValueError, match="invalid_reward_filter"):
        REINFORCEPLUSPLUSAdvantageFn()([mk(None), mk(1.0, task="b")])


# ------------------------------------------------------------------ ReMax


def test_remax_with_kwarg_and_info_baselines():
    e1 = mk(1.0, resp=4, mask=[True, False, True, True])
    e2 = mk(-0.5, resp=2, task="b")
    e3 = mk(0.7, resp=3, task="c", mask=[True, True, False])  # reward on a masked token
    fn = REMAXAdvantageFn()
    out, metrics = fn([e1, e2, e3], reward_baselines=[0.25, 0.5, 0.1])
    assert metrics == {}

    def ref(rewards, mask, baseline):
        masked = np.asarray(rewards) * np.asarray(mask)
        ret = np.cumsum(masked[::-1])[::-1]
        return (ret - baseline) * np.asarray(mask), ret * np.asarray(mask)

    cases = [
        ([0, 0, 0, 1.0], [1, 0, 1, 1], 0.25),
        ([0, -0.5], [1, 1], 0.5),
        ([0, 0, 0.7], [1, 1, 0], 0.1),
    ]
    for exp, (r, m, b) in zip(out, cases, strict=True):
        a_ref, ret_ref = ref(r, m, b)
        np.testing.assert_allclose(exp.advantages.numpy(), a_ref, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(exp.returns.numpy(), ret_ref, rtol=1e-6, atol=1e-7)
        assert exp.advantages.dtype == torch.float32

    e4 = mk(1.0, resp=2, info={"reward_baseline": 0.4})
    fn([e4])
    np.testing.assert_allclose(e4.advantages.numpy(), [0.6, 0.6], rtol=1e-6)
    with pytest.raises(ValueError, match="reward_baseline"):
        fn([mk(1.0)])
    with pytest.raises(ValueError, match="baselines"):
        fn([mk(1.0), mk(0.0, task="b")], reward_baselines=[0.0])


# ------------------------------------------------------------------ step-wise GRPO


def multi_step_task(task, finals_and_steps, batch=0, masks=None):
    """One experience per step; the last step of each run carries the final reward."""
    exps = []
    for run, (final, n_steps) in enumerate(finals_and_steps):
        for step in range(n_steps):
            reward = final if step == n_steps - 1 else 0.0
            mask = None if masks is None else masks.get((run, step))
            exps.append(mk(reward, task=task, run=run, step=step, batch=batch, mask=mask))
    return exps


def ref_grpo_scores(finals, eps, std=None):
    if len(finals) == 1:
        m, s = 0.0, 1.0
    else:
        m, s = mean(finals), std_unbiased(finals)
    denom = s if std is None else std
    return [(f - m) / (denom + eps) for f in finals], m, s


def test_step_wise_grpo_broadcasts_final_score_to_every_step():
    eps = 1e-6
    t1 = multi_step_task(
        "t1", [(1.0, 3), (0.0, 1), (0.5, 2)], masks={(0, 1): [False] * 4, (2, 0): [1, 0, 1, 0]}
    )
    t2 = multi_step_task("t2", [(2.0, 2), (-1.0, 4)])
    interleaved = [t2[0], *t1[:2], t2[1], *t1[2:], *t2[2:]]
    out, metrics = StepWiseGRPOAdvantageFn()(interleaved)
    assert out == t2 + t1  # tasks and runs in first-seen order, steps in input order
    s1, m1, sd1 = ref_grpo_scores([1.0, 0.0, 0.5], eps)
    s2, m2, sd2 = ref_grpo_scores([2.0, -1.0], eps)
    for exp in t1:
        check_broadcast(exp, s1[exp.eid.run])
    assert not t1[1].advantages.any()  # fully masked step
    for exp in t2:
        check_broadcast(exp, s2[exp.eid.run])
    assert metrics["reward_mean"] == pytest.approx(mean([m1, m2]))
    assert metrics["reward_std"] == pytest.approx(mean([sd1, sd2]), rel=1e-6)
    assert metrics["experience_count"] == len(t1) + len(t2)
    assert metrics["filtered_count"] == 0
    assert metrics["skipped_group_ratio"] == 0.0
    assert metrics["group_count"] == 2


def test_step_wise_grpo_final_reward_is_the_largest_step_even_out_of_order():
    runs = multi_step_task("t", [(1.0, 3), (0.0, 2)])
    shuffled = [runs[2], runs[0], runs[3], runs[4], runs[1]]  # run 0 arrives 2, 0, 1
    StepWiseGRPOAdvantageFn()(shuffled)
    scores, _, _ = ref_grpo_scores([1.0, 0.0], 1e-6)
    for exp in runs:
        check_broadcast(exp, scores[exp.eid.run])


def test_step_wise_grpo_step_norm_single_run_and_all_equal():
    eps = 1e-6
    t = multi_step_task("t", [(1.0, 4), (0.0, 1), (0.25, 2)])
    single = multi_step_task("s", [(0.6, 3)])
    equal = multi_step_task("e", [(1.0, 2), (1.0, 3)])
    out, metrics = StepWiseGRPOAdvantageFn(enable_step_norm=True)(t + single + equal)
    scores, _, _ = ref_grpo_scores([1.0, 0.0, 0.25], eps)
    steps = {0: 4, 1: 1, 2: 2}
    for exp in t:
        check_broadcast(exp, scores[exp.eid.run] / steps[exp.eid.run])
    for exp in single:  # one rollout: mean 0, std 1
        check_broadcast(exp, 0.6 / (1 + eps) / 3)
    for exp in equal:
        check_broadcast(exp, 0.0)
    assert metrics["group_count"] == 3


def test_step_wise_grpo_batch_and_none_std_levels():
    eps = 1e-6
    a = multi_step_task("a", [(1.0, 2), (0.0, 3)])
    b = multi_step_task("b", [(4.0, 1), (2.0, 2), (3.0, 1)])
    c = multi_step_task("c", [(5.0, 2)])
    batch_std = std_unbiased([1.0, 0.0, 4.0, 2.0, 3.0, 5.0])
    StepWiseGRPOAdvantageFn(std_cal_level="batch")(a + b + c)
    for exps, finals in ((a, [1.0, 0.0]), (b, [4.0, 2.0, 3.0])):
        m = mean(finals)
        for exp in exps:
            check_broadcast(exp, (finals[exp.eid.run] - m) / (batch_std + eps))
    for exp in c:  # single rollout: mean 0, batch std
        check_broadcast(exp, 5.0 / (batch_std + eps))

    StepWiseGRPOAdvantageFn(std_cal_level="none")(a + b + c)
    for exps, finals in ((a, [1.0, 0.0]), (b, [4.0, 2.0, 3.0])):
        for exp in exps:
            check_broadcast(exp, finals[exp.eid.run] - mean(finals))
    for exp in c:
        check_broadcast(exp, 5.0)

    lone = multi_step_task("l", [(2.0, 2)])
    StepWiseGRPOAdvantageFn(std_cal_level="batch")(lone)  # one final reward: batch std 1
    for exp in lone:
        check_broadcast(exp, 2.0 / (1 + eps))
    with pytest.raises(ValueError, match="std_cal_level"):
        StepWiseGRPOAdvantageFn(std_cal_level="task")


def test_step_wise_grpo_std_threshold_drops_groups():
    low = multi_step_task("low", [(1.0, 2), (1.05, 3)])  # std 0.035
    high = multi_step_task("high", [(0.0, 1), (1.0, 2)])
    single = multi_step_task("one", [(1.0, 2)])
    out, metrics = StepWiseGRPOAdvantageFn(std_threshold=0.1)(low + high + single)
    assert out == high
    scores, _, _ = ref_grpo_scores([0.0, 1.0], 1e-6)
    for exp in high:
        check_broadcast(exp, scores[exp.eid.run])
    for exp in low + single:
        assert exp.advantages is None
    assert metrics["experience_count"] == len(high)
    assert metrics["filtered_count"] == len(low) + len(single)
    assert metrics["skipped_group_ratio"] == pytest.approx(2 / 3)
    assert metrics["group_count"] == 3


def test_step_wise_grpo_groups_by_batch_and_task_and_checks_final_rewards():
    a0 = multi_step_task("t", [(1.0, 2), (0.0, 2)], batch=0)
    a1 = multi_step_task("t", [(3.0, 1)], batch=1)  # same task id, other batch: own group
    _, metrics = StepWiseGRPOAdvantageFn()(a0 + a1)
    assert metrics["group_count"] == 2
    for exp in a1:
        check_broadcast(exp, 3.0 / (1 + 1e-6))
    # a missing reward on a non-final step is fine; on a final step it is an error
    ok = [mk(None, run=0, step=0), mk(1.0, run=0, step=1), mk(0.0, run=1, step=0)]
    StepWiseGRPOAdvantageFn()(ok)
    with pytest.raises(ValueError, match="invalid_reward_filter"):
        StepWiseGRPOAdvantageFn()([mk(1.0, run=0, step=0), mk(None, run=0, step=1)])


# ------------------------------------------------------------------ OPMD metric


def test_opmd_reports_reward_mean_like_trinity():
    exps = [mk(r, run=i) for i, r in enumerate([1.0, 0.0, 2.0])]
    _, metrics = OPMDGroupAdvantage(opmd_baseline="logavgexp", tau=0.5)(exps)
    assert metrics["reward_mean"] == pytest.approx(1.0)
    base = 0.5 * (math.log(sum(math.exp(r / 0.5) for r in [1.0, 0.0, 2.0])) - math.log(3))
    assert metrics["group_baseline"] == pytest.approx(base, rel=1e-6)
