"""Failing workflows do not stop a run (issue part 7), over a real nats-server with the tiny model.

One taskset mixes, row by row (``format.workflow_key``), a workflow that always
raises, one that hangs on the event loop, one that hangs in a blocking
``run()``, one that fails once per task and then succeeds, and the ordinary
math workflow. With ``explorer.max_timeout: 1`` and ``max_retry_times: 1``
every bad task is tried twice and then dead-lettered on ``dlq.tasks`` with the
exception text in ``Rft-Dlq-Reason`` and counted in ``rollout/failed_tasks``;
the flaky tasks are retried into success and never dead-lettered; the trainer
reaches its steps on what the good tasks produce. The same run shows the real
explorer reusing resettable workflow instances and running async workflows on
its event-loop thread.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest

from rftstream.config import config_from_dict
from rftstream.runtime import prepare_run
from rftstream.wire import (
    H_DLQ_REASON,
    H_DLQ_STAGE,
    TaskMsg,
)
from tests.integration._util import read_metrics, read_stream, run_actors_to_end, small_config
from workflows import WORKFLOWS, Experience, MathWorkflow, Task, Workflow

pytestmark = pytest.mark.integration

# Short, but with room for a real (tiny-model) rollout on a loaded 2-CPU machine while the
# trainer starts in the same process: the good tasks must never time out.
MAX_TIMEOUT = 4.0
RETRIES = 1


class _Calls:
    """Attempts per (workflow name, epoch, row index), from every thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counts: Counter[tuple[str, int, int]] = Counter()

    def hit(self, name: str, task: Task) -> int:
        with self._lock:
            key = (name, int(task.epoch), int(task.index))
            self.counts[key] += 1
            return self.counts[key]

    def of(self, name: str) -> dict[tuple[int, int], int]:
        with self._lock:
            return {(e, i): n for (w, e, i), n in self.counts.items() if w == name}


CALLS = _Calls()


class Plain(MathWorkflow):
    """The math workflow, counting constructions and recording where/when it runs."""

    inits = 0
    runs: list[tuple[int, float, float]] = []  # (thread, start, end)

    def __init__(self, *, task: Task, model: Any, auxiliary_models: Any = None) -> None:
        super().__init__(task=task, model=model, auxiliary_models=auxiliary_models)
        type(self).inits += 1

    async def run_async(self) -> list[Experience]:
        start = time.monotonic()
        await anyio.sleep(0.1)  # long enough for the tasks of one step to overlap
        exps = await super().run_async()
        type(self).runs.append((threading.get_ident(), start, time.monotonic()))
        return exps


class AlwaysRaises(Workflow):
    async def run_async(self) -> list[Experience]:
        n = CALLS.hit("raise", self.task)
        raise RuntimeError(f"always_raises gives up on row {self.task.index} (attempt {n})")


class HangsAsync(Workflow):
    async def run_async(self) -> list[Experience]:
        CALLS.hit("hang_async", self.task)
        await anyio.sleep_forever()
        return []


class HangsSync(Workflow):
    def run(self) -> list[Experience]:  # blocking: runs in a worker thread, abandoned on timeout
        CALLS.hit("hang_sync", self.task)
        time.sleep(MAX_TIMEOUT * 2.5)
        return []


class FailsOnce(MathWorkflow):
    async def run_async(self) -> list[Experience]:
        if CALLS.hit("flaky", self.task) == 1:
            raise ConnectionError(f"flaky: transient failure on row {self.task.index}")
        return await super().run_async()


ROWS = [  # per epoch two explorer steps of 4 tasks (shuffle off): the bad ones, then the rest
    {"question": "1+2=", "answer": "3", "workflow": "rb_raise"},
    {"question": "2+2=", "answer": "4", "workflow": "rb_hang_async"},
    {"question": "3+2=", "answer": "5", "workflow": "rb_hang_sync"},
    {"question": "4+2=", "answer": "6"},
    {"question": "5+2=", "answer": "7", "workflow": "rb_flaky"},
    {"question": "6+2=", "answer": "8"},
    {"question": "7+2=", "answer": "9", "workflow": "rb_flaky"},
    {"question": "8+1=", "answer": "9"},
]
BAD = {0: "rb_raise", 1: "rb_hang_async", 2: "rb_hang_sync"}
FLAKY = {4, 6}


def _register() -> None:
    for name, cls in (
        ("rb_plain", Plain),
        ("rb_raise", AlwaysRaises),
        ("rb_hang_async", HangsAsync),
        ("rb_hang_sync", HangsSync),
        ("rb_flaky", FailsOnce),
    ):
        WORKFLOWS.register_module(name, cls)


def test_failing_and_hanging_workflows_are_retried_dead_lettered_and_the_run_goes_on(
    tmp_path: Path, tiny_model_path: str, nats_url: str
) -> None:
    _register()
    CALLS.counts.clear()
    Plain.inits, Plain.runs = 0, []
    taskset = tmp_path / "mixed.jsonl"
    taskset.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    cfg = small_config(tmp_path, tiny_model_path)
    cfg["buffer"].update(batch_size=4, total_steps=2, total_epochs=3)
    cfg["buffer"]["explorer_input"]["taskset"] = {
        "path": str(taskset),
        "shuffle": False,
        "default_workflow_type": "rb_plain",
        "format": {"workflow_key": "workflow"},
        "rollout_args": {"max_tokens": 6},
    }
    cfg["explorer"] = {"runner_num": 4, "max_timeout": MAX_TIMEOUT, "max_retry_times": RETRIES}
    run = prepare_run(config_from_dict(cfg))

    steps = run_actors_to_end(run, nats_url, timeout=300)

    # the trainer reached its steps on what the good tasks produced
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["actor/pg_loss"] == r["actor/pg_loss"]  # finite
    records = [json.loads(x) for x in (run.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert sum(r["rollout/failed_tasks"] for r in records) >= len(BAD)

    # retries: every bad task was attempted 1 + max_retry_times times, no more (epoch 0 is
    # complete: the trainer's 32 experiences need groups of epoch 1; later tasks may have been
    # cut short when the run ended)
    attempts = RETRIES + 1
    assert CALLS.of("raise")[(0, 0)] == attempts
    assert CALLS.of("hang_async")[(0, 1)] == attempts
    assert CALLS.of("hang_sync")[(0, 2)] == attempts
    for name in ("raise", "hang_async", "hang_sync"):
        assert max(CALLS.of(name).values()) == attempts, name
    # the flaky tasks failed once, then succeeded on the retry
    flaky = CALLS.of("flaky")
    assert flaky[(0, 4)] == flaky[(0, 6)] == 2 and max(flaky.values()) == 2

    async def check() -> None:
        dead = await read_stream(nats_url, "rft.itest.dlq.tasks")
        by_task: dict[tuple[int, int], str] = {}
        for m in dead:
            assert m.headers[H_DLQ_STAGE] == "tasks"
            t = msgspec.json.decode(m.data, type=TaskMsg)
            by_task[(t.epoch, t.index)] = m.headers[H_DLQ_REASON]
        # exactly the bad rows were dead-lettered (each epoch the explorer reached), with their reasons
        assert {index for _, index in by_task} == set(BAD)
        assert {(0, i) for i in BAD} <= set(by_task)
        for (epoch, index), reason in by_task.items():
            assert f"{epoch}/{index}: " in reason  # "task [<taskset>/]<epoch>/<index>: ..."
            if BAD[index] == "rb_raise":
                assert "RuntimeError: always_raises gives up on row 0 (attempt 2)" in reason
            else:
                assert "TimeoutError" in reason and "explorer.max_timeout" in reason
                assert f"{MAX_TIMEOUT:g} s" in reason

        # the explorer's per-step metric counts them
        metrics = await read_metrics(nats_url, "rft.itest.metrics.explorer")
        # by step: a step's record goes out when its tasks are done, and step 2 (fetched as
        # soon as a runner was free) may finish before step 1's retried hangs do
        by_step = sorted((m for m in metrics if m.role == "explorer"), key=lambda m: m.step)
        failed = [m.values["rollout/failed_tasks"] for m in by_step]
        assert failed[:2] == [3.0, 0.0]  # step 1: rows 0, 1, 2; step 2: none
        assert sum(failed) <= len(dead)

        # the good tasks' groups are all on exp.raw; no group of a bad task
        raw = await read_stream(nats_url, "rft.itest.exp.raw")
        stored = {  # msg id raw:<taskset>:<epoch>:<index>
            tuple(int(x) for x in m.headers["Nats-Msg-Id"].split(":")[-2:]) for m in raw
        }
        assert {(0, i) for i in range(len(ROWS)) if i not in BAD} <= stored
        assert not {t for t in stored if t[1] in BAD}, stored

    anyio.run(check, backend="asyncio")

    # the explorer reused resettable instances: at most runner_num constructions of rb_plain,
    # however many tasks it served (2 at a time per step here)
    assert len(Plain.runs) >= 4
    assert 1 <= Plain.inits <= 2 < len(Plain.runs)
    # ... and ran the async workflow on its event-loop thread, concurrently
    assert {thread for thread, _, _ in Plain.runs} == {threading.main_thread().ident}
    windows = sorted((s, e) for _, s, e in Plain.runs)
    assert any(b[0] < a[1] for a, b in zip(windows, windows[1:], strict=False)), windows
