"""TOPR policy loss (Tapered Off-Policy REINFORCE).

Ref: Le Roux et al., arXiv:2503.14286; Trinity-RFT ``topr_policy_loss.py``.
"""

from __future__ import annotations

import torch

from algorithms.policy_loss_fn.policy_loss_fn import POLICY_LOSS_FN, PolicyLossFn
from algorithms.utils import masked_loss, masked_mean


@POLICY_LOSS_FN.register_module("topr")
class TOPRPolicyLossFn(PolicyLossFn):
    """REINFORCE whose negative part is weighted by a truncated importance ratio.

    Per token, with ``r = exp(logprob - old_logprob)``::

        alpha = clip(r, 0, 1)  if A <= advantage_threshold  else 1
        loss  = agg( -sg(alpha) * A * logprob )

    Positive examples get plain (SFT-like) REINFORCE; negative ones are
    tapered by the ratio truncated to ``[0, 1]``, which keeps their gradient
    bounded as the policy moves away from them. As in Trinity-RFT the ratio
    is per token and ``advantages`` play the role of the paper's rewards (the
    baseline trick). ``log r`` is clamped to at most 20 before ``exp``.

    Args: ``advantage_threshold=0.0``; ``loss_agg_mode="token-mean"``.

    Inputs: ``logprob``, ``old_logprob``, ``advantages`` ``(batch, response_len)``
    float; ``action_mask`` same shape, bool or float 0/1.

    Metrics: ``topr_loss``; ``avg_alpha`` and ``avg_ratio`` (masked means of
    ``alpha`` and ``r``).
    """

    def __init__(
        self,
        backend: str = "verl",
        advantage_threshold: float = 0.0,
        loss_agg_mode: str = "token-mean",
    ) -> None:
        super().__init__(backend=backend, loss_agg_mode=loss_agg_mode)
        self.advantage_threshold = float(advantage_threshold)

    def __call__(  # type: ignore[override]
        self,
        logprob: torch.Tensor,
        old_logprob: torch.Tensor,
        action_mask: torch.Tensor,
        advantages: torch.Tensor,
        **kwargs,
    ) -> tuple[torch.Tensor, dict]:
        ratio = torch.exp(torch.clamp(logprob - old_logprob, max=20.0)).detach()
        alpha = torch.where(
            advantages <= self.advantage_threshold,
            torch.clamp(ratio, min=0.0, max=1.0),
            torch.ones_like(ratio),
        )
        topr_losses = -alpha * advantages * logprob
        loss = masked_loss(topr_losses, action_mask, loss_agg_mode=self.loss_agg_mode)
        metrics = {
            "topr_loss": loss.detach().item(),
            "avg_alpha": masked_mean(alpha, action_mask).item(),
            "avg_ratio": masked_mean(ratio, action_mask).item(),
        }
        return loss, metrics

    @classmethod
    def default_args(cls) -> dict:
        return {"advantage_threshold": 0.0}
