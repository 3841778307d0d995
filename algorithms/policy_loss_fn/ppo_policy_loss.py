"""PPO clipped policy loss (with optional asymmetric clip and dual clip).

Ref: verl ``core_algos.compute_policy_loss``; Trinity-RFT ``ppo_policy_loss.py``.
"""

from __future__ import annotations

import torch

from algorithms.policy_loss_fn.policy_loss_fn import POLICY_LOSS_FN, PolicyLossFn
from algorithms.utils import masked_loss, masked_mean

DEFAULT_CLIP_RANGE = 0.2


@POLICY_LOSS_FN.register_module("ppo")
class PPOPolicyLossFn(PolicyLossFn):
    """PPO-clip: ``max(-A * r, -A * clip(r, 1 - low, 1 + high))`` with ``r = exp(logprob - old_logprob)``.

    * ``clip_range_low`` / ``clip_range_high`` default to ``clip_range``; when
      all three are None the range is 0.2 (so MIX's default ``clip_range=None``
      works).
    * Dual clip (``clip_ratio_c``, default 3.0, must be > 1; None disables):
      for tokens with ``A < 0`` the loss is further capped at ``-A * c``.
    * ``log r`` is clamped to ``[-20, 20]`` before ``exp``.

    * ``fallback_to_policy_gradient`` (Trinity-RFT 0.6): ignore ``old_logprob``
      and use ``logprob.detach()`` in its place, so the ratio is 1 and the loss
      is the plain policy gradient ``-A * logprob`` (its gradient; nothing is
      clipped).
    * ``enable_sequence_masking`` (Trinity-RFT 0.6, from DeepSeek-V3.2): a row
      whose mean per-token KL ``mean(old_logprob - logprob)`` over its
      unmasked tokens exceeds ``delta_sequence_masking`` has its
      negative-advantage tokens taken out of the loss (their per-token loss
      becomes 0; they still count in the ``token-mean`` denominator, as in
      Trinity-RFT).

    Metrics: ``pg_loss``; ``pg_clipfrac`` (fraction of unmasked tokens where the
    clipped term is the larger one); ``ppo_kl`` (masked mean of ``old_logprob -
    logprob``); with dual clip ``pg_clipfrac_lower`` (fraction where the dual
    clip bound is active, ``A < 0``); with sequence masking
    ``seq_mask/masked_tokens`` (masked tokens / unmasked tokens) and
    ``seq_mask/mean_sequence_kl`` (mean over rows of the row KL).
    """

    def __init__(
        self,
        backend: str = "verl",
        clip_range: float | None = DEFAULT_CLIP_RANGE,
        clip_range_low: float | None = None,
        clip_range_high: float | None = None,
        clip_ratio_c: float | None = 3.0,
        loss_agg_mode: str = "token-mean",
        enable_sequence_masking: bool = False,
        delta_sequence_masking: float = 0.1,
        fallback_to_policy_gradient: bool = False,
    ) -> None:
        super().__init__(backend=backend, loss_agg_mode=loss_agg_mode)
        self.enable_sequence_masking = bool(enable_sequence_masking)
        self.delta_sequence_masking = float(delta_sequence_masking)
        self.fallback_to_policy_gradient = bool(fallback_to_policy_gradient)
        if clip_range is None and (clip_range_low is None or clip_range_high is None):
            clip_range = DEFAULT_CLIP_RANGE
        self.clip_range_low = float(clip_range if clip_range_low is None else clip_range_low)  # type: ignore[arg-type]
        self.clip_range_high = float(clip_range if clip_range_high is None else clip_range_high)  # type: ignore[arg-type]
        if self.clip_range_low < 0 or self.clip_range_high < 0:
            raise ValueError("clip ranges must be >= 0")
        if clip_ratio_c is not None and clip_ratio_c <= 1.0:
            raise ValueError(f"clip_ratio_c must be greater than 1.0 (or None), got {clip_ratio_c}")
        self.clip_ratio_c = None if clip_ratio_c is None else float(clip_ratio_c)

    def __call__(  # type: ignore[override]
        self,
        logprob: torch.Tensor,
        old_logprob: torch.Tensor,
        action_mask: torch.Tensor,
        advantages: torch.Tensor,
        **kwargs,
    ) -> tuple[torch.Tensor, dict]:
        pg_losses, metrics = self.token_losses(logprob, old_logprob, action_mask, advantages)
        if self.enable_sequence_masking:
            pg_losses, mask_metrics = self.sequence_mask(
                pg_losses, logprob, old_logprob, action_mask, advantages
            )
            metrics.update(mask_metrics)
        pg_loss = masked_loss(pg_losses, action_mask, loss_agg_mode=self.loss_agg_mode)
        metrics["pg_loss"] = pg_loss.detach().item()
        return pg_loss, metrics

    def token_losses(
        self,
        logprob: torch.Tensor,
        old_logprob: torch.Tensor,
        action_mask: torch.Tensor,
        advantages: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """The per-token clipped loss ``(batch, response_len)``, before aggregation, and the
        clipping metrics (``pg_clipfrac``, ``ppo_kl``, with dual clip ``pg_clipfrac_lower``).

        :meth:`__call__` aggregates it with ``loss_agg_mode``; a subclass may
        weight it per token first (``decoupled_ppo``). With
        ``fallback_to_policy_gradient`` ``old_logprob`` is replaced by
        ``logprob.detach()``.
        """
        if self.fallback_to_policy_gradient:
            old_logprob = logprob.detach()
        negative_approx_kl = torch.clamp(logprob - old_logprob, min=-20.0, max=20.0)
        ratio = torch.exp(negative_approx_kl)
        ppo_kl = masked_mean(-negative_approx_kl, action_mask)

        pg_losses1 = -advantages * ratio
        pg_losses2 = -advantages * torch.clamp(
            ratio, 1.0 - self.clip_range_low, 1.0 + self.clip_range_high
        )
        clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
        pg_clipfrac = masked_mean(torch.gt(pg_losses2, pg_losses1).float(), action_mask)
        metrics: dict[str, float] = {}

        if self.clip_ratio_c is not None:
            pg_losses3 = -advantages * self.clip_ratio_c
            clip_pg_losses2 = torch.minimum(pg_losses3, clip_pg_losses1)
            negative = advantages < 0
            pg_clipfrac_lower = masked_mean(
                (torch.gt(clip_pg_losses1, pg_losses3) & negative).float(), action_mask
            )
            pg_losses = torch.where(negative, clip_pg_losses2, clip_pg_losses1)
            metrics["pg_clipfrac_lower"] = pg_clipfrac_lower.detach().item()
        else:
            pg_losses = clip_pg_losses1

        metrics["pg_clipfrac"] = pg_clipfrac.detach().item()
        metrics["ppo_kl"] = ppo_kl.detach().item()
        return pg_losses, metrics

    def sequence_mask(
        self,
        pg_losses: torch.Tensor,
        logprob: torch.Tensor,
        old_logprob: torch.Tensor,
        action_mask: torch.Tensor,
        advantages: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Zero the negative-advantage token losses of rows whose mean KL exceeds the threshold.

        The row KL is the masked mean of ``old_logprob - logprob`` (clamped to
        ``[-20, 20]`` like the ratio; with ``fallback_to_policy_gradient`` it is
        0). Returns the masked per-token losses and the ``seq_mask/*`` metrics.
        """
        if self.fallback_to_policy_gradient:
            old_logprob = logprob.detach()
        kl = torch.clamp(old_logprob - logprob, min=-20.0, max=20.0).detach()
        sequence_kl = masked_mean(kl, action_mask, dim=-1)
        high_kl = (sequence_kl > self.delta_sequence_masking).unsqueeze(-1)
        drop = (advantages < 0) & high_kl
        masked = torch.where(drop, torch.zeros_like(pg_losses), pg_losses)
        valid = action_mask.to(torch.bool)
        n_valid = int(valid.sum())
        metrics = {
            "seq_mask/masked_tokens": float((drop & valid).sum()) / max(n_valid, 1),
            "seq_mask/mean_sequence_kl": float(sequence_kl.mean()) if kl.shape[0] else 0.0,
        }
        return masked, metrics

    @classmethod
    def default_args(cls) -> dict:
        return {
            "clip_range": DEFAULT_CLIP_RANGE,
            "clip_ratio_c": 3.0,
            "loss_agg_mode": "token-mean",
            "enable_sequence_masking": False,
            "delta_sequence_masking": 0.1,
            "fallback_to_policy_gradient": False,
        }
