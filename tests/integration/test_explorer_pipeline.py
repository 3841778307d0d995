"""The explorer keeps ``runner_num`` tasks in flight across steps, over a real nats-server.

A step's tasks run in the background; the next step's tasks are fetched and
started while a slow task of an earlier step is still running (the slow
verifier of a long-tail workload no longer holds every later task back). Each
task's group still reaches ``exp.raw`` exactly once, the run ends when the
tasks run out only after the ones in flight are done, and the explorer reports
its tasks in flight and its idle share. ``KeyWrites`` (what wakes an explorer
paused by ``max_staleness``) is checked on its own.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import anyio
import pytest

from rftstream.bus.client import Bus
from rftstream.bus.state import RunState
from rftstream.config import config_from_dict
from rftstream.config.schema import NatsConfig
from rftstream.control import KeyWrites
from rftstream.experience import H_MSG_ID
from rftstream.runtime import prepare_run, run_actors
from rftstream.subjects import RunNames
from rftstream.wire import EXPLORER_STEP, TRAINER_STEP
from tests.integration._util import read_metrics, read_stream, small_config
from tests.kv_json import write_json
from workflows import WORKFLOWS, Experience, MathWorkflow

pytestmark = pytest.mark.integration

ROWS = 12
SLOW_S = 1.5


class Timed(MathWorkflow):
    """The math workflow; every 4th row takes ``SLOW_S`` longer. Records (index, start, end)."""

    lock = threading.Lock()
    spans: list[tuple[int, float, float]] = []

    async def run_async(self) -> list[Experience]:
        start = time.monotonic()
        if self.task.index % 4 == 0:
            await anyio.sleep(SLOW_S)
        exps = await super().run_async()
        with self.lock:
            type(self).spans.append((int(self.task.index), start, time.monotonic()))
        return exps


WORKFLOWS.register_module("timed_math_pipeline", Timed, force=True)


def test_steps_overlap_and_every_task_is_published_once(
    tmp_path: Path, tiny_model_path: str, nats_url: str
) -> None:
    data_file = tmp_path / "tasks.jsonl"
    data_file.write_text(
        "".join(
            json.dumps({"question": f"{i % 10}+1=", "answer": str(i % 10 + 1)}) + "\n"
            for i in range(ROWS)
        )
    )
    data = small_config(tmp_path, tiny_model_path)
    data["mode"] = "explore"
    data["buffer"].update({"batch_size": 2, "total_epochs": 1, "total_steps": None})
    data["buffer"]["explorer_input"]["taskset"].update(
        {"path": str(data_file), "default_workflow_type": "timed_math_pipeline"}
    )
    data["algorithm"]["repeat_times"] = 2
    data["explorer"]["runner_num"] = 6
    run = prepare_run(config_from_dict(data))
    Timed.spans = []

    async def main() -> None:
        with anyio.fail_after(240):
            await run_actors(run, nats_url)

    anyio.run(main, backend="asyncio")
    names = run.names
    raw = anyio.run(read_stream, nats_url, names.exp_subject("raw"), backend="asyncio")
    ids = [m.headers[H_MSG_ID] for m in raw]
    assert len(ids) == ROWS and len(set(ids)) == ROWS  # every task once
    spans = {i: (s, e) for i, s, e in Timed.spans}
    assert sorted(spans) == list(range(ROWS))
    # row 0 is slow and in step 1; rows of later steps (2+) started and finished meanwhile
    slow_start, slow_end = spans[0]
    overtaking = [i for i, (s, e) in spans.items() if i >= 2 and s < slow_end and e < slow_end]
    assert overtaking, f"no later task ran while row 0 was running: {spans}"
    metrics = anyio.run(
        read_metrics, nats_url, names.metrics_subject("explorer"), backend="asyncio"
    )
    steps = [m for m in metrics if "explorer/tasks_in_flight" in m.values]
    assert len(steps) == ROWS // 2
    assert max(m.values["explorer/tasks_in_flight"] for m in steps) > 2  # more than one step
    for m in steps:
        assert 0.0 <= m.values["explorer/idle_share"] <= 1.0
        assert m.values["explorer/idle_seconds_total"] <= m.values["explorer/seconds_total"]
    # the keep loop's reads of the stream (beside the publishes): a running total, reported
    checks = [m.values["explorer/stream_check_seconds_total"] for m in steps]
    assert checks == sorted(checks) and checks[-1] > 0, checks
    assert all(m.values["explorer/exp_purged_total"] >= 0 for m in steps)


async def _key_changes(url: str) -> None:
    names = RunNames("keys")
    async with await Bus.connect(url, names, NatsConfig(), "test") as bus:
        await bus.provision()
        state = RunState(await bus.kv())
        changes = KeyWrites(await bus.kv(), ("trainer.step", "weights.latest"))
        await changes.start()
        try:
            assert not await changes.wait(0.2)
            await state.put(TRAINER_STEP, 1)
            assert await changes.wait(5.0)
            assert not await changes.wait(0.2)  # reported once
            await state.put(EXPLORER_STEP.of(name="x"), 3)  # not watched
            assert not await changes.wait(0.3)
            await write_json(state, "weights.latest", {"version": 2})  # written before the wait
            await anyio.sleep(0.2)
            assert await changes.wait(0.01)
        finally:
            await changes.stop()


def test_key_changes_wake_on_watched_writes(nats_url: str) -> None:
    anyio.run(_key_changes, nats_url, backend="asyncio")


def test_the_plan_is_published_as_it_is_taken(
    tmp_path: Path, tiny_model_path: str, nats_url: str
) -> None:
    """With ``publish_lead`` tasks waiting the publisher stops (the claim kept alive); taking
    tasks lets it go on; the record comes after the last task."""
    from rftstream.actors.explorer import Explorer
    from rftstream.actors.taskset_publisher import PUBLISH_CHUNK
    from rftstream.runtime import provision
    from rftstream.subjects import KV_TASKSET_CLAIM

    data = small_config(tmp_path, tiny_model_path)
    data["buffer"]["total_epochs"] = 2  # 100 rows x 2 epochs = 200 tasks
    run = prepare_run(config_from_dict(data))
    names = run.names

    async def main() -> None:
        await provision(run, nats_url)
        async with await Bus.connect(nats_url, names, run.cfg.nats, "explorer") as bus:
            state = RunState(await bus.kv())
            explorer = Explorer(
                run.cfg, bus, resolved=run.resolved, model_path=run.model_path, name="explorer"
            )
            explorer.publisher.publish_lead = 10
            explorer.publisher.claim_keepalive_s = 0.3
            async with anyio.create_task_group() as tg:
                tg.start_soon(explorer.publisher.run, state)
                await anyio.sleep(1.5)
                info = await bus.transport.js.stream_info(names.tasks_stream)
                assert info.state.messages == PUBLISH_CHUNK  # one chunk, then it waits
                assert await state.taskset() is None
                first = await state.kv.get(KV_TASKSET_CLAIM)
                await anyio.sleep(0.8)
                assert (await state.kv.get(KV_TASKSET_CLAIM)).revision > first.revision  # alive
                consumer = await bus.pull(names.tasks_stream, names.explorer_consumer)
                taken = 0
                with anyio.fail_after(60):
                    while await state.taskset() is None or taken < 200:
                        for m in await consumer.fetch(32, timeout=0.5):
                            await m.ack()
                            taken += 1
                assert taken == 200
                await consumer.unsubscribe()
            record = await state.taskset()
            assert record is not None and record.count == 200

    anyio.run(main, backend="asyncio")
