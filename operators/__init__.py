"""Experience operators (``from operators import ExperienceOperator, EXPERIENCE_OPERATORS``).

Registered: ``reward_filter``, ``reward_std_filter``, ``invalid_reward_filter``,
``group_advantage``. Depends on the ``rftstream`` kernel and ``algorithms``,
never on the actors.
"""

from operators.advantage import GroupAdvantageOperator
from operators.base import EXPERIENCE_OPERATORS, AsyncExperienceOperator, ExperienceOperator
from operators.filters import InvalidRewardFilter, RewardFilter, RewardSTDFilter
from operators.pipeline import ExperiencePipeline, create_operators, operator_name

__all__ = [
    "EXPERIENCE_OPERATORS",
    "AsyncExperienceOperator",
    "ExperienceOperator",
    "ExperiencePipeline",
    "GroupAdvantageOperator",
    "InvalidRewardFilter",
    "RewardFilter",
    "RewardSTDFilter",
    "create_operators",
    "operator_name",
]
