"""KL estimators, KL loss / reward penalty, adaptive coefficient and entropy loss."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from algorithms import ENTROPY_LOSS_FN, KL_FN
from rftstream.experience import EID, Experience

LP = np.array([[-0.5, -1.0, -2.0, -30.0], [-0.1, -3.0, -0.7, -1.2]])
REF = np.array([[-0.7, -1.0, -1.0, -0.5], [-0.2, -0.5, -0.9, -1.2]])
OLD = np.array([[-0.6, -0.9, -2.5, -29.0], [-0.1, -2.0, -0.7, -1.0]])
MASK = np.array([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=bool)


def t(x, dtype=torch.float32):
    return torch.tensor(np.asarray(x), dtype=dtype)


def ref_kl(name, lp, ref, old=None):
    d = lp - ref
    if name == "none":
        return np.zeros_like(lp)
    if name == "k1":
        return d
    if name == "k2":
        return 0.5 * d**2
    if name == "abs":
        return np.abs(d)
    logr = ref - lp
    if name == "k3":
        return np.exp(logr) - logr - 1
    if name == "low_var_kl":
        c = np.clip(logr, -20, 20)
        return np.clip(np.exp(c) - c - 1, -10, 10)
    if name == "corrected_k3":
        k3 = np.exp(logr) - logr - 1
        return k3 if old is None else np.clip(np.exp(lp - old), 0, 2) * k3
    raise AssertionError(name)


KL_NAMES = ["none", "k1", "k2", "k3", "low_var_kl", "abs", "corrected_k3"]


@pytest.mark.parametrize("name", KL_NAMES)
def test_calculate_kl_matches_reference(name):
    fn = KL_FN.get(name)()
    got = fn.calculate_kl(t(LP), t(REF)).numpy()
    np.testing.assert_allclose(got, ref_kl(name, LP, REF), rtol=1e-5, atol=1e-6)


def test_low_var_kl_clamps_and_k3_does_not():
    # ref - logprob = 29.5 -> k3 is huge, low_var_kl clamps to 10
    assert KL_FN.get("low_var_kl")().calculate_kl(t(LP), t(REF))[0, 3].item() == 10.0
    assert KL_FN.get("k3")().calculate_kl(t(LP), t(REF))[0, 3].item() > 1e10


def test_corrected_k3_uses_old_logprob():
    got = KL_FN.get("corrected_k3")().calculate_kl(t(LP), t(REF), t(OLD)).numpy()
    np.testing.assert_allclose(got, ref_kl("corrected_k3", LP, REF, OLD), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["k1", "k2", "low_var_kl"])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_kl_loss(name, mode):
    fn = KL_FN.get(name)(kl_coef=0.05, loss_agg_mode=mode)
    kl = ref_kl(name, LP, REF)
    if mode == "token-mean":
        agg = kl[MASK].mean()
    else:
        agg = np.mean([kl[i][MASK[i]].mean() for i in range(2)])
    loss, metrics = fn.calculate_kl_loss(t(LP), t(REF), t(MASK, torch.bool))
    assert loss.item() == pytest.approx(0.05 * agg, rel=1e-5)
    assert metrics == {"kl_loss": pytest.approx(agg, rel=1e-5), "kl_coef": 0.05}
    # explicit mode argument beats the constructor's
    loss2, _ = fn.calculate_kl_loss(t(LP), t(REF), t(MASK, torch.bool), "seq-mean-token-sum-norm")
    assert loss2.item() == pytest.approx(0.05 * kl[MASK].sum() / 4, rel=1e-5)


def test_none_kl_loss_is_zero():
    loss, metrics = KL_FN.get("none")().calculate_kl_loss(t(LP), t(REF), t(MASK, torch.bool))
    assert loss.item() == 0.0 and metrics == {}


def test_adaptive_kl_coefficient():
    with pytest.raises(ValueError):
        KL_FN.get("k1")(adaptive=True)
    fn = KL_FN.get("k1")(kl_coef=0.1, adaptive=True, target_kl=0.02, horizon=1000)
    fn.update_kl_coef(current_kl=0.03, batch_size=100)  # error 0.5, clipped to 0.2
    assert fn.kl_coef == pytest.approx(0.1 * (1 + 0.2 * 100 / 1000))
    fn.update_kl_coef(current_kl=0.019, batch_size=10)  # error -0.05
    assert fn.kl_coef == pytest.approx(0.1 * 1.02 * (1 - 0.05 * 10 / 1000))
    fixed = KL_FN.get("k1")(kl_coef=0.1)
    fixed.update_kl_coef(current_kl=5.0, batch_size=100)
    assert fixed.kl_coef == 0.1


def mk(reward, lp, mask, ref=None, task="t"):
    info = {} if ref is None else {"ref_logprobs": list(ref)}
    return Experience(
        tokens=list(range(2 + len(lp))),
        prompt_length=2,
        reward=reward,
        logprobs=list(lp),
        action_mask=list(mask),
        info=info,
        eid=EID(task=task),
    )


def test_apply_kl_penalty_to_reward():
    coef = 0.1
    fn = KL_FN.get("k2")(kl_coef=coef)
    e1 = mk(1.0, LP[0], MASK[0], REF[0])
    e2 = mk(0.5, LP[1], MASK[1])
    out, metrics = fn.apply_kl_penalty_to_reward([e1, e2], ref_logprobs=[t(REF[0]), t(REF[1])])
    for exp, reward, i in ((e1, 1.0, 0), (e2, 0.5, 1)):
        scores = np.zeros(4)
        scores[-1] = reward
        kl = ref_kl("k2", LP[i], REF[i]) * MASK[i]
        np.testing.assert_allclose(exp.token_level_reward.numpy(), scores - coef * kl, rtol=1e-5)
        assert exp.token_level_reward.dtype == torch.float32
    seq_kls = [ref_kl("k2", LP[i], REF[i])[MASK[i]].mean() for i in range(2)]
    assert metrics["kl"] == pytest.approx(np.mean(seq_kls), rel=1e-5)
    assert metrics["kl_coef"] == coef


def test_apply_kl_penalty_reads_info_and_adapts():
    fn = KL_FN.get("k1")(kl_coef=0.1, adaptive=True, target_kl=1.0, horizon=10)
    e = mk(2.0, LP[1], MASK[1], REF[1])
    _, metrics = fn.apply_kl_penalty_to_reward([e])
    kl = LP[1] - REF[1]
    expected = np.zeros(4)
    expected[-1] = 2.0
    np.testing.assert_allclose(e.token_level_reward.numpy(), expected - 0.1 * kl, rtol=1e-5)
    err = min(max(kl.mean() / 1.0 - 1, -0.2), 0.2)
    assert fn.kl_coef == pytest.approx(0.1 * (1 + err * 1 / 10))
    assert metrics["kl_coef"] == 0.1


def test_apply_kl_penalty_without_reference_or_with_none():
    e = mk(1.0, LP[0], MASK[0])
    _, metrics = KL_FN.get("k2")().apply_kl_penalty_to_reward([e])
    np.testing.assert_allclose(e.token_level_reward.numpy(), [0, 0, 0, 1.0])
    assert metrics == {"kl": 0.0, "kl_coef": 0.0}
    e2 = mk(3.0, LP[0], MASK[0], REF[0])
    _, m2 = KL_FN.get("none")().apply_kl_penalty_to_reward([e2])
    np.testing.assert_allclose(e2.token_level_reward.numpy(), [0, 0, 0, 3.0])
    assert m2 == {}


# ------------------------------------------------------------------ entropy

ENT = np.array([[1.0, 2.0, 3.0, 100.0], [0.5, 0.5, 0.5, 0.5], [7.0, 7.0, 7.0, 7.0]])
EMASK = np.array([[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]], dtype=bool)


def test_default_entropy_loss():
    fn = ENTROPY_LOSS_FN.get("default")(entropy_coef=0.01)
    loss, m = fn(entropy=t(ENT), action_mask=t(EMASK, torch.bool))
    agg = ENT[EMASK].mean()
    assert loss.item() == pytest.approx(0.01 * agg)
    assert m == {"entropy_loss": pytest.approx(agg)}
    loss2, m2 = fn(t(ENT), t(EMASK, torch.bool), loss_agg_mode="seq-mean-token-mean")
    assert m2["entropy_loss"] == pytest.approx((2.0 + 0.5) / 2)
    assert loss2.item() == pytest.approx(0.01 * 1.25)
    fn2 = ENTROPY_LOSS_FN.get("default")(entropy_coef=0.5, loss_agg_mode="seq-mean-token-sum")
    assert fn2(t(ENT), t(EMASK, torch.bool))[0].item() == pytest.approx(0.5 * (6.0 + 1.0) / 2)


def test_zero_coef_and_none_entropy():
    loss, _ = ENTROPY_LOSS_FN.get("default")()(t(ENT), t(EMASK, torch.bool))
    assert loss.item() == 0.0
    loss, m = ENTROPY_LOSS_FN.get("none")()(t(ENT), t(EMASK, torch.bool))
    assert loss.item() == 0.0 and m == {}
    empty = ENTROPY_LOSS_FN.get("default")(entropy_coef=1.0)(
        torch.zeros(0, 4), torch.zeros(0, 4, dtype=torch.bool)
    )
    assert empty[0].item() == 0.0
