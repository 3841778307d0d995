"""Step-wise GRPO for multi-step workflows, as in Trinity-RFT ``multi_step_grpo_advantage.py``.

In a multi-step (agentic) workflow one rollout (``eid.rid``) yields one
experience per turn (``eid.step``). The GRPO score is computed per task group
from each rollout's final reward and broadcast to every step of that rollout
(inspired by rLLM).
"""

from __future__ import annotations

from typing import Any

import torch

from algorithms.advantage_fn.advantage_fn import (
    ADVANTAGE_FN,
    AdvantageFn,
    _aggregate_group_metrics,
)
from algorithms.advantage_fn.grpo_advantage import group_rewards, set_outcome_advantage
from rftstream.experience import Experience, group_by

_STD_LEVELS = ("group", "batch", "none")


def last_step(run_exps: list[Experience]) -> Experience:
    """The experience with the largest ``eid.step``; of equal steps, the latest in the list.

    Trinity-RFT takes the run's last experience in arrival order; this is the
    same whenever the steps arrive in order (or all carry the same step).
    """
    best = run_exps[0]
    for exp in run_exps[1:]:
        if exp.eid.step >= best.eid.step:
            best = exp
    return best


@ADVANTAGE_FN.register_module("step_wise_grpo")
class StepWiseGRPOAdvantageFn(AdvantageFn):
    """GRPO over the rollouts' final rewards, broadcast to all steps of each rollout.

    For each task (``eid.tid``): group its experiences by rollout
    (``eid.rid``), take each rollout's final reward (:func:`last_step`) and
    score ``(r - mean) / (std + epsilon)`` with the group's mean and unbiased
    std; every experience of the rollout gets ``score * action_mask`` (divided
    by the rollout's experience count with ``enable_step_norm``).

    Args:
        epsilon: added to the std.
        enable_step_norm: divide each rollout's advantages by its number of steps.
        std_cal_level: ``"group"`` (std per task), ``"batch"`` (std of all final
            rewards passed in; in the experience pipeline a call sees one task's
            group, so this equals ``"group"`` there unless groups are batched) or
            ``"none"`` (no division). The mean is always per task.
        std_threshold: if set, a task whose final-reward std is ``<=`` it, or
            which has one rollout, is dropped from the output (counted in
            ``filtered_count``).

    A task with a single rollout uses ``mean = 0``, ``std = 1``, as in
    Trinity-RFT (score ``r / (1 + epsilon)``). Output order: task, then rollout
    (first seen), then input order. Metrics: ``reward_mean``, ``reward_std``
    (averaged over tasks, skipped ones included), ``experience_count`` (kept
    experiences), ``filtered_count`` (dropped experiences),
    ``skipped_group_ratio`` and ``group_count``.
    """

    def __init__(
        self,
        epsilon: float = 1e-6,
        enable_step_norm: bool = False,
        std_cal_level: str = "group",
        std_threshold: float | None = None,
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        if std_cal_level not in _STD_LEVELS:
            raise ValueError(
                f"step_wise_grpo: std_cal_level must be one of {_STD_LEVELS}, got {std_cal_level!r}"
            )
        self.epsilon = float(epsilon)
        self.enable_step_norm = bool(enable_step_norm)
        self.std_cal_level = std_cal_level
        self.std_threshold = None if std_threshold is None else float(std_threshold)

    def __call__(self, exps: list[Experience], **kwargs: Any) -> tuple[list[Experience], dict]:
        return self.process(exps)

    def process(self, exps: list[Experience]) -> tuple[list[Experience], dict]:
        """Compute the advantages of ``exps`` (any number of tasks); see the class docstring."""
        if not exps:
            return [], {}
        tasks = {tid: group_by(task_exps, "run") for tid, task_exps in group_by(exps).items()}
        finals = {tid: [last_step(r) for r in runs.values()] for tid, runs in tasks.items()}
        batch_std: torch.Tensor | None = None
        if self.std_cal_level == "batch":
            all_final = [e for task_finals in finals.values() for e in task_finals]
            batch_std = group_rewards(all_final).std() if len(all_final) > 1 else torch.tensor(1.0)

        out: list[Experience] = []
        metric_list: list[dict] = []
        filtered = 0
        skipped_groups = 0
        with torch.no_grad():
            for tid, runs in tasks.items():
                rewards = group_rewards(finals[tid])
                if len(rewards) == 1:
                    mean, std = torch.tensor(0.0), torch.tensor(1.0)
                else:
                    mean, std = rewards.mean(), rewards.std()
                metric_list.append({"reward_mean": float(mean), "reward_std": float(std)})
                if self.std_threshold is not None and (
                    len(rewards) == 1 or float(std) <= self.std_threshold
                ):
                    filtered += sum(len(r) for r in runs.values())
                    skipped_groups += 1
                    continue
                if self.std_cal_level == "none":
                    scores = rewards - mean
                else:
                    denom = batch_std if batch_std is not None else std
                    scores = (rewards - mean) / (denom + self.epsilon)
                for run_exps, score in zip(runs.values(), scores, strict=True):
                    if self.enable_step_norm:
                        score = score / len(run_exps)
                    for exp in run_exps:
                        set_outcome_advantage(exp, score)
                    out.extend(run_exps)
        metrics = _aggregate_group_metrics(metric_list)
        metrics["experience_count"] = float(len(out))
        metrics["filtered_count"] = float(filtered)
        metrics["skipped_group_ratio"] = skipped_groups / len(tasks)
        metrics["group_count"] = float(len(tasks))
        return out, metrics

    @classmethod
    def default_args(cls) -> dict:
        return {
            "epsilon": 1e-6,
            "enable_step_norm": False,
            "std_cal_level": "group",
            "std_threshold": None,
        }

    @classmethod
    def compute_in_trainer(cls) -> bool:
        return False
