"""Masked reductions and loss aggregation: what the trainer and every algorithm component compute with.

Modelled on verl's ``verl.utils.torch_functional`` and ``core_algos.agg_loss``
(and Trinity-RFT's ``trinity.algorithm.utils``), with two deliberate
differences that keep a training step NaN-free:

* an empty batch, or a batch whose mask is all zero, aggregates to ``0``
  (verl divides by ``mask.sum() + 1e-8`` or by zero);
* in the ``seq-mean-*`` modes a fully masked row is left out of the mean over
  rows (verl counts it as ``0`` in ``seq-mean-token-sum`` and gets ``0/0 =
  NaN`` in ``seq-mean-token-mean``).

Masked-out positions never reach the result, even when they hold ``inf`` or
``NaN`` (padding logprobs often do): a bool mask selects with ``torch.where``
instead of multiplying.

Shapes: ``values`` and ``mask`` have the same shape, ``(batch, seq)`` for the
loss functions; a 1-D input is one sequence. ``mask`` is bool (1 = include) or
float (a per-token weight). Pure tensor code, no I/O.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar

import torch

from rftstream.config.schema import LOSS_AGG_MODES

# inside :func:`whole_batch`: adds a tensor of this shard's sums over every trainer rank
_SUM_OVER_SHARDS: ContextVar[Callable[[torch.Tensor], torch.Tensor] | None] = ContextVar(
    "rftstream_sum_over_shards", default=None
)


@contextlib.contextmanager
def whole_batch(sum_over_shards: Callable[[torch.Tensor], torch.Tensor]) -> Iterator[None]:
    """Within this block the whole-tensor statistics (:func:`masked_count`,
    :func:`masked_mean` with ``dim=None``, :func:`masked_var`, :func:`masked_whiten`) are
    those of the whole batch, not of this trainer rank's shard (:func:`masked_sum` stays
    local: advantage fns sum per group).

    ``sum_over_shards`` takes a 1-D float64 tensor of this shard's partial sums and returns
    the element-wise sums over every rank (an all-reduce; a collective, so every rank must
    make the same calls in the same order, which holds when the code branches only on these
    whole-batch values). The trainer opens it around the advantage fn when it trains on
    several ranks, so REINFORCE++'s and PPO's whitening see the batch a 1-rank step sees.
    """
    token = _SUM_OVER_SHARDS.set(sum_over_shards)
    try:
        yield
    finally:
        _SUM_OVER_SHARDS.reset(token)


def _over_shards(*sums: torch.Tensor) -> list[torch.Tensor]:
    """``sums`` (scalars) summed over every rank's shard inside :func:`whole_batch`; as
    given outside it."""
    reduce = _SUM_OVER_SHARDS.get()
    if reduce is None:
        return list(sums)
    total = reduce(torch.stack([x.detach().to(torch.float64).reshape(()) for x in sums]))
    return [t.to(dtype=x.dtype, device=x.device) for t, x in zip(total, sums, strict=True)]


def check_loss_agg_mode(loss_agg_mode: str) -> str:
    """Return ``loss_agg_mode`` if it is one of :data:`LOSS_AGG_MODES`, else raise ValueError."""
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(
            f"invalid loss_agg_mode {loss_agg_mode!r}; choose one of {list(LOSS_AGG_MODES)}"
        )
    return loss_agg_mode


def _masked_values(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``values`` with masked-out positions set to 0 (weights applied for a float mask)."""
    if mask.dtype == torch.bool:
        return torch.where(mask, values, torch.zeros((), dtype=values.dtype, device=values.device))
    weighted = values * mask
    return torch.where(
        mask != 0, weighted, torch.zeros((), dtype=weighted.dtype, device=weighted.device)
    )


def _resolve_dim(dim: int | None, axis: int | None) -> int | None:
    if dim is not None and axis is not None and dim != axis:
        raise ValueError("pass either dim or axis, not both")
    return dim if dim is not None else axis


def masked_sum(
    values: torch.Tensor, mask: torch.Tensor, dim: int | None = None, *, axis: int | None = None
) -> torch.Tensor:
    """Sum of ``values`` where ``mask`` is set (weighted by a float mask).

    ``dim=None`` sums everything to a scalar; otherwise reduces ``dim``.
    ``axis`` is accepted as an alias of ``dim`` (Trinity-RFT's spelling).
    """
    d = _resolve_dim(dim, axis)
    mv = _masked_values(values, mask)
    return mv.sum() if d is None else mv.sum(dim=d)


def masked_count(mask: torch.Tensor) -> int:
    """Positions where ``mask`` is set (non-zero); over the whole batch inside
    :func:`whole_batch`."""
    return int(_over_shards((mask != 0).sum().to(torch.float64))[0])


def masked_mean(
    values: torch.Tensor, mask: torch.Tensor, dim: int | None = None, *, axis: int | None = None
) -> torch.Tensor:
    """Mean of ``values`` over positions where ``mask`` is set: ``sum(v*m) / sum(m)``.

    ``dim=None`` gives a scalar; otherwise a tensor with ``dim`` reduced. Where
    the mask sums to 0 (empty input, fully masked row) the result is ``0``, not
    NaN. ``axis`` is an alias of ``dim``.
    """
    d = _resolve_dim(dim, axis)
    if d is None:
        num, den = _over_shards(_masked_values(values, mask).sum(), mask.to(values.dtype).sum())
    else:
        num = masked_sum(values, mask, d)
        den = mask.to(num.dtype).sum(dim=d)
    safe = torch.where(den == 0, torch.ones_like(den), den)
    return torch.where(den == 0, torch.zeros_like(num), num / safe)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of the masked ``values`` (all dims). ``unbiased`` applies Bessel's correction.

    Raises ValueError when fewer than one (biased) or two (unbiased) positions are set.
    """
    dtype = values.dtype if values.is_floating_point() else torch.float32
    count = _over_shards(mask.to(dtype).sum())[0]
    if count < 1 or (unbiased and count < 2):
        raise ValueError(
            f"masked_var needs at least {2 if unbiased else 1} unmasked values, got {int(count)}"
        )
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        var = var * (count / (count - 1))
    return var


def masked_whiten(
    values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True
) -> torch.Tensor:
    """Normalise ``values`` to zero mean and unit variance using masked statistics (verl).

    ``(values - mean) * rsqrt(var + 1e-8)`` with the unbiased masked variance;
    with ``shift_mean=False`` the mean is added back. Same shape as ``values``;
    masked-out positions are transformed too (multiply by the mask afterwards).
    Raises ValueError for fewer than two unmasked values.
    """
    mean = masked_mean(values, mask)
    var = masked_var(values, mask, unbiased=True)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return whitened


def masked_loss(
    values: torch.Tensor,
    mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    normalizer: float | None = None,
) -> torch.Tensor:
    """Aggregate a per-token loss matrix ``values`` (``(batch, seq)``) into a scalar.

    Modes (verl's ``agg_loss``):

    * ``token-mean``: ``sum(v*m) / sum(m)`` over the whole batch.
    * ``seq-mean-token-sum``: per-row ``sum(v*m)``, then the mean over rows.
    * ``seq-mean-token-mean``: per-row ``sum(v*m)/sum(m)``, then the mean over rows.
    * ``seq-mean-token-sum-norm`` (Dr. GRPO): ``sum(v*m) / mask.shape[-1]`` over
      the whole batch, i.e. the per-row token sums added up and divided by the
      padded length (or by ``normalizer`` when given). Note that this is *not*
      divided by the number of rows, exactly as in verl.

    The seq-mean modes average only over rows with at least one unmasked
    token. An empty or fully masked batch gives ``0``. Raises ValueError for
    an unknown mode.
    """
    check_loss_agg_mode(loss_agg_mode)
    if values.dim() == 1:
        values = values.unsqueeze(0)
        mask = mask.unsqueeze(0)
    if values.numel() == 0:
        return values.sum() * 0.0  # keeps dtype/device/graph, value 0
    if loss_agg_mode == "token-mean":
        return masked_mean(values, mask)
    if loss_agg_mode == "seq-mean-token-sum-norm":
        norm = float(normalizer) if normalizer is not None else float(mask.shape[-1])
        total = masked_sum(values, mask)
        return total / norm if norm > 0 else total * 0.0
    row_has_tokens = (mask != 0).any(dim=-1)
    if loss_agg_mode == "seq-mean-token-sum":
        seq_losses = masked_sum(values, mask, dim=-1)
    else:  # seq-mean-token-mean
        seq_losses = masked_mean(values, mask, dim=-1)
    return masked_mean(seq_losses, row_has_tokens)


aggregate_loss = masked_loss
"""Alias of :func:`masked_loss` (Trinity-RFT exports both names)."""


def prefix_metrics(src_metrics: dict, prefix: str, dst_metrics: dict | None = None) -> dict:
    """Copy ``src_metrics`` into ``dst_metrics`` (a new dict if None) with keys ``f"{prefix}/{k}"``."""
    if dst_metrics is None:
        dst_metrics = {}
    for k, v in src_metrics.items():
        dst_metrics[f"{prefix}/{k}"] = v
    return dst_metrics
