"""``python_tool_workflow``: function calling through the OpenAI API, with a sandboxed Python tool.

Each of the ``repeat_times`` rollouts is a conversation with the rollout
model through its OpenAI-compatible API (``model.get_openai_async_client()``,
``await client.chat.completions.create(model=..., messages=..., tools=[python])``).
Whenever the reply carries ``message.tool_calls``, each call of the ``python``
tool runs its ``code`` argument in :func:`workflows.sandbox.run_python_async`
(a subprocess under time and memory limits, in a worker thread) and the
result (stdout, stderr, exit status, truncated) goes back as a ``tool``
message; the conversation ends with a reply without tool calls, or after
``max_turns`` model calls. That final reply is scored by the reward fn
(``math_reward`` unless ``default_reward_fn_type`` says otherwise) against
``raw_task[format.response_key]``.

Concurrency: the rollouts of a task run concurrently on the event loop
(an anyio task group; the engine batches their requests), each through its
own ``model.clone(enable_history=True)`` (its own API session and history),
so their recorded calls never mix. The clones are kept for the next task of
a reused instance; ``run_async`` first drops whatever their histories still
hold. A model without ``clone`` is shared: its rollouts then run one after
the other.

Experiences: every completion the server produced for a rollout is recorded
in its clone's history; they are merged into one Experience per rollout when
the calls chain (``extract_experience_from_history(merge_turns=True)``:
``action_mask`` 1 exactly on the model's tokens, 0 on the tool results and
templates), else returned one per call (``eid.step`` = the call's index).
All of a rollout's experiences get its reward and ``eid.run`` =
``run_id_base`` + the rollout's index; ``info["tool_calls"]`` counts the
tool calls.

``workflow_args``: ``max_turns`` (default 4), ``tool_timeout`` (seconds,
default 5), ``tool_memory_limit_mb`` (default 512), ``max_tool_output_chars``
(default 1000), ``model_name`` (default: the API's model). ``run_async()``
never blocks the event loop; ``run()`` is its blocking form.
"""

from __future__ import annotations

import json
from typing import Any

import anyio
import anyio.to_thread

from rftstream.errors import WorkflowError
from rftstream.experience import Experience
from rftstream.workflow import WORKFLOWS, Task, Workflow, call_reward_fn, scores_inline
from workflows.math_workflow import SimpleWorkflow
from workflows.sandbox import run_python_async

__all__ = ["PYTHON_TOOL", "PythonToolWorkflow", "format_tool_result"]

PYTHON_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "python",
        "description": "Run a Python program and return what it prints (stdout and stderr).",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "The Python source."}},
            "required": ["code"],
        },
    },
}


def format_tool_result(
    stdout: str, stderr: str, exit_code: int | None, timed_out: bool, limit: int
) -> str:
    """The ``tool`` message content for one sandbox run, at most ``limit`` characters."""
    parts = []
    if stdout:
        parts.append(stdout.rstrip())
    if stderr:
        parts.append("stderr:\n" + stderr.rstrip())
    if timed_out:
        parts.append("[timed out]")
    elif exit_code not in (0, None):
        parts.append(f"[exit code {exit_code}]")
    text = "\n".join(parts) or "[no output]"
    if len(text) > limit:
        text = text[: max(0, limit - 12)] + "\n[truncated]"
    return text


def _field(obj: Any, name: str, default: Any = None) -> Any:
    """Attribute or key access (openai objects and plain dicts alike)."""
    if isinstance(obj, dict):
        return obj.get(name, default)
    return getattr(obj, name, default)


@WORKFLOWS.register_module("python_tool_workflow")
class PythonToolWorkflow(SimpleWorkflow):
    """Multi-turn function calling with a sandboxed ``python`` tool; see the module docstring."""

    default_reward_fn = "math_reward"
    run = Workflow.run  # the blocking form of run_async (not SimpleWorkflow's single chat)

    def __init__(
        self, *, task: Task, model: Any, auxiliary_models: list[Any] | None = None
    ) -> None:
        self._api_models: list[Any] = []
        self._model_name: str | None = None
        super().__init__(task=task, model=model, auxiliary_models=auxiliary_models)

    def reset(self, task: Task) -> None:
        super().reset(task)
        wa = self.workflow_args
        self.max_turns = max(1, int(wa.get("max_turns", 4)))
        self.tool_timeout = float(wa.get("tool_timeout", 5.0))
        self.tool_memory_limit_mb = wa.get("tool_memory_limit_mb", 512)
        self.max_tool_output_chars = int(wa.get("max_tool_output_chars", 1000))
        if wa.get("model_name"):
            self._model_name = str(wa["model_name"])

    # ------------------------------------------------------------ API plumbing
    def api_model(self, rollout: int = 0) -> Any:
        """The model view whose API calls rollout ``rollout`` records (a history-enabled clone)."""
        clone = getattr(self.model, "clone", None)
        if not callable(clone):
            return self.model
        while len(self._api_models) <= rollout:
            self._api_models.append(clone(enable_history=True))
        return self._api_models[rollout]

    async def model_name(self, client: Any) -> str:
        if self._model_name is None:
            name = getattr(client, "model_path", None)
            if not name:
                name = (await client.models.list()).data[0].id
            self._model_name = str(name)
        return self._model_name

    def request_kwargs(self) -> dict[str, Any]:
        ra = self.rollout_args
        kwargs: dict[str, Any] = {"temperature": ra.temperature, "top_p": ra.top_p}
        if ra.max_tokens is not None:
            kwargs["max_tokens"] = ra.max_tokens
        extra: dict[str, Any] = {}
        if ra.top_k is not None and ra.top_k > 0:
            extra["top_k"] = ra.top_k
        if self.chat_template:
            extra["chat_template"] = self.chat_template
        if extra:
            kwargs["extra_body"] = extra
        return kwargs

    @staticmethod
    def tool_code(call: Any) -> tuple[str | None, str]:
        """``(code, "")`` of a ``python`` tool call, or ``(None, the tool message)`` when it is not one."""
        fn = _field(call, "function")
        name = _field(fn, "name")
        if name != "python":
            return None, f"[unknown tool {name!r}; the only tool is `python`]"
        raw = _field(fn, "arguments") or "{}"
        try:
            args = json.loads(raw) if isinstance(raw, str) else dict(raw)
        except (json.JSONDecodeError, TypeError, ValueError):
            return None, "[the arguments are not a JSON object]"
        code = args.get("code") if isinstance(args, dict) else None
        if not isinstance(code, str):
            return None, "[missing string argument `code`]"
        return code, ""

    async def call_tool_async(self, call: Any) -> str:
        """Run one tool call; returns the ``tool`` message content. The sandbox runs in a
        worker thread, so the event loop never blocks."""
        code, message = self.tool_code(call)
        if code is None:
            return message
        res = await run_python_async(
            code, timeout=self.tool_timeout, memory_limit_mb=self.tool_memory_limit_mb
        )
        return format_tool_result(
            res.stdout, res.stderr, res.exit_code, res.timed_out, self.max_tool_output_chars
        )

    # ------------------------------------------------------------ running
    async def rollout(self, api: Any) -> tuple[list[dict[str, Any]], str, int]:
        """One conversation through ``api``'s async client: (messages, final reply, tool calls)."""
        client = api.get_openai_async_client()
        model = await self.model_name(client)
        messages = self.format_messages()
        final, n_calls = "", 0
        for _ in range(self.max_turns):
            completion = await client.chat.completions.create(
                model=model, messages=messages, tools=[PYTHON_TOOL], **self.request_kwargs()
            )
            message = completion.choices[0].message
            content = _field(message, "content") or ""
            calls = list(_field(message, "tool_calls") or [])
            turn: dict[str, Any] = {"role": "assistant", "content": content}
            if calls:
                turn["tool_calls"] = [
                    {
                        "id": _field(c, "id"),
                        "type": "function",
                        "function": {
                            "name": _field(_field(c, "function"), "name"),
                            "arguments": _field(_field(c, "function"), "arguments"),
                        },
                    }
                    for c in calls
                ]
            messages.append(turn)
            final = content
            if not calls:
                break
            for c in calls:
                n_calls += 1
                messages.append(
                    {
                        "role": "tool",
                        "tool_call_id": _field(c, "id"),
                        "content": await self.call_tool_async(c),
                    }
                )
        return messages, final, n_calls

    @staticmethod
    def collect(api: Any) -> list[Experience]:
        """The experiences ``api`` recorded since the last call (merged per conversation)."""
        try:
            return api.extract_experience_from_history(merge_turns=True)
        except TypeError:  # a wrapper without merge_turns
            return api.extract_experience_from_history()

    async def run_rollout(self, index: int, api: Any) -> list[Experience]:
        """Rollout ``index``: the conversation, then its recorded experiences, scored."""
        messages, final, n_calls = await self.rollout(api)
        exps = self.collect(api)

        def score() -> dict[str, float]:
            return call_reward_fn(
                self.reward_fn, response=final, truth=self.truth, **self.reward_kwargs()
            )

        if scores_inline(self.reward_fn, [final], self.truth):
            scores = score()
        else:
            scores = await anyio.to_thread.run_sync(score, abandon_on_cancel=True)
        reward = float(sum(scores.values()))
        for step, exp in enumerate(exps):
            exp.reward = reward
            exp.metrics.update(scores)
            exp.metrics["tool_calls"] = float(n_calls)
            exp.info.update({"tool_calls": n_calls, "rollout": index, "final_response": final})
            exp.eid.run = self.run_id_base + index
            exp.eid.step = step
            if exp.messages is None or len(exps) == 1:
                exp.messages = messages
        return exps

    async def run_async(self) -> list[Experience]:
        """``repeat_times`` rollouts, concurrently when each has its own clone."""
        apis = [self.api_model(r) for r in range(self.repeat_times)]
        if not all(getattr(api, "enable_history", False) for api in apis):
            raise WorkflowError(
                "python_tool_workflow needs a model with history (ModelWrapper.clone); "
                "set explorer.rollout_model.enable_history: true"
            )
        for api in {id(a): a for a in apis}.values():
            api.extract_experience_from_history()  # drop what an earlier run left behind
        shared = len({id(a) for a in apis}) < len(apis)
        limiter = anyio.CapacityLimiter(1 if shared else max(1, len(apis)))
        results: list[list[Experience]] = [[] for _ in apis]

        async def one(index: int) -> None:
            async with limiter:
                results[index] = await self.run_rollout(index, apis[index])

        async with anyio.create_task_group() as tg:
            for index in range(len(apis)):
                tg.start_soon(one, index)
        return [exp for exps in results for exp in exps]
