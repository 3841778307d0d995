"""The critic: verl's clipped value loss against numpy, and the value model on the tiny LM."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rftstream.training.critic import ValueModel, value_loss

# ----------------------------------------------------------------------- numpy reference


def np_value_loss(
    vpreds: np.ndarray,
    returns: np.ndarray,
    values: np.ndarray,
    mask: np.ndarray,
    c: float,
    mode: str,
) -> tuple[float, float]:
    """verl: 0.5 * agg(max((v - R)^2, (clip(v, old - c, old + c) - R)^2)); clipfrac."""
    clipped = np.clip(vpreds, values - c, values + c)
    l1 = (vpreds - returns) ** 2
    l2 = (clipped - returns) ** 2
    per_tok = np.maximum(l1, l2)
    m = mask.astype(np.float64)
    if mode == "token-mean":
        agg = (per_tok * m).sum() / m.sum() if m.sum() else 0.0
    elif mode == "seq-mean-token-mean":
        rows = [(per_tok[i] * m[i]).sum() / m[i].sum() for i in range(len(m)) if m[i].sum() > 0]
        agg = float(np.mean(rows)) if rows else 0.0
    elif mode == "seq-mean-token-sum":
        rows = [(per_tok[i] * m[i]).sum() for i in range(len(m)) if m[i].sum() > 0]
        agg = float(np.mean(rows)) if rows else 0.0
    else:
        raise AssertionError(mode)
    clipfrac = ((l2 > l1) * m).sum() / m.sum() if m.sum() else 0.0
    return 0.5 * float(agg), float(clipfrac)


def t(a: np.ndarray) -> torch.Tensor:
    return torch.tensor(a, dtype=torch.float64)


MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_value_loss_matches_numpy(mode: str, seed: int) -> None:
    rng = np.random.default_rng(seed)
    B, T = 5, 7
    vpreds = rng.normal(size=(B, T))
    values = vpreds + rng.normal(scale=0.5, size=(B, T))
    returns = rng.normal(size=(B, T))
    mask = (rng.random((B, T)) < 0.7).astype(np.float64)
    mask[2] = 0.0  # a fully masked row
    mask[0, 0] = 1.0
    c = 0.2
    loss, metrics = value_loss(t(vpreds), t(returns), t(values), t(mask), c, mode)
    want, want_frac = np_value_loss(vpreds, returns, values, mask, c, mode)
    assert float(loss) == pytest.approx(want, rel=1e-9, abs=1e-12)
    assert metrics["vf_loss"] == pytest.approx(want, rel=1e-9)
    assert metrics["vf_clipfrac"] == pytest.approx(want_frac, abs=1e-12)
    assert 0.0 < want_frac < 1.0  # the case exercises both branches
    m = mask.astype(bool)
    assert metrics["vpred_mean"] == pytest.approx(float(vpreds[m].mean()), rel=1e-9)


def test_value_loss_by_hand() -> None:
    # one row, two tokens; c = 0.1
    vpreds = np.array([[1.0, 0.0]])
    values = np.array([[0.5, 0.05]])
    returns = np.array([[0.0, 1.0]])
    # token 0: l1 = 1, clipped = 0.6 -> l2 = 0.36: max 1, unclipped wins
    # token 1: l1 = 1, clipped = 0.0 (within 0.05 +- 0.1) -> l2 = 1: max 1, no clip (not >)
    loss, m = value_loss(t(vpreds), t(returns), t(values), t(np.ones((1, 2))), 0.1)
    assert float(loss) == pytest.approx(0.5)
    assert m["vf_clipfrac"] == 0.0
    # token where clipping pulls the prediction away from the return: the clipped term wins
    vpreds = np.array([[1.0]])
    values = np.array([[0.0]])
    returns = np.array([[1.0]])  # l1 = 0; clipped = 0.1 -> l2 = 0.81
    loss, m = value_loss(t(vpreds), t(returns), t(values), t(np.ones((1, 1))), 0.1)
    assert float(loss) == pytest.approx(0.5 * 0.81)
    assert m["vf_clipfrac"] == 1.0


@pytest.mark.parametrize("mode", MODES)
def test_fully_masked_rows_do_not_count(mode: str) -> None:
    rng = np.random.default_rng(5)
    vpreds, values, returns = (rng.normal(size=(3, 4)) for _ in range(3))
    mask = np.array([[1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]], dtype=np.float64)
    full, _ = value_loss(t(vpreds), t(returns), t(values), t(mask), 0.3, mode)
    keep = [0, 2]
    sub, _ = value_loss(
        t(vpreds[keep]), t(returns[keep]), t(values[keep]), t(mask[keep]), 0.3, mode
    )
    assert float(full) == pytest.approx(float(sub), rel=1e-12)
    # garbage in the masked row changes nothing
    vpreds2 = vpreds.copy()
    vpreds2[1] = 1e6
    again, m = value_loss(t(vpreds2), t(returns), t(values), t(mask), 0.3, mode)
    assert float(again) == pytest.approx(float(full), rel=1e-12)
    assert np.isfinite(m["vpred_mean"])


@pytest.mark.parametrize("mode", MODES)
def test_all_masked_is_zero_not_nan(mode: str) -> None:
    z = torch.ones(2, 3)
    loss, m = value_loss(z, z * 2, z * 3, torch.zeros(2, 3), 0.2, mode)
    assert float(loss) == 0.0
    assert m["vf_clipfrac"] == 0.0
    assert m["vpred_mean"] == 0.0


def test_token_mean_and_seq_mean_differ_with_ragged_rows() -> None:
    vpreds = np.array([[1.0, 1.0, 1.0, 1.0], [3.0, 0.0, 0.0, 0.0]])
    returns = np.zeros((2, 4))
    values = vpreds.copy()  # no clipping: clipped == vpreds
    mask = np.array([[1, 1, 1, 1], [1, 0, 0, 0]], dtype=np.float64)
    tok, _ = value_loss(t(vpreds), t(returns), t(values), t(mask), 0.2, "token-mean")
    seq, _ = value_loss(t(vpreds), t(returns), t(values), t(mask), 0.2, "seq-mean-token-mean")
    # token-mean: (4 * 1 + 9) / 5; seq-mean-token-mean: (1 + 9) / 2
    assert float(tok) == pytest.approx(0.5 * 13 / 5)
    assert float(seq) == pytest.approx(0.5 * 5.0)


def test_value_loss_gradient_matches_numpy() -> None:
    rng = np.random.default_rng(9)
    vpreds = rng.normal(size=(2, 3))
    values = vpreds + rng.normal(scale=0.4, size=(2, 3))
    returns = rng.normal(size=(2, 3))
    mask = np.array([[1, 1, 0], [1, 1, 1]], dtype=np.float64)
    c = 0.2
    v = t(vpreds).requires_grad_(True)
    loss, _ = value_loss(v, t(returns), t(values), t(mask), c, "token-mean")
    loss.backward()
    # d/dv of 0.5 * mean(max(l1, l2)): (v - R) where l1 wins; (clip - R) where l2 wins and v
    # is inside the clip range; 0 where l2 wins and v is clipped.
    lo, hi = values - c, values + c
    clipped = np.clip(vpreds, lo, hi)
    l1, l2 = (vpreds - returns) ** 2, (clipped - returns) ** 2
    inside = (vpreds > lo) & (vpreds < hi)
    g = np.where(l2 > l1, np.where(inside, clipped - returns, 0.0), vpreds - returns)
    want = g * mask / mask.sum()
    np.testing.assert_allclose(v.grad.numpy(), want, rtol=1e-9, atol=1e-12)


# ----------------------------------------------------------------------- ValueModel


@pytest.fixture(scope="module")
def backbone(tiny_model_path: str):
    from rftstream.model_loading import load_causal_lm

    torch.manual_seed(0)
    return load_causal_lm(tiny_model_path)


def layout(prompts: list[list[int]], responses: list[list[int]], pad: int = 0):
    """verl layout by hand: prompts left-padded to P, responses right-padded to R."""
    P = max(len(p) for p in prompts)
    R = max(len(r) for r in responses)
    B = len(prompts)
    ids = torch.full((B, P + R), pad, dtype=torch.long)
    att = torch.zeros((B, P + R), dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        ids[i, P - len(p) : P] = torch.tensor(p)
        att[i, P - len(p) : P] = 1
        ids[i, P : P + len(r)] = torch.tensor(r)
        att[i, P : P + len(r)] = 1
    pos = (att.cumsum(1) - 1).clamp(min=0)
    return ids, att, pos, P, R


def test_value_model_starts_at_zero_and_has_response_shape(backbone) -> None:
    model = ValueModel(backbone)
    ids, att, pos, P, R = layout([[5, 6, 7], [8, 9]], [[10, 11], [12, 13, 14, 15]])
    with torch.no_grad():
        out = model(ids, att, pos, P)
    assert out.shape == (2, R)
    assert out.dtype == torch.float32
    assert torch.count_nonzero(out) == 0
    assert model.value_head.in_features == backbone.config.hidden_size
    assert model.value_head.out_features == 1


def test_value_model_reads_the_state_that_predicts_each_response_token(backbone) -> None:
    model = ValueModel(backbone)
    torch.manual_seed(1)
    with torch.no_grad():
        model.value_head.weight.normal_()
        model.value_head.bias.fill_(0.25)
    ids, att, pos, P, R = layout([[5, 6, 7], [8, 9]], [[10, 11, 4], [12]])
    with torch.no_grad():
        out = model(ids, att, pos, P)
        hidden = backbone(
            input_ids=ids, attention_mask=att, position_ids=pos, output_hidden_states=True
        ).hidden_states[-1]
    w = model.value_head.weight.detach().double().numpy()[0]
    h = hidden.double().numpy()
    for b in range(2):
        for j in range(R):
            want = float(h[b, P - 1 + j] @ w + 0.25)
            assert float(out[b, j]) == pytest.approx(want, rel=1e-4, abs=1e-4)


def test_value_model_gradient_reaches_the_value_head(backbone) -> None:
    model = ValueModel(backbone)
    model.zero_grad(set_to_none=True)
    ids, att, pos, P, R = layout([[5, 6, 7], [8, 9]], [[10, 11], [12, 13, 14]])
    mask = att[:, P:].float()
    vpreds = model(ids, att, pos, P)
    returns = torch.ones_like(vpreds)
    loss, _ = value_loss(vpreds, returns, torch.zeros_like(vpreds), mask, 0.5)
    loss.backward()
    assert model.value_head.bias.grad is not None
    assert model.value_head.weight.grad is not None
    # dL/d(bias) = mean over real tokens of (v - R) = -1 (values are 0, the unclipped term wins)
    assert float(model.value_head.bias.grad[0]) == pytest.approx(-1.0, rel=1e-5)
    assert float(model.value_head.weight.grad.abs().sum()) > 0
    # one step moves the values towards the returns
    with torch.no_grad():
        for p in model.value_head.parameters():
            p -= 0.1 * p.grad
        after = model(ids, att, pos, P)
    assert float((after * mask).sum()) > 0
    model.zero_grad(set_to_none=True)
