"""CISPO policy loss (clipped importance-sampling-weight policy optimisation).

Ref: MiniMax-M1, arXiv:2506.13585; Trinity-RFT ``cispo_policy_loss.py``.
"""

from __future__ import annotations

import torch

from algorithms.policy_loss_fn.policy_loss_fn import POLICY_LOSS_FN, PolicyLossFn
from algorithms.utils import masked_loss, masked_mean


@POLICY_LOSS_FN.register_module("cispo")
class CISPOPolicyLossFn(PolicyLossFn):
    """REINFORCE weighted by a clipped, *detached* importance ratio.

    With ``r = exp(logprob - old_logprob)`` per token::

        w    = sg(clip(r, 1 - clip_range_low, 1 + clip_range_high))
        loss = agg( -A * w * M * logprob )

    Unlike PPO-clip, tokens whose ratio is clipped still get a gradient (the
    weight is clipped, not the token dropped). ``M`` is 1 unless
    ``enable_mask_clip``: then ``M = 0`` where ``r > 1 + mask_clip_range_high``
    and ``A > 0``, or where ``r < 1 - mask_clip_range_low`` and ``A < 0``
    (PPO's trust-region mask). ``log r`` is clamped to ``[-20, 20]`` before
    ``exp`` (only ever changes ``r`` far outside any clip range).

    Args (defaults as Trinity-RFT; the paper sets no lower bound, hence
    ``clip_range_low = 1.0``): ``clip_range_low=1.0``, ``clip_range_high=0.28``,
    ``enable_mask_clip=False``, ``mask_clip_range_low=1.0``,
    ``mask_clip_range_high=0.28``, ``loss_agg_mode="token-mean"``.

    Inputs: ``logprob``, ``old_logprob``, ``advantages`` ``(batch, response_len)``
    float; ``action_mask`` same shape, bool or float 0/1.

    Metrics: ``cispo_loss``; ``ppo_kl`` (masked mean of ``old_logprob - logprob``);
    ``masked_frac`` (masked mean of ``M``, i.e. the fraction of tokens kept).
    """

    def __init__(
        self,
        backend: str = "verl",
        clip_range_low: float = 1.0,
        clip_range_high: float = 0.28,
        enable_mask_clip: bool = False,
        mask_clip_range_low: float = 1.0,
        mask_clip_range_high: float = 0.28,
        loss_agg_mode: str = "token-mean",
    ) -> None:
        super().__init__(backend=backend, loss_agg_mode=loss_agg_mode)
        self.clip_range_low = float(clip_range_low)
        self.clip_range_high = float(clip_range_high)
        self.enable_mask_clip = bool(enable_mask_clip)
        self.mask_clip_range_low = float(mask_clip_range_low)
        self.mask_clip_range_high = float(mask_clip_range_high)
        if min(self.clip_range_low, self.clip_range_high) < 0:
            raise ValueError("clip ranges must be >= 0")
        if min(self.mask_clip_range_low, self.mask_clip_range_high) < 0:
            raise ValueError("mask clip ranges must be >= 0")

    def __call__(  # type: ignore[override]
        self,
        logprob: torch.Tensor,
        old_logprob: torch.Tensor,
        action_mask: torch.Tensor,
        advantages: torch.Tensor,
        **kwargs,
    ) -> tuple[torch.Tensor, dict]:
        negative_approx_kl = logprob - old_logprob
        ratio = torch.exp(torch.clamp(negative_approx_kl, min=-20.0, max=20.0)).detach()
        ppo_kl = masked_mean(-negative_approx_kl, action_mask)
        weight = torch.clamp(ratio, min=1.0 - self.clip_range_low, max=1.0 + self.clip_range_high)

        keep = torch.ones_like(ratio)
        if self.enable_mask_clip:
            drop = ((ratio > 1.0 + self.mask_clip_range_high) & (advantages > 0)) | (
                (ratio < 1.0 - self.mask_clip_range_low) & (advantages < 0)
            )
            keep = torch.where(drop, torch.zeros_like(keep), keep)

        cispo_losses = -advantages * weight * keep * logprob
        loss = masked_loss(cispo_losses, action_mask, loss_agg_mode=self.loss_agg_mode)
        masked_frac = masked_mean(keep, action_mask)
        metrics = {
            "cispo_loss": loss.detach().item(),
            "ppo_kl": ppo_kl.detach().item(),
            "masked_frac": masked_frac.detach().item(),
        }
        return loss, metrics

    @classmethod
    def default_args(cls) -> dict:
        return {
            "clip_range_low": 1.0,
            "clip_range_high": 0.28,
            "enable_mask_clip": False,
            "mask_clip_range_low": 1.0,
            "mask_clip_range_high": 0.28,
        }
