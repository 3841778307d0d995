"""sPPO policy loss (PPO in log-ratio space, with a ratio trust region).

Ref: Vaswani et al., arXiv:2108.05828; Trinity-RFT ``sppo_loss_fn.py``.
Not to be confused with Self-Play Preference Optimization.
"""

from __future__ import annotations

import torch

from algorithms.policy_loss_fn.policy_loss_fn import POLICY_LOSS_FN, PolicyLossFn
from algorithms.utils import masked_loss, masked_mean


@POLICY_LOSS_FN.register_module("sppo")
class SPPOPolicyLossFn(PolicyLossFn):
    """sPPO (Trinity-RFT's ``sPPOPolicyLossFn``).

    ``agg( -A * (logprob - old_logprob) * [1/(1+eps) <= r <= 1+eps] )``, ``r = exp(logprob - old_logprob)``.

    A token whose ratio has left the interval ``[1/(1+epsilon), 1+epsilon]``
    contributes nothing (no value, no gradient); inside it, the gradient is
    ``-A * grad logprob`` (the ratio does not multiply it, unlike PPO).

    Args: ``epsilon=0.3``; ``loss_agg_mode="token-mean"``.

    Inputs: ``logprob``, ``old_logprob``, ``advantages`` ``(batch, response_len)``
    float; ``action_mask`` same shape, bool or float 0/1.

    Metrics: ``pg_loss`` and its alias ``sppo_loss`` (the name that tells
    sPPO apart from PPO in a run's metrics); ``pg_clipfrac`` (fraction of
    unmasked tokens outside the interval).
    """

    def __init__(
        self,
        backend: str = "verl",
        epsilon: float = 0.3,
        loss_agg_mode: str = "token-mean",
    ) -> None:
        super().__init__(backend=backend, loss_agg_mode=loss_agg_mode)
        if epsilon <= 0:
            raise ValueError(f"epsilon must be > 0, got {epsilon}")
        self.epsilon = float(epsilon)

    def __call__(  # type: ignore[override]
        self,
        logprob: torch.Tensor,
        old_logprob: torch.Tensor,
        action_mask: torch.Tensor,
        advantages: torch.Tensor,
        **kwargs,
    ) -> tuple[torch.Tensor, dict]:
        log_ratio = logprob - old_logprob
        ratio = torch.exp(torch.clamp(log_ratio, min=-20.0, max=20.0)).detach()
        in_range = (ratio >= 1.0 / (1.0 + self.epsilon)) & (ratio <= 1.0 + self.epsilon)
        pg_losses = -advantages * log_ratio * in_range.to(log_ratio.dtype)
        pg_loss = masked_loss(pg_losses, action_mask, loss_agg_mode=self.loss_agg_mode)
        pg_clipfrac = masked_mean((~in_range).float(), action_mask)
        loss = pg_loss.detach().item()
        metrics = {"pg_clipfrac": pg_clipfrac.item(), "pg_loss": loss, "sppo_loss": loss}
        return pg_loss, metrics

    @classmethod
    def default_args(cls) -> dict:
        return {"epsilon": 0.3}
