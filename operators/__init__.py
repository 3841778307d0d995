"""Experience operators (``from operators import ExperienceOperator, EXPERIENCE_OPERATORS``).

Registered: ``reward_filter``, ``reward_std_filter``, ``invalid_reward_filter``,
``staleness_filter``, ``length_filter``, ``overlong_filter``, ``duplicate_filter``,
``dapo_dynamic_sampling``, ``mask_response_truncated``, ``reward_shaping_mapper``,
``pass_rate_calculator``, ``group_advantage``, ``data_juicer`` (needs the
``data-juicer`` extra when constructed; Data-Juicer is imported lazily). The
interface, the registry and the pipeline live in :mod:`rftstream.experience_pipeline`
(re-exported here); the core imports this package by name on the registry's first
lookup. Depends on the ``rftstream`` kernel and ``algorithms``, never on the actors.
"""

from operators.advantage import GroupAdvantageOperator
from operators.data_juicer import DataJuicerOperator  # imports no data_juicer until built
from operators.filters import (
    DAPODynamicSampling,
    DuplicateFilter,
    InvalidRewardFilter,
    LengthFilter,
    OverlongFilter,
    RewardFilter,
    RewardSTDFilter,
    StalenessFilter,
)
from operators.mappers import MaskResponseTruncated, PassRateCalculator, RewardShapingMapper
from rftstream.experience_pipeline import (
    EXPERIENCE_OPERATORS,
    AsyncExperienceOperator,
    ExperienceOperator,
    ExperiencePipeline,
    create_operators,
    operator_name,
)

__all__ = [
    "EXPERIENCE_OPERATORS",
    "AsyncExperienceOperator",
    "DAPODynamicSampling",
    "DataJuicerOperator",
    "DuplicateFilter",
    "ExperienceOperator",
    "ExperiencePipeline",
    "GroupAdvantageOperator",
    "InvalidRewardFilter",
    "LengthFilter",
    "MaskResponseTruncated",
    "OverlongFilter",
    "PassRateCalculator",
    "RewardFilter",
    "RewardSTDFilter",
    "RewardShapingMapper",
    "StalenessFilter",
    "create_operators",
    "operator_name",
]
