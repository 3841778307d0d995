"""GRPO, RLOO and REINFORCE group advantages (outcome reward: one scalar per experience).

Ref: verl ``core_algos.compute_grpo_outcome_advantage`` /
``compute_rloo_outcome_advantage`` and Trinity-RFT ``grpo_advantage.py`` /
``reinforce_advantage.py``.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import uuid

import numpy as np
import torch

from algorithms.advantage_fn.advantage_fn import (
    ADVANTAGE_FN,
    GroupAdvantage,
    _aggregate_group_metrics,
)
from rftstream.experience import Experience, array_numpy


def group_rewards(exps: list[Experience]) -> torch.Tensor:
    """The rewards of ``exps`` as a float32 tensor ``(len(exps),)``.

    Raises ValueError naming the experience whose reward is None or NaN
    (put ``invalid_reward_filter`` before the advantage operator).
    """
    values: list[float] = []
    for exp in exps:
        if exp.reward is None or math.isnan(exp.reward):
            raise ValueError(
                f"experience {exp.eid.uid} has reward {exp.reward!r}; an advantage needs a "
                f"numeric reward (add the `invalid_reward_filter` operator before it)"
            )
        values.append(float(exp.reward))
    return torch.tensor(values, dtype=torch.float32)


def set_outcome_advantage(exp: Experience, score: float | torch.Tensor) -> None:
    """Broadcast a scalar ``score`` over the response: ``advantages = returns = score * action_mask``
    (float32, as ``torch.as_tensor(score, dtype=torch.float32) * mask`` gives).

    Done in numpy over the mask as it came off the wire: an operator host sets this for
    every experience, and a handful of torch calls each cost more than the arithmetic."""
    score32 = np.float32(float(score))
    mask = array_numpy(exp, "action_mask")
    if mask is None:  # absent on the wire: every response token
        adv = np.full(exp.response_length, score32, dtype=np.float32)
    else:
        adv = mask.astype(np.float32) * score32
    exp.advantages = torch.from_numpy(adv)
    exp.returns = torch.from_numpy(adv.copy())


STD_CAL_LEVELS: tuple[str, ...] = ("group", "batch")


def rank_penalised_rewards(
    rewards: torch.Tensor, exps: list[Experience], rank_penalty: float
) -> torch.Tensor:
    """Rewards scaled down by the rank of each response's mean rollout log-prob.

    ``r_i * (1 - rank_i / n * rank_penalty)`` where ``rank_i`` (0 = lowest) ranks
    ``mean(exp.logprobs)`` within the ``n`` responses of the group (Trinity-RFT
    0.6, after arXiv:2506.02355): the likeliest response is penalised most.
    Raises ValueError naming an experience without ``logprobs``.
    """
    means: list[float] = []
    for exp in exps:
        if exp.logprobs is None or exp.logprobs.numel() == 0:
            raise ValueError(
                f"experience {exp.eid.uid} has no logprobs; advantage_fn_args.rank_penalty "
                f"ranks responses by their mean rollout log-prob"
            )
        means.append(float(exp.logprobs.to(torch.float32).mean()))
    ranks = torch.argsort(torch.argsort(torch.tensor(means))).to(torch.float32)
    return rewards * (1 - ranks / len(exps) * rank_penalty)


def _copy_with_new_eid(exp: Experience) -> Experience:
    """A deep copy of ``exp`` whose ``eid`` has a fresh suffix (so it trains as another row)."""
    clone = copy.deepcopy(exp)
    clone.eid = dataclasses.replace(exp.eid, suffix=uuid.uuid4().hex[:12])
    return clone


@ADVANTAGE_FN.register_module("grpo")
class GRPOGroupedAdvantage(GroupAdvantage):
    """GRPO: ``advantage = (r - mean(group)) / (std + epsilon)``.

    ``std`` is ``torch.std`` (unbiased, ``n - 1`` denominator), as in Trinity-RFT
    and verl. Arguments (Trinity-RFT 0.6 names and meaning):

    * ``std_cal_level``: ``"group"`` (default) divides by the group's reward
      std; ``"batch"`` by the std of every reward passed to one call (the mean
      stays per group; a batch of one reward has std 1). In the experience
      pipeline one call sees what one operator call is given (one NATS message
      holds one task's group).
    * ``rank_penalty``: rewards are first scaled by
      :func:`rank_penalised_rewards` (groups of two or more).
    * ``std_threshold``: a group whose reward std is ``<=`` it is skipped and
      counted in ``skipped_count``. Without ``duplicate_experiences`` it is kept
      with advantage 0 (use the ``reward_std_filter`` operator to drop it); with
      ``duplicate_experiences`` it is dropped, as in Trinity-RFT, and replaced
      by copies (fresh ``eid.suffix``) of groups drawn at random from the valid
      groups of the same call, so the count stays the same (Polaris); when no
      group of the call is valid, nothing is returned.
    * ``norm_adv_by_std_in_grpo=False`` (Dr. GRPO): the advantage is
      ``r - mean(group)``.

    A group of one has no baseline: its advantage is 0 (Trinity-RFT divides
    the raw reward by ``1 + epsilon`` instead). All-equal rewards give
    advantage 0 (std 0, numerator 0).

    Metrics (averaged over groups by :class:`GroupAdvantage`): ``reward_mean``,
    ``reward_std``; ``skipped_count`` summed; ``group_count``; with
    ``duplicate_experiences`` also ``duplicated_count``.
    """

    def __init__(
        self,
        epsilon: float = 1e-6,
        std_threshold: float | None = None,
        norm_adv_by_std_in_grpo: bool = True,
        duplicate_experiences: bool = False,
        rank_penalty: float | None = None,
        std_cal_level: str = "group",
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        if std_cal_level not in STD_CAL_LEVELS:
            raise ValueError(
                f"std_cal_level must be one of {list(STD_CAL_LEVELS)}, got {std_cal_level!r}"
            )
        self.epsilon = float(epsilon)
        self.std_threshold = None if std_threshold is None else float(std_threshold)
        self.norm_adv_by_std_in_grpo = bool(norm_adv_by_std_in_grpo)
        self.duplicate_experiences = bool(duplicate_experiences)
        self.rank_penalty = None if rank_penalty is None else float(rank_penalty)
        self.std_cal_level = std_cal_level
        self._batch_std: torch.Tensor | None = None

    def _drops_skipped(self) -> bool:
        return self.duplicate_experiences and self.std_threshold is not None

    def calculate_group_advantage(
        self, group_id: str, exps: list[Experience]
    ) -> tuple[list[Experience], dict]:
        metrics: dict[str, float] = {}
        with torch.no_grad():
            rewards = group_rewards(exps)
            if len(exps) == 1:
                mean = rewards[0]
                std = torch.tensor(0.0)
                scores = torch.zeros(1)
            else:
                if self.rank_penalty is not None:
                    rewards = rank_penalised_rewards(rewards, exps, self.rank_penalty)
                mean = rewards.mean()
                std = rewards.std()
                divisor = self._batch_std if self._batch_std is not None else std
                if self.norm_adv_by_std_in_grpo:
                    scores = (rewards - mean) / (divisor + self.epsilon)
                else:
                    scores = rewards - mean
            if self.std_threshold is not None and float(std) <= self.std_threshold:
                scores = torch.zeros_like(rewards)
                metrics["skipped_count"] = float(len(exps))
            for exp, score in zip(exps, scores.tolist(), strict=True):
                set_outcome_advantage(exp, score)
        metrics["reward_mean"] = float(mean)
        metrics["reward_std"] = float(std)
        return exps, metrics

    def process(self, exps: list[Experience]) -> tuple[list[Experience], dict]:
        """Compute per group (see the class docstring for ``std_cal_level`` and duplication)."""
        if not exps:
            return [], {}
        self._batch_std = None
        if self.std_cal_level == "batch":
            all_rewards = group_rewards(exps)
            self._batch_std = all_rewards.std() if len(exps) > 1 else torch.tensor(1.0)
        try:
            groups = self.group_experiences(exps)
            kept: list[list[Experience]] = []
            skipped = 0
            metric_list: list[dict] = []
            for group_id, group_exps in groups.items():
                group_exps, group_metrics = self.calculate_group_advantage(group_id, group_exps)
                metric_list.append(group_metrics)
                if self._drops_skipped() and "skipped_count" in group_metrics:
                    skipped += 1
                else:
                    kept.append(group_exps)
        finally:
            self._batch_std = None
        metrics = _aggregate_group_metrics(metric_list)
        metrics["group_count"] = float(len(groups))
        out = [exp for group in kept for exp in group]
        if self._drops_skipped():
            duplicated = 0
            if kept and skipped:
                picks = torch.randint(0, len(kept), (skipped,)).tolist()
                for i in picks:
                    out.extend(_copy_with_new_eid(exp) for exp in kept[i])
                    duplicated += len(kept[i])
            metrics["duplicated_count"] = float(duplicated)
        return out, metrics

    @classmethod
    def default_args(cls) -> dict:
        return {
            "epsilon": 1e-6,
            "std_threshold": None,
            "norm_adv_by_std_in_grpo": True,
            "duplicate_experiences": False,
            "rank_penalty": None,
            "std_cal_level": "group",
        }


@ADVANTAGE_FN.register_module("rloo")
class RLOOGroupAdvantage(GroupAdvantage):
    """RLOO (leave-one-out baseline): ``advantage_i = r_i - mean(r_j for j != i)``.

    Equals ``n/(n-1) * (r_i - mean(group))`` as in verl. A group of one keeps its
    raw reward (verl's baseline 0). Metrics (averaged over groups):
    ``reward_mean`` and ``rloo_baseline``, the mean over the group of each
    response's leave-one-out baseline ``mean(r_j for j != i)`` (0 for a group
    of one).
    """

    def calculate_group_advantage(
        self, group_id: str, exps: list[Experience]
    ) -> tuple[list[Experience], dict]:
        with torch.no_grad():
            rewards = group_rewards(exps)
            n = len(exps)
            if n == 1:
                baselines = torch.zeros(1)
            else:
                baselines = (rewards.sum() - rewards) / (n - 1)
            scores = rewards - baselines
            for exp, score in zip(exps, scores.tolist(), strict=True):
                set_outcome_advantage(exp, score)
        return exps, {
            "reward_mean": float(rewards.mean()),
            "rloo_baseline": float(baselines.mean()),
        }


@ADVANTAGE_FN.register_module("reinforce")
class REINFORCEGroupAdvantage(GroupAdvantage):
    """REINFORCE: the advantage is the raw reward (no baseline). Metric ``reward_mean``."""

    def calculate_group_advantage(
        self, group_id: str, exps: list[Experience]
    ) -> tuple[list[Experience], dict]:
        with torch.no_grad():
            rewards = group_rewards(exps)
            for exp, score in zip(exps, rewards, strict=True):
                set_outcome_advantage(exp, score)
        return exps, {"reward_mean": float(rewards.mean())}
