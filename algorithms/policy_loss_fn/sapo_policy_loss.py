"""SAPO (Soft Adaptive Policy Optimization, arXiv:2511.20347) policy loss, as Trinity-RFT's ``sapo``.

A smooth, temperature-controlled gate replaces PPO's hard clip.
"""

from __future__ import annotations

import torch

from algorithms.policy_loss_fn.policy_loss_fn import POLICY_LOSS_FN, PolicyLossFn
from algorithms.utils import masked_loss, masked_mean


@POLICY_LOSS_FN.register_module("sapo")
class SAPOPolicyLossFn(PolicyLossFn):
    """``loss = agg(-A * stopgrad(g(r)) * logprob)`` with the soft gate
    ``g(r) = sigmoid(tau * (r - 1)) * 4 / tau``, ``r = exp(logprob - old_logprob)``.

    ``tau`` is ``tau_pos`` where ``A > 0`` and ``tau_neg`` elsewhere;
    ``tau_neg >= tau_pos`` is required (ValueError otherwise). The gate is 2/tau
    at ``r = 1``, so on-policy the gradient is ``2/tau`` times the plain policy
    gradient, as in Trinity-RFT. The ratio is not clamped (Trinity-RFT's).

    Metrics: ``sapo_loss``, ``ppo_kl`` (masked mean of ``old_logprob -
    logprob``), ``avg_soft_gate``, ``avg_ratio``, ``pos_adv_frac`` (fraction of
    unmasked tokens with ``A > 0``).
    """

    def __init__(
        self,
        backend: str = "verl",
        tau_pos: float = 1.0,
        tau_neg: float = 1.05,
        loss_agg_mode: str = "token-mean",
    ) -> None:
        super().__init__(backend=backend, loss_agg_mode=loss_agg_mode)
        if not tau_pos > 0 or not tau_neg >= tau_pos:
            raise ValueError(
                f"SAPO needs 0 < tau_pos <= tau_neg, got tau_pos={tau_pos}, tau_neg={tau_neg}"
            )
        self.tau_pos = float(tau_pos)
        self.tau_neg = float(tau_neg)

    def soft_gate(self, ratio: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
        """``sigmoid(tau * (ratio - 1)) * 4 / tau`` with ``tau`` chosen by the sign of the advantage."""
        tau = torch.where(
            advantages > 0,
            torch.full_like(ratio, self.tau_pos),
            torch.full_like(ratio, self.tau_neg),
        )
        return torch.sigmoid(tau * (ratio - 1)) * (4.0 / tau)

    def __call__(  # type: ignore[override]
        self,
        logprob: torch.Tensor,
        old_logprob: torch.Tensor,
        action_mask: torch.Tensor,
        advantages: torch.Tensor,
        **kwargs,
    ) -> tuple[torch.Tensor, dict]:
        log_ratio = logprob - old_logprob
        ratio = torch.exp(log_ratio)
        gate = self.soft_gate(ratio, advantages).detach()
        loss = masked_loss(
            -advantages * gate * logprob, action_mask, loss_agg_mode=self.loss_agg_mode
        )
        return loss, {
            "sapo_loss": loss.detach().item(),
            "ppo_kl": masked_mean(-log_ratio.detach(), action_mask).item(),
            "avg_soft_gate": masked_mean(gate, action_mask).item(),
            "avg_ratio": masked_mean(ratio.detach(), action_mask).item(),
            "pos_adv_frac": masked_mean((advantages > 0).float(), action_mask).item(),
        }

    @classmethod
    def default_args(cls) -> dict:
        return {"tau_pos": 1.0, "tau_neg": 1.05, "loss_agg_mode": "token-mean"}
