"""Built-in single-turn workflows: ``simple_workflow``, ``math_workflow``, ``math_boxed_workflow``.

Both send one chat (optional ``format.system_prompt``, the question from
``raw_task[format.prompt_key]`` or a message list from
``raw_task[format.messages_key]``, optional ``format.reply_prefix`` to continue)
and ask for ``repeat_times`` completions in ONE model call, so the engine
batches the whole group. Each experience gets ``reward`` = the sum of the
reward function's scores and the scores as ``metrics``. ``simple_workflow``
scores by exact match (``accuracy_reward``), ``math_workflow`` by numeric
comparison of the final answer (``math_reward``); ``task.reward_fn``
(``default_reward_fn_type``) overrides either. ``math_boxed_workflow`` asks
for a ``\\boxed{}`` answer and scores it with ``math_boxed_reward`` (see
:class:`MathBoxedWorkflow` for its ``workflow_args``). Subclasses adapt the
prompt and truth through :meth:`SimpleWorkflow.get_task_desc`,
:meth:`~SimpleWorkflow.get_truth` and :meth:`~SimpleWorkflow.reward_kwargs`.

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
from rftstream.workflow import (
    WORKFLOWS,
    Task,
    Workflow,
    call_reward_fn,
    resolve_reward_fn,
    scores_inline,
)

__all__ = ["MathBoxedWorkflow", "MathWorkflow", "SimpleWorkflow"]


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
        self.task_desc = self.get_task_desc(task)
        if self.task_desc is None and self.task_messages is None:
            raise WorkflowError(
                f"task {task.task_id}: raw task has no key {fa.prompt_key!r} "
                f"(buffer.explorer_input.taskset.format.prompt_key); keys: {sorted(self.raw_task)}"
            )
        self.truth = self.get_truth(task)
        key = self._reward_key_for(task)
        if getattr(self, "_reward_key", None) != key:
            self.reward_fn = resolve_reward_fn(key[0], task.reward_fn_args)
            self._reward_key = key

    def _reward_key_for(self, task: Task) -> tuple[Any, Any]:
        """(reward fn spec, its args): :meth:`reset` builds a new reward fn when it changes
        (args that cannot be hashed: a new one for every task)."""
        args = task.reward_fn_args
        return (
            task.reward_fn or self.default_reward_fn,
            tuple(sorted(args.items())) if _hashable(args) else id(task),
        )

    def reset_is_cheap(self, task: Task) -> bool:
        """True for this class's own :meth:`reset` when it keeps the reward fn (a new one
        is constructed, which may be any code): attribute copies and dict lookups. A
        subclass that overrides ``reset`` is not covered (it says so itself)."""
        if type(self).reset is not SimpleWorkflow.reset:
            return False
        return getattr(self, "_reward_key", None) == self._reward_key_for(task)

    def get_task_desc(self, task: Task) -> Any:
        """The question (``raw_task[format.prompt_key]``); subclasses may build it from the row."""
        return task.raw_task.get(task.format_args.prompt_key)

    def get_truth(self, task: Task) -> Any:
        """The reference answer (``raw_task[format.response_key]``)."""
        return task.raw_task.get(task.format_args.response_key)

    def reward_kwargs(self) -> dict[str, Any]:
        """Extra keyword arguments for the reward fn (passed only where it accepts them)."""
        return {"prompt": self.task_desc}

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
        if ra.min_tokens:
            kwargs["min_tokens"] = ra.min_tokens
        if self.chat_template:
            kwargs["chat_template"] = self.chat_template
        return kwargs

    def run(self) -> list[Experience]:
        """Blocking form (worker thread): chat, then score."""
        return self.score(self.generate())

    def generate(self) -> list[Experience]:
        """Blocking :meth:`generate_async`."""
        return self.model.chat(self.format_messages(), **self.sampling_kwargs())

    async def generate_async(self) -> list[Experience]:
        """The ``repeat_times`` responses (one batched model call)."""
        return await self.model.chat_async(self.format_messages(), **self.sampling_kwargs())

    async def run_async(self) -> list[Experience]:
        """Async form: awaits the engine; the reward fn runs in a worker thread unless it is
        cheap for these responses (:func:`~rftstream.workflow.scores_inline`)."""
        responses = await self.generate_async()
        if scores_inline(self.reward_fn, (e.response_text or "" for e in responses), self.truth):
            return self.score(responses)
        return await anyio.to_thread.run_sync(self.score, responses, abandon_on_cancel=True)

    def score(self, responses: list[Experience]) -> list[Experience]:
        """Set ``eid.run`` (``run_id_base`` + its index) on each response, then
        :meth:`score_one` it."""
        for i, exp in enumerate(responses):
            exp.eid.run = self.run_id_base + i
            self.score_one(exp)
        return responses

    def score_one(self, exp: Experience) -> None:
        """Set ``reward`` (sum of the scores) and ``metrics`` (the scores) on one response.
        Blocks for as long as the reward fn does."""
        scores = call_reward_fn(
            self.reward_fn,
            response=exp.response_text or "",
            truth=self.truth,
            response_token=exp.response_tokens,
            **self.reward_kwargs(),
        )
        exp.reward = float(sum(scores.values()))
        exp.metrics.update(scores)


@WORKFLOWS.register_module("math_workflow")
class MathWorkflow(SimpleWorkflow):
    """Like ``simple_workflow``, scored by ``math_reward`` (numeric final-answer match)."""

    default_reward_fn = "math_reward"


BOXED_PROMPT = "Please reason step by step, and put your final answer within \\boxed{}."
BOXED_THINK_PROMPT = (
    "You are a helpful assistant that solves math problems. Think about the reasoning "
    "process first and write it inside <think> </think> tags, then give the final answer "
    "as a closed-form result inside \\boxed{}."
)


@WORKFLOWS.register_module("math_boxed_workflow")
class MathBoxedWorkflow(MathWorkflow):
    """Math with ``\\boxed{}`` answers, scored by ``math_boxed_reward``.

    ``workflow_args`` (Trinity-RFT's names): ``with_think`` (default false:
    ask for and require a ``<think>...</think>`` block, whose absence costs
    ``format_score_coef``, default 0.1), ``use_base`` (default false: prompt a
    base model with plain ``System:/User:/Assistant:`` text through
    ``model.generate`` instead of the chat template). Without
    ``format.system_prompt`` a default one asks for the boxed answer (and
    the think block with ``with_think``); set it to ``""`` for none.
    """

    default_reward_fn = "math_boxed_reward"

    def reset(self, task: Task) -> None:
        super().reset(task)
        wa = self.workflow_args
        self.use_base = bool(wa.get("use_base", False))
        self.with_think = bool(wa.get("with_think", False))
        self.format_score_coef = float(wa.get("format_score_coef", 0.1))
        if self.system_prompt is None:
            self.system_prompt = BOXED_THINK_PROMPT if self.with_think else BOXED_PROMPT

    def reward_kwargs(self) -> dict[str, Any]:
        return {
            **super().reward_kwargs(),
            "with_think": self.with_think,
            "format_score_coef": self.format_score_coef,
        }

    def format_prompt(self) -> str:
        """The plain-text prompt of ``use_base``."""
        text = f"System:{self.system_prompt}\n" if self.system_prompt else ""
        text += f"User:\n{self.task_desc}\nAssistant:\n"
        if self.reply_prefix:
            text += self.reply_prefix
        return text

    def _base_kwargs(self) -> dict[str, Any]:
        kwargs = self.sampling_kwargs()
        kwargs.pop("chat_template", None)
        return kwargs

    def generate(self) -> list[Experience]:
        if self.use_base:
            return self.model.generate([self.format_prompt()], **self._base_kwargs())
        return super().generate()

    async def generate_async(self) -> list[Experience]:
        if self.use_base:
            return await self.model.generate_async([self.format_prompt()], **self._base_kwargs())
        return await super().generate_async()


def _hashable(args: dict[str, Any]) -> bool:
    try:
        hash(tuple(sorted(args.items())))
    except TypeError:
        return False
    return True
