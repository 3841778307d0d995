"""Decoupled PPO: PPO-clip against the proximal policy, importance-weighted to the behaviour policy.

Off-policy correction for stale rollouts. Explorers sample with weights that
may be versions behind the trainer (and a rollout engine such as vLLM computes
slightly different log-probs than the trainer even at the same version). Three
policies meet in one update:

* the *behaviour* policy that generated the tokens: ``rollout_logprob``, the
  log-probs the rollout engine recorded;
* the *proximal* policy: ``old_logprob``, recomputed by the trainer with its
  weights before the update (or ``logprob.detach()`` of the same forward pass
  when that recomputation is provably identical);
* the current policy being optimised: ``logprob``.

Ref: Fu et al., "AReaL: A Large-Scale Asynchronous Reinforcement Learning
System for Language Reasoning", arXiv:2505.24298 (decoupled PPO objective,
``areal.utils.functional.ppo_actor_loss_fn`` with ``proximal_logprobs`` and
``behav_imp_weight_cap``); Hilton et al., "Batch size-invariance for policy
optimization", arXiv:2110.00641 (the decoupled objective); Yao et al., "Your
Efficient RL Framework Secretly Brings You Off-Policy RL Training" (truncated
importance sampling, TIS) and verl ``tis_imp_ratio_cap`` / ``rollout_is``.
"""

from __future__ import annotations

import torch

from algorithms.policy_loss_fn.policy_loss_fn import POLICY_LOSS_FN
from algorithms.policy_loss_fn.ppo_policy_loss import DEFAULT_CLIP_RANGE, PPOPolicyLossFn
from algorithms.utils import masked_loss, masked_mean

BEHAV_IMP_WEIGHT_MODES: tuple[str, ...] = ("truncate", "mask")
DEFAULT_BEHAV_IMP_WEIGHT_CAP = 2.0


@POLICY_LOSS_FN.register_module("decoupled_ppo")
class DecoupledPPOPolicyLossFn(PPOPolicyLossFn):
    """PPO-clip on ``r = exp(logprob - old_logprob)``, each token weighted by the detached
    behaviour importance weight ``w = exp(old_logprob - rollout_logprob)``, capped.

    Per token::

        w_raw  = exp(sg(old_logprob) - rollout_logprob)       # proximal / behaviour
        w      = min(w_raw, cap)                  (truncate)  # truncated IS (verl TIS)
               = w_raw if w_raw <= cap else 0     (mask)      # AReaL
        loss_t = w * ppo_t(logprob, old_logprob, advantages)  # ppo_t: the ``ppo`` loss per token
        loss   = agg(loss_t)                                  # loss_agg_mode, over action_mask

    ``ppo_t`` is exactly the ``ppo`` loss's per-token term (asymmetric clip
    range, dual clip ``clip_ratio_c``), so with ``rollout_logprob ==
    old_logprob`` this loss equals ``ppo`` in value and gradient. ``w`` carries
    no gradient. For a token whose clip is inactive ``d loss_t / d logprob_t =
    -A_t * w_t * r_t`` (times the aggregation's factor, e.g. ``1 / N`` for
    ``token-mean``); a clipped token has zero gradient, as in PPO. Tokens
    masked by the cap (mode ``mask``) keep their place in the aggregation's
    denominator, as in AReaL.

    Tokens without a rollout log-prob (``rollout_logprob_mask`` 0: rows from
    a dataset, MIX expert rows, rows whose engine flagged its log-probs
    inexact; see ``rftstream.training.batch.has_rollout_logprobs``) get
    ``w = 1``: plain PPO. ``log w_raw`` is clamped to ``[-20, 20]`` before
    ``exp``.

    Args: every ``ppo`` argument (``clip_range``, ``clip_range_low``,
    ``clip_range_high``, ``clip_ratio_c``, ``loss_agg_mode``) plus

    * ``behav_imp_weight_cap`` (default 2.0, must be >= 1; None: no cap, the
      untruncated importance weight);
    * ``behav_imp_weight_mode``: ``"truncate"`` (default: ``w = min(w, cap)``,
      truncated importance sampling as in verl's ``tis_imp_ratio_cap``) or
      ``"mask"`` (``w = 0`` where ``w > cap``, as AReaL's
      ``behav_imp_weight_cap``).

    ``enable_sequence_masking`` (as ``ppo``'s) measures each row's mean KL against the
    behaviour policy, ``mean(rollout_logprob - logprob)``, over the tokens that have a
    rollout log-prob (``old_logprob`` for the others): the policy that sampled the row, as
    DeepSeek-V3.2's off-policy sequence masking does. (``ppo`` measures it against
    ``old_logprob``, as Trinity-RFT does; with one update a batch that is the current
    policy, and nothing is ever masked.)

    Inputs: ``logprob``, ``old_logprob``, ``advantages``, ``rollout_logprob``
    ``(batch, response_len)`` float; ``action_mask`` and
    ``rollout_logprob_mask`` same shape, bool or float 0/1.

    Metrics: the ``ppo`` metrics (``pg_loss``, the weighted loss;
    ``pg_clipfrac``, ``ppo_kl``, ``pg_clipfrac_lower``), and over the unmasked
    tokens that have a rollout log-prob (all 1.0 / 0.0 when there are none):
    ``behav_imp_weight`` (mean of ``w_raw``, before the cap),
    ``behav_imp_weight_max`` (its max), ``behav_imp_weight_capped_frac``
    (fraction with ``w_raw > cap``: truncated or masked), ``behav_kl`` (mean
    of ``rollout_logprob - old_logprob``, a k1 estimate of KL(behaviour ||
    proximal), the staleness seen by the loss).
    """

    def __init__(
        self,
        backend: str = "verl",
        clip_range: float | None = DEFAULT_CLIP_RANGE,
        clip_range_low: float | None = None,
        clip_range_high: float | None = None,
        clip_ratio_c: float | None = 3.0,
        loss_agg_mode: str = "token-mean",
        behav_imp_weight_cap: float | None = DEFAULT_BEHAV_IMP_WEIGHT_CAP,
        behav_imp_weight_mode: str = "truncate",
        enable_sequence_masking: bool = False,
        delta_sequence_masking: float = 0.1,
        fallback_to_policy_gradient: bool = False,
    ) -> None:
        super().__init__(
            backend=backend,
            clip_range=clip_range,
            clip_range_low=clip_range_low,
            clip_range_high=clip_range_high,
            clip_ratio_c=clip_ratio_c,
            loss_agg_mode=loss_agg_mode,
            enable_sequence_masking=enable_sequence_masking,
            delta_sequence_masking=delta_sequence_masking,
            fallback_to_policy_gradient=fallback_to_policy_gradient,
        )
        if behav_imp_weight_cap is not None:
            if isinstance(behav_imp_weight_cap, bool) or not isinstance(
                behav_imp_weight_cap, int | float
            ):
                raise ValueError(
                    f"behav_imp_weight_cap must be a number >= 1 or None, "
                    f"got {behav_imp_weight_cap!r}"
                )
            if not behav_imp_weight_cap >= 1.0:  # also rejects NaN
                raise ValueError(
                    f"behav_imp_weight_cap must be >= 1 (or None for no cap), "
                    f"got {behav_imp_weight_cap}"
                )
            behav_imp_weight_cap = float(behav_imp_weight_cap)
        if behav_imp_weight_mode not in BEHAV_IMP_WEIGHT_MODES:
            raise ValueError(
                f"behav_imp_weight_mode must be one of {list(BEHAV_IMP_WEIGHT_MODES)}, "
                f"got {behav_imp_weight_mode!r}"
            )
        self.behav_imp_weight_cap: float | None = behav_imp_weight_cap
        self.behav_imp_weight_mode = behav_imp_weight_mode

    def __call__(  # type: ignore[override]
        self,
        logprob: torch.Tensor,
        old_logprob: torch.Tensor,
        action_mask: torch.Tensor,
        advantages: torch.Tensor,
        rollout_logprob: torch.Tensor,
        rollout_logprob_mask: torch.Tensor,
        **kwargs,
    ) -> tuple[torch.Tensor, dict]:
        pg_losses, metrics = self.token_losses(logprob, old_logprob, action_mask, advantages)
        if self.enable_sequence_masking:
            # the row KL against the policy that sampled it (DeepSeek-V3.2's off-policy
            # sequence masking), where the token has a rollout log-prob; the proximal
            # policy is the current one at a single update a batch, so against it
            # nothing would ever be masked
            behaviour = torch.where(
                rollout_logprob_mask != 0, rollout_logprob.to(old_logprob.dtype), old_logprob
            )
            pg_losses, mask_metrics = self.sequence_mask(
                pg_losses, logprob, behaviour, action_mask, advantages
            )
            metrics.update(mask_metrics)
        weight, weight_metrics = self.behav_imp_weight(
            old_logprob, rollout_logprob, rollout_logprob_mask, action_mask
        )
        pg_loss = masked_loss(pg_losses * weight, action_mask, loss_agg_mode=self.loss_agg_mode)
        metrics.update(weight_metrics)
        metrics["pg_loss"] = pg_loss.detach().item()
        return pg_loss, metrics

    def behav_imp_weight(
        self,
        old_logprob: torch.Tensor,
        rollout_logprob: torch.Tensor,
        rollout_logprob_mask: torch.Tensor,
        action_mask: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """The capped, detached per-token weight ``w`` (1 where ``rollout_logprob_mask`` is 0)
        and the ``behav_*`` metrics (see the class docstring)."""
        with torch.no_grad():
            has = rollout_logprob_mask != 0
            log_w = torch.clamp(old_logprob.detach() - rollout_logprob, min=-20.0, max=20.0)
            one = torch.ones((), dtype=log_w.dtype, device=log_w.device)
            raw = torch.where(has, torch.exp(log_w), one)
            cap = self.behav_imp_weight_cap
            if cap is None:
                capped = torch.zeros_like(has)
                weight = raw
            else:
                capped = raw > cap
                if self.behav_imp_weight_mode == "truncate":
                    weight = torch.clamp(raw, max=cap)
                else:
                    weight = torch.where(capped, torch.zeros_like(raw), raw)
            counted = has & (action_mask != 0)
            if bool(counted.any()):
                metrics = {
                    "behav_imp_weight": masked_mean(raw, counted).item(),
                    "behav_imp_weight_max": raw[counted].max().item(),
                    "behav_imp_weight_capped_frac": masked_mean(capped.float(), counted).item(),
                    "behav_kl": masked_mean(-log_w, counted).item(),
                }
            else:
                metrics = {
                    "behav_imp_weight": 1.0,
                    "behav_imp_weight_max": 1.0,
                    "behav_imp_weight_capped_frac": 0.0,
                    "behav_kl": 0.0,
                }
        return weight, metrics

    @classmethod
    def default_args(cls) -> dict:
        return {
            **super().default_args(),
            "behav_imp_weight_cap": DEFAULT_BEHAV_IMP_WEIGHT_CAP,
            "behav_imp_weight_mode": "truncate",
        }
