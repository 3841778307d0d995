# ruff: noqa
# fmt: off
# Seed 003, operator section, verbatim apart from the imports: loaded as a plugin by
# tests/integration/test_seed_plugins.py.

from typing import Dict, List, Tuple

from operators import EXPERIENCE_OPERATORS, ExperienceOperator
from rftstream import Experience


@EXPERIENCE_OPERATORS.register_module("reward_filter")
class RewardFilter(ExperienceOperator):

    def __init__(self, threshold: float = 0.0) -> None:
        self.threshold = threshold

    def process(self, exps: List[Experience]) -> Tuple[List[Experience], Dict]:
        filtered_exps = [exp for exp in exps if exp.reward >= self.threshold]
        metrics = {"filtered_count": len(exps) - len(filtered_exps)}
        return filtered_exps, metrics
