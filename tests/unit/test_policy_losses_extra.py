"""GSPO, CISPO, TOPR, sPPO, REC and DPO policy losses against plain numpy/python references."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from algorithms import POLICY_LOSS_FN, loss_inputs_for, resolve_algorithm
from algorithms.policy_loss_fn import (
    CISPOPolicyLossFn,
    DPOLossFn,
    GSPOPolicyLossFn,
    RECPolicyLossFn,
    SPPOPolicyLossFn,
    TOPRPolicyLossFn,
)
from rftstream.config.schema import AlgorithmConfig

MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
NAMES = ["gspo", "cispo", "topr", "sppo", "rec", "dpo"]

# ------------------------------------------------------------------ inputs and helpers


def make_inputs(rows=6, length=7, seed=0, sigma=0.3, masked_row=2):
    """Random (logprob, old_logprob, ref_logprob, advantages, mask), float32-representable."""
    rng = np.random.default_rng(seed)
    old = -rng.uniform(0.05, 3.0, size=(rows, length))
    lp = old + rng.normal(0.0, sigma, size=(rows, length))
    ref = old + rng.normal(0.0, sigma, size=(rows, length))
    adv = rng.normal(0.0, 1.0, size=(rows, length))
    lengths = rng.integers(1, length + 1, size=rows)
    mask = np.arange(length)[None, :] < lengths[:, None]
    if masked_row is not None and rows > masked_row:
        mask[masked_row] = False
    f32 = lambda x: x.astype(np.float32).astype(np.float64)  # noqa: E731
    return f32(lp), f32(old), f32(ref), f32(adv), mask


def t(x, dtype=torch.float32):
    return torch.tensor(np.asarray(x), dtype=dtype)


def mask_t(mask, kind):
    return t(mask, torch.bool) if kind == "bool" else t(mask.astype(np.float64))


def agg_weights(mask, mode):
    """Per-token weight w with loss = sum(w * v) for each aggregation mode (python loops)."""
    rows, length = mask.shape
    w = np.zeros((rows, length))
    n_tokens = int(mask.sum())
    live_rows = [i for i in range(rows) if mask[i].any()]
    for i in range(rows):
        for j in range(length):
            if not mask[i, j]:
                continue
            if mode == "token-mean":
                w[i, j] = 1.0 / n_tokens
            elif mode == "seq-mean-token-mean":
                w[i, j] = 1.0 / (len(live_rows) * mask[i].sum())
            elif mode == "seq-mean-token-sum":
                w[i, j] = 1.0 / len(live_rows)
            else:  # seq-mean-token-sum-norm
                w[i, j] = 1.0 / length
    return w


def ref_agg(values, mask, mode):
    """Aggregate with explicit loops over rows and tokens."""
    rows, length = mask.shape
    if not mask.any():
        return 0.0
    if mode == "token-mean":
        vals = [values[i][j] for i in range(rows) for j in range(length) if mask[i, j]]
        return sum(vals) / len(vals)
    if mode == "seq-mean-token-sum-norm":
        return sum(values[i][j] for i in range(rows) for j in range(length) if mask[i, j]) / length
    per_row = []
    for i in range(rows):
        toks = [values[i][j] for j in range(length) if mask[i, j]]
        if toks:
            per_row.append(sum(toks) / (len(toks) if mode == "seq-mean-token-mean" else 1))
    return sum(per_row) / len(per_row)


def masked_avg(values, mask):
    vals = [values[i][j] for i in range(mask.shape[0]) for j in range(mask.shape[1]) if mask[i, j]]
    return sum(vals) / len(vals) if vals else 0.0


def check(loss, metrics, ref_loss, ref_metrics, rel=1e-5, abs_=1e-6):
    assert loss.item() == pytest.approx(ref_loss, rel=rel, abs=abs_)
    assert set(metrics) == set(ref_metrics)
    for k, v in ref_metrics.items():
        assert isinstance(metrics[k], float), k
        assert metrics[k] == pytest.approx(v, rel=rel, abs=abs_), k


def run(fn, lp, old, ref, adv, mask, mask_kind="bool"):
    """Call ``fn`` with exactly the inputs its signature names; return (loss, metrics, grad)."""
    logprob = t(lp).requires_grad_(True)
    available = {
        "old_logprob": t(old),
        "ref_logprob": t(ref),
        "advantages": t(adv),
        "action_mask": mask_t(mask, mask_kind),
    }
    kwargs = {k: available[k] for k in loss_inputs_for(fn) if k != "logprob"}
    loss, metrics = fn(logprob, **kwargs)
    loss.backward()
    return loss, metrics, logprob.grad.numpy().astype(np.float64)


# ------------------------------------------------------------------ references


def ref_gspo(lp, old, adv, mask, low, high, mode):
    rows, length = mask.shape
    tok = np.zeros((rows, length))
    grad_factor = np.zeros((rows, length))  # d token_loss / d logprob (stop-gradient form)
    seq_kl, clipped = [], []
    for i in range(rows):
        idx = [j for j in range(length) if mask[i, j]]
        s = sum(lp[i, j] - old[i, j] for j in idx) / len(idx) if idx else 0.0
        if idx:
            seq_kl.append(-s)
        r = math.exp(min(s, 10.0))
        rc = min(max(r, 1 - low), 1 + high)
        for j in range(length):
            l1, l2 = -adv[i, j] * r, -adv[i, j] * rc
            tok[i, j] = max(l1, l2)
            if mask[i, j]:
                clipped.append(1.0 if l2 > l1 else 0.0)
            grad_factor[i, j] = 0.0 if l2 > l1 else -adv[i, j] * r
    loss = ref_agg(tok, mask, mode)
    metrics = {
        "pg_loss": loss,
        "pg_clipfrac": sum(clipped) / len(clipped) if clipped else 0.0,
        "ppo_kl": masked_avg(old - lp, mask),
        "ppo_kl_seq": sum(seq_kl) / len(seq_kl) if seq_kl else 0.0,
    }
    return loss, metrics, grad_factor * agg_weights(mask, mode)


def ref_cispo(lp, old, adv, mask, low, high, mask_clip, mlow, mhigh, mode):
    rows, length = mask.shape
    tok, keep, dloss = np.zeros_like(lp), np.ones_like(lp), np.zeros_like(lp)
    for i in range(rows):
        for j in range(length):
            r = math.exp(lp[i, j] - old[i, j])
            w = min(max(r, 1 - low), 1 + high)
            if mask_clip and (
                (r > 1 + mhigh and adv[i, j] > 0) or (r < 1 - mlow and adv[i, j] < 0)
            ):
                keep[i, j] = 0.0
            tok[i, j] = -adv[i, j] * w * keep[i, j] * lp[i, j]
            dloss[i, j] = -adv[i, j] * w * keep[i, j]
    loss = ref_agg(tok, mask, mode)
    metrics = {
        "cispo_loss": loss,
        "ppo_kl": masked_avg(old - lp, mask),
        "masked_frac": masked_avg(keep, mask),
    }
    return loss, metrics, dloss * agg_weights(mask, mode)


def ref_topr(lp, old, adv, mask, threshold, mode):
    rows, length = mask.shape
    tok, alpha, ratio, dloss = (np.zeros_like(lp) for _ in range(4))
    for i in range(rows):
        for j in range(length):
            ratio[i, j] = math.exp(lp[i, j] - old[i, j])
            alpha[i, j] = min(ratio[i, j], 1.0) if adv[i, j] <= threshold else 1.0
            tok[i, j] = -alpha[i, j] * adv[i, j] * lp[i, j]
            dloss[i, j] = -alpha[i, j] * adv[i, j]
    loss = ref_agg(tok, mask, mode)
    metrics = {
        "topr_loss": loss,
        "avg_alpha": masked_avg(alpha, mask),
        "avg_ratio": masked_avg(ratio, mask),
    }
    return loss, metrics, dloss * agg_weights(mask, mode)


def ref_sppo(lp, old, adv, mask, eps, mode):
    rows, length = mask.shape
    tok, out, dloss = (np.zeros_like(lp) for _ in range(3))
    for i in range(rows):
        for j in range(length):
            r = math.exp(lp[i, j] - old[i, j])
            inside = 1 / (1 + eps) <= r <= 1 + eps
            out[i, j] = 0.0 if inside else 1.0
            tok[i, j] = -adv[i, j] * (lp[i, j] - old[i, j]) if inside else 0.0
            dloss[i, j] = -adv[i, j] if inside else 0.0
    loss = ref_agg(tok, mask, mode)
    return (
        loss,
        {"pg_loss": loss, "sppo_loss": loss, "pg_clipfrac": masked_avg(out, mask)},
        dloss * agg_weights(mask, mode),
    )


def ref_rec(lp, old, adv, mask, mode="token-mean", **kw):
    el, eh = kw.get("epsilon_low", 0.2), kw.get("epsilon_high", 0.2)
    elp, ehp = kw.get("epsilon_low_prime", 0.4), kw.get("epsilon_high_prime", 0.4)
    clip_mode, weight = kw.get("clip_mode", "none"), kw.get("weight", "none")
    reg, coef, temp = (
        kw.get("regularizer", "none"),
        kw.get("regularizer_coef", 0.0),
        kw.get("temp", 1.0),
    )
    fix = kw.get("fix_opd_advantage", False)
    rows, length = mask.shape
    tok, out, dloss = (np.zeros_like(lp) for _ in range(3))
    for i in range(rows):
        idx = [j for j in range(length) if mask[i, j]]
        seq = math.exp(sum(lp[i, j] - old[i, j] for j in idx) / len(idx)) if idx else 1.0
        for j in range(length):
            a = adv[i, j]
            r = math.exp(lp[i, j] - old[i, j])
            if clip_mode == "two-side":
                keep = 1 - el <= r <= 1 + eh
            elif clip_mode == "one-side":
                keep = (a >= 0 and r <= 1 + eh) or (a <= 0 and r >= 1 - el)
            elif clip_mode == "gspo-one-side":
                keep = (a >= 0 and seq <= 1 + eh) or (a <= 0 and seq >= 1 - el)
            elif clip_mode == "ring":
                keep = (
                    (1 - el <= r <= 1 + eh)
                    or (a >= 0 and r <= 1 - elp)
                    or (a <= 0 and r >= 1 + ehp)
                )
            else:
                keep = True
            if weight == "importance_sampling":
                a = a * r
            elif weight == "truncated_importance_sampling":
                a = a * min(max(r, 1 - elp), 1 + ehp)
            elif weight == "gspo_importance_sampling":
                a = a * seq
            elif weight in ("advantage", "advantage_unnormalized"):
                a = a * math.exp(a / temp)
            elif weight == "confidence":
                a = a * math.exp(temp * lp[i, j])
            if fix:
                a = a + old[i, j] - lp[i, j]
            v = -a * lp[i, j] * (1.0 if keep else 0.0)
            d = -a * (1.0 if keep else 0.0)
            if reg == "forward-kl":
                v -= coef * lp[i, j]
                d -= coef
            elif reg == "k2":
                v += coef * (lp[i, j] - old[i, j]) ** 2
                d += 2 * coef * (lp[i, j] - old[i, j])
            tok[i, j], dloss[i, j], out[i, j] = v, d, 0.0 if keep else 1.0
    if clip_mode == "gspo-one-side":
        mode = "seq-mean-token-mean"
    loss = ref_agg(tok, mask, mode)
    return (
        loss,
        {"pg_loss": loss, "pg_clipfrac": masked_avg(out, mask)},
        dloss * agg_weights(mask, mode),
    )


def ref_dpo(lp, ref, mask, beta, ls):
    rows, length = mask.shape
    logratio = [sum(lp[i, j] - ref[i, j] for j in range(length) if mask[i, j]) for i in range(rows)]
    pairs = rows // 2
    losses, correct = [], []
    grad = np.zeros_like(lp)
    sig = lambda x: 1.0 / (1.0 + math.exp(-x))  # noqa: E731
    for p in range(pairs):
        c, r = logratio[2 * p], logratio[2 * p + 1]
        z = beta * (c - r)
        losses.append(-(1 - ls) * math.log(sig(z)) - ls * math.log(sig(-z)))
        correct.append(1.0 if c > r else 0.0)
        dz = (-(1 - ls) * sig(-z) + ls * sig(z)) * beta / pairs  # d loss / d (c - r)
        for j in range(length):
            grad[2 * p, j] = dz if mask[2 * p, j] else 0.0
            grad[2 * p + 1, j] = -dz if mask[2 * p + 1, j] else 0.0
    loss = sum(losses) / pairs
    metrics = {
        "dpo_loss": loss,
        "chosen_reward": beta * sum(logratio[0::2]) / pairs,
        "rejected_reward": beta * sum(logratio[1::2]) / pairs,
        "accuracy_mean": sum(correct) / pairs,
    }
    return loss, metrics, grad


# ------------------------------------------------------------------ GSPO


@pytest.mark.parametrize(
    "kwargs,low,high",
    [
        ({}, 3e-4, 4e-4),
        ({"clip_range": 0.2}, 0.2, 0.2),
        ({"clip_range_low": 0.05, "clip_range_high": 0.1}, 0.05, 0.1),
        ({"clip_range": 0.2, "clip_range_high": 0.28}, 0.2, 0.28),
    ],
)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("mask_kind", ["bool", "float"])
def test_gspo_matches_reference(kwargs, low, high, mode, mask_kind):
    lp, old, ref, adv, mask = make_inputs(seed=1)
    fn = GSPOPolicyLossFn(loss_agg_mode=mode, **kwargs)
    loss, metrics, grad = run(fn, lp, old, ref, adv, mask, mask_kind)
    ref_loss, ref_metrics, ref_grad = ref_gspo(lp, old, adv, mask, low, high, mode)
    check(loss, metrics, ref_loss, ref_metrics)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-4, atol=1e-7)


def test_gspo_sequence_ratio_hand_computed():
    # one row, ratios 1.1 and 1.3 -> sequence ratio sqrt(1.1 * 1.3) (geometric mean), A = 1
    lp = np.log(np.array([[1.1, 1.3]]))
    old = np.zeros((1, 2))
    adv = np.ones((1, 2))
    mask = np.ones((1, 2), dtype=bool)
    seq_ratio = math.sqrt(1.1 * 1.3)
    loss, m, grad = run(GSPOPolicyLossFn(clip_range=0.2), lp, old, old, adv, mask)
    assert loss.item() == pytest.approx(-seq_ratio, rel=1e-6)
    assert m["pg_clipfrac"] == 0.0
    assert m["ppo_kl_seq"] == pytest.approx(-math.log(seq_ratio), rel=1e-5)
    # stop-gradient form: each token's gradient is -A * seq_ratio / n_tokens
    np.testing.assert_allclose(grad, [[-seq_ratio / 2, -seq_ratio / 2]], rtol=1e-6)
    # the default clip range is tiny: 1.196 is clipped to 1.0004 and gets no gradient
    loss, m, grad = run(
        GSPOPolicyLossFn(**GSPOPolicyLossFn.default_args()), lp, old, old, adv, mask
    )
    assert loss.item() == pytest.approx(-1.0004, rel=1e-6)
    assert m["pg_clipfrac"] == 1.0 and (grad == 0).all()


def test_gspo_args():
    fn = GSPOPolicyLossFn()
    assert (fn.clip_range_low, fn.clip_range_high) == (3e-4, 4e-4)
    assert fn.loss_agg_mode == "seq-mean-token-mean"
    assert GSPOPolicyLossFn(clip_range=0.1, clip_range_low=0.05).clip_range_high == 0.1
    assert GSPOPolicyLossFn.default_args() == {
        "clip_range_low": 3e-4,
        "clip_range_high": 4e-4,
        "loss_agg_mode": "seq-mean-token-mean",
    }
    with pytest.raises(ValueError):
        GSPOPolicyLossFn(clip_range=-0.1)


# ------------------------------------------------------------------ CISPO


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"clip_range_low": 0.1, "clip_range_high": 0.1},
        {"enable_mask_clip": True, "mask_clip_range_low": 0.2, "mask_clip_range_high": 0.2},
        {"enable_mask_clip": True},
    ],
)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("mask_kind", ["bool", "float"])
def test_cispo_matches_reference(kwargs, mode, mask_kind):
    lp, old, ref, adv, mask = make_inputs(seed=2)
    full = {**CISPOPolicyLossFn.default_args(), **kwargs}
    fn = CISPOPolicyLossFn(loss_agg_mode=mode, **kwargs)
    loss, metrics, grad = run(fn, lp, old, ref, adv, mask, mask_kind)
    ref_loss, ref_metrics, ref_grad = ref_cispo(
        lp,
        old,
        adv,
        mask,
        full["clip_range_low"],
        full["clip_range_high"],
        full["enable_mask_clip"],
        full["mask_clip_range_low"],
        full["mask_clip_range_high"],
        mode,
    )
    check(loss, metrics, ref_loss, ref_metrics)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-5, atol=1e-7)


def test_cispo_clipped_token_keeps_gradient():
    # ratio 2, A = +1: PPO would drop the token; CISPO weights it by 1.28 and keeps it
    lp, old = np.array([[math.log(2.0)]]), np.zeros((1, 1))
    adv, mask = np.ones((1, 1)), np.ones((1, 1), dtype=bool)
    loss, m, grad = run(CISPOPolicyLossFn(), lp, old, old, adv, mask)
    assert grad[0, 0] == pytest.approx(-1.28, rel=1e-6)  # increases logprob under gradient descent
    assert m["masked_frac"] == 1.0
    _, m, grad = run(CISPOPolicyLossFn(enable_mask_clip=True), lp, old, old, adv, mask)
    assert grad[0, 0] == 0.0 and m["masked_frac"] == 0.0


# ------------------------------------------------------------------ TOPR


@pytest.mark.parametrize("threshold", [0.0, 0.5, -0.5])
@pytest.mark.parametrize("mode", MODES)
def test_topr_matches_reference(threshold, mode):
    lp, old, ref, adv, mask = make_inputs(seed=3, sigma=0.5)
    fn = TOPRPolicyLossFn(advantage_threshold=threshold, loss_agg_mode=mode)
    loss, metrics, grad = run(fn, lp, old, ref, adv, mask)
    ref_loss, ref_metrics, ref_grad = ref_topr(lp, old, adv, mask, threshold, mode)
    check(loss, metrics, ref_loss, ref_metrics)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-5, atol=1e-7)


def test_topr_gradient_sign_and_taper():
    # A = +1 at ratio 3: plain REINFORCE (gradient -1); A = -1 at ratio 3: alpha = 1 (capped);
    # A = -1 at ratio 0.25: alpha = 0.25
    lp = np.log(np.array([[3.0, 3.0, 0.25]]))
    old = np.zeros((1, 3))
    adv = np.array([[1.0, -1.0, -1.0]])
    mask = np.ones((1, 3), dtype=bool)
    _, m, grad = run(TOPRPolicyLossFn(loss_agg_mode="seq-mean-token-sum"), lp, old, old, adv, mask)
    np.testing.assert_allclose(grad, [[-1.0, 1.0, 0.25]], rtol=1e-6)
    assert m["avg_alpha"] == pytest.approx((1.0 + 1.0 + 0.25) / 3)


# ------------------------------------------------------------------ sPPO


@pytest.mark.parametrize("eps", [0.3, 0.1, 1.0])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("mask_kind", ["bool", "float"])
def test_sppo_matches_reference(eps, mode, mask_kind):
    lp, old, ref, adv, mask = make_inputs(seed=4)
    fn = SPPOPolicyLossFn(epsilon=eps, loss_agg_mode=mode)
    loss, metrics, grad = run(fn, lp, old, ref, adv, mask, mask_kind)
    ref_loss, ref_metrics, ref_grad = ref_sppo(lp, old, adv, mask, eps, mode)
    check(loss, metrics, ref_loss, ref_metrics)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-5, atol=1e-7)


def test_sppo_interval_is_multiplicative():
    # eps = 0.25: interval [0.8, 1.25]; ratio 0.79 out, 0.81 in, 1.24 in, 1.26 out
    lp = np.log(np.array([[0.79, 0.81, 1.24, 1.26]]))
    old = np.zeros((1, 4))
    adv = np.ones((1, 4))
    mask = np.ones((1, 4), dtype=bool)
    loss, m, grad = run(SPPOPolicyLossFn(epsilon=0.25), lp, old, old, adv, mask)
    assert m["pg_clipfrac"] == 0.5
    np.testing.assert_allclose(grad, [[0.0, -0.25, -0.25, 0.0]], rtol=1e-6)
    assert loss.item() == pytest.approx(-(math.log(0.81) + math.log(1.24)) / 4, rel=1e-5)
    with pytest.raises(ValueError, match="epsilon"):
        SPPOPolicyLossFn(epsilon=0.0)


# ------------------------------------------------------------------ REC


REC_CASES = [
    {},
    {"clip_mode": "two-side"},
    {"clip_mode": "one-side", "epsilon_low": 0.1, "epsilon_high": 0.15},
    {"clip_mode": "gspo-one-side", "epsilon_low": 0.05, "epsilon_high": 0.05},
    {"clip_mode": "ring", "epsilon_low_prime": 0.3, "epsilon_high_prime": 0.3},
    {"weight": "importance_sampling"},
    {
        "weight": "truncated_importance_sampling",
        "epsilon_low_prime": 0.1,
        "epsilon_high_prime": 0.1,
    },
    {"weight": "gspo_importance_sampling"},
    {"weight": "gspo_importance_sampling", "clip_mode": "gspo-one-side"},
    {"weight": "advantage", "temp": 2.0},
    {"weight": "advantage_unnormalized"},
    {"weight": "confidence", "temp": 0.5},
    {"regularizer": "forward-kl", "regularizer_coef": 0.1},
    {"regularizer": "k2", "regularizer_coef": 0.5, "clip_mode": "two-side"},
    {"fix_opd_advantage": True},
    {"clip_mode": "one-side", "weight": "importance_sampling", "fix_opd_advantage": True},
]


@pytest.mark.parametrize("kwargs", REC_CASES)
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize("mask_kind", ["bool", "float"])
def test_rec_matches_reference(kwargs, mode, mask_kind):
    lp, old, ref, adv, mask = make_inputs(seed=5, sigma=0.4)
    fn = RECPolicyLossFn(loss_agg_mode=mode, **kwargs)
    loss, metrics, grad = run(fn, lp, old, ref, adv, mask, mask_kind)
    ref_loss, ref_metrics, ref_grad = ref_rec(lp, old, adv, mask, mode=mode, **kwargs)
    check(loss, metrics, ref_loss, ref_metrics)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-5, atol=1e-7)


def test_rec_one_side_drops_only_tokens_pushed_further():
    # ratios 1.5 and 0.5 with A = +1 and -1 (one-side, eps 0.2)
    lp = np.log(np.array([[1.5, 1.5, 0.5, 0.5]]))
    old = np.zeros((1, 4))
    adv = np.array([[1.0, -1.0, 1.0, -1.0]])
    mask = np.ones((1, 4), dtype=bool)
    _, m, grad = run(RECPolicyLossFn(clip_mode="one-side"), lp, old, old, adv, mask)
    # A>0 at r=1.5 dropped; A<0 at r=1.5 kept; A>0 at r=0.5 kept; A<0 at r=0.5 dropped
    np.testing.assert_allclose(grad, [[0.0, 0.25, -0.25, 0.0]], rtol=1e-6)
    assert m["pg_clipfrac"] == 0.5


def test_rec_args():
    fn = RECPolicyLossFn()
    assert (fn.epsilon_low_prime, fn.epsilon_high_prime, fn.clip_mode, fn.weight) == (
        0.4,
        0.4,
        "none",
        "none",
    )
    d = RECPolicyLossFn.default_args()
    assert (d["epsilon_low_prime"], d["epsilon_high_prime"]) == (0.6, 2)
    RECPolicyLossFn(**d)
    for bad in (
        {"clip_mode": "three-side"},
        {"weight": "bogus"},
        {"regularizer": "k3"},
        {"regularizer_coef": -1.0},
        {"temp": 0.0},
        {"epsilon_low": 1.5},
        {"epsilon_high": 0.0},
        {"epsilon_low_prime": 0.0},
        {"epsilon_high_prime": -1.0},
    ):
        with pytest.raises(ValueError):
            RECPolicyLossFn(**bad)


# ------------------------------------------------------------------ DPO


@pytest.mark.parametrize("beta,ls", [(0.1, 0.0), (0.5, 0.0), (0.1, 0.2), (2.0, 0.1)])
@pytest.mark.parametrize("mask_kind", ["bool", "float"])
def test_dpo_matches_reference(beta, ls, mask_kind):
    lp, old, ref, adv, mask = make_inputs(rows=8, seed=6, masked_row=3)
    fn = DPOLossFn(beta=beta, label_smoothing=ls)
    loss, metrics, grad = run(fn, lp, old, ref, adv, mask, mask_kind)
    ref_loss, ref_metrics, ref_grad = ref_dpo(lp, ref, mask, beta, ls)
    check(loss, metrics, ref_loss, ref_metrics)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-5, atol=1e-7)
    assert (grad[3] == 0).all()  # fully masked rejected row


def test_dpo_gradient_direction_and_one_pair():
    # one pair, no label smoothing: descent raises the chosen and lowers the rejected logprobs
    lp, _, ref, _, mask = make_inputs(rows=2, seed=7, masked_row=None)
    loss, m, grad = run(DPOLossFn(), lp, lp, ref, lp, mask)
    ref_loss, ref_m, ref_grad = ref_dpo(lp, ref, mask, 0.1, 0.0)
    check(loss, m, ref_loss, ref_m)
    assert (grad[0][mask[0]] < 0).all() and (grad[1][mask[1]] > 0).all()
    # identical chosen and rejected: loss log 2, accuracy 0 (strict comparison)
    same = np.stack([lp[0], lp[0]])
    same_mask = np.stack([mask[0], mask[0]])
    loss, m, _ = run(DPOLossFn(beta=0.3), same, same, np.stack([ref[0], ref[0]]), same, same_mask)
    assert loss.item() == pytest.approx(math.log(2.0), rel=1e-6)
    assert m["accuracy_mean"] == 0.0


def test_dpo_odd_rows_rejected():
    with pytest.raises(ValueError, match="odd number of rows"):
        DPOLossFn()(torch.zeros(3, 4), torch.zeros(3, 4), torch.ones(3, 4, dtype=torch.bool))


# ------------------------------------------------------------------ all six: edge cases


def make_fn(name, mode="token-mean"):
    cls = POLICY_LOSS_FN.get(name)
    args = {**cls.default_args(), "loss_agg_mode": mode}
    if name == "gspo":
        args.update(clip_range_low=0.2, clip_range_high=0.2)
    return cls(**args)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("mode", MODES)
def test_empty_batch_gives_differentiable_zero(name, mode):
    fn = make_fn(name, mode)
    lp, old, ref, adv, mask = (np.zeros((0, 5)),) * 4 + (np.zeros((0, 5), dtype=bool),)
    loss, metrics, grad = run(fn, lp, old, ref, adv, mask)
    assert loss.item() == 0.0 and loss.dim() == 0
    assert grad.shape == (0, 5)
    assert all(math.isfinite(v) for v in metrics.values())


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("mode", MODES)
def test_fully_masked_row_is_inert(name, mode):
    lp, old, ref, adv, mask = make_inputs(rows=4, seed=8, masked_row=1)
    # garbage in the masked row: extreme ratios must not leak
    lp[1], old[1], ref[1] = -60.0, 0.0, 30.0
    fn = make_fn(name, mode)
    loss, metrics, grad = run(fn, lp, old, ref, adv, mask)
    assert math.isfinite(loss.item()) and np.isfinite(grad).all()
    assert all(math.isfinite(v) for v in metrics.values())
    assert (grad[1] == 0).all()
    if name != "dpo":  # without the masked row, the loss is unchanged
        keep = [0, 2, 3]
        loss2, _, grad2 = run(fn, lp[keep], old[keep], ref[keep], adv[keep], mask[keep])
        assert loss.item() == pytest.approx(loss2.item(), rel=1e-6, abs=1e-7)
        np.testing.assert_allclose(grad[keep], grad2, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("name", NAMES)
def test_all_masked_batch(name):
    lp, old, ref, adv, mask = make_inputs(rows=2, seed=9)
    mask[:] = False
    loss, metrics, grad = run(make_fn(name), lp, old, ref, adv, mask)
    if name == "dpo":
        assert loss.item() == pytest.approx(math.log(2.0))  # both log-ratios 0
    else:
        assert loss.item() == 0.0
    assert (grad == 0).all() and all(math.isfinite(v) for v in metrics.values())


def ref_for(name, lp, old, ref, adv, mask, mode="token-mean"):
    if name == "gspo":
        return ref_gspo(lp, old, adv, mask, 0.2, 0.2, mode)
    if name == "cispo":
        return ref_cispo(lp, old, adv, mask, 1.0, 0.28, False, 1.0, 0.28, mode)
    if name == "topr":
        return ref_topr(lp, old, adv, mask, 0.0, mode)
    if name == "sppo":
        return ref_sppo(lp, old, adv, mask, 0.3, mode)
    if name == "rec":
        return ref_rec(lp, old, adv, mask, mode=mode, **RECPolicyLossFn.default_args())
    return ref_dpo(lp, ref, mask, 0.1, 0.0)


@pytest.mark.parametrize("name", NAMES)
def test_single_row_or_pair(name):
    rows = 2 if name == "dpo" else 1
    lp, old, ref, adv, mask = make_inputs(rows=rows, seed=10, masked_row=None)
    loss, metrics, grad = run(make_fn(name), lp, old, ref, adv, mask)
    ref_loss, ref_metrics, ref_grad = ref_for(name, lp, old, ref, adv, mask)
    check(loss, metrics, ref_loss, ref_metrics)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("name", ["gspo", "cispo", "topr", "sppo", "rec"])
@pytest.mark.parametrize("value", [0.0, 1.5, -0.7])
def test_all_equal_advantages(name, value):
    lp, old, ref, _, mask = make_inputs(rows=5, seed=11)
    adv = np.full_like(lp, value)
    loss, metrics, grad = run(make_fn(name), lp, old, ref, adv, mask)
    ref_loss, ref_metrics, ref_grad = ref_for(name, lp, old, ref, adv, mask)
    check(loss, metrics, ref_loss, ref_metrics)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-5, atol=1e-7)
    if value == 0.0:
        assert loss.item() == 0.0 and (grad == 0).all()
    elif value > 0:  # every kept token's probability is pushed up
        assert (grad[mask] <= 0).all()
    else:
        assert (grad[mask] >= 0).all()


# ------------------------------------------------------------------ registry / discovery / config


CLASSES = {
    "gspo": GSPOPolicyLossFn,
    "cispo": CISPOPolicyLossFn,
    "topr": TOPRPolicyLossFn,
    "sppo": SPPOPolicyLossFn,
    "rec": RECPolicyLossFn,
    "dpo": DPOLossFn,
}


@pytest.mark.parametrize("name", NAMES)
def test_registry_and_loss_inputs(name):
    assert name in POLICY_LOSS_FN.names()
    assert POLICY_LOSS_FN.get(name) is CLASSES[name]
    expected = (
        ["logprob", "ref_logprob", "action_mask"]
        if name == "dpo"
        else ["logprob", "old_logprob", "action_mask", "advantages"]
    )
    assert loss_inputs_for(CLASSES[name]) == expected
    assert make_fn(name).select_keys == expected[1:]


@pytest.mark.parametrize("name", NAMES)
def test_resolve_algorithm_accepts_name(name):
    r = resolve_algorithm(AlgorithmConfig(algorithm_type="grpo", policy_loss_fn=name))
    assert isinstance(r.policy_loss_fn, CLASSES[name])
    assert r.config.policy_loss_fn == name
    defaults = CLASSES[name].default_args()
    for k, v in defaults.items():
        if k != "loss_agg_mode":
            assert r.config.policy_loss_fn_args[k] == v, k
    have = {"logprob", "old_logprob", "ref_logprob", "action_mask", "advantages"}
    assert r.check_loss_inputs(have) == loss_inputs_for(CLASSES[name])


def test_resolve_algorithm_args_reach_the_loss():
    r = resolve_algorithm(
        AlgorithmConfig(
            algorithm_type="grpo",
            policy_loss_fn="gspo",
            policy_loss_fn_args={"clip_range": 0.01, "loss_agg_mode": "seq-mean-token-mean"},
        )
    )
    fn = r.policy_loss_fn
    # the user's clip_range replaces the bounds default_args() would have set
    assert (fn.clip_range_low, fn.clip_range_high) == (0.01, 0.01)
    assert "clip_range_low" not in r.config.policy_loss_fn_args
    # and it takes effect: a sequence ratio of exp(0.05) with A = 1 is clipped at 1.01
    lp = torch.full((1, 3), -1.0 + 0.05)
    loss, _ = fn(lp, torch.full((1, 3), -1.0), torch.ones(1, 3, dtype=torch.bool), torch.ones(1, 3))
    assert loss.item() == pytest.approx(-1.01, rel=1e-6)
    assert fn.loss_agg_mode == "seq-mean-token-mean"
    # without a user clip_range the GSPO defaults apply; bounds the user gives stay
    r = resolve_algorithm(AlgorithmConfig(algorithm_type="gspo"))
    assert (r.policy_loss_fn.clip_range_low, r.policy_loss_fn.clip_range_high) == (3e-4, 4e-4)
    r = resolve_algorithm(
        AlgorithmConfig(
            algorithm_type="gspo",
            policy_loss_fn_args={"clip_range": 0.01, "clip_range_high": 0.05},
        )
    )
    assert (r.policy_loss_fn.clip_range_low, r.policy_loss_fn.clip_range_high) == (0.01, 0.05)
    # a preset's bounds yield to the user's clip_range too (DAPO: 0.2 / 0.28)
    r = resolve_algorithm(AlgorithmConfig(algorithm_type="dapo"))
    assert (r.policy_loss_fn.clip_range_low, r.policy_loss_fn.clip_range_high) == (0.2, 0.28)
    r = resolve_algorithm(
        AlgorithmConfig(algorithm_type="dapo", policy_loss_fn_args={"clip_range": 0.3})
    )
    assert (r.policy_loss_fn.clip_range_low, r.policy_loss_fn.clip_range_high) == (0.3, 0.3)
    r = resolve_algorithm(
        AlgorithmConfig(
            algorithm_type="grpo",
            policy_loss_fn="rec",
            policy_loss_fn_args={"clip_mode": "ring", "weight": "importance_sampling"},
        )
    )
    assert (r.policy_loss_fn.clip_mode, r.policy_loss_fn.weight) == ("ring", "importance_sampling")
    r = resolve_algorithm(
        AlgorithmConfig(
            algorithm_type="grpo", policy_loss_fn="dpo", policy_loss_fn_args={"beta": 0.5}
        )
    )
    assert r.policy_loss_fn.beta == 0.5 and r.policy_loss_fn.label_smoothing == 0.0
