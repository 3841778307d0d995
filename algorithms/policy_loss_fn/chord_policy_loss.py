"""CHORD (arXiv:2508.11408): ``mix_chord`` and its SFT variants ``sft_is`` / ``sft_phi``.

As Trinity-RFT's ``chord_policy_loss.py``: MIX with a scheduled ``mu`` and an
SFT part whose tokens are re-weighted by their probability.
"""

from __future__ import annotations

import math

import torch

from algorithms.policy_loss_fn.mix_policy_loss import (
    MixedBatchWeights,
    part_modes,
    split_mixed_loss,
)
from algorithms.policy_loss_fn.policy_loss_fn import POLICY_LOSS_FN, PolicyLossFn
from algorithms.policy_loss_fn.ppo_policy_loss import PPOPolicyLossFn
from algorithms.policy_loss_fn.sft_loss import SFTLossFn, token_level_mode
from algorithms.utils import masked_loss


def mu_schedule(
    global_step: int, mu_warmup_steps: int, mu_decay_steps: int, mu_peak: float, mu_valley: float
) -> float:
    """CHORD's ``mu`` at ``global_step``: linear warm-up to ``mu_peak``, cosine decay to ``mu_valley``.

    * ``step < mu_warmup_steps``: ``step / mu_warmup_steps * mu_peak``;
    * ``step >= mu_warmup_steps + mu_decay_steps``: ``mu_valley``;
    * otherwise ``mu_valley + (mu_peak - mu_valley) * (1 + cos(pi * s / mu_decay_steps)) / 2``
      with ``s = step - mu_warmup_steps``.
    """
    if global_step < mu_warmup_steps:
        return global_step / mu_warmup_steps * mu_peak
    if global_step >= mu_warmup_steps + mu_decay_steps:
        return mu_valley
    s = global_step - mu_warmup_steps
    return (mu_peak - mu_valley) * 0.5 * (1 + math.cos(math.pi * s / mu_decay_steps)) + mu_valley


@POLICY_LOSS_FN.register_module("sft_is")
class SFTISLossFn(PolicyLossFn):
    """SFT weighted by the token probability: ``loss = agg(-logprob * stopgrad(exp(logprob)))``.

    Metric ``sft_is_loss``.
    """

    def __init__(self, backend: str = "verl", loss_agg_mode: str = "token-mean") -> None:
        super().__init__(backend=backend, loss_agg_mode=loss_agg_mode)

    def __call__(  # type: ignore[override]
        self, logprob: torch.Tensor, action_mask: torch.Tensor, **kwargs
    ) -> tuple[torch.Tensor, dict]:
        weight = torch.exp(logprob).detach()
        loss = masked_loss(-logprob * weight, action_mask, loss_agg_mode=self.loss_agg_mode)
        return loss, {"sft_is_loss": loss.detach().item()}

    @classmethod
    def default_args(cls) -> dict:
        return {"loss_agg_mode": "token-mean"}


@POLICY_LOSS_FN.register_module("sft_phi")
class SFTPhiLossFn(PolicyLossFn):
    """SFT weighted by ``phi(p) = p * (1 - p)``: ``loss = agg(-logprob' * stopgrad(phi(p)))``.

    ``p = exp(logprob)``; tokens of extreme probability count less. With
    ``cutoff_prob < 1`` the log-prob in the loss is clamped at
    ``log(cutoff_prob)`` (``logprob'``; ``phi`` still uses the unclamped
    ``p``), so tokens above the cutoff give no gradient. ``cutoff_prob`` must be
    in ``[0, 1]`` (ValueError otherwise). Metric ``sft_phi_loss``.
    """

    def __init__(
        self, backend: str = "verl", loss_agg_mode: str = "token-mean", cutoff_prob: float = 1.0
    ) -> None:
        super().__init__(backend=backend, loss_agg_mode=loss_agg_mode)
        if not 0.0 <= cutoff_prob <= 1.0:
            raise ValueError(f"cutoff_prob must be in [0, 1], got {cutoff_prob}")
        self.cutoff_prob = float(cutoff_prob)

    def __call__(  # type: ignore[override]
        self, logprob: torch.Tensor, action_mask: torch.Tensor, **kwargs
    ) -> tuple[torch.Tensor, dict]:
        prob = torch.exp(logprob)
        if self.cutoff_prob < 1.0:
            logprob = torch.clamp(logprob, max=math.log(self.cutoff_prob))
        phi = (prob * (1 - prob)).detach()
        loss = masked_loss(-logprob * phi, action_mask, loss_agg_mode=self.loss_agg_mode)
        return loss, {"sft_phi_loss": loss.detach().item()}

    @classmethod
    def default_args(cls) -> dict:
        return {"loss_agg_mode": "token-mean", "cutoff_prob": 1.0}


@POLICY_LOSS_FN.register_module("mix_chord")
class MIXCHORDPolicyLossFn(PolicyLossFn):
    """``loss = (1 - mu(step)) * grpo_loss + mu(step) * sft_loss`` (CHORD).

    As ``mix`` (same row split and per-micro-batch weights,
    :func:`~algorithms.policy_loss_fn.mix_policy_loss.split_mixed_loss`), with
    ``mu`` from :func:`mu_schedule` at the batch's ``step`` (the ``mix`` sample
    strategy provides it; every row must carry the same step, ValueError
    otherwise) and the SFT part ``sft_phi`` (``enable_phi_function``, default)
    or plain ``sft``. Modes: ``grpo_loss_agg_mode`` / ``sft_loss_agg_mode``,
    each defaulting to ``loss_agg_mode``; ``use_token_level_loss_in_sft`` (Trinity-RFT
    0.2.1-0.3.0), when given, sets the SFT mode (True: ``token-mean``, False:
    ``seq-mean-token-mean``).

    Metrics: ``usual/*``, ``expert/*`` (scaled like their parts), ``loss``, ``mu``.
    """

    def __init__(
        self,
        backend: str = "verl",
        mu_warmup_steps: int = 0,
        mu_decay_steps: int = 0,
        mu_peak: float = 0.1,
        mu_valley: float = 0.1,
        enable_phi_function: bool = True,
        clip_range: float | None = None,
        clip_range_low: float | None = None,
        clip_range_high: float | None = None,
        use_dynamic_bsz: bool | None = None,
        ppo_mini_batch_size: int = 1,
        ppo_micro_batch_size_per_gpu: int = 1,
        ngpus_trainer: int = 1,
        train_batch_size_usual: int = 1,
        train_batch_size_expert: int = 1,
        loss_agg_mode: str = "token-mean",
        sft_loss_agg_mode: str | None = None,
        grpo_loss_agg_mode: str | None = None,
        repeat_times: int | None = None,
        use_token_level_loss_in_sft: bool | None = None,
    ) -> None:
        super().__init__(backend=backend, loss_agg_mode=loss_agg_mode)
        if use_token_level_loss_in_sft is not None:  # Trinity-RFT 0.2.1-0.3.0's flag
            sft_loss_agg_mode = token_level_mode(bool(use_token_level_loss_in_sft))
        if mu_warmup_steps < 0 or mu_decay_steps < 0:
            raise ValueError(
                f"mu_warmup_steps and mu_decay_steps must be >= 0, got "
                f"{mu_warmup_steps} and {mu_decay_steps}"
            )
        self.mu_warmup_steps = int(mu_warmup_steps)
        self.mu_decay_steps = int(mu_decay_steps)
        self.mu_peak = float(mu_peak)
        self.mu_valley = float(mu_valley)
        self.enable_phi_function = bool(enable_phi_function)
        self.use_dynamic_bsz = use_dynamic_bsz
        self.batch_weights = MixedBatchWeights.build(
            use_dynamic_bsz,
            ppo_mini_batch_size,
            ppo_micro_batch_size_per_gpu,
            ngpus_trainer,
            train_batch_size_usual,
            train_batch_size_expert,
        )
        self.train_batch_size_usual = train_batch_size_usual
        self.train_batch_size_expert = train_batch_size_expert
        sft_mode, grpo_mode = part_modes(loss_agg_mode, sft_loss_agg_mode, grpo_loss_agg_mode)
        self.grpo_loss_fn = PPOPolicyLossFn(
            clip_range=clip_range,
            clip_range_low=clip_range_low,
            clip_range_high=clip_range_high,
            loss_agg_mode=grpo_mode,
        )
        self.sft_loss_fn: PolicyLossFn = (
            SFTPhiLossFn(loss_agg_mode=sft_mode)
            if self.enable_phi_function
            else SFTLossFn(loss_agg_mode=sft_mode)
        )

    def mu(self, step: int) -> float:
        """The SFT weight at trainer step ``step`` (:func:`mu_schedule`)."""
        return mu_schedule(
            step, self.mu_warmup_steps, self.mu_decay_steps, self.mu_peak, self.mu_valley
        )

    def __call__(  # type: ignore[override]
        self,
        logprob: torch.Tensor,
        old_logprob: torch.Tensor,
        action_mask: torch.Tensor,
        advantages: torch.Tensor,
        expert_mask: torch.Tensor,
        step: torch.Tensor,
        **kwargs,
    ) -> tuple[torch.Tensor, dict]:
        steps = torch.as_tensor(step).reshape(-1)
        if steps.numel() != logprob.shape[0]:
            raise ValueError(f"step has {steps.numel()} entries for {logprob.shape[0]} rows")
        if steps.numel() and int(steps.max()) != int(steps.min()):
            raise ValueError(
                f"mix_chord needs one step per batch, got steps {int(steps.min())}..{int(steps.max())}"
            )
        current = int(steps.max()) if steps.numel() else 0
        grpo_loss, sft_loss, metrics = split_mixed_loss(
            self.grpo_loss_fn,
            self.sft_loss_fn,
            self.batch_weights,
            logprob,
            old_logprob,
            action_mask,
            advantages,
            expert_mask,
        )
        mu = self.mu(current)
        loss = (1 - mu) * grpo_loss + mu * sft_loss
        metrics["loss"] = loss.item()
        metrics["mu"] = mu
        return loss, metrics

    @classmethod
    def default_args(cls) -> dict:
        return {
            "mu_warmup_steps": 0,
            "mu_decay_steps": 0,
            "mu_peak": 0.1,
            "mu_valley": 0.1,
            "clip_range": 0.2,
            "enable_phi_function": True,
            "loss_agg_mode": "token-mean",
        }
