"""Plain importance-sampling policy loss (no clipping), as Trinity-RFT's ``importance_sampling``.

Used for on-policy distillation when no clipping is wanted.
"""

from __future__ import annotations

import torch

from algorithms.policy_loss_fn.policy_loss_fn import POLICY_LOSS_FN, PolicyLossFn
from algorithms.utils import masked_loss, masked_mean


@POLICY_LOSS_FN.register_module("importance_sampling")
class ImportanceSamplingLossFn(PolicyLossFn):
    """``loss = agg(-A * r)`` with ``r = exp(clamp(logprob - old_logprob, -20, 20))``.

    Metrics: ``pg_loss``, ``ratio/mean`` (masked mean of ``r``), ``approx_kl``
    (masked mean of ``old_logprob - logprob``, clamped like the ratio).
    """

    def __init__(self, backend: str = "verl", loss_agg_mode: str = "token-mean") -> None:
        super().__init__(backend=backend, loss_agg_mode=loss_agg_mode)

    def __call__(  # type: ignore[override]
        self,
        logprob: torch.Tensor,
        old_logprob: torch.Tensor,
        action_mask: torch.Tensor,
        advantages: torch.Tensor,
        **kwargs,
    ) -> tuple[torch.Tensor, dict]:
        log_ratio = torch.clamp(logprob - old_logprob, min=-20.0, max=20.0)
        ratio = torch.exp(log_ratio)
        pg_loss = masked_loss(-advantages * ratio, action_mask, loss_agg_mode=self.loss_agg_mode)
        return pg_loss, {
            "pg_loss": pg_loss.detach().item(),
            "ratio/mean": masked_mean(ratio.detach(), action_mask).item(),
            "approx_kl": masked_mean(-log_ratio.detach(), action_mask).item(),
        }

    @classmethod
    def default_args(cls) -> dict:
        return {"loss_agg_mode": "token-mean"}
