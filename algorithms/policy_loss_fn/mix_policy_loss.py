"""MIX policy loss: GRPO (PPO-clip) on usual experiences plus SFT on expert experiences.

As in the Trinity-RFT "integrate a new algorithm" guide (MIX).
"""

from __future__ import annotations

import torch

from algorithms.policy_loss_fn.policy_loss_fn import POLICY_LOSS_FN, PolicyLossFn
from algorithms.policy_loss_fn.ppo_policy_loss import PPOPolicyLossFn
from algorithms.policy_loss_fn.sft_loss import SFTLossFn


@POLICY_LOSS_FN.register_module("mix")
class MIXPolicyLossFn(PolicyLossFn):
    """``loss = (1 - mu) * grpo_loss + mu * sft_loss``.

    Rows with ``expert_mask`` False get the PPO-clip loss, rows with it True the
    SFT loss. Each part is scaled by its row count in this micro-batch times a
    per-micro-batch weight, so that summing over the micro-batches of a step
    averages each kind over its own batch size:

    * ``use_dynamic_bsz``: ``weight = experience_per_gpu / (rows * train_batch_size_<kind>)``
      with ``experience_per_gpu = ppo_mini_batch_size // ngpus_trainer``;
    * otherwise: ``weight = gradient_accumulation / train_batch_size_<kind>`` with
      ``gradient_accumulation = ppo_mini_batch_size // ppo_micro_batch_size_per_gpu``.

    Metrics: the PPO metrics prefixed ``usual/`` and the SFT metrics prefixed
    ``expert/`` (each scaled like its loss) and ``loss``.

    Beyond the guide's signature: ``loss_agg_mode`` is passed to the inner PPO
    loss, and ``repeat_times`` is accepted and ignored (the guide's example
    YAML puts it under ``policy_loss_fn_args``).
    """

    def __init__(
        self,
        backend: str = "verl",
        mu: float = 0.1,
        clip_range: float | None = None,
        clip_range_low: float | None = None,
        clip_range_high: float | None = None,
        use_dynamic_bsz: bool | None = None,
        ppo_mini_batch_size: int = 1,
        ppo_micro_batch_size_per_gpu: int = 1,
        ngpus_trainer: int = 1,
        train_batch_size_usual: int = 1,
        train_batch_size_expert: int = 1,
        use_token_level_loss_in_sft: bool = True,
        loss_agg_mode: str = "token-mean",
        repeat_times: int | None = None,
    ) -> None:
        super().__init__(backend=backend, loss_agg_mode=loss_agg_mode)
        self.mu = mu
        self.use_dynamic_bsz = use_dynamic_bsz
        self.experience_per_gpu = ppo_mini_batch_size // ngpus_trainer
        self.gradient_accumulation = ppo_mini_batch_size // ppo_micro_batch_size_per_gpu
        self.train_batch_size_usual = train_batch_size_usual
        self.train_batch_size_expert = train_batch_size_expert
        self.grpo_loss_fn = PPOPolicyLossFn(
            clip_range=clip_range,
            clip_range_low=clip_range_low,
            clip_range_high=clip_range_high,
            loss_agg_mode=loss_agg_mode,
        )
        self.sft_loss_fn = SFTLossFn(use_token_level_loss=use_token_level_loss_in_sft)

    def __call__(  # type: ignore[override]
        self,
        logprob: torch.Tensor,
        old_logprob: torch.Tensor,
        action_mask: torch.Tensor,
        advantages: torch.Tensor,
        expert_mask: torch.Tensor,
        **kwargs,
    ) -> tuple[torch.Tensor, dict]:
        expert_mask = expert_mask.to(torch.bool)
        assert len(expert_mask) == logprob.shape[0], (
            f"Error: {len(expert_mask)=} != {logprob.shape[0]=}"
        )

        n_usual_exp = torch.sum(~expert_mask).item()
        n_expert_exp = torch.sum(expert_mask).item()

        if self.use_dynamic_bsz:
            per_micro_batch_weight_usual = self.experience_per_gpu / (
                logprob.shape[0] * self.train_batch_size_usual
            )
            per_micro_batch_weight_expert = self.experience_per_gpu / (
                logprob.shape[0] * self.train_batch_size_expert
            )
        else:
            per_micro_batch_weight_usual = self.gradient_accumulation / self.train_batch_size_usual
            per_micro_batch_weight_expert = (
                self.gradient_accumulation / self.train_batch_size_expert
            )

        if n_usual_exp > 0:
            grpo_loss, grpo_metrics = self.grpo_loss_fn(
                logprob[~expert_mask],
                old_logprob[~expert_mask],
                action_mask[~expert_mask],
                advantages[~expert_mask],
                **kwargs,
            )
            grpo_loss = grpo_loss * n_usual_exp * per_micro_batch_weight_usual
            grpo_metrics = {
                k: v * n_usual_exp * per_micro_batch_weight_usual for k, v in grpo_metrics.items()
            }
        else:
            grpo_loss = torch.tensor(0.0, device=logprob.device)
            grpo_metrics = {}

        # SFT loss (expert)
        if n_expert_exp > 0:
            sft_loss, sft_metrics = self.sft_loss_fn(
                logprob[expert_mask],
                action_mask[expert_mask],
            )
            sft_loss = sft_loss * n_expert_exp * per_micro_batch_weight_expert
            sft_metrics = {
                k: v * n_expert_exp * per_micro_batch_weight_expert for k, v in sft_metrics.items()
            }
        else:
            sft_loss = torch.tensor(0.0, device=logprob.device)
            sft_metrics = {}

        loss = (1 - self.mu) * grpo_loss + self.mu * sft_loss

        metrics = {f"usual/{k}": v for k, v in grpo_metrics.items()}
        metrics.update({f"expert/{k}": v for k, v in sft_metrics.items()})
        metrics.update({"loss": loss.item()})

        return loss, metrics

    @classmethod
    def default_args(cls) -> dict:
        return {"mu": 0.1, "clip_range": 0.2}
