"""Mappers: operators that change experiences in place and drop none.

``mask_response_truncated`` excludes truncated responses from the loss,
``reward_shaping_mapper`` reshapes rewards (Trinity-RFT's ``reward_shaping_configs``,
then rftstream's rescaling) and ``pass_rate_calculator`` annotates each
experience with its group's pass rate. Both take Trinity-RFT's arguments.
Each returns the same list (same objects, same order), modified in place.
"""

from __future__ import annotations

from typing import Any

import torch

from rftstream.experience import Experience, group_by
from rftstream.experience_pipeline import EXPERIENCE_OPERATORS, ExperienceOperator


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


SHAPING_OPS = ("ADD", "SUB", "MUL", "DIV")


def _shaping_configs(configs: list[dict[str, Any]] | None) -> list[tuple[str, str, float]]:
    """Trinity-RFT's ``reward_shaping_configs`` as ``(stats_key, op_type, weight)``; raises
    ValueError naming the entry at fault."""
    out: list[tuple[str, str, float]] = []
    for i, conf in enumerate(configs or []):
        where = f"reward_shaping_configs[{i}]"
        if not isinstance(conf, dict):
            raise ValueError(f"{where} must be a mapping with stats_key / op_type / weight")
        unknown = sorted(set(conf) - {"stats_key", "op_type", "weight"})
        if unknown:
            raise ValueError(f"{where}: unknown keys {unknown} (stats_key, op_type, weight)")
        key = conf.get("stats_key")
        if not key:
            raise ValueError(f"{where}.stats_key is required: the info field to shape with")
        op = str(conf.get("op_type", "ADD")).upper()
        if op not in SHAPING_OPS:
            raise ValueError(f"{where}.op_type must be one of {list(SHAPING_OPS)}, got {op!r}")
        out.append((str(key), op, float(conf.get("weight", 1.0))))
    return out


@EXPERIENCE_OPERATORS.register_module("reward_shaping_mapper")
class RewardShapingMapper(ExperienceOperator):
    """Reshape rewards: Trinity-RFT's ``reward_shaping_configs``, then rftstream's rescaling.

    ``reward_shaping_configs`` (Trinity-RFT's argument) is a list of
    ``{stats_key, op_type, weight}``, applied in order with ``v =
    exp.info[stats_key]``: ``ADD`` ``reward += weight * v``, ``SUB`` ``reward -=
    weight * v``, ``MUL`` ``reward *= weight * v``, ``DIV`` ``reward /= weight *
    v`` (skipped when that is 0). As in Trinity-RFT, an entry whose
    ``stats_key`` the experience's ``info`` lacks leaves the reward as it is.

    Then ``clip(scale * reward + offset - length_penalty * response_length)``
    (rftstream's arguments; the defaults change nothing). ``clip`` is
    ``[low, high]`` (None: no clipping).

    Deliberate difference: an experience with reward None is kept, untouched
    (Trinity-RFT drops it from the batch; ``invalid_reward_filter`` does that
    here). Metrics ``shaped_count`` and, over the non-None rewards only (omitted
    when there are none), ``reward_mean_before``, ``reward_mean_after`` and
    Trinity-RFT's ``reward_diff/mean``, ``reward_diff/min``, ``reward_diff/max``.
    """

    def __init__(
        self,
        reward_shaping_configs: list[dict[str, Any]] | None = None,
        scale: float = 1.0,
        offset: float = 0.0,
        length_penalty: float = 0.0,
        clip: list[float] | None = None,
    ) -> None:
        if clip is not None:
            if len(clip) != 2 or float(clip[0]) > float(clip[1]):
                raise ValueError(f"clip must be [low, high] with low <= high, got {clip!r}")
            clip = [float(clip[0]), float(clip[1])]
        self.reward_shaping_configs = _shaping_configs(reward_shaping_configs)
        self.scale = float(scale)
        self.offset = float(offset)
        self.length_penalty = float(length_penalty)
        self.clip = clip

    def _shape(self, exp: Experience, reward: float) -> float:
        for key, op, weight in self.reward_shaping_configs:
            if key not in exp.info:
                continue
            value = weight * float(exp.info[key])
            if op == "ADD":
                reward += value
            elif op == "SUB":
                reward -= value
            elif op == "MUL":
                reward *= value
            elif value != 0:  # DIV
                reward /= value
        reward = self.scale * reward + self.offset - self.length_penalty * exp.response_length
        if self.clip is not None:
            reward = min(max(reward, self.clip[0]), self.clip[1])
        return reward

    def process(self, exps: list[Experience]) -> tuple[list[Experience], dict]:
        before: list[float] = []
        after: list[float] = []
        for exp in exps:
            if exp.reward is None:
                continue
            before.append(exp.reward)
            exp.reward = self._shape(exp, float(exp.reward))
            after.append(exp.reward)
        metrics: dict[str, float] = {"shaped_count": len(after)}
        if before:
            diffs = [a - b for a, b in zip(after, before, strict=True)]
            metrics["reward_mean_before"] = sum(before) / len(before)
            metrics["reward_mean_after"] = sum(after) / len(after)
            metrics["reward_diff/mean"] = sum(diffs) / len(diffs)
            metrics["reward_diff/min"] = min(diffs)
            metrics["reward_diff/max"] = max(diffs)
        return exps, metrics


@EXPERIENCE_OPERATORS.register_module("pass_rate_calculator")
class PassRateCalculator(ExperienceOperator):
    """Write each task group's pass rate to ``info["pass_rate"]`` of its experiences.

    As in Trinity-RFT (``threshold`` unset), the pass rate is the group's
    mean reward (= the share solved for 0/1 rewards); with ``threshold``
    (rftstream's argument) it is the share of the group with ``reward >=
    threshold``. A None reward counts as 0 / a failure (the denominator is the
    group size; Trinity-RFT fails on it). Trinity-RFT's
    ``reward_shaping_configs`` argument is accepted and, as there, unused.
    Metric ``pass_rate_mean``: mean over groups (not experiences); omitted for
    an empty batch.
    """

    def __init__(
        self,
        threshold: float | None = None,
        reward_shaping_configs: list[dict[str, Any]] | None = None,
    ) -> None:
        self.threshold = None if threshold is None else float(threshold)
        self.reward_shaping_configs = reward_shaping_configs  # Trinity-RFT's; unused there too

    def _rate(self, group: list[Experience]) -> float:
        if self.threshold is None:
            return sum(float(e.reward or 0.0) for e in group) / len(group)
        passed = sum(1 for e in group if e.reward is not None and e.reward >= self.threshold)
        return passed / len(group)

    def process(self, exps: list[Experience]) -> tuple[list[Experience], dict]:
        rates: list[float] = []
        for group in group_by(exps, id_type="task").values():
            rate = self._rate(group)
            for exp in group:
                exp.info["pass_rate"] = rate
            rates.append(rate)
        metrics = {"pass_rate_mean": sum(rates) / len(rates)} if rates else {}
        return exps, metrics
