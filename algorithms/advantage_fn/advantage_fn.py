"""Advantage functions: the ``AdvantageFn`` interface and the ``GroupAdvantage`` helper.

As in Trinity-RFT (``trinity.algorithm.advantage_fn``): an advantage function
takes the experiences of one step and returns them with ``advantages`` and
``returns`` set, plus a metrics dict. Group-based functions (GRPO, OPMD, RLOO,
...) run in the experience pipeline (an operator host) because one NATS message
already carries one task's group; functions that need trainer state (PPO's GAE
needs critic values) say so with ``compute_in_trainer() -> True``.

``advantages`` and ``returns`` are float32 tensors of response length
(``len(tokens) - prompt_length``), zero where ``action_mask`` is False.
CPU-bound, no I/O; an operator host runs them off its event loop.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from rftstream.experience import Experience, group_by
from rftstream.plugins.registries import ADVANTAGE_FN


class AdvantageFn(ABC):
    """Computes ``advantages`` and ``returns`` for a list of experiences.

    Class attributes a trainer-side function may set:

    * ``trainer_inputs``: names from :data:`TRAINER_ADVANTAGE_INPUTS` the trainer
      must compute (one no-grad forward pass over the batch, only when non-empty)
      and pass as keyword arguments;
    * ``rewrites_action_mask``: the function narrows ``exp.action_mask`` (never
      widens it) and the trainer trains on the narrowed mask.
    """

    trainer_inputs: frozenset[str] = frozenset()
    rewrites_action_mask: bool = False

    def __init__(self, **kwargs: Any) -> None:
        if kwargs:
            raise TypeError(f"{type(self).__name__}: unexpected argument(s) {sorted(kwargs)}")

    @abstractmethod
    def __call__(self, exps: list[Experience], **kwargs: Any) -> tuple[list[Experience], dict]:
        """Calculate advantages from experiences.

        Args:
            exps: the experiences of one step (or one message's group).
            kwargs: step-level inputs some functions need (e.g. critic values).

        Returns:
            The experiences with ``advantages``/``returns`` set (a function may
            drop some) and a metrics dict for logging.
        """

    @classmethod
    def default_args(cls) -> dict:
        """Default constructor arguments, used where the config gives none."""
        return {}

    @classmethod
    def compute_in_trainer(cls) -> bool:
        """Whether the trainer computes this advantage (True) or the experience pipeline does (False)."""
        return True


def _aggregate_group_metrics(metric_list: list[dict]) -> dict[str, float]:
    """Combine per-group metrics: keys ending in ``_count`` are summed, others averaged.

    A key is averaged over the groups that report it.
    """
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for metrics in metric_list:
        for key, value in metrics.items():
            sums[key] = sums.get(key, 0.0) + float(value)
            counts[key] = counts.get(key, 0) + 1
    return {
        key: (total if key.endswith("_count") else total / counts[key])
        for key, total in sums.items()
    }


class GroupAdvantage(AdvantageFn):
    """Base for group-based advantages: group the experiences, then compute per group.

    Subclasses implement :meth:`calculate_group_advantage` (and may override
    :meth:`group_experiences`, which groups by task). ``__call__`` (and its alias
    :meth:`process`, so an instance also works as an experience operator)
    returns the experiences of every group, in group order, and metrics: each
    group metric averaged over groups (``*_count`` metrics summed) plus
    ``group_count``.
    """

    def group_experiences(self, exps: list[Experience]) -> dict[str, list[Experience]]:
        """Split ``exps`` into groups keyed by a group id; by default the task (``eid.tid``).

        Override for other groupings (e.g. per rollout step in multi-turn workflows).
        """
        return group_by(exps, id_type="task")

    @abstractmethod
    def calculate_group_advantage(
        self, group_id: str, exps: list[Experience]
    ) -> tuple[list[Experience], dict]:
        """Set ``advantages``/``returns`` on the experiences of one group; return them and metrics."""

    def __call__(self, exps: list[Experience], **kwargs: Any) -> tuple[list[Experience], dict]:
        return self.process(exps)

    def process(self, exps: list[Experience]) -> tuple[list[Experience], dict]:
        """Compute advantages group by group; see the class docstring for the metrics."""
        if len(exps) == 0:
            return [], {}
        groups = self.group_experiences(exps)
        out: list[Experience] = []
        metric_list: list[dict] = []
        for group_id, group_exps in groups.items():
            group_exps, group_metrics = self.calculate_group_advantage(group_id, group_exps)
            out.extend(group_exps)
            metric_list.append(group_metrics)
        metrics = _aggregate_group_metrics(metric_list)
        metrics["group_count"] = float(len(groups))
        return out, metrics

    @classmethod
    def compute_in_trainer(cls) -> bool:
        return False


@ADVANTAGE_FN.register_module("none")
class NoAdvantageFn(AdvantageFn):
    """Identity: leaves experiences untouched (SFT and other algorithms without advantages)."""

    def __call__(self, exps: list[Experience], **kwargs: Any) -> tuple[list[Experience], dict]:
        return exps, {}

    def process(self, exps: list[Experience]) -> tuple[list[Experience], dict]:
        return exps, {}

    @classmethod
    def compute_in_trainer(cls) -> bool:
        return False
