"""The ``mix`` entropy loss (non-expert rows only) and the uniform ``expert_mask`` convention.

Expected values come from plain numpy below, never from the implementation.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from algorithms import ENTROPY_LOSS_FN

MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]

# rows: usual, expert (holds inf / nan: must never leak), usual fully masked, usual
ENT = np.array(
    [
        [1.0, 2.0, 3.0, 50.0],
        [np.inf, np.nan, 9.0, 9.0],
        [4.0, 4.0, 4.0, 4.0],
        [0.5, 1.5, 2.5, 3.5],
    ]
)
MASK = np.array([[1, 1, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0], [1, 1, 0, 0]], dtype=bool)
EXPERT = np.array([False, True, False, False])


def ref_agg(ent: np.ndarray, mask: np.ndarray, mode: str) -> float:
    """Aggregate as documented in algorithms.utils.masked_loss, in plain python."""
    rows = [
        [float(v) for v, m in zip(r, mr, strict=True) if m] for r, mr in zip(ent, mask, strict=True)
    ]
    if ent.shape[0] == 0:
        return 0.0
    if mode == "token-mean":
        flat = [v for r in rows for v in r]
        return sum(flat) / len(flat) if flat else 0.0
    if mode == "seq-mean-token-sum-norm":
        return sum(v for r in rows for v in r) / ent.shape[1]
    nonempty = [r for r in rows if r]
    if not nonempty:
        return 0.0
    if mode == "seq-mean-token-sum":
        return sum(sum(r) for r in nonempty) / len(nonempty)
    return sum(sum(r) / len(r) for r in nonempty) / len(nonempty)


def t(x, dtype=torch.float32):
    return torch.tensor(np.asarray(x), dtype=dtype)


def test_registered_with_required_fields():
    assert ENTROPY_LOSS_FN.get("mix").required_fields == frozenset({"expert_mask"})
    assert ENTROPY_LOSS_FN.get("default").required_fields == frozenset()
    assert ENTROPY_LOSS_FN.get("none").required_fields == frozenset()
    cls = ENTROPY_LOSS_FN.get("mix")
    assert cls(**cls.default_args()).entropy_coef == 0.0


@pytest.mark.parametrize("mode", MODES)
def test_mix_matches_reference_on_usual_rows(mode):
    coef = 0.03
    fn = ENTROPY_LOSS_FN.get("mix")(entropy_coef=coef, loss_agg_mode=mode)
    loss, metrics = fn(
        entropy=t(ENT), action_mask=t(MASK, torch.bool), expert_mask=t(EXPERT, torch.bool)
    )
    usual = ~EXPERT
    agg = ref_agg(ENT[usual], MASK[usual], mode)
    assert math.isfinite(loss.item())
    assert loss.item() == pytest.approx(coef * agg, rel=1e-6)
    assert metrics == {"entropy_loss": pytest.approx(agg, rel=1e-6)}


def test_mix_call_mode_overrides_constructor_and_float_mask():
    fn = ENTROPY_LOSS_FN.get("mix")(entropy_coef=1.0, loss_agg_mode="token-mean")
    loss, _ = fn(
        t(ENT),
        t(MASK),  # float mask
        "seq-mean-token-mean",
        expert_mask=t(EXPERT.astype(np.int64), torch.int64),  # any dtype: nonzero = expert
    )
    usual = ~EXPERT
    assert loss.item() == pytest.approx(ref_agg(ENT[usual], MASK[usual], "seq-mean-token-mean"))


def test_mix_gradient_reaches_only_usual_unmasked_tokens():
    coef = 0.5
    ent = t(np.nan_to_num(ENT, nan=1.0, posinf=1.0)).requires_grad_(True)
    fn = ENTROPY_LOSS_FN.get("mix")(entropy_coef=coef)
    loss, _ = fn(ent, t(MASK, torch.bool), expert_mask=t(EXPERT, torch.bool))
    loss.backward()
    sel = MASK & ~EXPERT[:, None]
    expected = np.where(sel, coef / sel.sum(), 0.0)
    np.testing.assert_allclose(ent.grad.numpy(), expected, rtol=1e-6)


@pytest.mark.parametrize("mode", MODES)
def test_mix_all_rows_expert_is_zero_and_finite(mode):
    fn = ENTROPY_LOSS_FN.get("mix")(entropy_coef=0.1, loss_agg_mode=mode)
    ent = t(ENT).nan_to_num(nan=2.0, posinf=2.0).requires_grad_(True)
    loss, metrics = fn(ent, t(MASK, torch.bool), expert_mask=torch.ones(4, dtype=torch.bool))
    assert loss.item() == 0.0 and math.isfinite(loss.item())
    assert metrics == {"entropy_loss": 0.0}
    loss.backward()  # still part of the graph, zero gradient
    assert torch.equal(ent.grad, torch.zeros_like(ent))
    # inf/nan in the expert rows do not leak either
    loss2, _ = fn(t(ENT), t(MASK, torch.bool), expert_mask=torch.ones(4, dtype=torch.bool))
    assert loss2.item() == 0.0


@pytest.mark.parametrize("mode", MODES)
def test_mix_empty_batch_and_fully_masked_usual_rows(mode):
    fn = ENTROPY_LOSS_FN.get("mix")(entropy_coef=1.0, loss_agg_mode=mode)
    loss, metrics = fn(
        torch.zeros(0, 4), torch.zeros(0, 4, dtype=torch.bool), expert_mask=torch.zeros(0)
    )
    assert loss.item() == 0.0 and metrics == {"entropy_loss": 0.0}
    # usual rows present but every token masked
    loss, metrics = fn(
        t(ENT[[1, 2]]), t(MASK[[1, 2]], torch.bool), expert_mask=t([True, False], torch.bool)
    )
    assert loss.item() == 0.0 and metrics == {"entropy_loss": 0.0}


def test_mix_without_or_with_wrong_expert_mask():
    fn = ENTROPY_LOSS_FN.get("mix")(entropy_coef=0.1)
    with pytest.raises(ValueError, match="expert_mask"):
        fn(t(ENT), t(MASK, torch.bool))
    with pytest.raises(ValueError, match="3 entries for 4 rows"):
        fn(t(ENT), t(MASK, torch.bool), expert_mask=torch.zeros(3, dtype=torch.bool))


@pytest.mark.parametrize("mode", MODES)
def test_default_and_none_accept_and_ignore_expert_mask(mode):
    ent = np.nan_to_num(ENT, nan=1.0, posinf=1.0)
    fn = ENTROPY_LOSS_FN.get("default")(entropy_coef=0.2, loss_agg_mode=mode)
    loss, metrics = fn(
        entropy=t(ent),
        action_mask=t(MASK, torch.bool),
        loss_agg_mode=None,
        expert_mask=t(EXPERT, torch.bool),
        step=torch.zeros(4, dtype=torch.int32),
    )
    agg = ref_agg(ent, MASK, mode)  # every row counts
    assert loss.item() == pytest.approx(0.2 * agg, rel=1e-6)
    assert metrics == {"entropy_loss": pytest.approx(agg, rel=1e-6)}
    loss, metrics = ENTROPY_LOSS_FN.get("none")()(
        entropy=t(ent),
        action_mask=t(MASK, torch.bool),
        loss_agg_mode=mode,
        expert_mask=t(EXPERT, torch.bool),
    )
    assert loss.item() == 0.0 and metrics == {}
