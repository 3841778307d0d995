"""Helpers shared by the unit tests: a ModelWrapper on the tiny model, a model that
replies from a script, and a Task (the workflow tests); a script loaded as a module (the
benchmark tests); a trainer's feed over groups on an in-memory bus (the feed tests)."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import anyio

from rftstream.actors.common import InProgressTicker
from rftstream.actors.feed import ExperienceFeed
from rftstream.bus.client import Bus
from rftstream.config.schema import TasksetConfig
from rftstream.engines import create_engine
from rftstream.subjects import TRAIN_STAGE, RunNames
from tests.integration._util import _group
from workflows import Experience, ModelWrapper, Task, make_task


@asynccontextmanager
async def wrapper(
    path: str, max_response_tokens: int = 8, **engine_kwargs: Any
) -> AsyncIterator[ModelWrapper]:
    """A ModelWrapper on a running transformers engine of ``path``; closes both on exit."""
    engine = create_engine("transformers", path, batch_wait_ms=5, **engine_kwargs)
    async with anyio.create_task_group() as tg:
        await tg.start(engine.run)
        try:
            model = ModelWrapper(engine, model_path=path, max_response_tokens=max_response_tokens)
            try:
                yield model
            finally:
                await model.aclose()  # its clients, its clones' clients and the API server
        finally:
            await engine.aclose()
            tg.cancel_scope.cancel()


def task_for(
    row: dict[str, Any],
    workflow: Any = "math_workflow",
    repeat: int = 4,
    task_id: int = 0,
    **cfg: Any,
) -> Task:
    """Task ``task_id`` (batch 7, epoch 2) of ``row``; ``workflow`` is a registered name or a
    class, ``cfg`` more TasksetConfig fields."""
    ts = TasksetConfig(
        default_workflow_type=workflow if isinstance(workflow, str) else "math_workflow", **cfg
    )
    task = make_task(
        row, ts, repeat_times=repeat, batch_id=7, task_id=task_id, index=task_id, epoch=2
    )
    if not isinstance(workflow, str):
        task.workflow = workflow
    return task


class ScriptedModel:
    """Returns fixed replies (no engine), enough for SimpleWorkflow-based workflows.

    Reply ``i`` of a call is ``replies[i % len(replies)]``; ``sent`` holds the messages
    of every call."""

    def __init__(self, replies: list[str]) -> None:
        self.replies = replies
        self.model_version = 0
        self.sent: list[list[dict[str, Any]]] = []

    async def chat_async(
        self, messages: list[dict[str, Any]], n: int = 1, **kw: Any
    ) -> list[Experience]:
        self.sent.append(messages)
        return [
            Experience(
                tokens=[1, 2, 3], prompt_length=2, response_text=self.replies[i % len(self.replies)]
            )
            for i in range(n)
        ]


def load_script(path: Path, name: str) -> ModuleType:
    """The Python file ``path`` (a script, not in a package) executed as module ``name``,
    registered in ``sys.modules`` (dataclasses of the script need it)."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


async def trainer_feed(names: RunNames, groups: int, *, hold_trained: bool) -> ExperienceFeed:
    """The trainer's feed on a new in-memory bus whose exp.train holds ``groups`` groups of
    four (sequences 1..``groups``), never exhausted; ``feed.bus`` is the bus."""
    bus = Bus.in_memory(names)
    await bus.provision()
    for i in range(groups):
        await bus.publish_group(TRAIN_STAGE, _group(i, 1.0, 4), msg_id=f"g{i}")
    consumer = await bus.pull(names.exp_stream, names.trainer_consumer)

    async def never() -> bool:
        return False

    return ExperienceFeed(
        bus, consumer, InProgressTicker(5.0), never, group_size=4, hold_trained=hold_trained
    )
