"""GRPO, RLOO and REINFORCE group advantages (outcome reward: one scalar per experience).

Ref: verl ``core_algos.compute_grpo_outcome_advantage`` /
``compute_rloo_outcome_advantage`` and Trinity-RFT ``grpo_advantage.py`` /
``reinforce_advantage.py``.
"""

from __future__ import annotations

import math

import torch

from algorithms.advantage_fn.advantage_fn import ADVANTAGE_FN, GroupAdvantage
from rftstream.experience import Experience


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
    """Broadcast a scalar ``score`` over the response: ``advantages = returns = score * action_mask``."""
    mask = exp.action_mask.to(torch.float32)
    adv = torch.as_tensor(score, dtype=torch.float32) * mask
    exp.advantages = adv
    exp.returns = adv.clone()


@ADVANTAGE_FN.register_module("grpo")
class GRPOGroupedAdvantage(GroupAdvantage):
    """GRPO: ``advantage = (r - mean(group)) / (std(group) + epsilon)``.

    ``std`` is ``torch.std`` (unbiased, ``n - 1`` denominator), as in Trinity-RFT
    and verl. With ``norm_adv_by_std_in_grpo=False`` (Dr. GRPO) the advantage
    is ``r - mean(group)``.

    * A group of one has no baseline: its advantage is 0 (Trinity-RFT divides
      the raw reward by ``1 + epsilon`` instead).
    * All-equal rewards give advantage 0 (std 0, numerator 0).
    * ``std_threshold``: a group whose reward std is ``<=`` it gets advantage 0
      and is counted in the ``skipped_count`` metric (Trinity-RFT drops such
      groups; use the ``reward_std_filter`` operator to drop them here).

    Metrics (averaged over groups by :class:`GroupAdvantage`): ``reward_mean``,
    ``reward_std``; ``skipped_count`` summed; ``group_count``.
    """

    def __init__(
        self,
        epsilon: float = 1e-6,
        std_threshold: float | None = None,
        norm_adv_by_std_in_grpo: bool = True,
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        self.epsilon = float(epsilon)
        self.std_threshold = None if std_threshold is None else float(std_threshold)
        self.norm_adv_by_std_in_grpo = bool(norm_adv_by_std_in_grpo)

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
                mean = rewards.mean()
                std = rewards.std()
                if self.norm_adv_by_std_in_grpo:
                    scores = (rewards - mean) / (std + self.epsilon)
                else:
                    scores = rewards - mean
            if self.std_threshold is not None and float(std) <= self.std_threshold:
                scores = torch.zeros_like(rewards)
                metrics["skipped_count"] = float(len(exps))
            for exp, score in zip(exps, scores, strict=True):
                set_outcome_advantage(exp, score)
        metrics["reward_mean"] = float(mean)
        metrics["reward_std"] = float(std)
        return exps, metrics

    @classmethod
    def default_args(cls) -> dict:
        return {"epsilon": 1e-6, "std_threshold": None, "norm_adv_by_std_in_grpo": True}


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
            for exp, score in zip(exps, scores, strict=True):
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
