"""How the explorer counts the experience ahead of what it starts (``max_staleness``).

Logic above the bus: JetStream's consumer API and the run state are stand-ins that
change between the explorer's reads as the real ones can (a task publishes while the
explorer reads the queues; the trainer takes more messages after it said it starves).
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import anyio
import pytest

from rftstream.bus.transport import ConsumerState
from rftstream.config.schema import (
    AlgorithmConfig,
    BufferConfig,
    Config,
    SynchronizerConfig,
)
from rftstream.control.staleness import experience_backlog, pipeline_order
from rftstream.subjects import (
    KV_TRAINER_STARVING,
    KV_TRAINER_UNACKED,
    KV_WEIGHTS_PENDING,
    RunNames,
)
from rftstream.wire import TrainedUnacked, TrainerStarving, WeightsPointer
from tests.resolved_runs import resolved_run

pytestmark = pytest.mark.anyio

GROUP = 8  # experiences per message (repeat_times)
TBS = 64  # experiences per trainer step: 8 messages


def _info(name: str, stage: str, pending: int = 0, unacked: int = 0) -> ConsumerState:
    return ConsumerState(
        name=name, filter_subject=f"rft.t.exp.{stage}", num_pending=pending, num_ack_pending=unacked
    )


class World:
    """One operator and one trainer consumer; an explorer with tasks in flight."""

    def __init__(self, explorer: Any, *, op: int = 0, trainer: int = 0) -> None:
        self.explorer = explorer
        self.op_pending = op
        self.trainer_held = trainer
        self.version = 0
        self.starving: TrainerStarving | None = None
        self.trained_unacked: Any = None  # the trainer's TrainedUnacked record
        self.on_list: list[Any] = []  # one callable per consumers() call, then nothing
        self.after_trainer_read: list[Any] = []  # one per read of the trainer's consumer
        self.on_weights: list[Any] = []  # one per latest_weights call
        self.versions_seen: list[int] = []

    # the part of the transport experience_backlog uses
    async def consumers(self, stream: str) -> list[ConsumerState]:
        # a server reads each consumer in turn, here the trainer first: what moves
        # meanwhile is in neither count of the list
        trainer = _info("trainer", "train", 0, self.trainer_held)
        if self.on_list:
            self.on_list.pop(0)()
        return [trainer, self._op()]

    async def consumer_state(self, stream: str, name: str) -> ConsumerState:
        if name != "trainer":
            return self._op()
        info = _info(name, "train", 0, self.trainer_held)
        if self.after_trainer_read:
            self.after_trainer_read.pop(0)()
        return info

    def _op(self) -> Any:
        return _info("op_raw_to_train", "raw", self.op_pending, 0)

    # the part of RunState _respect_staleness uses
    async def latest_weights(self) -> WeightsPointer | None:
        self.versions_seen.append(self.version)
        ptr = WeightsPointer(version=self.version, method="memory", uri="unused")
        if self.on_weights:
            self.on_weights.pop(0)()
        return ptr

    async def get(self, key: Any) -> Any:  # a typed wire.Key handle
        if key.name == KV_TRAINER_UNACKED:
            return self.trained_unacked
        if key.name == KV_WEIGHTS_PENDING:  # memory sync: the pointer is written before the acks
            return None
        assert key.name == KV_TRAINER_STARVING
        return self.starving

    async def status(self) -> str:
        return "running"

    def publish_in_flight(self) -> None:
        """Every task in flight finishes and publishes its group (to ``exp.raw``)."""
        n = self.explorer._in_flight
        self.explorer._finished(n, 0)
        self.op_pending += n

    def trainer_steps(self) -> None:
        """The trainer trains the batch it holds, publishes the next version, acks it."""
        self.version += 1
        self.trainer_held = max(0, self.trainer_held - TBS // GROUP)


def _explorer(max_staleness: int) -> Any:
    from rftstream.actors.explorer import Explorer

    cfg = Config(
        mode="both",
        buffer=BufferConfig(batch_size=8, train_batch_size=TBS),
        algorithm=AlgorithmConfig(repeat_times=GROUP),
        synchronizer=SynchronizerConfig(
            sync_method="checkpoint", sync_style="dynamic_by_explorer", max_staleness=max_staleness
        ),
    )
    # no transport: the experience stream is unbounded here (the World counts what it holds)
    bus = SimpleNamespace(names=RunNames("t"), transport=None, max_payload=8 << 20)
    explorer = Explorer(cfg, bus, resolved=resolved_run(cfg), model_path="unused")  # type: ignore[arg-type]
    explorer.engine = SimpleNamespace(model_version=0)
    return explorer


def _attach(explorer: Any, world: World) -> None:
    explorer.bus = SimpleNamespace(
        names=RunNames("t"), consumers=world.consumers, consumer_state=world.consumer_state
    )


def test_consumers_are_read_upstream_first() -> None:
    consumers = [
        ("trainer", "rft.r.exp.train"),
        ("op_s1_to_train", "rft.r.exp.s1"),
        ("trainer_s2", "rft.r.exp.s2"),
        ("op_raw_to_s1", "rft.r.exp.raw"),
        ("op_raw_to_train", "rft.r.exp.raw"),
        ("op_dedup_x_to_s1", "rft.r.exp.dedup-x"),
        ("op_s0_to_dedup_x", "rft.r.exp.s0"),
        ("op_raw_to_s0", "rft.r.exp.raw"),
    ]
    assert pipeline_order(consumers) == [
        "op_raw_to_s0",
        "op_raw_to_s1",
        "op_raw_to_train",
        "op_s0_to_dedup_x",  # depth 1
        "op_s1_to_train",  # depth 1
        "op_dedup_x_to_s1",  # depth 2 (stage dedup-x: a consumer name has '_' for '-')
        "trainer_s2",  # the trainer's consumers last
        "trainer",
    ]


async def test_a_message_moving_downstream_while_the_queues_are_read_is_counted() -> None:
    explorer = _explorer(1)
    world = World(explorer, op=4)
    _attach(explorer, world)

    def operator_hands_on() -> None:  # the operator publishes its 4 to exp.train and acks
        world.op_pending -= 4
        world.trainer_held += 4

    world.on_list.append(operator_hands_on)
    backlog = await experience_backlog(explorer.bus, "S")
    assert backlog.total >= 4 and backlog.held_by_trainer == 4


async def test_a_group_published_while_the_explorer_counts_is_not_missed() -> None:
    """The trainer trains batch 1 (v0); batch 2 is in flight; batch 3 started now with v0
    would be trained at step 3 (version 2): staleness 2 > 1. The explorer must wait for
    the trainer's step, however the publishing of batch 2 interleaves with its reads."""
    explorer = _explorer(1)
    explorer._started(8, 0)
    world = World(explorer, trainer=8)
    _attach(explorer, world)
    # batch 2 lands just after the queues were read, before the explorer is done counting
    world.after_trainer_read.append(world.publish_in_flight)
    world.on_weights.extend([lambda: None, world.trainer_steps])
    with anyio.fail_after(5):
        take = await explorer._respect_staleness(world, 3)  # type: ignore[arg-type]
    assert world.versions_seen[-1] == 1, world.versions_seen  # it waited for version 1
    assert take == 8


async def test_a_stale_starving_flag_does_not_let_the_explorer_run_ahead() -> None:
    """The trainer said it starves while it waited for its first batch; it holds two now."""
    explorer = _explorer(1)
    world = World(explorer, trainer=16)
    _attach(explorer, world)
    world.starving = TrainerStarving(since=time.time(), held=0)
    with anyio.move_on_after(0.6) as scope:
        await explorer._respect_staleness(world, 3)  # type: ignore[arg-type]
    assert scope.cancelled_caught  # still waiting for room
    world.starving = TrainerStarving(since=time.time(), held=16)  # said again with what it holds
    with anyio.fail_after(5):
        assert await explorer._respect_staleness(world, 3) == 8  # type: ignore[arg-type]


async def test_a_group_is_published_after_the_tasks_started_with_older_weights() -> None:
    """A slow task started with v0 is not overtaken by tasks started with v1: experience
    reaches the trainer in weights order, which the count by position relies on."""
    explorer = _explorer(2)
    explorer._started(1, 0)  # the slow one
    explorer._started(2, 1)
    published: list[int] = []

    async def publish(version: int) -> None:
        await explorer._after_older_tasks(version)
        published.append(version)
        explorer._finished(1, version)

    async with anyio.create_task_group() as tg:
        tg.start_soon(publish, 1)
        tg.start_soon(publish, 1)  # same version: not ordered among themselves
        await anyio.sleep(0.05)
        assert published == []  # both wait for the v0 task
        published.append(0)
        explorer._finished(1, 0)  # the slow task publishes (or fails: it counts as done)
    assert published == [0, 1, 1]


async def test_a_newer_task_never_waits_for_itself_or_a_newer_one() -> None:
    explorer = _explorer(2)
    explorer._started(1, 3)
    explorer._started(1, 5)
    with anyio.fail_after(1):
        await explorer._after_older_tasks(3)  # only v3 and v5 in flight: nothing older


async def test_messages_trained_and_held_for_a_checkpoint_are_not_backlog() -> None:
    """The trainer holds 16 messages it trained (acked at its next checkpoint): nothing is
    ahead of what the explorer starts now, so it must not wait (it would forever with a
    save_interval past max_staleness + 1); without the record they count and it waits."""
    explorer = _explorer(1)
    world = World(explorer, trainer=16)
    _attach(explorer, world)
    with anyio.move_on_after(0.6) as scope:
        await explorer._respect_staleness(world, 3)  # type: ignore[arg-type]
    assert scope.cancelled_caught  # 16 messages = 2 batches ahead: staleness 2 > 1
    world.trained_unacked = TrainedUnacked(trained=16, acked=0)
    with anyio.fail_after(5):
        assert await explorer._respect_staleness(world, 3) == 8  # type: ignore[arg-type]


async def test_trained_messages_acked_while_counted_are_not_subtracted_twice() -> None:
    """The trainer acks 8 of its trained messages while the explorer reads the queues (its
    record says so before the acks): what is left is counted, never less."""
    explorer = _explorer(1)
    world = World(explorer, trainer=24)  # 8 trained-unacked, 16 untrained ahead
    world.trained_unacked = TrainedUnacked(trained=8, acked=0)
    _attach(explorer, world)

    def checkpoint() -> None:  # record first, then the acks: after the consumer was read
        world.trained_unacked = TrainedUnacked(trained=8, acked=8)
        world.trainer_held = 16

    world.after_trainer_read.append(checkpoint)
    with anyio.move_on_after(0.6) as scope:
        await explorer._respect_staleness(world, 3)  # type: ignore[arg-type]
    assert scope.cancelled_caught  # 16 untrained messages ahead still: it waits


def test_backlog_less_trained_is_clamped_to_what_the_trainer_holds() -> None:
    from rftstream.control.staleness import Backlog

    b = Backlog(total=30, held_by_trainer=10, held_by_operators=2)
    assert b.without_trained(4) == Backlog(26, 6, 2)
    assert b.without_trained(50) == Backlog(20, 0, 2)
    assert b.without_trained(-3) == b
