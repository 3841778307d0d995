"""Workflows: ``Task``, the ``Workflow`` base, built-in workflows and reward functions.

``from workflows import Workflow, Task, WORKFLOWS`` is all a workflow author
needs (plus ``ModelWrapper`` and ``Experience``, re-exported here). The interface
(``Task``, ``Workflow``, ``WORKFLOWS``), the runner and the taskset readers are the
explorer's, in :mod:`rftstream.workflow`, :mod:`rftstream.workflow_runner` and
:mod:`rftstream.tasksets`, re-exported here; this package holds the built-ins, which
register themselves (the core imports it by name on a registry's first lookup).
Depends on the rftstream kernel and engines only, never on NATS or the actors.
"""

from rftstream.engines.model_wrapper import ModelWrapper
from rftstream.experience import Experience
from rftstream.tasksets import builtin_arithmetic_tasks, load_taskset
from rftstream.workflow import WORKFLOWS, Task, Workflow, make_task
from rftstream.workflow_runner import TaskResult, WorkflowRunner
from workflows.code_workflow import CodeReward, CodeWorkflow
from workflows.countdown import CountdownWorkflow
from workflows.distill_workflow import OnPolicyDistillMathWorkflow, OnPolicyDistillWorkflow
from workflows.env_workflow import EnvWorkflow
from workflows.envs import ENVS, TextEnv
from workflows.math_workflow import MathBoxedWorkflow, MathWorkflow, SimpleWorkflow
from workflows.rewards import (
    REWARD_FUNCTIONS,
    AccuracyReward,
    CountdownReward,
    FormatReward,
    MathBoxedReward,
    MathReward,
    RewardFn,
)
from workflows.sandbox import SandboxResult, run_python, run_python_async
from workflows.tool_workflow import PythonToolWorkflow

__all__ = [
    "ENVS",
    "REWARD_FUNCTIONS",
    "WORKFLOWS",
    "AccuracyReward",
    "CodeReward",
    "CodeWorkflow",
    "CountdownReward",
    "CountdownWorkflow",
    "EnvWorkflow",
    "Experience",
    "FormatReward",
    "MathBoxedReward",
    "MathBoxedWorkflow",
    "MathReward",
    "MathWorkflow",
    "ModelWrapper",
    "OnPolicyDistillMathWorkflow",
    "OnPolicyDistillWorkflow",
    "PythonToolWorkflow",
    "RewardFn",
    "SandboxResult",
    "SimpleWorkflow",
    "Task",
    "TaskResult",
    "Workflow",
    "WorkflowRunner",
    "builtin_arithmetic_tasks",
    "load_taskset",
    "make_task",
    "run_python",
    "run_python_async",
    "TextEnv",
]
