"""The reward-filter splice the splice tests run (unit and integration): groups of mixed
rewards and the ``reward_filter`` pipelines that keep half of each."""

from __future__ import annotations

from operators import EXPERIENCE_OPERATORS, ExperiencePipeline
from rftstream.experience import Experience
from tests.integration._util import _group

THRESHOLD = 0.5


def mixed_groups(i: int) -> list[Experience]:
    """Task ``i``'s group: rewards 0, 1, 0, 1 (``reward_filter(THRESHOLD)`` keeps two)."""
    return [e for k, e in enumerate(_group(i, 0.0, 4)) if k % 2 == 0] + [
        e for k, e in enumerate(_group(i, 1.0, 4)) if k % 2 == 1
    ]


def filter_pipelines(n: int) -> list[ExperiencePipeline]:
    """``n`` replicas' pipelines of one ``reward_filter(THRESHOLD)`` each."""
    return [
        ExperiencePipeline([EXPERIENCE_OPERATORS.get("reward_filter")(THRESHOLD)]) for _ in range(n)
    ]
