"""Built-in single-turn workflows: ``simple_workflow`` and ``math_workflow``.

Both send one chat (optional ``format.system_prompt``, the question from
``raw_task[format.prompt_key]`` or a message list from
``raw_task[format.messages_key]``, optional ``format.reply_prefix`` to continue)
and ask for ``repeat_times`` completions in ONE model call, so the engine
batches the whole group. Each experience gets ``reward`` = the sum of the
reward function's scores and the scores as ``metrics``. ``simple_workflow``
scores by exact match (``accuracy_reward``), ``math_workflow`` by numeric
comparison of the final answer (``math_reward``); ``task.reward_fn``
(``default_reward_fn_type``) overrides either.

``run()`` blocks (worker thread); ``run_async()`` awaits the model directly,
so the explorer can run many tasks concurrently without threads. Both are
resettable (one instance serves many tasks) and repeatable.
"""

from __future__ import annotations

from typing import Any

import anyio
import anyio.to_thread

from rftstream.errors import WorkflowError
from rftstream.experience import Experience
from workflows.workflow import WORKFLOWS, Task, Workflow, call_reward_fn, resolve_reward_fn

__all__ = ["MathWorkflow", "SimpleWorkflow"]


@WORKFLOWS.register_module("simple_workflow")
class SimpleWorkflow(Workflow):
    """One question, ``repeat_times`` answers, exact-match reward by default."""

    can_reset = True
    can_repeat = True
    default_reward_fn: str = "accuracy_reward"

    def __init__(
        self, *, task: Task, model: Any, auxiliary_models: list[Any] | None = None
    ) -> None:
        super().__init__(task=task, model=model, auxiliary_models=auxiliary_models)
        self.reset(task)

    def reset(self, task: Task) -> None:
        """Take the next task (no model or reward-fn rebuild unless the reward fn changes)."""
        self.task = task
        self.is_eval = task.is_eval
        self.repeat_times = task.repeat_times
        self.run_id_base = 0
        self.raw_task = task.raw_task
        self.format_args = fa = task.format_args
        self.rollout_args = task.rollout_args
        self.workflow_args = dict(task.workflow_args)
        self.system_prompt = fa.system_prompt
        self.reply_prefix = fa.reply_prefix
        self.chat_template = fa.chat_template
        self.task_messages = None
        if fa.messages_key and fa.messages_key in self.raw_task:
            self.task_messages = list(self.raw_task[fa.messages_key])
        self.task_desc = self.raw_task.get(fa.prompt_key)
        if self.task_desc is None and self.task_messages is None:
            raise WorkflowError(
                f"task {task.task_id}: raw task has no key {fa.prompt_key!r} "
                f"(buffer.explorer_input.taskset.format.prompt_key); keys: {sorted(self.raw_task)}"
            )
        self.truth = self.raw_task.get(fa.response_key)
        spec = task.reward_fn or self.default_reward_fn
        key = (
            spec,
            tuple(sorted(task.reward_fn_args.items()))
            if _hashable(task.reward_fn_args)
            else id(task),
        )
        if getattr(self, "_reward_key", None) != key:
            self.reward_fn = resolve_reward_fn(spec, task.reward_fn_args)
            self._reward_key = key

    def format_messages(self) -> list[dict[str, Any]]:
        """The chat sent to the model."""
        messages: list[dict[str, Any]] = []
        if self.system_prompt:
            messages.append({"role": "system", "content": self.system_prompt})
        if self.task_messages is not None:
            messages.extend(dict(m) for m in self.task_messages)
        else:
            messages.append({"role": "user", "content": str(self.task_desc)})
        if self.reply_prefix:
            messages.append({"role": "assistant", "content": self.reply_prefix})
        return messages

    def sampling_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of the model call (``n`` = ``repeat_times``)."""
        ra = self.rollout_args
        kwargs: dict[str, Any] = {
            "n": self.repeat_times,
            "temperature": ra.temperature,
            "top_p": ra.top_p,
            "top_k": ra.top_k,
            "max_tokens": ra.max_tokens,
        }
        if self.chat_template:
            kwargs["chat_template"] = self.chat_template
        return kwargs

    def run(self) -> list[Experience]:
        """Blocking form (worker thread): chat, then score."""
        responses = self.model.chat(self.format_messages(), **self.sampling_kwargs())
        return self.score(responses)

    async def run_async(self) -> list[Experience]:
        """Async form: awaits the engine; slow (non-``fast``) reward fns run in a worker thread."""
        responses = await self.model.chat_async(self.format_messages(), **self.sampling_kwargs())
        if getattr(self.reward_fn, "fast", False):
            return self.score(responses)
        return await anyio.to_thread.run_sync(self.score, responses, abandon_on_cancel=True)

    def score(self, responses: list[Experience]) -> list[Experience]:
        """Set ``reward`` (sum of the scores) and ``metrics`` (the scores) on each response."""
        for exp in responses:
            scores = call_reward_fn(
                self.reward_fn,
                response=exp.response_text or "",
                truth=self.truth,
                prompt=self.task_desc,
            )
            exp.reward = float(sum(scores.values()))
            exp.metrics.update(scores)
        return responses


@WORKFLOWS.register_module("math_workflow")
class MathWorkflow(SimpleWorkflow):
    """Like ``simple_workflow``, scored by ``math_reward`` (numeric final-answer match)."""

    default_reward_fn = "math_reward"


def _hashable(args: dict[str, Any]) -> bool:
    try:
        hash(tuple(sorted(args.items())))
    except TypeError:
        return False
    return True
