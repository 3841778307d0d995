"""ReMax advantage (computed in the trainer), as in Trinity-RFT ``remax_advantage.py``.

verl ``compute_remax_outcome_advantage`` (paper arXiv:2310.10505): the baseline
is the reward of the greedy response to the same prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from algorithms.advantage_fn.advantage_fn import ADVANTAGE_FN, AdvantageFn
from algorithms.advantage_fn.reinforce_plus_plus_advantage import token_level_rewards
from rftstream.experience import Experience


@ADVANTAGE_FN.register_module("remax")
class REMAXAdvantageFn(AdvantageFn):
    """ReMax: ``returns_t = sum_{s >= t} r_s * mask_s``; ``advantages = returns - baseline``.

    ``__call__(exps, reward_baselines=...)``: one scalar per experience (the
    greedy response's reward); without it each ``exp.info["reward_baseline"]``
    is used. Rewards as :func:`token_level_rewards` (the outcome reward on the
    last response token). As in Trinity-RFT the rewards are masked *before*
    the reverse cumulative sum, so a reward on a masked token does not count.
    Both tensors are zeroed where ``action_mask`` is False. Metrics: none
    (``{}``), as in Trinity-RFT.
    """

    def __call__(
        self,
        exps: list[Experience],
        reward_baselines: Sequence[float] | torch.Tensor | None = None,
        **kwargs: Any,
    ) -> tuple[list[Experience], dict]:
        if not exps:
            return [], {}
        if reward_baselines is None:
            missing = [e.eid.uid for e in exps if "reward_baseline" not in e.info]
            if missing:
                raise ValueError(
                    "ReMax advantage needs the greedy response's reward: pass "
                    "reward_baselines=... or set exp.info['reward_baseline'] "
                    f"(missing for {missing[:3]})"
                )
            reward_baselines = [float(e.info["reward_baseline"]) for e in exps]
        baselines = torch.as_tensor(reward_baselines, dtype=torch.float32).reshape(-1)
        if baselines.numel() != len(exps):
            raise ValueError(
                f"got {baselines.numel()} reward baselines for {len(exps)} experiences"
            )
        with torch.no_grad():
            for exp, baseline in zip(exps, baselines, strict=True):
                fmask = exp.action_mask.to(torch.float32)
                masked = token_level_rewards(exp) * fmask
                returns = masked.flip(-1).cumsum(-1).flip(-1)
                exp.advantages = (returns - baseline) * fmask
                exp.returns = returns * fmask
        return exps, {}

    @classmethod
    def default_args(cls) -> dict:
        return {}

    @classmethod
    def compute_in_trainer(cls) -> bool:
        return True
