"""Filters: operators that drop experiences.

``reward_filter`` is the Trinity-RFT guide's example; ``reward_std_filter``
follows Trinity-RFT's operator of that name; ``invalid_reward_filter`` drops
experiences without a usable reward (put it first: the others need rewards).
"""

from __future__ import annotations

import math

import numpy as np

from operators.base import EXPERIENCE_OPERATORS, ExperienceOperator
from rftstream.experience import Experience, group_by


@EXPERIENCE_OPERATORS.register_module("reward_filter")
class RewardFilter(ExperienceOperator):
    """Keep experiences with ``reward >= threshold``. Metric ``filtered_count``.

    Assumes every experience has a reward (see ``invalid_reward_filter``).
    """

    def __init__(self, threshold: float = 0.0) -> None:
        self.threshold = threshold

    def process(self, exps: list[Experience]) -> tuple[list[Experience], dict]:
        filtered_exps = [exp for exp in exps if exp.reward >= self.threshold]  # type: ignore[operator]
        metrics = {"filtered_count": len(exps) - len(filtered_exps)}
        return filtered_exps, metrics


@EXPERIENCE_OPERATORS.register_module("reward_std_filter")
class RewardSTDFilter(ExperienceOperator):
    """Drop task groups whose reward standard deviation is ``<= threshold``.

    Such groups carry no GRPO signal (all advantages 0). The std is the
    population std (``numpy.std``, as in Trinity-RFT); a group of one is
    dropped too. Metrics ``filtered_count`` (experiences) and
    ``filtered_group_count`` (groups).
    """

    def __init__(self, threshold: float = 0.0) -> None:
        self.threshold = threshold

    def process(self, exps: list[Experience]) -> tuple[list[Experience], dict]:
        kept: list[Experience] = []
        dropped_groups = 0
        for group in group_by(exps, id_type="task").values():
            if len(group) < 2 or float(np.std([e.reward for e in group])) <= self.threshold:
                dropped_groups += 1
                continue
            kept.extend(group)
        metrics = {
            "filtered_count": len(exps) - len(kept),
            "filtered_group_count": dropped_groups,
        }
        return kept, metrics


@EXPERIENCE_OPERATORS.register_module("invalid_reward_filter")
class InvalidRewardFilter(ExperienceOperator):
    """Drop experiences whose reward is None, NaN or infinite. Metric ``filtered_count``."""

    def process(self, exps: list[Experience]) -> tuple[list[Experience], dict]:
        kept = [e for e in exps if e.reward is not None and math.isfinite(e.reward)]
        return kept, {"filtered_count": len(exps) - len(kept)}
