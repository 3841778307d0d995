"""OPMD group advantage, as in the Trinity-RFT algorithm development guide."""

from __future__ import annotations

import torch

from algorithms.advantage_fn.advantage_fn import ADVANTAGE_FN, GroupAdvantage
from algorithms.advantage_fn.grpo_advantage import group_rewards
from rftstream.experience import Experience


@ADVANTAGE_FN.register_module("opmd")
class OPMDGroupAdvantage(GroupAdvantage):
    """OPMD: ``advantage = r - baseline(group)``.

    ``opmd_baseline="mean"``: the group's mean reward. Any other value
    (``"logavgexp"``): ``tau * (logsumexp(r / tau) - log(n))``. A group of one
    has baseline 0 (its advantage is its reward). Metrics ``group_baseline`` and
    ``reward_mean`` (the group's mean reward), as in Trinity-RFT.
    """

    def __init__(self, opmd_baseline: str = "mean", tau: float = 1.0, **kwargs) -> None:
        super().__init__(**kwargs)
        self.opmd_baseline = opmd_baseline
        self.tau = tau

    def calculate_group_advantage(
        self, group_id: str, exps: list[Experience]
    ) -> tuple[list[Experience], dict]:
        with torch.no_grad():
            rewards = group_rewards(exps)
            if len(exps) == 1:
                group_baseline = torch.tensor(0.0)
            else:
                if self.opmd_baseline == "mean":
                    group_baseline = torch.mean(rewards)
                else:
                    group_baseline = self.tau * (
                        torch.logsumexp(rewards / self.tau, dim=-1)
                        - torch.log(torch.tensor(float(len(exps))))
                    )
            for exp, reward in zip(exps, rewards, strict=True):
                score = reward - group_baseline
                exp.advantages = (score * exp.action_mask).to(torch.float32)
                exp.returns = exp.advantages.clone()
            metrics = {
                "group_baseline": group_baseline.item(),
                "reward_mean": rewards.mean().item(),
            }
        return exps, metrics

    @classmethod
    def default_args(cls) -> dict:
        return {"opmd_baseline": "mean", "tau": 1.0}
