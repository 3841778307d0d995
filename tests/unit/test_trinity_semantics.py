"""Trinity-RFT 0.6 semantics that ported code depends on, against references written here.

* Entropy fns return the bonus ``+entropy_coef * H``; the trainer subtracts it
  (checked on the loss the trainer builds for one micro-batch, tiny model).
* ``sft`` aggregates with ``loss_agg_mode``; MIX's ``sft_loss_agg_mode`` /
  ``grpo_loss_agg_mode`` choose each part's mode.
* GRPO's ``std_cal_level``, ``rank_penalty``, ``duplicate_experiences``.
* PPO's ``enable_sequence_masking`` / ``delta_sequence_masking`` and
  ``fallback_to_policy_gradient``.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from algorithms import ENTROPY_LOSS_FN, POLICY_LOSS_FN
from algorithms.advantage_fn import GRPOGroupedAdvantage
from algorithms.algorithm import resolve_algorithm
from algorithms.policy_loss_fn import MIXPolicyLossFn, PPOPolicyLossFn
from rftstream.config.schema import AlgorithmConfig
from rftstream.errors import ConfigError
from rftstream.experience import EID, Experience

MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]

LP = np.array(
    [[-0.5, -1.0, -2.0, -0.1], [-0.3, -0.7, -9.0, -9.0], [-1.5, -0.2, -0.4, -0.9]],
    dtype=np.float64,
)
MASK = np.array([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=bool)


def t(a: np.ndarray, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.tensor(a, dtype=dtype)


def ref_agg(values: np.ndarray, mask: np.ndarray, mode: str) -> float:
    """verl's agg_loss in plain numpy (rows with no token are left out of seq means)."""
    m = mask.astype(np.float64)
    if mode == "token-mean":
        return float((values * m).sum() / m.sum())
    if mode == "seq-mean-token-sum-norm":
        return float((values * m).sum() / mask.shape[-1])
    rows = m.sum(-1) > 0
    sums = (values * m).sum(-1)
    per_row = sums if mode == "seq-mean-token-sum" else sums / np.maximum(m.sum(-1), 1)
    return float(per_row[rows].mean())


# ------------------------------------------------------------------ entropy sign


@pytest.mark.parametrize("name", ["default", "mix"])
def test_entropy_fn_returns_plus_coef_times_entropy(name: str) -> None:
    ent = np.abs(LP)
    fn = ENTROPY_LOSS_FN.get(name)(entropy_coef=0.25, loss_agg_mode="token-mean")
    expert = torch.tensor([False, True, False])
    bonus, metrics = fn(entropy=t(ent), action_mask=t(MASK, torch.bool), expert_mask=expert)
    rows = [0, 2] if name == "mix" else [0, 1, 2]
    agg = ref_agg(ent[rows], MASK[rows], "token-mean")
    assert bonus.item() == pytest.approx(0.25 * agg, rel=1e-6)
    assert metrics["entropy_loss"] == pytest.approx(agg, rel=1e-6)


class _ZeroPolicyLoss(PPOPolicyLossFn):
    """A policy loss of 0 (with the graph), so the trainer's total is KL + entropy only."""

    def __call__(self, logprob, old_logprob, action_mask, advantages, **kwargs):  # type: ignore[override]
        return (logprob * 0.0).sum(), {}


def test_trainer_subtracts_the_entropy_bonus(tmp_path: Path, tiny_model_path: str) -> None:
    """total = policy + kl - bonus: the step's loss is -coef * token-mean entropy here."""
    from rftstream.config import config_from_dict
    from rftstream.runtime import prepare_run
    from rftstream.training.policy_trainer import PolicyTrainer
    from tests.integration._util import small_config

    POLICY_LOSS_FN.register_module("zero_policy_loss_for_test")(_ZeroPolicyLoss)
    data = small_config(tmp_path, tiny_model_path)
    data["algorithm"].update(
        {
            "algorithm_type": "grpo",
            "policy_loss_fn": "zero_policy_loss_for_test",
            "kl_loss_fn": "none",
            "entropy_loss_fn_args": {"entropy_coef": 0.5},
        }
    )
    run = prepare_run(config_from_dict(data))
    trainer = PolicyTrainer(run.cfg, run.model_path, run.algorithm)
    exps = [
        Experience(
            tokens=[5, 6, 7 + i, 8, 9],
            prompt_length=2,
            reward=0.0,
            logprobs=[0.0] * 3,
            advantages=[0.0] * 3,
            eid=EID(0, f"t{i}", 0),
        )
        for i in range(2)
    ]
    out = trainer.train_step(exps)
    # every micro-batch's loss is 0 - 0.5 * its token-mean entropy (the old sign gave +)
    assert out["actor/entropy"] > 0
    assert out["actor/loss"] == pytest.approx(-0.5 * out["actor/entropy"], rel=1e-5)


# ------------------------------------------------------------------ sft / MIX aggregation


@pytest.mark.parametrize("mode", MODES)
def test_sft_aggregates_with_loss_agg_mode(mode: str) -> None:
    fn = POLICY_LOSS_FN.get("sft")(loss_agg_mode=mode)
    loss, metrics = fn(logprob=t(LP), action_mask=t(MASK, torch.bool))
    assert loss.item() == pytest.approx(ref_agg(-LP, MASK, mode), rel=1e-6)
    assert metrics["sft_loss"] == pytest.approx(loss.item())


@pytest.mark.parametrize("mode", MODES)
def test_algorithm_loss_agg_mode_reaches_sft(mode: str) -> None:
    r = resolve_algorithm(AlgorithmConfig(algorithm_type="raft", loss_agg_mode=mode))
    loss, _ = r.policy_loss_fn(logprob=t(LP), action_mask=t(MASK, torch.bool))
    assert loss.item() == pytest.approx(ref_agg(-LP, MASK, mode), rel=1e-6)


def test_sft_pre_06_flag_still_means_what_it_meant() -> None:
    fn = POLICY_LOSS_FN.get("sft")(loss_agg_mode="seq-mean-token-sum", use_token_level_loss=False)
    loss, _ = fn(logprob=t(LP), action_mask=t(MASK, torch.bool))
    assert loss.item() == pytest.approx(ref_agg(-LP, MASK, "seq-mean-token-mean"), rel=1e-6)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        POLICY_LOSS_FN.get("sft")(loss_agg_mode="token-sum")


def _ref_ppo_first_pass(adv: np.ndarray, mask: np.ndarray, mode: str) -> float:
    """PPO loss at ratio 1 (old == new): -A, aggregated."""
    return ref_agg(-adv, mask, mode)


@pytest.mark.parametrize(
    "sft_mode,grpo_mode", [("seq-mean-token-sum", None), (None, "seq-mean-token-mean")]
)
def test_mix_part_modes(sft_mode: str | None, grpo_mode: str | None) -> None:
    adv = np.array([[1.0, 1.0, 1.0, 1.0], [0.0] * 4, [-0.5] * 4])
    expert = np.array([False, True, False])
    mu, base = 0.3, "token-mean"
    fn = MIXPolicyLossFn(
        mu=mu, loss_agg_mode=base, sft_loss_agg_mode=sft_mode, grpo_loss_agg_mode=grpo_mode
    )
    loss, _ = fn(
        logprob=t(LP),
        old_logprob=t(LP),
        action_mask=t(MASK, torch.bool),
        advantages=t(adv),
        expert_mask=torch.tensor(expert),
    )
    usual = ~expert
    grpo = _ref_ppo_first_pass(adv[usual], MASK[usual], grpo_mode or base) * usual.sum()
    sft = ref_agg(-LP[expert], MASK[expert], sft_mode or base) * expert.sum()
    assert loss.item() == pytest.approx((1 - mu) * grpo + mu * sft, rel=1e-5)


def test_mix_modes_resolve_from_config() -> None:
    r = resolve_algorithm(
        AlgorithmConfig(
            algorithm_type="mix",
            policy_loss_fn_args={"sft_loss_agg_mode": "seq-mean-token-sum"},
            loss_agg_mode="seq-mean-token-mean",
        )
    )
    assert r.policy_loss_fn.sft_loss_fn.loss_agg_mode == "seq-mean-token-sum"
    assert r.policy_loss_fn.grpo_loss_fn.loss_agg_mode == "seq-mean-token-mean"
    with pytest.raises(ConfigError) as ei:
        resolve_algorithm(
            AlgorithmConfig(algorithm_type="mix", policy_loss_fn_args={"grpo_loss_agg_mode": "x"})
        )
    assert ei.value.key_path == "algorithm.policy_loss_fn_args"


# ------------------------------------------------------------------ GRPO arguments


def mk(reward: float, task: str = "t0", run: int = 0, logprobs: list[float] | None = None):
    return Experience(
        tokens=[1, 2, 3, 4, 5],
        prompt_length=2,
        reward=reward,
        logprobs=logprobs if logprobs is not None else [-1.0, -1.0, -1.0],
        eid=EID(batch=0, task=task, run=run),
    )


def adv_of(exp: Experience) -> float:
    return float(exp.advantages[0])


def test_grpo_std_cal_level_batch_divides_by_the_batch_std() -> None:
    groups = {"a": [1.0, 0.0, 0.5], "b": [2.0, 4.0]}
    exps = [mk(r, task=g, run=i) for g, rs in groups.items() for i, r in enumerate(rs)]
    out, _ = GRPOGroupedAdvantage(std_cal_level="batch", epsilon=1e-6)(exps)
    all_r = [r for rs in groups.values() for r in rs]
    batch_std = float(np.std(all_r, ddof=1))
    for exp in out:
        rs = groups[exp.eid.task]
        want = (exp.reward - sum(rs) / len(rs)) / (batch_std + 1e-6)
        assert adv_of(exp) == pytest.approx(want, rel=1e-5)
    with pytest.raises(ValueError, match="std_cal_level"):
        GRPOGroupedAdvantage(std_cal_level="global")


def test_grpo_rank_penalty_scales_rewards_by_logprob_rank() -> None:
    rewards = [1.0, 1.0, 0.0, 1.0]
    mean_lps = [-0.5, -2.0, -1.0, -0.1]  # ranks (0 = lowest): 2, 0, 1, 3
    exps = [
        mk(r, run=i, logprobs=[lp] * 3)
        for i, (r, lp) in enumerate(zip(rewards, mean_lps, strict=True))
    ]
    penalty = 0.4
    out, _ = GRPOGroupedAdvantage(rank_penalty=penalty)(exps)
    order = sorted(range(4), key=lambda i: mean_lps[i])
    rank = {i: order.index(i) for i in range(4)}
    shaped = [rewards[i] * (1 - rank[i] / 4 * penalty) for i in range(4)]
    mean = sum(shaped) / 4
    std = math.sqrt(sum((s - mean) ** 2 for s in shaped) / 3)
    for i, exp in enumerate(out):
        assert adv_of(exp) == pytest.approx((shaped[i] - mean) / (std + 1e-6), rel=1e-5)


def test_grpo_duplicate_experiences_replaces_skipped_groups() -> None:
    exps = [mk(1.0, task="flat", run=i) for i in range(3)] + [
        mk(r, task="ok", run=i) for i, r in enumerate([1.0, 0.0, 0.5])
    ]
    out, metrics = GRPOGroupedAdvantage(std_threshold=0.0, duplicate_experiences=True)(exps)
    assert len(out) == 6 and all(e.eid.task == "ok" for e in out)
    assert metrics["skipped_count"] == 3 and metrics["duplicated_count"] == 3
    assert len({e.eid.uid for e in out}) == 6  # the copies train as other rows
    originals = [adv_of(e) for e in out[:3]]
    assert sorted(adv_of(e) for e in out[3:]) == pytest.approx(sorted(originals))
    # without duplicate_experiences the flat group stays, with advantage 0
    kept, _ = GRPOGroupedAdvantage(std_threshold=0.0)(
        [mk(1.0, task="flat", run=i) for i in range(3)]
    )
    assert [adv_of(e) for e in kept] == [0.0, 0.0, 0.0]
    # only skipped groups in the call: nothing is left (as in Trinity-RFT)
    gone, _ = GRPOGroupedAdvantage(std_threshold=0.0, duplicate_experiences=True)(
        [mk(1.0, task="flat", run=i) for i in range(3)]
    )
    assert gone == []


# ------------------------------------------------------------------ PPO arguments


def test_ppo_fallback_to_policy_gradient_ignores_old_logprob() -> None:
    adv = np.array([[1.0, -1.0, 2.0, 0.5], [0.3] * 4, [-2.0] * 4])
    lp = t(LP).requires_grad_(True)
    fn = PPOPolicyLossFn(fallback_to_policy_gradient=True)
    loss, metrics = fn(lp, t(LP + 3.0), t(MASK, torch.bool), t(adv))  # far-off old logprob
    assert loss.item() == pytest.approx(ref_agg(-adv, MASK, "token-mean"), rel=1e-6)
    assert metrics["pg_clipfrac"] == 0.0 and metrics["ppo_kl"] == 0.0
    loss.backward()
    np.testing.assert_allclose(lp.grad.numpy(), np.where(MASK, -adv / MASK.sum(), 0), rtol=1e-6)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_ppo_sequence_masking(mode: str) -> None:
    old = LP.copy()
    old[0] += 0.5  # row 0: mean KL old - new = 0.5 > delta
    old[2] += 0.05  # row 2: 0.05 <= delta
    adv = np.array([[1.0, -1.0, -2.0, -1.0], [-1.0] * 4, [-0.5] * 4])
    delta = 0.1
    common = {"clip_range": 10.0, "clip_ratio_c": None, "loss_agg_mode": mode}  # nothing clips
    fn = PPOPolicyLossFn(enable_sequence_masking=True, delta_sequence_masking=delta, **common)
    fn_plain = PPOPolicyLossFn(**common)
    ratio = np.exp(LP - old)
    per_token = -adv * ratio
    row_kl = np.array([((old - LP) * MASK)[i].sum() / MASK[i].sum() for i in range(3)])
    drop = (adv < 0) & (row_kl > delta)[:, None]
    per_token = np.where(drop, 0.0, per_token)
    loss, metrics = fn(t(LP), t(old), t(MASK, torch.bool), t(adv))
    assert loss.item() == pytest.approx(ref_agg(per_token, MASK, mode), rel=1e-5)
    assert metrics["seq_mask/masked_tokens"] == pytest.approx((drop & MASK).sum() / MASK.sum())
    assert metrics["seq_mask/mean_sequence_kl"] == pytest.approx(row_kl.mean(), rel=1e-5)
    plain, _ = fn_plain(t(LP), t(old), t(MASK, torch.bool), t(adv))
    assert plain.item() != pytest.approx(loss.item())


def test_ppo_arguments_resolve_from_config() -> None:
    r = resolve_algorithm(
        AlgorithmConfig(
            algorithm_type="grpo",
            policy_loss_fn_args={
                "enable_sequence_masking": True,
                "delta_sequence_masking": 0.2,
                "fallback_to_policy_gradient": True,
            },
            advantage_fn_args={"std_cal_level": "batch", "rank_penalty": 0.1},
        )
    )
    assert r.policy_loss_fn.enable_sequence_masking is True
    assert r.policy_loss_fn.delta_sequence_masking == 0.2
    assert r.policy_loss_fn.fallback_to_policy_gradient is True
    assert r.advantage_fn.std_cal_level == "batch" and r.advantage_fn.rank_penalty == 0.1
