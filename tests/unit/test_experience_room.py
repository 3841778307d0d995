"""ExperienceRoom, the explorer's gate to ``exp.raw``, on the in-memory transport: with its
``keep`` loop running, the stream is read and purged off the publish path (``wait`` makes
no round trip while there is room), a full stream still holds publishes until consumers
make room, and a failed check reaches the publisher."""

from __future__ import annotations

import anyio
import msgspec
import pytest

from rftstream.bus.client import Bus
from rftstream.bus.memory import MemoryTransport
from rftstream.config.schema import ExperienceStreamConfig, NatsConfig
from rftstream.errors import BusError
from rftstream.experience import EID, Experience
from rftstream.retention.limits import ExperienceRoom
from rftstream.retention.purged import read_purged
from rftstream.subjects import RAW_STAGE, TRAIN_STAGE, RunNames

pytestmark = pytest.mark.anyio

NAMES = RunNames("room")
PREFIX = NAMES.exp_wildcard[:-1]


def _group(task: int) -> list[Experience]:
    return [
        Experience(tokens=[5, 6, 7, 8], prompt_length=2, reward=1.0, eid=EID(0, task, i))
        for i in range(2)
    ]


async def _bus(**streams: object) -> Bus:
    cfg = msgspec.convert({"streams": {"experience": streams}}, NatsConfig)
    bus = Bus(MemoryTransport(), NAMES, cfg, "explorer")
    await bus.provision()
    return bus


def _room(bus: Bus, **cfg: object) -> ExperienceRoom:
    exp = msgspec.convert(cfg, ExperienceStreamConfig)
    return ExperienceRoom(bus.transport, NAMES.exp_stream, exp, "explorer", subject_prefix=PREFIX)


async def test_keep_purges_acked_experience_in_the_background_while_publishes_go_on() -> None:
    bus = await _bus()
    for task in range(4):
        await bus.publish_group(TRAIN_STAGE, _group(task), msg_id=f"g{task}")
    room = _room(bus, purge_acked=True, keep_acked_msgs=0, keep_acked_s=0)
    room.state = await bus.state()
    purging = anyio.Event()
    real_purge = bus.transport.purge

    async def slow_purge(stream: str, subject: str, seq: int) -> None:
        purging.set()
        await anyio.sleep(1.0)  # a purge of a large prefix: a read, a KV write, the purge
        await real_purge(stream, subject, seq)

    bus.transport.purge = slow_purge  # type: ignore[method-assign]
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(room.keep)
            assert await room.wait()  # the first check: nothing acked, nothing to purge
            trainer = await bus.pull(NAMES.exp_stream, NAMES.trainer_consumer)
            for msg in await trainer.fetch(2, 0.01):
                await msg.ack()
            await purging.wait()  # the keep loop's next check purges the two acked groups
            with anyio.fail_after(0.2):  # meanwhile a publish does not wait for it
                assert await room.wait()
            assert room.purged == 0
            while room.purged < 2:
                await anyio.sleep(0.01)
            tg.cancel_scope.cancel()
    record = (await read_purged(room.state))[TRAIN_STAGE]  # the account's ledger
    assert (record.below_seq, record.messages, record.experiences) == (3, 2, 4)
    assert room.check_s >= 1.0  # the slow purge counts in the loop's time (a metric)


async def test_a_full_stream_holds_the_publish_until_consumers_make_room() -> None:
    bus = await _bus(max_msgs=2)
    room = _room(bus, max_msgs=2, purge_acked=False)
    raw = NAMES.exp_subject(RAW_STAGE)
    for i in range(2):
        await bus.publish(raw, b"x", msg_id=f"m{i}")
    waited: list[bool] = []

    async def publisher() -> None:
        waited.append(await room.wait())

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(room.keep)
            tg.start_soon(publisher)
            await anyio.sleep(0.6)  # two re-checks of the full stream
            assert waited == []  # still held
            await bus.transport.purge(NAMES.exp_stream, raw, 3)  # consumers made room
            while not waited:
                await anyio.sleep(0.01)
            tg.cancel_scope.cancel()
    assert waited == [True]
    assert room.waited_s >= 0.5


async def test_a_full_stream_at_the_end_of_the_run_lets_the_publisher_go() -> None:
    bus = await _bus(max_msgs=1)
    room = _room(bus, max_msgs=1, purge_acked=False)
    await bus.publish(NAMES.exp_subject(RAW_STAGE), b"x", msg_id="m")

    async def ended() -> bool:
        return True

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(room.keep)
            assert await room.wait(ended) is False
            tg.cancel_scope.cancel()


@pytest.mark.parametrize("keeping", [True, False], ids=["keep_loop", "inline"])
async def test_a_stream_that_cannot_be_read_fails_the_wait(keeping: bool) -> None:
    bus = await _bus()
    room = _room(bus, purge_acked=True)
    reads: list[float] = []

    async def broken(*args: object, **kwargs: object) -> object:
        reads.append(anyio.current_time())
        raise BusError("no responders")

    bus.transport.stream_state = broken  # type: ignore[method-assign]
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            if keeping:
                tg.start_soon(room.keep)
                while not reads:  # the loop's first check failed (its next one is 0.25 s away)
                    await anyio.sleep(0.01)
            with pytest.raises(BusError, match=f"stream {NAMES.exp_stream}.*no responders"):
                await room.wait()
            assert len(reads) == 1  # keep loop: its failure, raised without a read of our own
            tg.cancel_scope.cancel()


@pytest.mark.parametrize("keeping", [False, True])
async def test_publishes_behind_a_stale_check_never_fill_the_stream(keeping: bool) -> None:
    """Between two reads of the stream, the room counts the publishes it let through (each
    the stream's average message, or ``message_bytes`` while it was empty): the explorer
    stops for a fresh read before its own groups could pass HIGH_WATER, so operators and
    the trainer always have room to publish into (a stale 'room' used to let an explorer
    fill the stream and deadlock the pipeline behind it)."""
    bus = await _bus(max_bytes=100_000, purge_acked=False)
    exp = msgspec.convert({"max_bytes": 100_000, "purge_acked": False}, ExperienceStreamConfig)
    room = ExperienceRoom(
        bus.transport, NAMES.exp_stream, exp, "explorer", subject_prefix=PREFIX, message_bytes=9000
    )
    published = 0

    async def publish_while_there_is_room() -> None:
        nonlocal published
        while True:
            with anyio.move_on_after(0.5):
                await room.wait()
                await bus.publish(NAMES.exp_subject(RAW_STAGE), b"x" * 8000, msg_id=f"m{published}")
                published += 1
                continue
            return  # held: the stream is at its high water

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            if keeping:
                tg.start_soon(room.keep)
            await publish_while_there_is_room()
            tg.cancel_scope.cancel()
    stored = (await bus.transport.stream_state(NAMES.exp_stream)).bytes
    assert 0.7 * 100_000 <= stored <= 0.8 * 100_000 + 8000  # stopped at the high water
