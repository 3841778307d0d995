"""masked_mean / masked_sum / masked_loss / masked_whiten against plain numpy references."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from algorithms import aggregate_loss, masked_loss, masked_mean, masked_sum, masked_whiten
from algorithms.utils import LOSS_AGG_MODES


def ref_agg(values: np.ndarray, mask: np.ndarray, mode: str) -> float:
    """Independent reference, row by row in plain Python."""
    rows = [
        [(float(v), float(m)) for v, m in zip(vr, mr, strict=True)]
        for vr, mr in zip(values, mask, strict=True)
    ]
    if mode == "token-mean":
        num = sum(v * m for r in rows for v, m in r if m != 0)
        den = sum(m for r in rows for _, m in r)
        return num / den if den else 0.0
    if mode == "seq-mean-token-sum-norm":
        total = sum(v * m for r in rows for v, m in r if m != 0)
        return total / values.shape[-1] if values.shape[-1] else 0.0
    per_row = []
    for r in rows:
        den = sum(m for _, m in r)
        if den == 0:
            continue  # fully masked rows are excluded
        s = sum(v * m for v, m in r if m != 0)
        per_row.append(s if mode == "seq-mean-token-sum" else s / den)
    return sum(per_row) / len(per_row) if per_row else 0.0


VALUES = np.array(
    [
        [0.5, -1.0, 2.0, 3.0, 0.25],
        [1.5, 2.5, -0.5, 0.0, 4.0],
        [9.0, 9.0, 9.0, 9.0, 9.0],
        [-2.0, 1.0, 0.0, 0.0, 0.0],
    ],
    dtype=np.float32,
)
MASK = np.array(
    [
        [1, 1, 1, 0, 0],
        [1, 1, 1, 1, 1],
        [0, 0, 0, 0, 0],  # fully masked row
        [1, 1, 0, 0, 0],
    ],
    dtype=bool,
)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_modes_match_reference_with_fully_masked_row(mode):
    got = masked_loss(torch.tensor(VALUES), torch.tensor(MASK), loss_agg_mode=mode)
    assert got.item() == pytest.approx(ref_agg(VALUES, MASK, mode), rel=1e-6)


def test_mode_values_differ_as_documented():
    v, m = torch.tensor(VALUES), torch.tensor(MASK)
    # hand-computed: row sums 1.5, 7.5, -, -1.0 ; row lengths 3, 5, -, 2
    assert masked_loss(v, m, "token-mean").item() == pytest.approx(8.0 / 10)
    assert masked_loss(v, m, "seq-mean-token-sum").item() == pytest.approx((1.5 + 7.5 - 1.0) / 3)
    assert masked_loss(v, m, "seq-mean-token-mean").item() == pytest.approx((0.5 + 1.5 - 0.5) / 3)
    assert masked_loss(v, m, "seq-mean-token-sum-norm").item() == pytest.approx(8.0 / 5)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_float_mask_weights(mode):
    weights = np.array([[1.0, 0.5, 0.0], [0.0, 0.0, 0.0], [2.0, 1.0, 1.0]], dtype=np.float32)
    vals = np.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [-1.0, 0.5, 2.0]], dtype=np.float32)
    got = masked_loss(torch.tensor(vals), torch.tensor(weights), loss_agg_mode=mode)
    assert got.item() == pytest.approx(ref_agg(vals, weights, mode), rel=1e-6)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_all_masked_and_empty_batches_give_zero(mode):
    v = torch.randn(3, 4)
    assert masked_loss(v, torch.zeros(3, 4, dtype=torch.bool), mode).item() == 0.0
    assert masked_loss(torch.zeros(0, 4), torch.zeros(0, 4, dtype=torch.bool), mode).item() == 0.0
    assert masked_loss(torch.zeros(2, 0), torch.zeros(2, 0, dtype=torch.bool), mode).item() == 0.0


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_nan_and_inf_under_the_mask_do_not_leak(mode):
    vals = VALUES.copy()
    vals[0, 3] = np.nan
    vals[0, 4] = -np.inf
    vals[2, :] = np.inf
    got = masked_loss(torch.tensor(vals), torch.tensor(MASK), loss_agg_mode=mode)
    assert math.isfinite(got.item())
    assert got.item() == pytest.approx(ref_agg(VALUES, MASK, mode), rel=1e-6)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_gradient_is_finite_and_zero_on_masked_positions(mode):
    v = torch.tensor(VALUES, requires_grad=True)
    masked_loss(v, torch.tensor(MASK), mode).backward()
    assert torch.isfinite(v.grad).all()
    assert (v.grad[~torch.tensor(MASK)] == 0).all()


def test_one_dimensional_input_is_one_sequence():
    v = torch.tensor([1.0, 2.0, 3.0, 4.0])
    m = torch.tensor([True, True, False, True])
    assert masked_loss(v, m, "token-mean").item() == pytest.approx(7.0 / 3)
    assert masked_loss(v, m, "seq-mean-token-sum").item() == pytest.approx(7.0)
    assert masked_loss(v, m, "seq-mean-token-sum-norm").item() == pytest.approx(7.0 / 4)


def test_invalid_mode_raises():
    with pytest.raises(ValueError, match="invalid loss_agg_mode"):
        masked_loss(torch.ones(1, 2), torch.ones(1, 2, dtype=torch.bool), "mean")


def test_aggregate_loss_is_an_alias():
    assert aggregate_loss is masked_loss


def test_masked_mean_and_sum_per_row():
    v, m = torch.tensor(VALUES), torch.tensor(MASK)
    row_means = masked_mean(v, m, dim=-1)
    row_sums = masked_sum(v, m, axis=-1)
    for i in range(VALUES.shape[0]):
        sel = VALUES[i][MASK[i]]
        assert row_sums[i].item() == pytest.approx(float(sel.sum()))
        assert row_means[i].item() == pytest.approx(float(sel.mean()) if sel.size else 0.0)
    assert masked_mean(v, m).item() == pytest.approx(float(VALUES[MASK].mean()))


def test_masked_whiten_matches_numpy():
    v, m = torch.tensor(VALUES), torch.tensor(MASK)
    sel = VALUES[MASK].astype(np.float64)
    mean, var = sel.mean(), sel.var(ddof=1)
    expected = (VALUES - mean) / np.sqrt(var + 1e-8)
    got = masked_whiten(v, m)
    np.testing.assert_allclose(got.numpy()[MASK], expected[MASK], rtol=1e-5)
    got2 = masked_whiten(v, m, shift_mean=False)
    np.testing.assert_allclose(got2.numpy()[MASK], expected[MASK] + mean, rtol=1e-5)
    with pytest.raises(ValueError):
        masked_whiten(torch.ones(1, 2), torch.tensor([[True, False]]))
