"""REC group advantage, as in Trinity-RFT ``rec_advantage.py``.

``advantage = r - mean`` (or ``(r - mean) / (std + epsilon)`` with
``std_normalize``). With ``drop="balance"``, a group with more below-mean
responses than at-or-above-mean ones gets randomly chosen surplus below-mean
responses zeroed (advantage 0; they stay in the output), and the mean/std are
then taken over the kept responses.
"""

from __future__ import annotations

import torch

from algorithms.advantage_fn.advantage_fn import ADVANTAGE_FN, GroupAdvantage
from algorithms.advantage_fn.grpo_advantage import group_rewards, set_outcome_advantage
from rftstream.experience import Experience

_DROP_MODES = (None, "balance")


@ADVANTAGE_FN.register_module("rec")
class RECGroupedAdvantage(GroupAdvantage):
    """REC advantage.

    Args:
        epsilon: added to the std before dividing (``std_normalize`` only).
        std_normalize: divide the centred reward by the group std.
        drop: ``None`` or ``"balance"`` (see the module docstring).

    Statistics follow Trinity-RFT: responses with ``r >= mean(group)`` are
    "positive"; after balancing, ``mean`` and ``std`` are taken over the kept
    responses and ``std`` is the population std (``n`` denominator). A group
    of one uses ``mean = 0``, ``std = 1`` (advantage = reward, or
    ``reward / (1 + epsilon)``) and is never balanced.

    Metrics (averaged over groups): ``drop_balance`` (fraction of the group
    zeroed by balancing), ``reward_mean`` and ``reward_std`` (the statistics
    used); ``group_count``.
    """

    def __init__(
        self,
        epsilon: float = 1e-6,
        std_normalize: bool | None = False,
        drop: str | None = None,
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        if drop not in _DROP_MODES:
            raise ValueError(f"rec: drop must be None or 'balance', got {drop!r}")
        self.epsilon = float(epsilon)
        self.std_normalize = bool(std_normalize)
        self.drop = drop

    def calculate_group_advantage(
        self, group_id: str, exps: list[Experience]
    ) -> tuple[list[Experience], dict]:
        n = len(exps)
        with torch.no_grad():
            rewards = group_rewards(exps)
            keep = torch.ones(n, dtype=torch.bool)
            drop_frac = 0.0
            if self.drop == "balance" and n > 1:
                is_pos = rewards >= rewards.mean()
                pos_count = int(is_pos.sum())
                surplus = (n - pos_count) - pos_count
                if surplus > 0:
                    neg_idx = torch.nonzero(~is_pos, as_tuple=True)[0]
                    chosen = neg_idx[torch.randperm(neg_idx.numel())[:surplus]]
                    keep[chosen] = False
                    drop_frac = surplus / n
            if int(keep.sum()) <= 1:
                mean, std = torch.tensor(0.0), torch.tensor(1.0)
            else:
                kept = rewards[keep]
                mean, std = kept.mean(), kept.std(unbiased=False)
            for i, exp in enumerate(exps):
                if not keep[i]:
                    score = torch.tensor(0.0)
                elif self.std_normalize:
                    score = (rewards[i] - mean) / (std + self.epsilon)
                else:
                    score = rewards[i] - mean
                set_outcome_advantage(exp, score)
        return exps, {
            "drop_balance": drop_frac,
            "reward_mean": float(mean),
            "reward_std": float(std),
        }

    @classmethod
    def default_args(cls) -> dict:
        return {"epsilon": 1e-6, "std_normalize": False, "drop": None}
