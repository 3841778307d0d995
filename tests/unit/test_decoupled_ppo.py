"""The decoupled PPO loss (``decoupled_ppo``): its gradient against closed forms computed
here with numpy, equality with ``ppo`` on fresh rollouts, the staleness weight, the
rollout-logprob mask built by ``collate``, config resolution and a real trainer step.

Closed form per token (``r = exp(logprob - old_logprob)``, ``w = exp(old_logprob -
rollout_logprob)`` capped, 1 where a token has no rollout logprob)::

    d loss / d logprob_t = -A_t * w_t * r_t * g_t   if PPO's clip is inactive at t, else 0

with ``g_t`` the aggregation's factor (``1 / N`` for ``token-mean``).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from algorithms import POLICY_LOSS_FN, loss_inputs_for, resolve_algorithm
from algorithms.policy_loss_fn import DecoupledPPOPolicyLossFn, PPOPolicyLossFn
from rftstream.config import config_from_dict
from rftstream.config.schema import AlgorithmConfig
from rftstream.errors import ConfigError
from rftstream.experience import EID, Experience
from rftstream.runtime import prepare_run
from rftstream.training.batch import collate, has_rollout_logprobs, trainer_tensors
from tests.integration._util import small_config
from tests.unit._trainer import assert_gradients_match, capture_gradients, row_logprobs

MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
LOW, HIGH, DUAL = 0.2, 0.2, 3.0

# ------------------------------------------------------------------ closed forms (numpy)


def agg_factor(mask: np.ndarray, mode: str) -> np.ndarray:
    """Per-token g with loss = sum(g * v) for ``mode`` (rows without tokens left out)."""
    rows, length = mask.shape
    live = mask.any(axis=1)
    g = np.zeros((rows, length))
    for i in range(rows):
        if not live[i]:
            continue
        if mode == "token-mean":
            g[i] = 1.0 / mask.sum()
        elif mode == "seq-mean-token-mean":
            g[i] = 1.0 / (live.sum() * mask[i].sum())
        elif mode == "seq-mean-token-sum":
            g[i] = 1.0 / live.sum()
        else:
            g[i] = 1.0 / length
    return g * mask


def expected_weight(old, rollout, has, cap, mode):
    raw = np.where(has, np.exp(old - rollout), 1.0)
    if cap is None:
        return raw
    if mode == "truncate":
        return np.minimum(raw, cap)
    return np.where(raw > cap, 0.0, raw)


def clip_active(ratio: np.ndarray, adv: np.ndarray) -> np.ndarray:
    """Where PPO-clip (with dual clip) takes a constant branch: zero gradient."""
    upper = (adv > 0) & (ratio > 1 + HIGH)
    lower = (adv < 0) & (ratio < 1 - LOW)
    dual = (adv < 0) & (ratio > DUAL)
    return upper | lower | dual


def ppo_token_loss(ratio: np.ndarray, adv: np.ndarray) -> np.ndarray:
    loss = np.maximum(-adv * ratio, -adv * np.clip(ratio, 1 - LOW, 1 + HIGH))
    return np.where(adv < 0, np.minimum(loss, -adv * DUAL), loss)


# ------------------------------------------------------------------ a hand-made batch

# ratios r = exp(logprob - old) chosen away from every clip boundary: inside the range,
# above 1 + high, below 1 - low, and above the dual clip c = 3
RATIOS = np.array(
    [
        [1.0, 1.1, 0.9, 1.5, 0.5, 4.0],
        [1.05, 0.7, 1.3, 0.95, 3.5, 1.0],
        [0.85, 1.15, 1.0, 2.0, 0.6, 1.1],
        [1.0, 0.9, 1.1, 1.0, 1.2, 0.75],
    ]
)
# target behaviour weights w = exp(old - rollout): below 1, 1, between 1 and the cap 2, above it
WEIGHTS = np.array(
    [
        [1.0, 0.5, 1.7, 2.5, 1.2, 0.8],
        [3.0, 1.0, 0.4, 1.9, 1.0, 6.0],
        [1.0, 1.0, 1.0, 1.0, 1.0, 1.0],  # row 2 has no rollout logprobs (zeros in the batch)
        [1.5, 2.2, 0.9, 1.0, 0.3, 1.1],
    ]
)
ADV = np.array(
    [
        [1.0, -0.5, 0.8, -1.2, 0.6, -0.9],
        [-0.7, 1.1, -0.4, 0.9, -1.3, 0.5],
        [0.8, -0.6, 1.2, 0.7, -0.5, -1.0],
        [-1.5, 0.4, -0.8, 1.3, 0.9, -0.2],
    ]
)
MASK = np.array(
    [
        [1, 1, 1, 1, 1, 1],
        [1, 1, 1, 1, 0, 0],
        [1, 1, 1, 1, 1, 0],
        [1, 1, 1, 0, 0, 0],
    ],
    dtype=bool,
)


def hand_batch(*, with_has_row2: bool = False) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    old = -rng.uniform(0.1, 2.5, size=RATIOS.shape)
    lp = old + np.log(RATIOS)
    rollout = old - np.log(WEIGHTS)
    has = np.ones_like(MASK)
    has[2] = with_has_row2
    rollout[2] = 0.0  # what collate fills where a row has none
    rollout[~MASK] = 0.0  # padding
    f32 = lambda x: x.astype(np.float32).astype(np.float64)  # noqa: E731
    return {
        "logprob": f32(lp),
        "old_logprob": f32(old),
        "rollout_logprob": f32(rollout),
        "advantages": f32(ADV),
        "action_mask": MASK,
        "rollout_logprob_mask": has,
    }


def run(fn, b: dict[str, np.ndarray], *, float_masks: bool = True, detach_old: bool = False):
    """Call the loss; returns (loss, metrics, d loss / d logprob as numpy)."""
    lp = torch.tensor(b["logprob"], dtype=torch.float32, requires_grad=True)
    old = lp.detach() if detach_old else torch.tensor(b["old_logprob"], dtype=torch.float32)
    mdt = torch.float32 if float_masks else torch.bool
    kwargs: dict[str, Any] = {
        "logprob": lp,
        "old_logprob": old,
        "action_mask": torch.tensor(b["action_mask"], dtype=mdt),
        "advantages": torch.tensor(b["advantages"], dtype=torch.float32),
    }
    if isinstance(fn, DecoupledPPOPolicyLossFn):
        kwargs["rollout_logprob"] = torch.tensor(b["rollout_logprob"], dtype=torch.float32)
        kwargs["rollout_logprob_mask"] = torch.tensor(b["rollout_logprob_mask"], dtype=mdt)
    loss, metrics = fn(**kwargs)
    loss.backward()
    return loss, metrics, lp.grad.numpy().astype(np.float64)


# ------------------------------------------------------------------ the gradient, by formula


@pytest.mark.parametrize("agg", MODES)
@pytest.mark.parametrize("cap_mode", ["truncate", "mask"])
@pytest.mark.parametrize("float_masks", [True, False])
def test_gradient_is_the_closed_form(agg: str, cap_mode: str, float_masks: bool) -> None:
    b = hand_batch()
    fn = DecoupledPPOPolicyLossFn(loss_agg_mode=agg, behav_imp_weight_mode=cap_mode)
    loss, metrics, grad = run(fn, b, float_masks=float_masks)

    mask, adv = b["action_mask"], b["advantages"]
    ratio = np.exp(b["logprob"] - b["old_logprob"])
    has = b["rollout_logprob_mask"].astype(bool)
    w = expected_weight(b["old_logprob"], b["rollout_logprob"], has, 2.0, cap_mode)
    g = agg_factor(mask, agg)
    want = np.where(clip_active(ratio, adv), 0.0, -adv * w * ratio) * g
    np.testing.assert_allclose(grad, want, rtol=1e-5, atol=1e-8)
    want_loss = float((ppo_token_loss(ratio, adv) * w * g).sum())
    assert loss.item() == pytest.approx(want_loss, rel=1e-5)
    assert metrics["pg_loss"] == pytest.approx(want_loss, rel=1e-5)

    # the hand-made batch exercises every branch it claims to
    assert clip_active(ratio, adv)[mask].any() and (~clip_active(ratio, adv))[mask].any()
    assert ((WEIGHTS > 2.0) & mask & has).any() and ((WEIGHTS < 1.0) & mask & has).any()
    # row 2 has no rollout logprobs: w = 1 (not exp(old_logprob - 0)), exactly PPO there
    row2 = np.where(clip_active(ratio[2], adv[2]), 0.0, -adv[2] * ratio[2]) * g[2]
    np.testing.assert_allclose(grad[2], row2, rtol=1e-5, atol=1e-8)
    # padding never contributes
    assert (grad[~mask] == 0).all()


@pytest.mark.parametrize("cap_mode", ["truncate", "mask"])
def test_capped_tokens_by_mode(cap_mode: str) -> None:
    b = hand_batch()
    fn = DecoupledPPOPolicyLossFn(behav_imp_weight_mode=cap_mode)
    _, _, grad = run(fn, b)
    ratio = np.exp(b["logprob"] - b["old_logprob"])
    n = MASK.sum()
    # row 0 token 3: r = 1.5 > 1.2 with A < 0: unclipped; w = 2.5 over the cap 2
    assert not clip_active(ratio, ADV)[0, 3]
    got = grad[0, 3]
    if cap_mode == "truncate":
        assert got == pytest.approx(-ADV[0, 3] * 2.0 * 1.5 / n, rel=1e-5)
    else:
        assert got == 0.0
    # row 1 token 0: w = 3 over the cap; r = 1.05 with A < 0: unclipped
    assert (grad[1, 0] == 0.0) == (cap_mode == "mask")


def test_no_cap_is_the_plain_importance_weight() -> None:
    b = hand_batch()
    _, _, grad = run(DecoupledPPOPolicyLossFn(behav_imp_weight_cap=None), b)
    ratio = np.exp(b["logprob"] - b["old_logprob"])
    w = np.where(b["rollout_logprob_mask"], WEIGHTS, 1.0)
    want = np.where(clip_active(ratio, ADV), 0.0, -ADV * w * ratio) / MASK.sum() * MASK
    np.testing.assert_allclose(grad, want, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_without_recompute_old_logprob_is_logprob_detached(agg: str) -> None:
    """When the trainer skips the no-grad pass: r = 1 everywhere, gradient -A * w * g."""
    b = hand_batch()
    # the behaviour weight is then taken against logprob itself
    b["rollout_logprob"] = np.where(MASK, b["logprob"] - np.log(WEIGHTS), 0.0)
    b["rollout_logprob"] = b["rollout_logprob"].astype(np.float32).astype(np.float64)
    _, metrics, grad = run(DecoupledPPOPolicyLossFn(loss_agg_mode=agg), b, detach_old=True)
    has = b["rollout_logprob_mask"].astype(bool)
    w = expected_weight(b["logprob"], b["rollout_logprob"], has, 2.0, "truncate")
    want = -ADV * w * agg_factor(MASK, agg)
    np.testing.assert_allclose(grad, want, rtol=1e-5, atol=1e-8)
    assert metrics["pg_clipfrac"] == 0.0 and metrics["ppo_kl"] == 0.0


def test_sequence_masking_measures_against_the_behaviour_policy() -> None:
    """At one update a batch ``old_logprob`` is ``logprob`` detached: against it no row's
    KL is ever above the threshold. ``decoupled_ppo`` measures the row KL against the
    rollout log-probs (where a token has one) and drops the negative-advantage tokens of
    rows above it; the other tokens keep the unmasked gradient."""
    b = hand_batch()
    # rows sampled by a policy that made their tokens likelier than the current one by
    # 0.5 and 0.05 nats a token (row 2 has no rollout log-probs), and less likely by 0.2
    shift = np.array([0.5, 0.05, 0.0, -0.2])[:, None]
    b["rollout_logprob"] = np.where(MASK, b["logprob"] + shift, 0.0)
    b["rollout_logprob"][2] = 0.0
    b["rollout_logprob"] = b["rollout_logprob"].astype(np.float32).astype(np.float64)
    delta = 0.1
    high = np.array([True, False, False, False])
    kw = {"enable_sequence_masking": True, "delta_sequence_masking": delta}
    _, metrics, grad = run(DecoupledPPOPolicyLossFn(**kw), b, detach_old=True)
    _, _, unmasked = run(DecoupledPPOPolicyLossFn(), b, detach_old=True)
    drop = high[:, None] & (ADV < 0) & MASK
    assert drop.any()
    np.testing.assert_array_equal(grad[drop], 0.0)
    np.testing.assert_allclose(grad[~drop], unmasked[~drop], rtol=1e-6)
    assert metrics["seq_mask/masked_tokens"] == pytest.approx(drop.sum() / MASK.sum())
    # the ppo loss's own masking, against old_logprob = logprob: nothing
    _, ppo_metrics, _ = run(PPOPolicyLossFn(**kw), b, detach_old=True)
    assert ppo_metrics["seq_mask/masked_tokens"] == 0.0


def test_metrics() -> None:
    b = hand_batch()
    _, m, _ = run(DecoupledPPOPolicyLossFn(), b)
    counted = MASK & b["rollout_logprob_mask"].astype(bool)
    raw = np.exp(b["old_logprob"] - b["rollout_logprob"])[counted]
    assert m["behav_imp_weight"] == pytest.approx(raw.mean(), rel=1e-5)
    assert m["behav_imp_weight_max"] == pytest.approx(raw.max(), rel=1e-5)
    assert m["behav_imp_weight_max"] == pytest.approx(3.0, rel=1e-5)  # 6.0 is padding
    assert m["behav_imp_weight_capped_frac"] == pytest.approx((raw > 2.0).mean())
    kl = (b["rollout_logprob"] - b["old_logprob"])[counted].mean()
    assert m["behav_kl"] == pytest.approx(kl, rel=1e-4)
    _, ppo_m, _ = run(PPOPolicyLossFn(), b)
    for key in ("pg_clipfrac", "ppo_kl", "pg_clipfrac_lower"):
        assert m[key] == ppo_m[key]  # the clip metrics are PPO's, unweighted
    # no token with a rollout logprob: neutral values, never NaN
    b["rollout_logprob_mask"] = np.zeros_like(MASK)
    _, m, _ = run(DecoupledPPOPolicyLossFn(), b)
    assert (m["behav_imp_weight"], m["behav_imp_weight_max"]) == (1.0, 1.0)
    assert (m["behav_imp_weight_capped_frac"], m["behav_kl"]) == (0.0, 0.0)
    assert m["pg_loss"] == pytest.approx(ppo_m["pg_loss"], rel=1e-6)


# ------------------------------------------------------------------ against ppo


def random_batch(seed: int, rows: int = 6, length: int = 9) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    old = -rng.uniform(0.05, 3.0, size=(rows, length))
    lp = old + rng.normal(0.0, 0.4, size=(rows, length))
    adv = rng.normal(0.0, 1.0, size=(rows, length))
    mask = np.arange(length)[None, :] < rng.integers(1, length + 1, size=rows)[:, None]
    mask[2] = False
    f32 = lambda x: x.astype(np.float32).astype(np.float64)  # noqa: E731
    return {
        "logprob": f32(lp),
        "old_logprob": f32(old),
        "rollout_logprob": f32(old),
        "advantages": f32(adv),
        "action_mask": mask,
        "rollout_logprob_mask": np.ones_like(mask),
    }


@pytest.mark.parametrize("agg", MODES)
@pytest.mark.parametrize("cap", [2.0, None])
@pytest.mark.parametrize("cap_mode", ["truncate", "mask"])
def test_fresh_rollouts_equal_ppo_exactly(agg: str, cap: float | None, cap_mode: str) -> None:
    b = random_batch(1)
    common = {"loss_agg_mode": agg, "clip_range_high": 0.28}
    loss, m, grad = run(
        DecoupledPPOPolicyLossFn(
            behav_imp_weight_cap=cap, behav_imp_weight_mode=cap_mode, **common
        ),
        b,
    )
    ref_loss, ref_m, ref_grad = run(PPOPolicyLossFn(**common), b)
    assert loss.item() == ref_loss.item()
    assert np.array_equal(grad, ref_grad)
    assert {k: m[k] for k in ref_m} == ref_m
    assert m["behav_imp_weight"] == 1.0 and m["behav_imp_weight_capped_frac"] == 0.0


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum"])
def test_staleness_scales_the_gradient_by_the_weight(agg: str) -> None:
    """Same batch, rollout logprobs shifted: each token's gradient is PPO's times its w."""
    b = random_batch(2)
    rng = np.random.default_rng(3)
    shift = rng.uniform(-1.0, 0.6, size=b["logprob"].shape)  # w = exp(shift) in [0.37, 1.82]
    b["rollout_logprob"] = (b["old_logprob"] - shift).astype(np.float32).astype(np.float64)
    _, _, ref_grad = run(PPOPolicyLossFn(loss_agg_mode=agg), b)
    _, _, grad = run(DecoupledPPOPolicyLossFn(loss_agg_mode=agg), b)
    w = np.exp(b["old_logprob"] - b["rollout_logprob"])
    assert (w < 2.0).all()  # nothing capped
    np.testing.assert_allclose(grad, ref_grad * w, rtol=1e-5, atol=1e-9)
    assert not np.allclose(grad, ref_grad)


# ------------------------------------------------------------------ arguments and config


def test_default_args_and_inputs() -> None:
    assert DecoupledPPOPolicyLossFn.default_args() == {
        "clip_range": 0.2,
        "clip_ratio_c": 3.0,
        "loss_agg_mode": "token-mean",
        "behav_imp_weight_cap": 2.0,
        "behav_imp_weight_mode": "truncate",
        "enable_sequence_masking": False,
        "delta_sequence_masking": 0.1,
        "fallback_to_policy_gradient": False,
    }
    assert POLICY_LOSS_FN.get("decoupled_ppo") is DecoupledPPOPolicyLossFn
    assert issubclass(DecoupledPPOPolicyLossFn, PPOPolicyLossFn)
    assert loss_inputs_for(DecoupledPPOPolicyLossFn) == [
        "logprob",
        "old_logprob",
        "action_mask",
        "advantages",
        "rollout_logprob",
        "rollout_logprob_mask",
    ]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"behav_imp_weight_cap": 0.5}, "behav_imp_weight_cap must be >= 1"),
        ({"behav_imp_weight_cap": 0.0}, "behav_imp_weight_cap must be >= 1"),
        ({"behav_imp_weight_cap": float("nan")}, "behav_imp_weight_cap must be >= 1"),
        ({"behav_imp_weight_cap": "2"}, "behav_imp_weight_cap must be a number"),
        ({"behav_imp_weight_cap": True}, "behav_imp_weight_cap must be a number"),
        ({"behav_imp_weight_mode": "clip"}, r"behav_imp_weight_mode must be one of"),
        ({"clip_ratio_c": 1.0}, "clip_ratio_c"),
    ],
)
def test_bad_args(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        DecoupledPPOPolicyLossFn(**kwargs)
    with pytest.raises(ConfigError, match=match) as info:
        resolve_algorithm(
            AlgorithmConfig(
                algorithm_type="grpo", policy_loss_fn="decoupled_ppo", policy_loss_fn_args=kwargs
            )
        )
    assert info.value.key_path == "algorithm.policy_loss_fn_args"


def test_resolves_with_the_grpo_preset() -> None:
    r = resolve_algorithm(
        AlgorithmConfig(
            algorithm_type="grpo",
            policy_loss_fn="decoupled_ppo",
            policy_loss_fn_args={"behav_imp_weight_cap": 3, "clip_range_high": 0.28},
            loss_agg_mode="seq-mean-token-mean",
        )
    )
    fn = r.policy_loss_fn
    assert type(fn) is DecoupledPPOPolicyLossFn and r.config.policy_loss_fn == "decoupled_ppo"
    assert (fn.behav_imp_weight_cap, fn.behav_imp_weight_mode) == (3.0, "truncate")
    assert (fn.clip_range_low, fn.clip_range_high, fn.clip_ratio_c) == (0.2, 0.28, 3.0)
    assert fn.loss_agg_mode == "seq-mean-token-mean"
    assert r.config.policy_loss_fn_args == {
        "clip_range": 0.2,
        "clip_ratio_c": 3.0,
        "loss_agg_mode": "seq-mean-token-mean",
        "behav_imp_weight_cap": 3,
        "behav_imp_weight_mode": "truncate",
        "enable_sequence_masking": False,
        "delta_sequence_masking": 0.1,
        "fallback_to_policy_gradient": False,
        "clip_range_high": 0.28,
    }
    # the trainer's tensors provide every input (config-time check)
    assert r.check_loss_inputs(trainer_tensors(r)) == loss_inputs_for(fn)
    off = resolve_algorithm(
        AlgorithmConfig(
            algorithm_type="grpo",
            policy_loss_fn="decoupled_ppo",
            policy_loss_fn_args={"behav_imp_weight_cap": None, "behav_imp_weight_mode": "mask"},
        )
    ).policy_loss_fn
    assert (off.behav_imp_weight_cap, off.behav_imp_weight_mode) == (None, "mask")


def test_selected_from_a_config_file(tmp_path: Path, tiny_model_path: str) -> None:
    data = small_config(tmp_path, tiny_model_path)
    data["algorithm"].update(
        policy_loss_fn="decoupled_ppo",
        policy_loss_fn_args={"behav_imp_weight_cap": 4.0, "behav_imp_weight_mode": "mask"},
    )
    run_ = prepare_run(config_from_dict(data))
    fn = run_.algorithm.policy_loss_fn
    assert isinstance(fn, DecoupledPPOPolicyLossFn)
    assert (fn.behav_imp_weight_cap, fn.behav_imp_weight_mode) == (4.0, "mask")
    data["algorithm"]["policy_loss_fn_args"] = {"behav_imp_weight_mode": "nope"}
    with pytest.raises(ConfigError, match="behav_imp_weight_mode"):
        prepare_run(config_from_dict(data))


# ------------------------------------------------------------------ collate's mask


def test_collate_marks_the_tokens_with_rollout_logprobs() -> None:
    def e(resp: int, **kw: Any) -> Experience:
        return Experience(tokens=[1, 2] + [3] * resp, prompt_length=2, **kw)

    exps = [
        e(3, logprobs=[-1.0, -2.0, -3.0]),
        e(2),  # dataset row: no logprobs
        e(3, logprobs=[-1.0, -2.0]),  # fewer logprobs than tokens
        e(2, logprobs=[0.0, 0.0], info={"is_expert": True}),  # MIX expert zeros
        e(2, logprobs=[-1.0, -1.0], info={"logprobs_exact": False}),
        e(5, logprobs=[-1.0] * 5),  # cut by max_response
        e(1, logprobs=[-0.5], info={"logprobs_exact": True, "is_expert": False}),
    ]
    assert [has_rollout_logprobs(x) for x in exps] == [1, 0, 1, 0, 0, 1, 1]
    batch = collate(exps, 0, max_response=4)
    assert batch.rollout_logprob_mask.dtype == torch.float32
    assert batch.rollout_logprob_mask.tolist() == [
        [1, 1, 1, 0],
        [0, 0, 0, 0],
        [1, 1, 0, 0],
        [0, 0, 0, 0],
        [0, 0, 0, 0],
        [1, 1, 1, 1],
        [1, 0, 0, 0],
    ]
    sub = batch.rows(torch.tensor([2, 0]))
    assert sub.rollout_logprob_mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 0]]
    assert batch.to("cpu").rollout_logprob_mask.shape == (7, 4)


def test_log_probs_sampled_at_another_temperature_get_no_weight() -> None:
    def e(**info: Any) -> Experience:
        return Experience(tokens=[1, 2, 3, 3], prompt_length=2, logprobs=[-1.0, -1.0], info=info)

    exps = [e(temperature=1.0), e(temperature=0.7), e()]  # the last one does not say
    assert [has_rollout_logprobs(x, 1.0) for x in exps] == [True, False, True]
    assert [has_rollout_logprobs(x) for x in exps] == [True, True, True]
    mask = collate(exps, 0, temperature=1.0).rollout_logprob_mask
    assert mask.tolist() == [[1, 1], [0, 0], [1, 1]]


# ------------------------------------------------------------------ a real trainer step


def test_trainer_step_gradient_and_metrics(tmp_path: Path, tiny_model_path: str) -> None:
    """One PolicyTrainer step (DeepSpeed, tiny model) with ``decoupled_ppo``: the accumulated
    gradient is ``d/dθ sum_t -A_t * w_t * logprob_t / N`` computed here on a fresh copy of the
    model, with w set per row through the rollout logprobs (1.5, 0.5, 4 -> cap 2, none -> 1)."""
    from transformers import AutoModelForCausalLM

    from rftstream.training.policy_trainer import PolicyTrainer

    data = small_config(tmp_path, tiny_model_path)
    data["model"]["max_response_tokens"] = 16
    data["algorithm"].update(
        policy_loss_fn="decoupled_ppo",
        kl_loss_fn="none",
        entropy_loss_fn="none",
        repeat_times=4,
    )
    data["buffer"]["train_batch_size"] = 4
    data["trainer"].update(ppo_micro_batch_size_per_gpu=4, grad_clip=0.0)
    run_ = prepare_run(config_from_dict(data))
    trainer = PolicyTrainer(run_.cfg, run_.model_path, run_.algorithm)
    assert "rollout_logprob_mask" in trainer.loss_inputs

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, torch_dtype=torch.float32)
    model.train()

    lengths, advs = [3, 5, 2, 4], [1.0, -0.5, 0.75, -1.25]
    row_w = [1.5, 0.5, 4.0, None]  # None: no rollout logprobs
    exps = []
    for i, (n, a) in enumerate(zip(lengths, advs, strict=True)):
        e = Experience(
            tokens=[5 + i, 6] + [7 + ((i + j) % 9) for j in range(n)],
            prompt_length=2,
            reward=0.0,
            advantages=[a] * n,
            eid=EID(0, f"t{i}", 0),
        )
        if row_w[i] is not None:
            with torch.no_grad():
                e.logprobs = row_logprobs(model, e) - math.log(row_w[i])
        exps.append(e)

    grads = capture_gradients(trainer)
    out = trainer.train_step(exps)
    assert grads

    n_tokens = sum(lengths)
    objective = torch.zeros(())
    for e, a, w in zip(exps, advs, row_w, strict=True):
        lp = row_logprobs(model, e)
        weight = 1.0 if w is None else min(w, 2.0)
        objective = objective + (-a * weight * torch.exp(lp - lp.detach())).sum()
    (objective / n_tokens).backward()
    assert_gradients_match(grads, model)

    counted = lengths[:3]
    raw_mean = (1.5 * counted[0] + 0.5 * counted[1] + 4.0 * counted[2]) / sum(counted)
    assert out["actor/behav_imp_weight"] == pytest.approx(raw_mean, rel=1e-3)
    assert out["actor/behav_imp_weight_max"] == pytest.approx(4.0, rel=1e-3)
    assert out["actor/behav_imp_weight_capped_frac"] == pytest.approx(counted[2] / sum(counted))
    assert out["actor/behav_kl"] == pytest.approx(
        -(math.log(1.5) * 3 + math.log(0.5) * 5 + math.log(4.0) * 2) / 10, abs=1e-3
    )
    for key in ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"):
        assert math.isfinite(out[key]), key


# ------------------------------------------------------------------ on by default where it helps


@pytest.mark.parametrize(
    "over,expected",
    [
        ({}, "decoupled_ppo"),  # dynamic_by_explorer: experience can be stale
        ({"synchronizer": {"sync_style": "fixed", "sync_interval": 1}}, "ppo"),  # on-policy
        ({"synchronizer": {"sync_style": "fixed", "sync_interval": 2}}, "decoupled_ppo"),
        ({"synchronizer": {"max_staleness": 0}}, "ppo"),
        ({"algorithm": {"policy_loss_fn": "ppo"}}, "ppo"),  # a user's choice stands
        ({"mode": "explore"}, "ppo"),  # nothing is trained here
        ({"algorithm": {"algorithm_type": "opmd"}}, "opmd"),  # not a ppo preset
    ],
)
def test_asynchronous_ppo_presets_train_with_the_correction(
    tmp_path, tiny_model_path: str, over: dict[str, Any], expected: str
) -> None:
    from rftstream.config import config_from_dict
    from rftstream.runtime import prepare_run

    data = small_config(tmp_path, tiny_model_path)
    for key, value in over.items():
        if isinstance(value, dict):
            data.setdefault(key, {}).update(value)
        else:
            data[key] = value
    run = prepare_run(config_from_dict(data))
    assert run.algorithm.config.policy_loss_fn == expected
    assert (
        type(run.algorithm.policy_loss_fn).__name__
        == {
            "ppo": "PPOPolicyLossFn",
            "decoupled_ppo": "DecoupledPPOPolicyLossFn",
            "opmd": "OPMDPolicyLossFn",
        }[expected]
    )


def test_the_correction_keeps_a_presets_loss_arguments(tmp_path, tiny_model_path: str) -> None:
    from rftstream.config import config_from_dict
    from rftstream.runtime import prepare_run

    data = small_config(tmp_path, tiny_model_path)
    data["algorithm"] = {"algorithm_type": "dapo", "repeat_times": 4}
    loss = prepare_run(config_from_dict(data)).algorithm.policy_loss_fn
    assert type(loss).__name__ == "DecoupledPPOPolicyLossFn"
    assert (loss.clip_range_low, loss.clip_range_high) == (0.2, 0.28)
