"""Drop the groups whose rollouts all got the same reward (no GRPO signal in them).

The "Write your own operator" tutorial of docs/operators.md; tests/unit/test_operator_tutorial.py
runs it. Use it with ``--plugin-dir examples/operators``.
"""

from __future__ import annotations

from collections import defaultdict

from operators import EXPERIENCE_OPERATORS, ExperienceOperator
from rftstream import Experience


@EXPERIENCE_OPERATORS.register_module("equal_rewards_filter")
class EqualRewardsFilter(ExperienceOperator):
    """Keep a group only if its rewards differ by more than ``tolerance``."""

    def __init__(self, tolerance: float = 0.0) -> None:
        self.tolerance = tolerance

    def process(self, exps: list[Experience]) -> tuple[list[Experience], dict]:
        # one call holds several tasks' groups: group them by task id (eid.tid)
        groups: dict[str, list[Experience]] = defaultdict(list)
        for exp in exps:
            groups[exp.eid.tid].append(exp)
        kept: list[Experience] = []
        dropped = 0
        for group in groups.values():
            rewards = [exp.reward or 0.0 for exp in group]
            if max(rewards) - min(rewards) > self.tolerance:
                kept.extend(group)
            else:
                dropped += 1
        # numbers only; keys ending in _count add up over calls in the metrics record
        return kept, {"groups_dropped_count": dropped, "groups_seen_count": len(groups)}
