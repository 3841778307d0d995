"""GSPO-token policy loss (Group Sequence Policy Optimization).

Ref: Zheng et al., "Group Sequence Policy Optimization", arXiv:2507.18071;
Trinity-RFT ``gspo_policy_loss.py``; verl ``compute_policy_loss_gspo``.
"""

from __future__ import annotations

import torch

from algorithms.policy_loss_fn.policy_loss_fn import POLICY_LOSS_FN, PolicyLossFn
from algorithms.utils import masked_loss, masked_mean

DEFAULT_CLIP_RANGE_LOW = 3e-4
DEFAULT_CLIP_RANGE_HIGH = 4e-4
MAX_LOG_SEQ_RATIO = 10.0


@POLICY_LOSS_FN.register_module("gspo")
class GSPOPolicyLossFn(PolicyLossFn):
    """PPO-style clipped loss on a *sequence-level* importance ratio (GSPO-token).

    For row ``i`` with unmasked tokens ``T_i``::

        s_i   = mean_{t in T_i} (logprob[i, t] - old_logprob[i, t])   # log of the length-normalised ratio
        r_i,t = exp(logprob[i, t] - sg(logprob[i, t]) + sg(s_i))       # value exp(s_i), gradient per token
        loss  = agg( max(-A[i, t] * r_i,t, -A[i, t] * clip(r_i,t, 1 - low, 1 + high)) )

    ``sg`` is stop-gradient: every token of a sequence carries the same
    ratio value ``exp(s_i)`` while its gradient flows through its own
    ``logprob`` only (the paper's GSPO-token form; with a per-sequence
    advantage it equals GSPO). ``s_i`` is clamped to at most 10 before
    ``exp`` (as verl does). A fully masked row has ``s_i = 0`` and no effect.

    Args:
        clip_range: symmetric clip range; the fallback for ``clip_range_low`` / ``clip_range_high``.
        clip_range_low / clip_range_high: the clip range below / above 1.
            GSPO ratios are close to 1, so the defaults are tiny: 3e-4 / 4e-4
            (``default_args``, as in Trinity-RFT; also used here when no range
            is given at all, where Trinity-RFT raises).
        loss_agg_mode: default ``seq-mean-token-mean`` (the paper's sequence mean).

    Inputs: ``logprob``, ``old_logprob``, ``advantages`` ``(batch, response_len)``
    float; ``action_mask`` same shape, bool or float 0/1.

    Metrics: ``pg_loss``; ``pg_clipfrac`` (fraction of unmasked tokens where the
    clipped term is the larger one); ``ppo_kl`` (token masked mean of
    ``old_logprob - logprob``); ``ppo_kl_seq`` (mean over rows with tokens of
    ``-s_i``).
    """

    loss_agg_mode = "seq-mean-token-mean"

    def __init__(
        self,
        backend: str = "verl",
        clip_range: float | None = None,
        clip_range_low: float | None = None,
        clip_range_high: float | None = None,
        loss_agg_mode: str = "seq-mean-token-mean",
    ) -> None:
        super().__init__(backend=backend, loss_agg_mode=loss_agg_mode)
        low = clip_range if clip_range_low is None else clip_range_low
        high = clip_range if clip_range_high is None else clip_range_high
        self.clip_range_low = float(DEFAULT_CLIP_RANGE_LOW if low is None else low)
        self.clip_range_high = float(DEFAULT_CLIP_RANGE_HIGH if high is None else high)
        if self.clip_range_low < 0 or self.clip_range_high < 0:
            raise ValueError("clip ranges must be >= 0")

    def __call__(  # type: ignore[override]
        self,
        logprob: torch.Tensor,
        old_logprob: torch.Tensor,
        action_mask: torch.Tensor,
        advantages: torch.Tensor,
        **kwargs,
    ) -> tuple[torch.Tensor, dict]:
        negative_approx_kl = logprob - old_logprob  # (batch, len)
        negative_approx_kl_seq = masked_mean(negative_approx_kl, action_mask, dim=-1)  # (batch,)
        log_seq_ratio = logprob - logprob.detach() + negative_approx_kl_seq.detach().unsqueeze(-1)
        log_seq_ratio = torch.clamp(log_seq_ratio, max=MAX_LOG_SEQ_RATIO)
        ratio = torch.exp(log_seq_ratio)  # (batch, len), value exp(s_i) on every token

        pg_losses = -advantages * ratio
        pg_losses_clipped = -advantages * torch.clamp(
            ratio, 1.0 - self.clip_range_low, 1.0 + self.clip_range_high
        )
        pg_loss = masked_loss(
            torch.maximum(pg_losses, pg_losses_clipped),
            action_mask,
            loss_agg_mode=self.loss_agg_mode,
        )

        pg_clipfrac = masked_mean(torch.gt(pg_losses_clipped, pg_losses).float(), action_mask)
        ppo_kl = masked_mean(-negative_approx_kl, action_mask)
        row_has_tokens = (action_mask != 0).any(dim=-1)
        ppo_kl_seq = masked_mean(-negative_approx_kl_seq, row_has_tokens)
        metrics = {
            "pg_clipfrac": pg_clipfrac.detach().item(),
            "ppo_kl": ppo_kl.detach().item(),
            "pg_loss": pg_loss.detach().item(),
            "ppo_kl_seq": ppo_kl_seq.detach().item(),
        }
        return pg_loss, metrics

    @classmethod
    def default_args(cls) -> dict:
        return {
            "clip_range_low": DEFAULT_CLIP_RANGE_LOW,
            "clip_range_high": DEFAULT_CLIP_RANGE_HIGH,
            "loss_agg_mode": "seq-mean-token-mean",
        }
