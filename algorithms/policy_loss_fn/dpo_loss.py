"""DPO loss (Direct Preference Optimization) on interleaved chosen/rejected rows.

Ref: Rafailov et al., arXiv:2305.18290; Trinity-RFT ``dpo_loss.py``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from algorithms.policy_loss_fn.policy_loss_fn import POLICY_LOSS_FN, PolicyLossFn
from algorithms.utils import masked_sum


@POLICY_LOSS_FN.register_module("dpo")
class DPOLossFn(PolicyLossFn):
    """Sigmoid DPO loss with optional label smoothing (conservative DPO).

    The batch holds preference pairs interleaved: rows ``0, 2, 4, ...`` are the
    chosen responses, rows ``1, 3, 5, ...`` the rejected response of the same
    pair. Per row, ``logratio = sum_t mask * (logprob - ref_logprob)``; per pair,
    ``z = beta * (logratio_chosen - logratio_rejected)`` and::

        loss = mean_pairs( -(1 - label_smoothing) * logsigmoid(z) - label_smoothing * logsigmoid(-z) )

    (the mean over pairs is fixed; ``loss_agg_mode`` is accepted but unused).
    A fully masked row has log-ratio 0; an empty batch gives loss 0.

    Args: ``beta=0.1`` (inverse temperature), ``label_smoothing=0.0`` (in ``[0, 0.5)``
    is the meaningful range).

    Inputs: ``logprob`` (current policy, with gradient) and ``ref_logprob``
    ``(batch, response_len)`` float, ``batch`` even; ``action_mask`` same
    shape, bool or float 0/1. Raises ValueError for an odd number of rows.

    Metrics: ``dpo_loss``; ``chosen_reward`` / ``rejected_reward`` (``beta`` times
    the mean chosen / rejected log-ratio); ``accuracy_mean`` (fraction of pairs
    whose chosen log-ratio is strictly greater than the rejected one).
    """

    def __init__(
        self,
        backend: str = "verl",
        beta: float = 0.1,
        label_smoothing: float = 0.0,
        loss_agg_mode: str = "token-mean",
    ) -> None:
        super().__init__(backend=backend, loss_agg_mode=loss_agg_mode)
        self.beta = float(beta)
        self.label_smoothing = float(label_smoothing)

    def __call__(  # type: ignore[override]
        self,
        logprob: torch.Tensor,
        ref_logprob: torch.Tensor,
        action_mask: torch.Tensor,
        **kwargs,
    ) -> tuple[torch.Tensor, dict]:
        rows = logprob.shape[0]
        if rows % 2:
            raise ValueError(
                f"DPO needs interleaved (chosen, rejected) row pairs, got an odd number of rows ({rows})"
            )
        if rows == 0:
            zero = logprob.sum() * 0.0
            metrics = {"chosen_reward": 0.0, "rejected_reward": 0.0, "accuracy_mean": 0.0}
            return zero, {**metrics, "dpo_loss": 0.0}

        policy_sums = masked_sum(logprob, action_mask, dim=-1)  # (batch,)
        ref_sums = masked_sum(ref_logprob, action_mask, dim=-1).detach()
        logratios = policy_sums - ref_sums
        chosen_ratios = logratios[0::2]
        rejected_ratios = logratios[1::2]
        logits = self.beta * (chosen_ratios - rejected_ratios)
        losses = -F.logsigmoid(logits) * (1.0 - self.label_smoothing) - (
            F.logsigmoid(-logits) * self.label_smoothing
        )
        loss = losses.mean()

        chosen = chosen_ratios.detach()
        rejected = rejected_ratios.detach()
        metrics = {
            "chosen_reward": self.beta * chosen.mean().item(),
            "rejected_reward": self.beta * rejected.mean().item(),
            "accuracy_mean": (chosen > rejected).float().mean().item(),
            "dpo_loss": loss.detach().item(),
        }
        return loss, metrics

    @classmethod
    def default_args(cls) -> dict:
        return {"beta": 0.1, "label_smoothing": 0.0}
