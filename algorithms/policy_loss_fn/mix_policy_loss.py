"""MIX policy loss: GRPO (PPO-clip) on usual experiences plus SFT on expert experiences.

As in the Trinity-RFT "integrate a new algorithm" guide (MIX) and Trinity-RFT 0.6
(``sft_loss_agg_mode`` / ``grpo_loss_agg_mode``). :class:`MixedBatchWeights`
holds the verl batch arithmetic that MIX and ``mix_chord`` share.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from algorithms.policy_loss_fn.policy_loss_fn import POLICY_LOSS_FN, PolicyLossFn
from algorithms.policy_loss_fn.ppo_policy_loss import PPOPolicyLossFn
from algorithms.policy_loss_fn.sft_loss import SFTLossFn, token_level_mode
from algorithms.utils import check_loss_agg_mode


@dataclass(frozen=True)
class MixedBatchWeights:
    """verl's per-micro-batch weights of the usual and expert parts of a MIX loss.

    * ``use_dynamic_bsz``: ``weight = experience_per_gpu / (rows * train_batch_size_<kind>)``
      with ``experience_per_gpu = ppo_mini_batch_size // ngpus_trainer``;
    * otherwise: ``weight = gradient_accumulation / train_batch_size_<kind>`` with
      ``gradient_accumulation = ppo_mini_batch_size // ppo_micro_batch_size_per_gpu``.
    """

    use_dynamic_bsz: bool | None
    experience_per_gpu: int
    gradient_accumulation: int
    train_batch_size_usual: int
    train_batch_size_expert: int

    @classmethod
    def build(
        cls,
        use_dynamic_bsz: bool | None,
        ppo_mini_batch_size: int,
        ppo_micro_batch_size_per_gpu: int,
        ngpus_trainer: int,
        train_batch_size_usual: int,
        train_batch_size_expert: int,
    ) -> MixedBatchWeights:
        """Derive the weights from the constructor arguments Trinity-RFT's MIX losses take."""
        return cls(
            use_dynamic_bsz=use_dynamic_bsz,
            experience_per_gpu=ppo_mini_batch_size // ngpus_trainer,
            gradient_accumulation=ppo_mini_batch_size // ppo_micro_batch_size_per_gpu,
            train_batch_size_usual=train_batch_size_usual,
            train_batch_size_expert=train_batch_size_expert,
        )

    def weights(self, rows: int) -> tuple[float, float]:
        """``(usual, expert)`` weight per row of a micro-batch of ``rows`` rows."""
        if self.use_dynamic_bsz:
            return (
                self.experience_per_gpu / (rows * self.train_batch_size_usual),
                self.experience_per_gpu / (rows * self.train_batch_size_expert),
            )
        return (
            self.gradient_accumulation / self.train_batch_size_usual,
            self.gradient_accumulation / self.train_batch_size_expert,
        )


def split_mixed_loss(
    grpo_loss_fn: PolicyLossFn,
    sft_loss_fn: PolicyLossFn,
    weights: MixedBatchWeights,
    logprob: torch.Tensor,
    old_logprob: torch.Tensor,
    action_mask: torch.Tensor,
    advantages: torch.Tensor,
    expert_mask: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """``(grpo part, sft part, metrics)`` of one micro-batch of a MIX-style loss.

    Usual rows (``expert_mask`` False) go to ``grpo_loss_fn``, expert rows to
    ``sft_loss_fn``; each part (and its metrics) is scaled by its row count
    times its :meth:`MixedBatchWeights.weights`. A part with no row is 0.
    Metrics are prefixed ``usual/`` and ``expert/``. Raises ValueError when
    ``expert_mask`` has not one entry per row.
    """
    expert_mask = expert_mask.to(torch.bool).reshape(-1)
    if expert_mask.numel() != logprob.shape[0]:
        raise ValueError(
            f"expert_mask has {expert_mask.numel()} entries for {logprob.shape[0]} rows"
        )
    n_usual = int((~expert_mask).sum())
    n_expert = int(expert_mask.sum())
    w_usual, w_expert = weights.weights(logprob.shape[0])
    zero = torch.zeros((), device=logprob.device)
    metrics: dict[str, float] = {}
    grpo_loss = zero
    if n_usual > 0:
        usual = ~expert_mask
        loss, grpo_metrics = grpo_loss_fn(
            logprob[usual], old_logprob[usual], action_mask[usual], advantages[usual]
        )
        scale = n_usual * w_usual
        grpo_loss = loss * scale
        metrics.update({f"usual/{k}": v * scale for k, v in grpo_metrics.items()})
    sft_loss = zero
    if n_expert > 0:
        loss, sft_metrics = sft_loss_fn(logprob[expert_mask], action_mask[expert_mask])
        scale = n_expert * w_expert
        sft_loss = loss * scale
        metrics.update({f"expert/{k}": v * scale for k, v in sft_metrics.items()})
    return grpo_loss, sft_loss, metrics


def part_modes(
    loss_agg_mode: str, sft_loss_agg_mode: str | None, grpo_loss_agg_mode: str | None
) -> tuple[str, str]:
    """``(sft mode, grpo mode)``: each part's own mode, else ``loss_agg_mode`` (Trinity-RFT 0.6)."""
    sft = check_loss_agg_mode(sft_loss_agg_mode or loss_agg_mode)
    grpo = check_loss_agg_mode(grpo_loss_agg_mode or loss_agg_mode)
    return sft, grpo


@POLICY_LOSS_FN.register_module("mix")
class MIXPolicyLossFn(PolicyLossFn):
    """``loss = (1 - mu) * grpo_loss + mu * sft_loss``.

    Rows with ``expert_mask`` False get the PPO-clip loss, rows with it True the
    SFT loss. Each part is scaled by its row count in this micro-batch times a
    per-micro-batch weight (:class:`MixedBatchWeights`), so that summing over
    the micro-batches of a step averages each kind over its own batch size.

    Aggregation (Trinity-RFT 0.6): the PPO part uses ``grpo_loss_agg_mode``,
    the SFT part ``sft_loss_agg_mode``; each defaults to ``loss_agg_mode``.
    ``use_token_level_loss_in_sft`` (the pre-0.6 flag), when given, overrides
    the SFT mode (True: ``token-mean``, False: ``seq-mean-token-mean``).

    Metrics: the PPO metrics prefixed ``usual/`` and the SFT metrics prefixed
    ``expert/`` (each scaled like its loss) and ``loss``. ``repeat_times`` is
    accepted and ignored (the guide's example YAML puts it under
    ``policy_loss_fn_args``). ``read_batch_size_usual`` / ``read_batch_size_expert``
    are Trinity-RFT 0.2.0's names of ``train_batch_size_usual`` / ``_expert``.
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
        use_token_level_loss_in_sft: bool | None = None,
        loss_agg_mode: str = "token-mean",
        sft_loss_agg_mode: str | None = None,
        grpo_loss_agg_mode: str | None = None,
        repeat_times: int | None = None,
        read_batch_size_usual: int | None = None,
        read_batch_size_expert: int | None = None,
    ) -> None:
        super().__init__(backend=backend, loss_agg_mode=loss_agg_mode)
        # Trinity-RFT 0.2.0's names of train_batch_size_usual / _expert (renamed in 0.2.1)
        if read_batch_size_usual is not None and train_batch_size_usual == 1:
            train_batch_size_usual = int(read_batch_size_usual)
        if read_batch_size_expert is not None and train_batch_size_expert == 1:
            train_batch_size_expert = int(read_batch_size_expert)
        self.mu = mu
        self.use_dynamic_bsz = use_dynamic_bsz
        self.batch_weights = MixedBatchWeights.build(
            use_dynamic_bsz,
            ppo_mini_batch_size,
            ppo_micro_batch_size_per_gpu,
            ngpus_trainer,
            train_batch_size_usual,
            train_batch_size_expert,
        )
        self.experience_per_gpu = self.batch_weights.experience_per_gpu
        self.gradient_accumulation = self.batch_weights.gradient_accumulation
        self.train_batch_size_usual = train_batch_size_usual
        self.train_batch_size_expert = train_batch_size_expert
        if use_token_level_loss_in_sft is not None:
            sft_loss_agg_mode = token_level_mode(bool(use_token_level_loss_in_sft))
        sft_mode, grpo_mode = part_modes(loss_agg_mode, sft_loss_agg_mode, grpo_loss_agg_mode)
        self.grpo_loss_fn = PPOPolicyLossFn(
            clip_range=clip_range,
            clip_range_low=clip_range_low,
            clip_range_high=clip_range_high,
            loss_agg_mode=grpo_mode,
        )
        self.sft_loss_fn = SFTLossFn(loss_agg_mode=sft_mode)

    def __call__(  # type: ignore[override]
        self,
        logprob: torch.Tensor,
        old_logprob: torch.Tensor,
        action_mask: torch.Tensor,
        advantages: torch.Tensor,
        expert_mask: torch.Tensor,
        **kwargs,
    ) -> tuple[torch.Tensor, dict]:
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
        loss = (1 - self.mu) * grpo_loss + self.mu * sft_loss
        metrics["loss"] = loss.item()
        return loss, metrics

    @classmethod
    def default_args(cls) -> dict:
        return {"mu": 0.1, "clip_range": 0.2}
