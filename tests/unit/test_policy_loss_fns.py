"""Policy loss functions against numpy references; input discovery."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from algorithms import POLICY_LOSS_FN, PolicyLossFn, check_loss_inputs, loss_inputs_for
from algorithms.policy_loss_fn import (
    MIXPolicyLossFn,
    OPMDPolicyLossFn,
    PPOPolicyLossFn,
    SFTLossFn,
)
from algorithms.utils import masked_loss
from rftstream.errors import ConfigError

# ------------------------------------------------------------------ references


def ref_agg(v: np.ndarray, m: np.ndarray, mode: str) -> float:
    m = m.astype(bool)
    if not m.any():
        return 0.0
    if mode == "token-mean":
        return float(v[m].mean())
    rows = [(v[i][m[i]]) for i in range(v.shape[0]) if m[i].any()]
    if mode == "seq-mean-token-sum":
        return float(np.mean([r.sum() for r in rows]))
    if mode == "seq-mean-token-mean":
        return float(np.mean([r.mean() for r in rows]))
    return float(v[m].sum() / v.shape[-1])


def ref_ppo(lp, old, adv, mask, low, high, c, mode="token-mean"):
    lp, old, adv = (np.asarray(x, dtype=np.float64) for x in (lp, old, adv))
    mask = np.asarray(mask, dtype=bool)
    neg_kl = np.clip(lp - old, -20, 20)
    ratio = np.exp(neg_kl)
    l1 = -adv * ratio
    l2 = -adv * np.clip(ratio, 1 - low, 1 + high)
    c1 = np.maximum(l1, l2)
    metrics = {
        "pg_clipfrac": float((l2 > l1)[mask].mean()) if mask.any() else 0.0,
        "ppo_kl": float((-neg_kl)[mask].mean()) if mask.any() else 0.0,
    }
    if c is not None:
        l3 = -adv * c
        c2 = np.minimum(l3, c1)
        tok = np.where(adv < 0, c2, c1)
        lower = (c1 > l3) & (adv < 0)
        metrics["pg_clipfrac_lower"] = float(lower[mask].mean()) if mask.any() else 0.0
    else:
        tok = c1
    loss = ref_agg(tok, mask, mode)
    metrics["pg_loss"] = loss
    return loss, metrics


RATIOS = np.array(
    [[0.5, 0.85, 1.1, 1.25, 5.0], [0.7, 1.0, 1.35, 0.95, 2.0], [1.0, 1.0, 1.0, 1.0, 1.0]]
)
OLD = np.array(
    [[-1.0, -0.5, -2.0, -0.1, -3.0], [-0.2, -0.3, -1.5, -0.7, -0.9], [-1.0] * 5],
)
LP = OLD + np.log(RATIOS)
ADV = np.array([[1.0, -1.0, 1.0, 1.0, -1.0], [-0.5, 0.5, 2.0, -2.0, -1.5], [1.0] * 5])
MASK = np.array([[1, 1, 1, 1, 1], [1, 1, 1, 0, 1], [0, 0, 0, 0, 0]], dtype=bool)


def t(x, dtype=torch.float32):
    return torch.tensor(np.asarray(x), dtype=dtype)


# ------------------------------------------------------------------ PPO


@pytest.mark.parametrize(
    "kwargs,low,high,c",
    [
        ({}, 0.2, 0.2, 3.0),
        ({"clip_range": 0.1}, 0.1, 0.1, 3.0),
        ({"clip_range_low": 0.1, "clip_range_high": 0.3}, 0.1, 0.3, 3.0),
        ({"clip_range": 0.2, "clip_range_high": 0.28}, 0.2, 0.28, 3.0),
        ({"clip_ratio_c": None}, 0.2, 0.2, None),
        ({"clip_ratio_c": 2.0}, 0.2, 0.2, 2.0),
    ],
)
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_ppo_matches_reference(kwargs, low, high, c, mode):
    fn = PPOPolicyLossFn(loss_agg_mode=mode, **kwargs)
    loss, metrics = fn(
        logprob=t(LP), old_logprob=t(OLD), action_mask=t(MASK, torch.bool), advantages=t(ADV)
    )
    ref_loss, ref_metrics = ref_ppo(LP, OLD, ADV, MASK, low, high, c, mode)
    assert loss.item() == pytest.approx(ref_loss, rel=1e-5, abs=1e-6)
    assert set(metrics) == set(ref_metrics)
    for k, v in ref_metrics.items():
        assert metrics[k] == pytest.approx(v, rel=1e-5, abs=1e-6), k


def test_ppo_hand_computed_asymmetric_and_dual_clip():
    one = torch.tensor([[True]])
    # A=+1, ratio 1.25: symmetric 0.2 clips to 1.2; high=0.3 does not clip
    lp, old, a = torch.tensor([[math.log(1.25)]]), torch.zeros(1, 1), torch.ones(1, 1)
    assert PPOPolicyLossFn()(lp, old, one, a)[0].item() == pytest.approx(-1.2)
    asym = PPOPolicyLossFn(clip_range_low=0.1, clip_range_high=0.3)
    assert asym(lp, old, one, a)[0].item() == pytest.approx(-1.25)
    # A=-1, ratio 0.85: symmetric 0.2 does not clip (-A*0.85=0.85 vs 0.85); low=0.1 clips to 0.9
    lp2 = torch.tensor([[math.log(0.85)]])
    assert asym(lp2, old, one, -a)[0].item() == pytest.approx(0.9)
    # A=-1, ratio 5: PPO term 5, dual clip caps at c=3; no dual clip keeps 5
    lp3 = torch.tensor([[math.log(5.0)]])
    loss, m = PPOPolicyLossFn()(lp3, old, one, -a)
    assert loss.item() == pytest.approx(3.0)
    assert m["pg_clipfrac_lower"] == 1.0
    loss, m = PPOPolicyLossFn(clip_ratio_c=None)(lp3, old, one, -a)
    assert loss.item() == pytest.approx(5.0, rel=1e-6)
    assert "pg_clipfrac_lower" not in m


def test_ppo_gradient_and_all_masked_batch():
    lp = t(LP).requires_grad_(True)
    loss, _ = PPOPolicyLossFn()(lp, t(OLD), t(MASK, torch.bool), t(ADV))
    loss.backward()
    assert torch.isfinite(lp.grad).all()
    assert (lp.grad[2] == 0).all()  # fully masked row
    zero = torch.zeros(2, 3, dtype=torch.bool)
    loss, m = PPOPolicyLossFn()(torch.randn(2, 3), torch.randn(2, 3), zero, torch.randn(2, 3))
    assert loss.item() == 0.0 and m["pg_clipfrac"] == 0.0
    loss, _ = PPOPolicyLossFn()(
        torch.zeros(0, 3), torch.zeros(0, 3), torch.zeros(0, 3, dtype=torch.bool), torch.zeros(0, 3)
    )
    assert loss.item() == 0.0


def test_ppo_bad_args():
    with pytest.raises(ValueError, match="clip_ratio_c"):
        PPOPolicyLossFn(clip_ratio_c=1.0)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        PPOPolicyLossFn(loss_agg_mode="sum")
    assert PPOPolicyLossFn(clip_range=None).clip_range_high == 0.2


# ------------------------------------------------------------------ SFT / OPMD


def test_sft_token_and_sequence_level():
    lp = np.array([[-1.0, -2.0, -3.0], [-0.5, -0.5, -9.0], [-4.0, -4.0, -4.0]])
    mask = np.array([[1, 1, 0], [1, 1, 1], [0, 0, 0]], dtype=bool)
    loss, m = SFTLossFn()(t(lp), t(mask, torch.bool))
    assert loss.item() == pytest.approx(-lp[mask].mean())
    assert m["sft_loss"] == pytest.approx(loss.item())
    loss, _ = SFTLossFn(use_token_level_loss=False)(logprob=t(lp), action_mask=t(mask, torch.bool))
    assert loss.item() == pytest.approx(np.mean([1.5, 10.0 / 3]))


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum"])
def test_opmd_loss(mode):
    tau = 0.5
    fn = OPMDPolicyLossFn(tau=tau, loss_agg_mode=mode)
    loss, m = fn(logprob=t(LP), action_mask=t(MASK, torch.bool), advantages=t(ADV))
    expected = ref_agg(-ADV * LP, MASK, mode) / (1 + tau)
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    assert m["opmd_loss"] == pytest.approx(expected, rel=1e-5)


# ------------------------------------------------------------------ MIX


def ref_mix(lp, old, adv, mask, expert, mu, clip, ga, tbs_u, tbs_e, dyn=False, epg=1):
    rows = lp.shape[0]
    usual, exp_ = ~expert, expert
    n_u, n_e = int(usual.sum()), int(exp_.sum())
    if dyn:
        w_u, w_e = epg / (rows * tbs_u), epg / (rows * tbs_e)
    else:
        w_u, w_e = ga / tbs_u, ga / tbs_e
    g, gm = (0.0, {})
    if n_u:
        g, gm = ref_ppo(lp[usual], old[usual], adv[usual], mask[usual], clip, clip, 3.0)
        g, gm = g * n_u * w_u, {k: v * n_u * w_u for k, v in gm.items()}
    s, sm = 0.0, {}
    if n_e:
        s = float(-lp[exp_][mask[exp_]].mean()) * n_e * w_e
        sm = {"sft_loss": s}
    metrics = {f"usual/{k}": v for k, v in gm.items()}
    metrics.update({f"expert/{k}": v for k, v in sm.items()})
    loss = (1 - mu) * g + mu * s
    metrics["loss"] = loss
    return loss, metrics


@pytest.mark.parametrize("dyn", [False, True])
@pytest.mark.parametrize(
    "expert", [[False, True, False], [False, False, False], [True, True, True]]
)
def test_mix_matches_reference(dyn, expert):
    expert = np.array(expert)
    mask = np.array([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0], [1, 0, 1, 1, 1]], dtype=bool)
    kwargs = dict(
        mu=0.3,
        clip_range=0.2,
        use_dynamic_bsz=dyn,
        ppo_mini_batch_size=8,
        ppo_micro_batch_size_per_gpu=2,
        ngpus_trainer=2,
        train_batch_size_usual=6,
        train_batch_size_expert=2,
    )
    fn = MIXPolicyLossFn(**kwargs)
    loss, metrics = fn(
        logprob=t(LP),
        old_logprob=t(OLD),
        action_mask=t(mask, torch.bool),
        advantages=t(ADV),
        expert_mask=t(expert, torch.bool),
    )
    ref_loss, ref_metrics = ref_mix(
        LP, OLD, ADV, mask, expert, 0.3, 0.2, ga=4, tbs_u=6, tbs_e=2, dyn=dyn, epg=4
    )
    assert loss.item() == pytest.approx(ref_loss, rel=1e-5, abs=1e-7)
    assert set(metrics) == set(ref_metrics)
    for k, v in ref_metrics.items():
        assert metrics[k] == pytest.approx(v, rel=1e-5, abs=1e-7), k


def test_mix_accepts_seed_yaml_args_and_defaults():
    fn = MIXPolicyLossFn(
        mu=0.1,
        clip_range=0.2,
        use_token_level_loss_in_sft=False,
        use_dynamic_bsz=False,
        repeat_times=8,
        ppo_mini_batch_size=256,
        ppo_micro_batch_size_per_gpu=4,
        ngpus_trainer=4,
        train_batch_size_expert=64,
        train_batch_size_usual=192,
    )
    assert fn.gradient_accumulation == 64 and fn.experience_per_gpu == 64
    assert MIXPolicyLossFn().grpo_loss_fn.clip_range_low == 0.2
    assert MIXPolicyLossFn.default_args() == {"mu": 0.1, "clip_range": 0.2}


# ------------------------------------------------------------------ input discovery


class SeedStyleOPMD(PolicyLossFn):
    """The guide's OPMD loss, verbatim: no super().__init__(), self.loss_agg_mode used."""

    def __init__(self, tau: float = 1.0) -> None:
        self.tau = tau

    def __call__(self, logprob, action_mask, advantages, **kwargs):  # type: ignore[override]
        pg_losses = -advantages * logprob
        opmd_loss = masked_loss(pg_losses, action_mask, loss_agg_mode=self.loss_agg_mode)
        return opmd_loss / (1.0 + self.tau), {"opmd_loss": opmd_loss.item()}


def test_loss_inputs_for_seed_losses():
    assert loss_inputs_for(OPMDPolicyLossFn()) == ["logprob", "action_mask", "advantages"]
    assert loss_inputs_for(MIXPolicyLossFn) == [
        "logprob",
        "old_logprob",
        "action_mask",
        "advantages",
        "expert_mask",
    ]
    assert loss_inputs_for(PPOPolicyLossFn) == [
        "logprob",
        "old_logprob",
        "action_mask",
        "advantages",
    ]
    assert loss_inputs_for(SeedStyleOPMD()) == ["logprob", "action_mask", "advantages"]
    assert MIXPolicyLossFn().select_keys == [
        "old_logprob",
        "action_mask",
        "advantages",
        "expert_mask",
    ]
    # the verbatim guide code works without calling super().__init__()
    loss, _ = SeedStyleOPMD(tau=1.0)(t(LP), t(MASK, torch.bool), t(ADV))
    assert loss.item() == pytest.approx(ref_agg(-ADV * LP, MASK, "token-mean") / 2, rel=1e-5)


def test_check_loss_inputs():
    base = {"logprob", "old_logprob", "action_mask", "advantages"}
    assert check_loss_inputs(OPMDPolicyLossFn(), base) == ["logprob", "action_mask", "advantages"]
    with pytest.raises(ConfigError) as info:
        check_loss_inputs(MIXPolicyLossFn(), base)
    assert info.value.key_path == "algorithm.policy_loss_fn"
    assert "needs field 'expert_mask' which no experience field provides" in str(info.value)
    assert check_loss_inputs(MIXPolicyLossFn(), base | {"expert_mask"})[-1] == "expert_mask"

    class Optional_(PolicyLossFn):
        def __call__(self, logprob, action_mask, ref_logprob=None, **kwargs):  # type: ignore[override]
            return logprob.sum(), {}

    assert check_loss_inputs(Optional_, {"logprob", "action_mask"}) == ["logprob", "action_mask"]


def test_registry_and_base_args():
    assert {"ppo", "sft", "opmd", "mix"} <= set(POLICY_LOSS_FN.names())
    with pytest.raises(TypeError, match="unexpected argument"):
        SFTLossFn(bogus=1)  # forwarded to PolicyLossFn.__init__, which rejects it
    assert SFTLossFn(loss_agg_mode="seq-mean-token-sum").loss_agg_mode == "seq-mean-token-sum"
