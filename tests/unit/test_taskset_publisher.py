"""The taskset publisher's I/O loop (:class:`TasksetPublisher`) above a fake KV and task stream.

Logic above the bus: the KV stand-in keeps revisions and answers conditional
writes as JetStream KV does (create-if-absent, compare-and-set on the revision);
the task stream drops a message whose ``Nats-Msg-Id`` it already holds. The
real-server behaviour is proved by ``tests/integration/test_eval_and_resume.py``
and ``tests/integration/test_explorer_pipeline.py``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anyio
import anyio.lowlevel
import msgspec
import pytest

from rftstream.actors.taskset_publisher import PUBLISH_CHUNK, TasksetPublisher
from rftstream.config.schema import BufferConfig, Config, TasksetConfig
from rftstream.subjects import RunNames
from rftstream.taskset_claim import Seeking
from rftstream.wire import TASKSET_CLAIM, TASKSET_PUBLISHED, TasksetClaim, TasksetRecord

pytestmark = pytest.mark.anyio

ROWS = 100
EPOCHS = 2  # 200 tasks: 4 chunks of 64 (the last one short)


class FakeKV:
    """The part of RunState the publisher uses, with JetStream KV revisions."""

    def __init__(self) -> None:
        self.entries: dict[str, tuple[bytes, int]] = {}
        self.revision = 0

    def _put(self, key: str, value: Any) -> int:
        self.revision += 1
        self.entries[key] = (msgspec.json.encode(value), self.revision)
        return self.revision

    async def put_json(self, key: str, value: Any) -> None:
        self._put(key, value)

    async def get_json(self, key: str, typ: Any = None) -> Any:
        if key not in self.entries:
            return None
        raw = self.entries[key][0]
        return msgspec.json.decode(raw, type=typ) if typ else msgspec.json.decode(raw)

    async def get_entry(self, key: str) -> tuple[Any, int | None]:
        if key not in self.entries:
            return None, None
        raw, rev = self.entries[key]
        return msgspec.json.decode(raw), rev

    async def compare_and_put(self, key: str, value: Any, revision: int | None) -> int | None:
        current = self.entries.get(key)
        if (current is None) != (revision is None) or (current and current[1] != revision):
            return None  # someone else wrote it first
        return self._put(key, value)

    def claim(self) -> TasksetClaim:
        return msgspec.json.decode(self.entries[TASKSET_CLAIM.name][0], type=TasksetClaim)


class FakeTasks:
    """The task stream (deduplicated by message id) and the explorers' consumer of it."""

    def __init__(self) -> None:
        self.stored: dict[str, str] = {}  # msg id -> the actor that stored it
        self.published_by: dict[str, int] = {}  # publish calls per actor, duplicates too
        self.taken = 0  # tasks the explorers took (acked) so far
        self.keeping_up = False  # the explorers take every task as soon as it is stored
        self.transport = SimpleNamespace(consumer_state=self.consumer_state)

    def bus(self) -> Any:
        return SimpleNamespace(names=RunNames("t"), publish=self.publish, transport=self.transport)

    async def publish(self, subject: str, data: bytes, *, headers: dict[str, str], msg_id: str):
        actor = headers["Rft-Actor"]
        self.published_by[actor] = self.published_by.get(actor, 0) + 1
        self.stored.setdefault(msg_id, actor)
        await anyio.lowlevel.checkpoint()

    async def consumer_state(self, stream: str, consumer: str) -> Any:
        taken = len(self.stored) if self.keeping_up else self.taken
        return SimpleNamespace(num_pending=len(self.stored) - taken)


async def _until(condition: Callable[[], object], timeout: float = 10.0) -> None:
    with anyio.fail_after(timeout):
        while not condition():
            await anyio.sleep(0.01)


def _publisher(tmp_path: Path, tasks: FakeTasks, name: str, **timing: float) -> TasksetPublisher:
    path = tmp_path / "t.jsonl"
    if not path.exists():
        lines = (json.dumps({"question": f"{i}+1", "answer": str(i + 1)}) for i in range(ROWS))
        path.write_text("\n".join(lines) + "\n")
    cfg = Config(buffer=BufferConfig(total_epochs=EPOCHS))
    ts = TasksetConfig(name="t", path=str(path))
    publisher = TasksetPublisher(cfg, tasks.bus(), name, [("buffer.explorer_input.taskset", ts)])
    for attr, value in timing.items():
        setattr(publisher, attr, value)
    return publisher


async def test_one_of_two_explorers_publishes_every_task_once(tmp_path: Path) -> None:
    kv, tasks = FakeKV(), FakeTasks()
    a, b = _publisher(tmp_path, tasks, "a"), _publisher(tmp_path, tasks, "b")
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(a.run, kv)
            tg.start_soon(b.run, kv)
    record = await kv.get_json(TASKSET_PUBLISHED.name, TasksetRecord)
    assert record is not None and record.count == ROWS * EPOCHS
    assert len(tasks.published_by) == 1  # the other one only watched
    (winner,) = tasks.published_by
    assert record.by == winner and tasks.published_by[winner] == ROWS * EPOCHS
    assert len(tasks.stored) == ROWS * EPOCHS
    assert kv.claim().by == winner and kv.claim().seq == ROWS * EPOCHS


async def test_a_publisher_that_dies_mid_taskset_is_taken_over_where_it_stopped(
    tmp_path: Path,
) -> None:
    kv, tasks = FakeKV(), FakeTasks()
    ghost = _publisher(tmp_path, tasks, "ghost", publish_lead=10, claim_keepalive_s=0.05)
    async with anyio.create_task_group() as tg:  # one chunk, then it waits: it dies there
        tg.start_soon(ghost.run, kv)
        await _until(lambda: kv.entries and kv.claim().seq == PUBLISH_CHUNK)
        await anyio.sleep(0.1)  # it keeps the claim alive meanwhile, publishing nothing
        tg.cancel_scope.cancel()
    assert len(tasks.stored) == PUBLISH_CHUNK
    assert kv.claim() == TasksetClaim(by="ghost", ts=kv.claim().ts, seq=PUBLISH_CHUNK)
    tasks.taken = PUBLISH_CHUNK  # the explorers took them: nothing holds the heir back
    heir = _publisher(tmp_path, tasks, "heir", claim_stale_s=0.3)
    t0 = anyio.current_time()
    with anyio.fail_after(10):
        await heir.run(kv)
    assert anyio.current_time() - t0 >= 0.3  # it waited for the claim to go stale
    assert tasks.published_by["heir"] == ROWS * EPOCHS - PUBLISH_CHUNK  # from the ghost's seq
    assert len(tasks.stored) == ROWS * EPOCHS
    record = await kv.get_json(TASKSET_PUBLISHED.name, TasksetRecord)
    assert record is not None and record.by == "heir" and record.tasksets == {"t": 200}
    claim = kv.claim()
    assert (claim.by, claim.seq) == ("heir", ROWS * EPOCHS)


async def test_a_publisher_whose_claim_was_taken_over_stops_and_watches(tmp_path: Path) -> None:
    kv, tasks = FakeKV(), FakeTasks()
    slow = _publisher(tmp_path, tasks, "slow", publish_lead=10, claim_keepalive_s=0.05)
    slow.claim_stale_s = 0.8  # well past the checks below, even on a loaded machine
    async with anyio.create_task_group() as tg:
        tg.start_soon(slow.run, kv)
        await _until(lambda: kv.entries and kv.claim().seq == PUBLISH_CHUNK)
        # another explorer takes the claim over (it thought "slow" had died)
        _, rev = await kv.get_entry(TASKSET_CLAIM.name)
        other = TasksetClaim(by="other", ts=0.0, seq=PUBLISH_CHUNK, taken_over_from="slow")
        assert await kv.compare_and_put(TASKSET_CLAIM.name, other, rev) is not None
        # "slow" loses its next keep-alive and stops publishing
        await _until(lambda: isinstance(slow._claim, Seeking))
        tasks.keeping_up = True
        await anyio.sleep(0.2)
        assert tasks.published_by["slow"] == PUBLISH_CHUNK
        assert kv.claim().by == "other"
        # "other" never writes again: its claim goes stale and "slow" takes the rest
        with anyio.fail_after(5):
            while await kv.get_json(TASKSET_PUBLISHED.name) is None:
                await anyio.sleep(0.05)
    assert tasks.published_by["slow"] == ROWS * EPOCHS
    assert len(tasks.stored) == ROWS * EPOCHS
    assert kv.claim().by == "slow"


async def test_nothing_is_published_once_the_taskset_is_there(tmp_path: Path) -> None:
    kv, tasks = FakeKV(), FakeTasks()
    done = TasksetRecord(count=200, epochs=2, rows=100, by="earlier", ts=0.0)
    await kv.put_json(TASKSET_PUBLISHED.name, done)
    with anyio.fail_after(2):
        await _publisher(tmp_path, tasks, "late").run(kv)
    assert tasks.published_by == {} and TASKSET_CLAIM.name not in kv.entries
