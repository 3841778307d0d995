"""Advantage functions (``from algorithms.advantage_fn import ADVANTAGE_FN, GroupAdvantage``).

Registered: ``grpo``, ``opmd``, ``rloo``, ``reinforce`` (group advantages, run
in the experience pipeline), ``ppo`` (GAE, run in the trainer) and ``none``.
"""

from algorithms.advantage_fn.advantage_fn import (
    ADVANTAGE_FN,
    AdvantageFn,
    GroupAdvantage,
    NoAdvantageFn,
)
from algorithms.advantage_fn.grpo_advantage import (
    GRPOGroupedAdvantage,
    REINFORCEGroupAdvantage,
    RLOOGroupAdvantage,
)
from algorithms.advantage_fn.opmd_advantage import OPMDGroupAdvantage
from algorithms.advantage_fn.ppo_advantage import PPOAdvantageFn, compute_gae_advantage_return

__all__ = [
    "ADVANTAGE_FN",
    "AdvantageFn",
    "GRPOGroupedAdvantage",
    "GroupAdvantage",
    "NoAdvantageFn",
    "OPMDGroupAdvantage",
    "PPOAdvantageFn",
    "REINFORCEGroupAdvantage",
    "RLOOGroupAdvantage",
    "compute_gae_advantage_return",
]
