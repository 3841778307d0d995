"""Workflows: ``Task``, the ``Workflow`` base, built-in workflows and reward functions.

``from workflows import Workflow, Task, WORKFLOWS`` is all a workflow author
needs (plus ``ModelWrapper`` and ``Experience``, re-exported here). Depends on
the rftstream kernel and engines only, never on NATS or the actors.
"""

from rftstream.engines.model_wrapper import ModelWrapper
from rftstream.experience import Experience
from workflows.math_workflow import MathWorkflow, SimpleWorkflow
from workflows.rewards import REWARD_FUNCTIONS, AccuracyReward, MathReward, RewardFn
from workflows.runner import TaskResult, WorkflowRunner
from workflows.tasksets import builtin_arithmetic_tasks, load_taskset
from workflows.workflow import WORKFLOWS, Task, Workflow, make_task

__all__ = [
    "REWARD_FUNCTIONS",
    "WORKFLOWS",
    "AccuracyReward",
    "Experience",
    "MathReward",
    "MathWorkflow",
    "ModelWrapper",
    "RewardFn",
    "SimpleWorkflow",
    "Task",
    "TaskResult",
    "Workflow",
    "WorkflowRunner",
    "builtin_arithmetic_tasks",
    "load_taskset",
    "make_task",
]
