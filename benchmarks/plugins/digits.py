"""A reward a model with random weights earns some of: for ``benchmarks/weights.py``.

``digit_share_reward`` is the share of digit characters in the response. The
arithmetic reward of the default run is 0 for every rollout of a random model, so
GRPO's advantages, the gradient and with them every weight update would be zero,
and a weight sync would send nothing. This one differs between the rollouts of a
group, so the trainer moves its weights as a real run's would (at ``lr`` per step
under Adam) and the syncs carry real deltas. Load it with ``--plugin-dir
benchmarks/plugins``.
"""

from __future__ import annotations

from typing import Any

from workflows import REWARD_FUNCTIONS
from workflows.rewards import RewardFn


@REWARD_FUNCTIONS.register_module("digit_share_reward")
class DigitShareReward(RewardFn):
    """``{"digits": share of the response's characters that are digits}`` (0 when empty)."""

    def __call__(self, response: str, truth: str | None = None, **kwargs: Any) -> dict[str, float]:
        text = response or ""
        return {"digits": sum(ch.isdigit() for ch in text) / len(text) if text else 0.0}
