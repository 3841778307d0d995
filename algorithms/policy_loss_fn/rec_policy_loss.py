"""REC policy loss family (REINFORCE with clipping/masking, weighting and regularisers).

Ref: Trinity-RFT ``rec_policy_loss.py`` ("What is the role of importance
sampling / clipping in off-policy REINFORCE", the REC family: REC-OneSide,
REC-TwoSide, REC-Ring, with the GSPO-style and OPD variants of later versions).
"""

from __future__ import annotations

import torch

from algorithms.policy_loss_fn.policy_loss_fn import POLICY_LOSS_FN, PolicyLossFn
from algorithms.utils import masked_loss, masked_mean

CLIP_MODES = ("none", "one-side", "gspo-one-side", "two-side", "ring")
WEIGHTS = (
    "none",
    "importance_sampling",
    "truncated_importance_sampling",
    "gspo_importance_sampling",
    "advantage",
    "advantage_unnormalized",
    "confidence",
)
REGULARIZERS = ("none", "k2", "forward-kl")


@POLICY_LOSS_FN.register_module("rec")
class RECPolicyLossFn(PolicyLossFn):
    """``agg( -A' * logprob * in_range + regulariser )``: REINFORCE with a detached mask and weight.

    Everything but ``logprob`` in the first term is detached. With the
    per-token ratio ``r = exp(logprob - old_logprob)`` and, for the ``gspo-*``
    options, the sequence ratio ``s_i = exp(masked_mean_t(logprob - old_logprob))``:

    ``clip_mode`` (which tokens keep their gradient; ``el, eh`` =
    ``epsilon_low, epsilon_high``; ``el', eh'`` = the ``_prime`` ones):

    * ``none``: all tokens;
    * ``two-side``: ``1 - el <= r <= 1 + eh``;
    * ``one-side``: ``r <= 1 + eh`` where ``A >= 0``, ``r >= 1 - el`` where ``A <= 0``
      (PPO's trust region: only tokens pushed further away are dropped);
    * ``gspo-one-side``: as ``one-side`` with ``s_i`` instead of ``r``; the loss
      is then aggregated ``seq-mean-token-mean`` whatever ``loss_agg_mode`` says;
    * ``ring``: ``two-side``, plus ``r <= 1 - el'`` where ``A >= 0`` and
      ``r >= 1 + eh'`` where ``A <= 0`` (tokens far on the side the update
      moves them towards are kept).

    ``weight`` (``A'`` from the advantage ``A``):

    * ``none``: ``A``; ``importance_sampling``: ``A * r``;
    * ``truncated_importance_sampling``: ``A * clip(r, 1 - el', 1 + eh')``;
    * ``gspo_importance_sampling``: ``A * s_i``;
    * ``advantage`` (alias ``advantage_unnormalized``, its older name):
      ``A * exp(A / temp)``;
    * ``confidence`` (older Trinity-RFT versions): ``A * exp(temp * logprob)``.

    ``fix_opd_advantage``: afterwards ``A' += old_logprob - logprob`` (for
    on-policy distillation advantages computed against ``old_logprob``).

    ``regularizer`` (coefficient ``regularizer_coef``, not masked by ``clip_mode``):
    ``forward-kl`` adds ``-coef * logprob``; ``k2`` adds ``coef * (logprob - old_logprob)**2``
    (the 1/2 absorbed into the coefficient).

    Args and defaults (constructor as Trinity-RFT): ``epsilon_low=0.2`` (in
    ``(0, 1]``), ``epsilon_high=0.2`` (> 0), ``epsilon_low_prime=0.4`` (in
    ``(0, 1]``), ``epsilon_high_prime=0.4`` (> 0), ``clip_mode="none"``,
    ``weight="none"``, ``regularizer="none"``, ``regularizer_coef=0.0``,
    ``temp=1.0``, ``loss_agg_mode="token-mean"``, ``fix_opd_advantage=False``.
    Note that ``default_args()`` (what a config without ``policy_loss_fn_args``
    gets) sets ``epsilon_low_prime=0.6``, ``epsilon_high_prime=2``, as
    Trinity-RFT's does. Invalid values raise ValueError.

    Inputs: ``logprob``, ``old_logprob``, ``advantages`` ``(batch, response_len)``
    float; ``action_mask`` same shape, bool or float 0/1.

    Metrics: ``pg_loss``; ``pg_clipfrac`` (fraction of unmasked tokens dropped by
    ``clip_mode``).
    """

    def __init__(
        self,
        backend: str = "verl",
        epsilon_low: float = 0.2,
        epsilon_high: float = 0.2,
        epsilon_low_prime: float = 0.4,
        epsilon_high_prime: float = 0.4,
        clip_mode: str = "none",
        weight: str = "none",
        regularizer: str = "none",
        regularizer_coef: float = 0.0,
        temp: float = 1.0,
        loss_agg_mode: str = "token-mean",
        fix_opd_advantage: bool = False,
    ) -> None:
        super().__init__(backend=backend, loss_agg_mode=loss_agg_mode)
        if not 0.0 < epsilon_low <= 1.0:
            raise ValueError(f"epsilon_low must be in (0, 1], got {epsilon_low}")
        if not 0.0 < epsilon_high:
            raise ValueError(f"epsilon_high must be > 0, got {epsilon_high}")
        if not 0.0 < epsilon_low_prime <= 1.0:
            raise ValueError(f"epsilon_low_prime must be in (0, 1], got {epsilon_low_prime}")
        if not 0.0 < epsilon_high_prime:
            raise ValueError(f"epsilon_high_prime must be > 0, got {epsilon_high_prime}")
        if clip_mode not in CLIP_MODES:
            raise ValueError(f"invalid clip_mode {clip_mode!r}; choose one of {list(CLIP_MODES)}")
        if weight not in WEIGHTS:
            raise ValueError(f"invalid weight {weight!r}; choose one of {list(WEIGHTS)}")
        if regularizer not in REGULARIZERS:
            raise ValueError(
                f"invalid regularizer {regularizer!r}; choose one of {list(REGULARIZERS)}"
            )
        if regularizer_coef < 0.0:
            raise ValueError(f"regularizer_coef must be >= 0, got {regularizer_coef}")
        if temp <= 0.0:
            raise ValueError(f"temp must be > 0, got {temp}")
        self.epsilon_low = float(epsilon_low)
        self.epsilon_high = float(epsilon_high)
        self.epsilon_low_prime = float(epsilon_low_prime)
        self.epsilon_high_prime = float(epsilon_high_prime)
        self.clip_mode = clip_mode
        self.weight = weight
        self.regularizer = regularizer
        self.regularizer_coef = float(regularizer_coef)
        self.temp = float(temp)
        self.fix_opd_advantage = bool(fix_opd_advantage)

    def __call__(  # type: ignore[override]
        self,
        logprob: torch.Tensor,
        old_logprob: torch.Tensor,
        action_mask: torch.Tensor,
        advantages: torch.Tensor,
        **kwargs,
    ) -> tuple[torch.Tensor, dict]:
        log_ratio = (logprob - old_logprob).detach()
        ratio = torch.exp(torch.clamp(log_ratio, min=-20.0, max=20.0))
        seq_ratio: torch.Tensor | None = None
        if self.clip_mode == "gspo-one-side" or self.weight == "gspo_importance_sampling":
            mean_log_ratio = masked_mean(log_ratio, action_mask, dim=-1)
            seq_ratio = torch.exp(torch.clamp(mean_log_ratio, min=-20.0, max=20.0)).unsqueeze(-1)

        lo, hi = 1.0 - self.epsilon_low, 1.0 + self.epsilon_high
        pos, neg = advantages >= 0, advantages <= 0
        if self.clip_mode == "two-side":
            in_range = (ratio >= lo) & (ratio <= hi)
        elif self.clip_mode == "one-side":
            in_range = ((ratio <= hi) & pos) | ((ratio >= lo) & neg)
        elif self.clip_mode == "gspo-one-side":
            assert seq_ratio is not None
            in_range = ((seq_ratio <= hi) & pos) | ((seq_ratio >= lo) & neg)
        elif self.clip_mode == "ring":
            in_range = (
                ((ratio >= lo) & (ratio <= hi))
                | (pos & (ratio <= 1.0 - self.epsilon_low_prime))
                | (neg & (ratio >= 1.0 + self.epsilon_high_prime))
            )
        else:  # none
            in_range = torch.ones_like(ratio, dtype=torch.bool)

        adv = advantages
        if self.weight == "importance_sampling":
            adv = adv * ratio
        elif self.weight == "truncated_importance_sampling":
            adv = adv * torch.clamp(
                ratio, 1.0 - self.epsilon_low_prime, 1.0 + self.epsilon_high_prime
            )
        elif self.weight == "gspo_importance_sampling":
            assert seq_ratio is not None
            adv = adv * seq_ratio
        elif self.weight in ("advantage", "advantage_unnormalized"):
            adv = adv * torch.exp(adv / self.temp)
        elif self.weight == "confidence":
            adv = adv * torch.exp(self.temp * logprob).detach()
        if self.fix_opd_advantage:
            adv = adv - log_ratio
        adv = adv.detach()

        pg_losses = -adv * logprob * in_range.to(logprob.dtype)
        if self.regularizer == "forward-kl":
            pg_losses = pg_losses - self.regularizer_coef * logprob
        elif self.regularizer == "k2":
            pg_losses = pg_losses + self.regularizer_coef * (logprob - old_logprob).square()

        loss_agg_mode = (
            "seq-mean-token-mean" if self.clip_mode == "gspo-one-side" else self.loss_agg_mode
        )
        pg_loss = masked_loss(pg_losses, action_mask, loss_agg_mode=loss_agg_mode)
        pg_clipfrac = masked_mean((~in_range).float(), action_mask)
        metrics = {
            "pg_clipfrac": pg_clipfrac.item(),
            "pg_loss": pg_loss.detach().item(),
        }
        return pg_loss, metrics

    @classmethod
    def default_args(cls) -> dict:
        return {
            "epsilon_low": 0.2,
            "epsilon_high": 0.2,
            "epsilon_low_prime": 0.6,
            "epsilon_high_prime": 2,
            "clip_mode": "none",
            "weight": "none",
            "regularizer": "none",
            "regularizer_coef": 0.0,
            "temp": 1.0,
            "loss_agg_mode": "token-mean",
            "fix_opd_advantage": False,
        }
