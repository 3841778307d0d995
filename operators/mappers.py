"""Mappers: operators that change experiences in place and drop none.

``mask_response_truncated`` excludes truncated responses from the loss,
``reward_shaping_mapper`` rescales / penalises rewards and
``pass_rate_calculator`` annotates each experience with its group's pass rate.
Each returns the same list (same objects, same order), modified in place.
"""

from __future__ import annotations

import torch

from operators.base import EXPERIENCE_OPERATORS, ExperienceOperator
from rftstream.experience import Experience, group_by


@EXPERIENCE_OPERATORS.register_module("mask_response_truncated")
class MaskResponseTruncated(ExperienceOperator):
    """Set ``action_mask`` to all False for truncated responses.

    Truncated means ``info["finish_reason"] == "length"``; such an experience
    stays in the batch (it still counts for group statistics) but contributes
    no token to the policy loss. Metric ``masked_count``.
    """

    def process(self, exps: list[Experience]) -> tuple[list[Experience], dict]:
        masked = 0
        for exp in exps:
            if exp.info.get("finish_reason") == "length":
                exp.action_mask = torch.zeros_like(exp.action_mask, dtype=torch.bool)
                masked += 1
        return exps, {"masked_count": masked}


@EXPERIENCE_OPERATORS.register_module("reward_shaping_mapper")
class RewardShapingMapper(ExperienceOperator):
    """Reshape rewards: ``clip(scale * reward + offset - length_penalty * response_length)``.

    ``clip`` is ``[low, high]`` (None: no clipping). Experiences with reward
    None are left untouched. Metrics ``shaped_count`` and, over the non-None
    rewards only (omitted when there are none), ``reward_mean_before`` and
    ``reward_mean_after``.
    """

    def __init__(
        self,
        scale: float = 1.0,
        offset: float = 0.0,
        length_penalty: float = 0.0,
        clip: list[float] | None = None,
    ) -> None:
        if clip is not None:
            if len(clip) != 2 or float(clip[0]) > float(clip[1]):
                raise ValueError(f"clip must be [low, high] with low <= high, got {clip!r}")
            clip = [float(clip[0]), float(clip[1])]
        self.scale = float(scale)
        self.offset = float(offset)
        self.length_penalty = float(length_penalty)
        self.clip = clip

    def process(self, exps: list[Experience]) -> tuple[list[Experience], dict]:
        before: list[float] = []
        after: list[float] = []
        for exp in exps:
            if exp.reward is None:
                continue
            before.append(exp.reward)
            r = self.scale * exp.reward + self.offset - self.length_penalty * exp.response_length
            if self.clip is not None:
                r = min(max(r, self.clip[0]), self.clip[1])
            exp.reward = r
            after.append(r)
        metrics: dict[str, float] = {"shaped_count": len(after)}
        if before:
            metrics["reward_mean_before"] = sum(before) / len(before)
            metrics["reward_mean_after"] = sum(after) / len(after)
        return exps, metrics


@EXPERIENCE_OPERATORS.register_module("pass_rate_calculator")
class PassRateCalculator(ExperienceOperator):
    """Write each task group's pass rate to ``info["pass_rate"]`` of its experiences.

    Pass rate = fraction of the group's experiences with ``reward >= threshold``;
    a None reward counts as a failure (the denominator is the group size).
    Metric ``pass_rate_mean``: mean over groups (not experiences); omitted for
    an empty batch.
    """

    def __init__(self, threshold: float = 1.0) -> None:
        self.threshold = float(threshold)

    def process(self, exps: list[Experience]) -> tuple[list[Experience], dict]:
        rates: list[float] = []
        for group in group_by(exps, id_type="task").values():
            passed = sum(1 for e in group if e.reward is not None and e.reward >= self.threshold)
            rate = passed / len(group)
            for exp in group:
                exp.info["pass_rate"] = rate
            rates.append(rate)
        metrics = {"pass_rate_mean": sum(rates) / len(rates)} if rates else {}
        return exps, metrics
