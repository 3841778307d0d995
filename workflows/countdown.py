"""The Countdown game (TinyZero, Trinity-RFT's ``countdown`` example) as a workflow.

A row gives a target and some numbers: ``{"target": 24, "nums": [3, 5, 2, 4]}``
(``numbers`` works too). The model must write an equation using each number
exactly once that evaluates to the target, inside ``<answer>...</answer>``;
``countdown_reward`` scores it (1.0 right, 0.1 for a well-formed wrong answer,
0 without the tag: ``reward_fn_args`` ``score`` / ``format_score``).

The prompt is ``raw_task[format.prompt_key]`` when the row has it, else
``workflow_args.prompt_template`` formatted with ``{numbers}`` (``3, 5, 2,
4``) and ``{target}``. The truth is ``raw_task[format.response_key]`` when
present (Trinity-RFT's countdown rows store ``{"target", "numbers"}`` as JSON
there), else built from ``target`` / ``nums``. Registered as
``countdown_workflow`` and ``countdown``. Everything else (sampling, one
batched model call per group, reuse) is :class:`~workflows.math_workflow.SimpleWorkflow`'s.
"""

from __future__ import annotations

import json
from typing import Any

from rftstream.errors import WorkflowError
from rftstream.workflow import WORKFLOWS, Task
from workflows.math_workflow import SimpleWorkflow

__all__ = ["COUNTDOWN_PROMPT", "CountdownWorkflow"]

COUNTDOWN_PROMPT = (
    "Using the numbers {numbers}, write an equation that equals {target}. You may use "
    "+, -, * and / and must use every number exactly once. Think it through inside "
    "<think> </think> tags, then give only the equation inside <answer> </answer> tags, "
    "for example <answer>(1 + 2) / 3</answer>."
)


def _numbers(row: dict[str, Any]) -> list[Any] | None:
    nums = row.get("nums", row.get("numbers"))
    if isinstance(nums, str):
        try:
            nums = json.loads(nums)
        except json.JSONDecodeError:
            nums = [n for n in nums.replace(",", " ").split() if n]
    return list(nums) if nums is not None else None


@WORKFLOWS.register_module("countdown_workflow")
class CountdownWorkflow(SimpleWorkflow):
    """Countdown: make the target from the numbers; scored by ``countdown_reward``."""

    default_reward_fn = "countdown_reward"

    def get_task_desc(self, task: Task) -> Any:
        row = task.raw_task
        given = row.get(task.format_args.prompt_key)
        if given is not None:
            return given
        nums = _numbers(row)
        if nums is None or "target" not in row:
            return None  # SimpleWorkflow.reset reports the missing prompt
        template = task.workflow_args.get("prompt_template", COUNTDOWN_PROMPT)
        return str(template).format(numbers=", ".join(str(n) for n in nums), target=row["target"])

    def get_truth(self, task: Task) -> Any:
        row = task.raw_task
        given = row.get(task.format_args.response_key)
        if given is not None:
            return given
        nums = _numbers(row)
        if nums is None or "target" not in row:
            raise WorkflowError(
                f"task {task.task_id}: a countdown row needs `target` and `nums` (or "
                f"`numbers`), or the truth under format.response_key "
                f"{task.format_args.response_key!r}; keys: {sorted(row)}"
            )
        return {"target": row["target"], "numbers": nums}


WORKFLOWS.register_module("countdown", CountdownWorkflow)
