"""``rftstream debug workflow``: one task through its workflow, locally, without NATS.

As ``trinity debug --module workflow`` does: take row ``--task N`` (default 0)
of the training taskset (``buffer.explorer_input.taskset``, or the one named
by ``--taskset`` when ``tasksets`` lists several), build its :class:`Task` as
the explorer does (:func:`rftstream.workflow.make_task`; ``repeat_times`` from
the taskset or ``algorithm.repeat_times``; task id = row index, epoch 0),
build the rollout engine, :class:`ModelWrapper` and auxiliary models from
``explorer.rollout_model``, ``explorer.auxiliary_models`` and ``model`` as
the explorer does (:func:`rollout_model`), run the task
with a :class:`~rftstream.workflow_runner.WorkflowRunner` under ``explorer.max_timeout``
(one attempt: a failure shows at once), and print every experience with rich:
prompt and response text, reward, token counts, action-mask and logprobs
summaries, metrics and info. ``--json`` prints one JSON document instead.

Nothing here touches NATS; the engine runs in this process. Everything a user
can get wrong (mode, taskset name, task index, the workflow raising or timing
out) raises an :class:`~rftstream.errors.RftError` whose message names the
config key or the task; the CLI prints it as one line and exits 2.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread

from rftstream.config.resolve import run_repeat_times, taskset_repeat_times
from rftstream.config.validate import training_tasksets
from rftstream.engines.rollout import rollout_model
from rftstream.errors import ConfigError, RftError, WorkflowError
from rftstream.tasksets import load_taskset
from rftstream.workflow import Task, Workflow, make_task
from rftstream.workflow_runner import TaskResult, WorkflowRunner

if TYPE_CHECKING:
    from rich.console import Console

    from rftstream.experience import Experience
    from rftstream.runtime import PreparedRun

__all__ = [
    "WorkflowDebug",
    "debug_workflow",
    "experience_summary",
    "make_debug_task",
    "render",
    "rollout_model",
    "run_debug_task",
    "to_json",
]


@dataclass
class WorkflowDebug:
    """What one debug run produced (``result.experiences`` with their eids filled in)."""

    task: Task
    taskset_key: str
    taskset_size: int
    result: TaskResult
    tokenizer: Any
    engine_s: float
    default_max_tokens: int | None = None


# ---------------------------------------------------------------- the task


def make_debug_task(
    run: PreparedRun, task_index: int = 0, taskset: str | None = None
) -> tuple[Task, str, int]:
    """The :class:`Task` of row ``task_index`` as the explorer builds it: ``(task, key, rows)``.

    Blocks (reads the taskset). Raises :class:`RftError` for ``mode: train``,
    an unknown ``taskset`` name or an index outside the taskset.
    """
    cfg = run.cfg
    if cfg.mode == "train":
        raise ConfigError(
            "mode",
            "`train` reads a dataset in the trainer; there is no workflow to debug",
            value=cfg.mode,
        )
    sets = training_tasksets(cfg.buffer.explorer_input)
    if taskset is None:
        key, ts = sets[0]
    else:
        found = [(k, t) for k, t in sets if t.name == taskset]
        if not found:
            raise RftError(
                f"--taskset {taskset!r}: no training taskset of that name; "
                f"known: {[t.name for _, t in sets]} (buffer.explorer_input.taskset(s)[i].name)"
            )
        key, ts = found[0]
    rows = load_taskset(ts, key)
    if not 0 <= task_index < len(rows):
        raise RftError(
            f"--task {task_index}: `{key}` ({ts.path or 'builtin:arithmetic'}) has "
            f"{len(rows)} rows, so the task index must be 0..{len(rows) - 1}"
        )
    mixed = len(sets) > 1
    repeat = taskset_repeat_times(ts, run_repeat_times(cfg))
    task = make_task(
        rows[task_index],
        ts,
        repeat_times=repeat,
        batch_id=0,
        task_id=f"{ts.name}:{task_index}" if mixed else task_index,
        index=task_index,
        epoch=0,
    )
    return task, key, len(rows)


# ---------------------------------------------------------------- running


async def run_debug_task(run: PreparedRun, task: Task) -> tuple[TaskResult, Any, float]:
    """Run ``task`` once as the explorer would; ``(result, tokenizer, engine load s)``.

    Blocks the calling task until the workflow finished, failed or hit
    ``explorer.max_timeout`` (one attempt, no retries); everything started is
    closed before returning.
    """

    async with rollout_model(run.cfg, run.model_path) as (model, aux, engine_s):
        runner = WorkflowRunner(
            model,
            max_timeout=run.cfg.explorer.max_timeout,
            max_retry_times=0,
            auxiliary_models=aux,
        )
        result = await runner.run_task(task)
        return result, getattr(model, "tokenizer", None), engine_s


def debug_workflow(
    run: PreparedRun,
    *,
    task_index: int = 0,
    taskset: str | None = None,
    console: Console | None = None,
    as_json: bool = False,
    max_chars: int = 2000,
) -> WorkflowDebug:
    """Run one task through its workflow and print it (rich, or JSON with ``as_json``).

    Blocks (model load, generation). Raises :class:`WorkflowError` naming the
    task and the workflow when the workflow raised, timed out or returned
    nothing; see the module docstring for the other errors.
    """
    from rich.console import Console

    console = console or Console()
    task, key, size = make_debug_task(run, task_index, taskset)
    cls = task.workflow_cls  # WorkflowError names the key when the row's workflow is unknown
    result, tokenizer, engine_s = anyio.run(run_debug_task, run, task, backend="asyncio")
    where = f"task {task_index} of `{key}`, workflow {_workflow_name(task)} ({cls.__name__})"
    if result.error:
        raise WorkflowError(f"{where}: {' '.join(result.error.split())}")
    if not result.experiences:
        raise WorkflowError(f"{where}: run() returned no experiences")
    out = WorkflowDebug(
        task=task,
        taskset_key=key,
        taskset_size=size,
        result=result,
        tokenizer=tokenizer,
        engine_s=engine_s,
        default_max_tokens=run.cfg.model.max_response_tokens,
    )
    if as_json:
        print(json.dumps(to_json(out), default=str))
    else:
        render(out, console, max_chars=max_chars)
    return out


# ---------------------------------------------------------------- output


def _workflow_name(task: Task) -> str:
    wf = task.workflow
    return wf if isinstance(wf, str) else getattr(wf, "__name__", str(wf))


def _texts(exp: Experience, tokenizer: Any) -> tuple[str, str]:
    """Prompt and response text: the experience's own, else decoded from its tokens."""
    prompt, response = exp.prompt_text, exp.response_text
    if tokenizer is not None:
        ids = exp.tokens.tolist()
        if prompt is None:
            prompt = tokenizer.decode(ids[: exp.prompt_length])
        if response is None:
            response = tokenizer.decode(ids[exp.prompt_length :], skip_special_tokens=True)
    return prompt or "", response or ""


def _mask_summary(exp: Experience) -> dict[str, Any]:
    mask = exp.action_mask
    n = int(mask.numel()) if mask is not None else 0
    ones = int(mask.sum().item()) if n else 0
    out: dict[str, Any] = {"length": n, "trained": ones}
    if n and ones != n:
        out["pattern"] = "".join("1" if bool(b) else "0" for b in mask.tolist()[:120])
    return out


def _float_summary(t: Any) -> dict[str, Any] | None:
    if t is None or int(t.numel()) == 0:
        return None
    f = t.float()
    return {
        "count": int(f.numel()),
        "mean": round(float(f.mean()), 4),
        "min": round(float(f.min()), 4),
        "max": round(float(f.max()), 4),
        "sum": round(float(f.sum()), 4),
    }


def _num(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


def experience_summary(exp: Experience, tokenizer: Any) -> dict[str, Any]:
    """A JSON-ready view of one experience (texts, counts and summaries, no token arrays)."""
    prompt, response = _texts(exp, tokenizer)
    out: dict[str, Any] = {
        "eid": str(exp.eid),
        "reward": _num(exp.reward),
        "tokens": int(exp.tokens.numel()),
        "prompt_length": exp.prompt_length,
        "response_length": exp.response_length,
        "action_mask": _mask_summary(exp),
        "logprobs": _float_summary(exp.logprobs),
        "model_version": exp.model_version,
        "prompt_text": prompt,
        "response_text": response,
        "response_ids": exp.response_tokens.tolist(),
        "metrics": {k: _num(v) for k, v in (exp.metrics or {}).items()},
        "info": exp.info or {},
    }
    for name in ("token_level_reward", "advantages", "returns"):
        s = _float_summary(getattr(exp, name))
        if s is not None:
            out[name] = s
    if exp.messages is not None:
        out["messages"] = exp.messages
    return out


def to_json(d: WorkflowDebug) -> dict[str, Any]:
    """The ``--json`` document of a debug run."""
    task = d.task
    return {
        "taskset": d.taskset_key,
        "task_index": task.index,
        "task_id": task.task_id,
        "workflow": _workflow_name(task),
        "workflow_class": task.workflow_cls.__name__,
        "repeat_times": task.repeat_times,
        "reward_fn": task.reward_fn if task.reward_fn is None else str(task.reward_fn),
        "raw_task": task.raw_task,
        "metrics": {k: _num(v) for k, v in d.result.metrics.items()},
        "experiences": [experience_summary(e, d.tokenizer) for e in d.result.experiences],
    }


def _clip(text: str, max_chars: int) -> str:
    if max_chars <= 0 or len(text) <= max_chars:
        return text
    return text[:max_chars] + f" … ({len(text) - max_chars} more characters; --max-chars)"


def _fmt_summary(s: dict[str, Any] | None) -> str:
    if s is None:
        return "none"
    return f"{s['count']} values, mean {s['mean']:.4f}, min {s['min']:.4f}, max {s['max']:.4f}"


def render(d: WorkflowDebug, console: Console, *, max_chars: int = 2000) -> None:
    """Print a debug run readably: the task, then one panel per experience, then a summary."""
    from rich.markup import escape
    from rich.panel import Panel
    from rich.pretty import Pretty
    from rich.table import Table
    from rich.text import Text

    task = d.task
    cls = task.workflow_cls
    flags = [
        "async" if getattr(cls, "run_async", None) is not _base_run_async() else "sync (thread)",
    ]
    head = Table.grid(padding=(0, 2))
    head.add_column(style="bold cyan", no_wrap=True)
    head.add_column()
    head.add_row(
        "taskset",
        Text(f"{d.taskset_key} (row {task.index} of {d.taskset_size}, task id {task.task_id})"),
    )
    head.add_row("workflow", Text(f"{_workflow_name(task)} → {cls.__module__}.{cls.__qualname__}"))
    head.add_row("runs as", Text(", ".join(flags)))
    head.add_row("repeat_times", Text(str(task.repeat_times)))
    head.add_row("reward_fn", Text(str(task.reward_fn) if task.reward_fn else "(the workflow's)"))
    ra = task.rollout_args
    head.add_row(
        "rollout_args",
        Text(
            f"n={ra.n} temperature={ra.temperature} top_p={ra.top_p} top_k={ra.top_k} "
            f"max_tokens={ra.max_tokens if ra.max_tokens is not None else d.default_max_tokens}"
            + ("" if ra.max_tokens is not None else " (model.max_response_tokens)")
        ),
    )
    if task.workflow_args:
        head.add_row("workflow_args", Pretty(task.workflow_args))
    head.add_row("raw_task", Pretty(task.raw_task, max_string=max_chars or None))
    console.print(Panel(head, title="[bold]rftstream debug workflow[/]", expand=True))

    for i, exp in enumerate(d.result.experiences):
        s = experience_summary(exp, d.tokenizer)
        grid = Table.grid(padding=(0, 2))
        grid.add_column(style="bold", no_wrap=True)
        grid.add_column()
        reward = s["reward"]
        grid.add_row(
            "reward", Text("none" if reward is None else f"{reward:g}", style="bold green")
        )
        grid.add_row(
            "tokens",
            Text(f"{s['tokens']} = prompt {s['prompt_length']} + response {s['response_length']}"),
        )
        m = s["action_mask"]
        mask_text = f"{m['trained']} of {m['length']} response tokens trained"
        if "pattern" in m:
            mask_text += f"  [{m['pattern']}]"
        grid.add_row("action_mask", Text(mask_text))
        grid.add_row("logprobs", Text(_fmt_summary(s["logprobs"])))
        for name in ("token_level_reward", "advantages", "returns"):
            if name in s:
                grid.add_row(name, Text(_fmt_summary(s[name])))
        grid.add_row("model_version", Text(str(s["model_version"])))
        if s["metrics"]:
            grid.add_row("metrics", Pretty(s["metrics"]))
        if s["info"]:
            grid.add_row("info", Pretty(s["info"], max_string=200))
        grid.add_row("prompt", Text(_clip(s["prompt_text"], max_chars), style="dim"))
        grid.add_row("response", Text(_clip(s["response_text"], max_chars), style="yellow"))
        ids = s["response_ids"]
        grid.add_row(
            "response ids",
            Text(str(ids[:64])[:-1] + (f", … {len(ids) - 64} more]" if len(ids) > 64 else "]")),
            style="dim",
        )
        if "messages" in s and not s["prompt_text"]:
            grid.add_row("messages", Pretty(s["messages"], max_string=max_chars or None))
        console.print(Panel(grid, title=f"experience {i}  [dim]{escape(s['eid'])}[/]", expand=True))

    r = d.result
    mean = r.metrics.get("reward_mean", math.nan)
    console.print(
        Text(
            f"{len(r.experiences)} experience{'s' if len(r.experiences) != 1 else ''} · reward mean "
            f"{'-' if mean != mean else format(mean, '.4f')} · workflow {r.metrics.get('run_time', 0):.2f} s"
            f" · engine load {d.engine_s:.2f} s · attempts {r.attempts}",
            style="bold",
        )
    )


def _base_run_async() -> Any:

    return Workflow.run_async
