"""``group_advantage``: run a group advantage function as a pipeline operator.

Because one message carries one task's group, the operator host can compute
GRPO/OPMD/RLOO advantages before the trainer sees the experiences::

    data_processor:
      experience_pipeline:
        operators:
          - name: group_advantage
            args: {advantage_fn: grpo, epsilon: 1.0e-6}
"""

from __future__ import annotations

from typing import Any

from algorithms.advantage_fn import ADVANTAGE_FN, AdvantageFn
from rftstream.errors import RegistryError
from rftstream.experience import Experience
from rftstream.experience_pipeline import EXPERIENCE_OPERATORS, ExperienceOperator


@EXPERIENCE_OPERATORS.register_module("group_advantage")
class GroupAdvantageOperator(ExperienceOperator):
    """Wraps the advantage function registered as ``advantage_fn``.

    The remaining keyword arguments are merged over the function's
    ``default_args()`` and passed to its constructor. Raises ValueError for
    an unknown name or for a function that must run in the trainer
    (``compute_in_trainer() is True``, e.g. PPO's GAE). Metrics: the
    function's own (for GRPO ``reward_mean``, ``reward_std``,
    ``group_count``, ``skipped_count``).
    """

    def __init__(self, advantage_fn: str = "grpo", **advantage_fn_args: Any) -> None:
        try:
            cls = ADVANTAGE_FN.get(advantage_fn)
        except RegistryError as exc:
            raise ValueError(str(exc)) from exc
        if not (isinstance(cls, type) and issubclass(cls, AdvantageFn)):
            raise ValueError(f"{advantage_fn!r} is not an AdvantageFn")
        if cls.compute_in_trainer():
            raise ValueError(
                f"advantage_fn {advantage_fn!r} is computed in the trainer "
                f"(compute_in_trainer() is True); it cannot run as an operator"
            )
        args = {**(cls.default_args() or {}), **advantage_fn_args}
        self.advantage_fn_name = advantage_fn
        self.advantage_fn: AdvantageFn = cls(**args)

    def process(self, exps: list[Experience]) -> tuple[list[Experience], dict]:
        return self.advantage_fn(exps)
