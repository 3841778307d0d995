"""AsymRE group advantage (asymmetric REINFORCE), as in Trinity-RFT ``asymre_advantage.py``."""

from __future__ import annotations

import torch

from algorithms.advantage_fn.advantage_fn import ADVANTAGE_FN, GroupAdvantage
from algorithms.advantage_fn.grpo_advantage import group_rewards, set_outcome_advantage
from rftstream.experience import Experience


@ADVANTAGE_FN.register_module("asymre")
class ASYMREGroupAdvantage(GroupAdvantage):
    """AsymRE: ``advantage = r - (mean(group) + baseline_shift)``.

    A negative ``baseline_shift`` (default ``-0.1``) lowers the baseline, so
    more responses get a positive advantage. A group of one has baseline 0
    (its advantage is its reward), as in Trinity-RFT.

    Metrics (averaged over groups): ``group_baseline``, ``reward_mean`` (the
    group's mean reward; for a group of one its reward); ``group_count``.
    """

    def __init__(self, baseline_shift: float = -0.1, **kwargs) -> None:
        super().__init__(**kwargs)
        self.baseline_shift = float(baseline_shift)

    def calculate_group_advantage(
        self, group_id: str, exps: list[Experience]
    ) -> tuple[list[Experience], dict]:
        with torch.no_grad():
            rewards = group_rewards(exps)
            reward_mean = rewards.mean()
            if len(exps) == 1:
                baseline = torch.tensor(0.0)
            else:
                baseline = reward_mean + self.baseline_shift
            for exp, reward in zip(exps, rewards, strict=True):
                set_outcome_advantage(exp, reward - baseline)
        return exps, {"group_baseline": float(baseline), "reward_mean": float(reward_mean)}

    @classmethod
    def default_args(cls) -> dict:
        return {"baseline_shift": -0.1}
