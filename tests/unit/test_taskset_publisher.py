"""The taskset publisher's I/O loop (:class:`TasksetPublisher`) on the in-memory transport.

Each explorer has its own connection (:meth:`MemoryTransport.connection`) to one
in-memory server, a run provisioned as the runtime does it, and the
:class:`RunState` over its own bus's KV bucket, as the explorer passes it. The
task stream drops a task whose ``Nats-Msg-Id`` it already stored; the explorers
take tasks from their durable and ack them, which removes them from the work
queue. The real-server behaviour is proved by
``tests/integration/test_eval_and_resume.py`` and
``tests/integration/test_explorer_pipeline.py``.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pytest

from rftstream.actors.taskset_publisher import PUBLISH_CHUNK, TasksetPublisher
from rftstream.bus.client import Bus
from rftstream.bus.memory import MemoryTransport
from rftstream.bus.state import RunState
from rftstream.bus.transport import PubAck
from rftstream.config.schema import BufferConfig, Config, TasksetConfig
from rftstream.control.taskset_claim import Seeking
from rftstream.experience import H_MSG_ID
from rftstream.runtime import task_ack_wait
from rftstream.subjects import RunNames
from rftstream.tasksets import TasksetPlan, plan_tasks
from rftstream.wire import TASKSET_CLAIM, TASKSET_PUBLISHED, TasksetClaim, TasksetRecord
from tests.unit._memory_util import read_subject

pytestmark = pytest.mark.anyio

NAMES = RunNames("t")
ROWS = 100
EPOCHS = 2  # 200 tasks: 4 chunks of 64 (the last one short)
CFG = Config(buffer=BufferConfig(total_epochs=EPOCHS))
# every task's Nats-Msg-Id, in publishing order
PLAN = [
    f"task:{p.taskset}:{p.epoch}:{p.index}"
    for p in plan_tasks([TasksetPlan(name="t", rows=ROWS, epochs=EPOCHS)])
]


class CountingBus(Bus):
    """An explorer's bus that counts its publish calls per subject, duplicates included."""

    def __init__(self, transport: MemoryTransport, actor: str) -> None:
        super().__init__(transport, NAMES, CFG.nats, actor)
        self.publish_calls: Counter[str] = Counter()

    async def publish(self, subject: str, data: bytes, **kwargs: Any) -> PubAck:
        self.publish_calls[subject] += 1
        return await super().publish(subject, data, **kwargs)


@dataclass
class Explorer:
    """One explorer's taskset publisher, on its own connection, run as the explorer runs it."""

    bus: CountingBus
    publisher: TasksetPublisher
    state: RunState  # over this explorer's own bus

    async def publish_taskset(self) -> None:
        """:meth:`TasksetPublisher.run` with the explorer's RunState. Blocks as it does."""
        await self.publisher.run(self.state)

    @property
    def publish_calls(self) -> int:
        """Tasks it published (or tried to), duplicates included."""
        return self.bus.publish_calls[NAMES.tasks_subject]


class TaskTaker:
    """The explorers taking tasks: pulls from their durable and acks each task at once,
    recording which explorer stored it (``Rft-Actor``)."""

    def __init__(self, bus: Bus) -> None:
        self._bus = bus
        self.taken: list[tuple[str, str]] = []  # (Nats-Msg-Id, Rft-Actor) in delivery order

    async def take(self, count: int | None) -> None:
        """Take ``count`` tasks (None: every task as soon as it is stored, until cancelled),
        acking each as soon as it is fetched. Blocks until they were there."""
        sub = await self._bus.pull(NAMES.tasks_stream, NAMES.explorer_consumer)
        try:
            while count is None or count > 0:
                for msg in await sub.fetch(count or PUBLISH_CHUNK, timeout=1.0):
                    headers = msg.headers or {}
                    self.taken.append((headers[H_MSG_ID], headers["Rft-Actor"]))
                    await msg.ack()
                    count = None if count is None else count - 1
        finally:
            await sub.unsubscribe()


class Run:
    """A provisioned run on one in-memory server: its explorers and their task queue."""

    def __init__(self, tmp_path: Path) -> None:
        self.server = MemoryTransport()
        self.path = tmp_path / "t.jsonl"
        lines = (json.dumps({"question": f"{i}+1", "answer": str(i + 1)}) for i in range(ROWS))
        self.path.write_text("\n".join(lines) + "\n")
        self.tasks = TaskTaker(self.bus("taker"))

    def bus(self, actor: str) -> CountingBus:
        """A bus on a new connection to this run's server."""
        return CountingBus(self.server.connection(), actor)

    async def provision(self) -> RunState:
        """Streams, durables and bucket as ``rftstream.runtime.provision`` makes them;
        the run's state (a provisioner's)."""
        bus = self.bus("provisioner")
        await bus.provision(task_ack_wait=task_ack_wait(CFG))
        state = RunState(await bus.kv())
        await state.set_status("running")
        return state

    async def explorer(self, name: str, **timing: float) -> Explorer:
        """Explorer ``name``'s publisher; ``timing`` overrides its claim and lead settings."""
        bus = self.bus(name)
        ts = TasksetConfig(name="t", path=str(self.path))
        publisher = TasksetPublisher(CFG, bus, name, [("buffer.explorer_input.taskset", ts)])
        for attr, value in timing.items():
            setattr(publisher, attr, value)
        return Explorer(bus, publisher, RunState(await bus.kv()))

    async def stored(self) -> dict[str, str]:
        """Every task the task stream stored (Nats-Msg-Id -> the explorer that published it):
        those taken (acked, so gone from the work queue) and those still in it. Fails when
        one was stored twice."""
        msgs = await read_subject(self.server, NAMES.tasks_stream, NAMES.tasks_subject)
        queued = [((m.headers or {})[H_MSG_ID], (m.headers or {})["Rft-Actor"]) for m in msgs]
        tasks = self.tasks.taken + queued
        stored = dict(tasks)
        assert len(stored) == len(tasks), "a task stored twice"
        return stored


async def _claim(state: RunState) -> TasksetClaim | None:
    return await state.get(TASKSET_CLAIM)


async def _until(condition: Callable[[], Awaitable[object]], timeout: float = 10.0) -> None:
    with anyio.fail_after(timeout):
        while not await condition():
            await anyio.sleep(0.01)


async def _claimed_through(state: RunState, seq: int) -> bool:
    claim = await _claim(state)
    return claim is not None and claim.seq == seq


async def _seeking(publisher: TasksetPublisher) -> bool:
    return isinstance(publisher._claim, Seeking)


def _by(stored: dict[str, str], actor: str) -> set[str]:
    return {msg_id for msg_id, by in stored.items() if by == actor}


async def test_one_of_two_explorers_publishes_every_task_once(tmp_path: Path) -> None:
    run = Run(tmp_path)
    state = await run.provision()
    a, b = await run.explorer("a"), await run.explorer("b")
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(a.publish_taskset)
            tg.start_soon(b.publish_taskset)
    record = await state.get(TASKSET_PUBLISHED)
    assert record is not None and record.count == len(PLAN)
    calls = {e.publisher.name: e.publish_calls for e in (a, b) if e.publish_calls}
    assert len(calls) == 1  # the other one only watched
    (winner,) = calls
    assert record.by == winner and calls[winner] == len(PLAN)
    stored = await run.stored()
    assert stored == dict.fromkeys(PLAN, winner)
    claim = await _claim(state)
    assert claim is not None and (claim.by, claim.seq) == (winner, len(PLAN))


async def test_a_publisher_that_dies_mid_taskset_is_taken_over_where_it_stopped(
    tmp_path: Path,
) -> None:
    run = Run(tmp_path)
    state = await run.provision()
    ghost = await run.explorer("ghost", publish_lead=10, claim_keepalive_s=0.05)
    async with anyio.create_task_group() as tg:  # one chunk, then it waits: it dies there
        tg.start_soon(ghost.publish_taskset)
        await _until(lambda: _claimed_through(state, PUBLISH_CHUNK))
        await anyio.sleep(0.1)  # it keeps the claim alive meanwhile, publishing nothing
        tg.cancel_scope.cancel()
    assert await run.stored() == dict.fromkeys(PLAN[:PUBLISH_CHUNK], "ghost")
    claim = await _claim(state)
    assert claim == TasksetClaim(by="ghost", ts=claim.ts if claim else 0.0, seq=PUBLISH_CHUNK)
    with anyio.fail_after(5):  # the explorers take them: nothing holds the heir back
        await run.tasks.take(PUBLISH_CHUNK)
    heir = await run.explorer("heir", claim_stale_s=0.3)
    t0 = anyio.current_time()
    with anyio.fail_after(10):
        await heir.publish_taskset()
    assert anyio.current_time() - t0 >= 0.3  # it waited for the claim to go stale
    assert heir.publish_calls == len(PLAN) - PUBLISH_CHUNK  # from the ghost's seq
    stored = await run.stored()
    assert _by(stored, "ghost") == set(PLAN[:PUBLISH_CHUNK])
    assert _by(stored, "heir") == set(PLAN[PUBLISH_CHUNK:])
    record = await state.get(TASKSET_PUBLISHED)
    assert record is not None and record.by == "heir" and record.tasksets == {"t": len(PLAN)}
    claim = await _claim(state)
    assert claim is not None and (claim.by, claim.seq) == ("heir", len(PLAN))


async def test_a_publisher_whose_claim_was_taken_over_stops_and_watches(tmp_path: Path) -> None:
    run = Run(tmp_path)
    state = await run.provision()
    slow = await run.explorer("slow", publish_lead=10, claim_keepalive_s=0.05)
    slow.publisher.claim_stale_s = 0.8  # well past the checks below, even on a loaded machine
    async with anyio.create_task_group() as tg:
        tg.start_soon(slow.publish_taskset)
        await _until(lambda: _claimed_through(state, PUBLISH_CHUNK))
        # another explorer takes the claim over (it thought "slow" had died)
        _, rev = await state.entry(TASKSET_CLAIM)
        other = TasksetClaim(by="other", ts=0.0, seq=PUBLISH_CHUNK, taken_over_from="slow")
        assert await state.cas(TASKSET_CLAIM, other, rev) is not None
        # "slow" loses its next keep-alive and stops publishing
        await _until(lambda: _seeking(slow.publisher))
        tg.start_soon(run.tasks.take, None)
        await anyio.sleep(0.2)
        assert slow.publish_calls == PUBLISH_CHUNK
        assert await _claim(state) == other
        # "other" never writes again: its claim goes stale and "slow" takes the rest
        with anyio.fail_after(5):
            while await state.get(TASKSET_PUBLISHED) is None:
                await anyio.sleep(0.05)
        tg.cancel_scope.cancel()
    assert slow.publish_calls == len(PLAN)  # the first chunk once, then the rest
    assert await run.stored() == dict.fromkeys(PLAN, "slow")
    claim = await _claim(state)
    assert claim is not None and (claim.by, claim.seq) == ("slow", len(PLAN))


async def test_nothing_is_published_once_the_taskset_is_there(tmp_path: Path) -> None:
    run = Run(tmp_path)
    state = await run.provision()
    done = TasksetRecord(count=len(PLAN), epochs=EPOCHS, rows=ROWS, by="earlier", ts=0.0)
    await state.put(TASKSET_PUBLISHED, done)
    late = await run.explorer("late")
    with anyio.fail_after(2):
        await late.publish_taskset()
    assert late.publish_calls == 0
    assert (await run.server.stream_state(NAMES.tasks_stream)).last_seq == 0
    assert await state.entry(TASKSET_CLAIM) == (None, None)


async def test_a_waiting_explorer_wakes_at_the_write_not_after_its_pause(tmp_path: Path) -> None:
    """An explorer that waits on another's live claim looks again when the claim or
    ``taskset.published`` is written (a KV write notification), not a pause later."""
    run = Run(tmp_path)
    state = await run.provision()
    await state.create(TASKSET_CLAIM, TasksetClaim(by="other", ts=0.0))
    # "other" stays alive throughout; between two looks it would pause an hour
    waiting = await run.explorer("waiting", claim_stale_s=600.0, claim_poll_s=3600.0)
    finished = anyio.Event()

    async def explore() -> None:
        await waiting.publish_taskset()
        finished.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(explore)
        await _until(lambda: _seeking(waiting.publisher))
        await anyio.sleep(0.2)  # it looked, saw a live claim, and is in its pause now
        assert not finished.is_set()
        done = TasksetRecord(count=len(PLAN), epochs=EPOCHS, rows=ROWS, by="other", ts=0.0)
        await state.put(TASKSET_PUBLISHED, done)
        with anyio.fail_after(2):  # far less than its pause
            await finished.wait()
    assert waiting.publish_calls == 0
