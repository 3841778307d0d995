"""Logic above the bus, run on the in-memory transport (no server): the Bus's publishing
and dead letters, RunState's compare-and-set, the trainer's ExperienceFeed acking what it
trained, the backlog count and the purge of acked experience."""

from __future__ import annotations

import anyio
import msgspec
import pytest

from rftstream.actors.common import InProgressTicker
from rftstream.actors.feed import ExperienceFeed
from rftstream.bus.client import Bus
from rftstream.bus.memory import MemoryTransport
from rftstream.bus.state import RunState
from rftstream.config.schema import ExperienceStreamConfig, NatsConfig
from rftstream.control import KeyWrites
from rftstream.control.staleness import experience_backlog
from rftstream.errors import PayloadTooLargeError, SchemaError, StreamFullError
from rftstream.experience import EID, Experience, decode_group
from rftstream.retention.limits import purge_acked, purge_on_full
from rftstream.retention.purged import read_purged
from rftstream.subjects import TRAIN_STAGE, RunNames
from rftstream.wire import H_DLQ_REASON, H_DLQ_SEQ, H_DLQ_STAGE, Heartbeat, Key

pytestmark = pytest.mark.anyio

NAMES = RunNames("mem")


def _group(task: int, n: int = 2) -> list[Experience]:
    return [
        Experience(tokens=[5, 6, 7, 8], prompt_length=2, reward=1.0, eid=EID(0, task, i))
        for i in range(n)
    ]


async def _bus(actor: str = "test", transport: MemoryTransport | None = None, **cfg: object) -> Bus:
    config = msgspec.convert(cfg, NatsConfig)
    bus = Bus(transport or MemoryTransport(), NAMES, config, actor)
    await bus.provision()
    return bus


async def test_provision_makes_the_runs_streams_durables_and_bucket() -> None:
    bus = await _bus()
    streams = await bus.transport.streams()
    assert set(NAMES.streams) | {f"KV_{NAMES.kv_bucket}"} <= set(streams)
    assert (await bus.transport.consumer_state(NAMES.exp_stream, NAMES.trainer_consumer)).durable
    await bus.provision()  # idempotent


async def test_publish_group_is_stored_once_per_msg_id_with_its_headers() -> None:
    bus = await _bus()
    assert await bus.publish_group("raw", _group(1), msg_id="g1") == 1
    assert await bus.publish_group("raw", _group(1), msg_id="g1") == 0  # a retried publish
    stored = await bus.transport.last_msg(NAMES.exp_stream, NAMES.exp_subject("raw"))
    assert stored.headers is not None and stored.headers["Rft-Count"] == "2"
    assert [e.eid.run for e in decode_group(stored.data)] == [0, 1]
    with pytest.raises(PayloadTooLargeError, match="max_payload"):
        await bus.publish(NAMES.exp_subject("raw"), b"x" * (bus.max_payload + 1))


async def test_a_full_stream_raises_stream_full_naming_the_config_key() -> None:
    # a full stream is retried for nats.retry_window (consumers make room), then refused
    bus = await _bus(streams={"experience": {"max_msgs": 1}}, retry_window=0.0)
    await bus.publish(NAMES.exp_subject("raw"), b"a")
    with pytest.raises(StreamFullError, match="max_bytes / max_msgs"):
        await bus.publish(NAMES.exp_subject("raw"), b"b", retries=0)


async def test_a_publish_to_a_full_stream_waits_until_consumers_make_room() -> None:
    cfg = {"experience": {"max_msgs": 1, "purge_acked": False}}
    bus = await _bus(streams=cfg, retry_window=5.0)
    raw = NAMES.exp_subject("raw")
    await bus.publish(raw, b"a")

    async def make_room() -> None:
        await anyio.sleep(0.3)
        await bus.transport.purge(NAMES.exp_stream, raw, 2)  # what purge_acked does

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(make_room)
            await bus.publish(raw, b"b", retries=0)  # no StreamFullError: it waited
    assert (await bus.transport.last_msg(NAMES.exp_stream, raw)).data == b"b"


async def test_the_stream_full_hook_purges_acked_experience_before_the_retry() -> None:
    """An experience publisher's bus (``on_stream_full=purge_on_full``) frees the room
    every consumer acked when a publish finds the stream full; a bus without the hook
    only waits, and is refused once its retries and window are spent."""
    transport = MemoryTransport()
    streams = {"experience": {"max_msgs": 2, "purge_acked": True, "keep_acked_msgs": 0}}
    plain = await _bus("plain", transport, streams=streams, retry_window=0.0)
    train = NAMES.exp_subject(TRAIN_STAGE)
    await plain.publish_group(TRAIN_STAGE, _group(1), msg_id="g1")
    await plain.publish_group(TRAIN_STAGE, _group(2), msg_id="g2")
    sub = await plain.pull(NAMES.exp_stream, NAMES.trainer_consumer)
    for msg in await sub.fetch(2, 0.01):
        await msg.ack()
    with pytest.raises(StreamFullError):
        await plain.publish(train, b"x", retries=0)
    config = msgspec.convert({"streams": streams, "retry_window": 0.0}, NatsConfig)
    hooked = Bus(transport, NAMES, config, "explorer", on_stream_full=purge_on_full)
    with anyio.fail_after(5):
        await hooked.publish(train, b"x", retries=1)  # the hook purged g1 and g2
    assert (await transport.last_msg(NAMES.exp_stream, train)).data == b"x"
    record = (await read_purged(await hooked.state()))[TRAIN_STAGE]
    assert (record.messages, record.experiences) == (2, 4)


async def test_a_dead_letter_carries_the_reason_and_is_never_redelivered() -> None:
    transport = MemoryTransport()
    producer = await _bus("explorer", transport)
    trainer = await _bus("trainer", transport)
    await producer.publish_group(TRAIN_STAGE, _group(1), msg_id="g1")
    sub = await trainer.pull(NAMES.exp_stream, NAMES.trainer_consumer)
    (msg,) = await sub.fetch(1, 0.01)
    await trainer.dead_letter(TRAIN_STAGE, msg, "trainer: bad\nrecord")
    dead = await transport.last_msg(NAMES.dlq_stream, NAMES.dlq_subject(TRAIN_STAGE))
    assert dead.headers is not None
    assert dead.headers[H_DLQ_REASON] == "trainer: bad record"
    assert (dead.headers[H_DLQ_STAGE], dead.headers[H_DLQ_SEQ]) == (TRAIN_STAGE, "1")
    assert dead.data == msg.data
    info = await sub.info()
    assert (info.num_ack_pending, info.ack_floor) == (0, 1)  # terminated: settled


async def test_run_state_compare_and_put_loses_a_race_as_none() -> None:
    state = await (await _bus()).state()
    k: Key[dict[str, int]] = Key("k", dict[str, int])
    c: Key[dict[str, str]] = Key("c", dict[str, str])
    first = await state.cas(k, {"v": 1}, None)
    assert first is not None
    assert await state.cas(k, {"v": 2}, None) is None  # exists already
    second = await state.cas(k, {"v": 3}, first)
    assert second is not None and second > first
    assert await state.cas(k, {"v": 4}, first) is None  # stale revision
    assert await state.entry(k) == ({"v": 3}, second)
    assert await state.revision(k) == second
    assert await state.create(c, {"by": "a"}) and not await state.create(c, {"by": "b"})
    await state.heartbeat(Heartbeat(actor="trainer", role="trainer", ts=1.0, step=3))
    assert (await state.heartbeats())["trainer"].step == 3
    await state.delete(c)
    assert await state.get(c) is None and "c" not in await state.all()
    assert not await state.present(c) and await state.revision(c) is None
    with pytest.raises(SchemaError, match="KV .*/k: not a"):
        await state.get(Key("k", list[str]))  # another shape names the key


async def test_key_changes_wake_a_waiter_on_a_write() -> None:
    bus = await _bus()
    changes = KeyWrites(await bus.kv(), ["watched"])
    await changes.start()
    assert not await changes.wait(0.01)
    await RunState(await bus.kv()).put(Key("watched", int), 1)
    assert await changes.wait(0.01)
    await changes.stop()


async def test_the_feed_acks_a_message_once_all_its_experiences_were_trained() -> None:
    transport = MemoryTransport()
    explorer = await _bus("explorer", transport)
    trainer = await _bus("trainer", transport)
    groups = [_group(task) for task in range(3)]
    for task, group in enumerate(groups):
        await explorer.publish_group(TRAIN_STAGE, group, msg_id=f"g{task}")
    await explorer.publish_group(TRAIN_STAGE, groups[0], msg_id="copy")  # the same uids again
    consumer = await trainer.pull(NAMES.exp_stream, NAMES.trainer_consumer)

    async def exhausted() -> bool:
        return True

    ticker = InProgressTicker(5.0)
    feed = ExperienceFeed(trainer, consumer, ticker, exhausted, group_size=2, fetch_timeout=0.01)
    assert len(await feed.read(3)) == 3  # one message and a half: two fetched
    assert await feed.commit() == 1  # only the first message is wholly trained
    info = await consumer.info()
    assert (info.ack_floor, info.num_ack_pending) == (1, 1)
    assert len(await feed.read(5)) == 3  # the rest; the copy's experiences are duplicates
    assert await feed.commit() == 2
    assert feed.duplicates == 2
    info = await consumer.info()
    assert (info.ack_floor, info.num_ack_pending, info.num_pending) == (4, 0, 0)


async def test_backlog_and_purge_of_acked_experience() -> None:
    transport = MemoryTransport()
    explorer = await _bus("explorer", transport)
    for task in range(4):
        await explorer.publish_group(TRAIN_STAGE, _group(task), msg_id=f"g{task}")
    backlog = await experience_backlog(explorer, NAMES.exp_stream)
    assert (backlog.total, backlog.held_by_trainer) == (4, 0)
    sub = await explorer.pull(NAMES.exp_stream, NAMES.trainer_consumer)
    msgs = await sub.fetch(3, 0.01)
    await msgs[0].ack()
    await msgs[1].ack()
    backlog = await experience_backlog(explorer, NAMES.exp_stream)
    assert (backlog.total, backlog.held_by_trainer) == (2, 1)
    state = await explorer.state()
    cfg = ExperienceStreamConfig(purge_acked=True, keep_acked_msgs=0, keep_acked_s=0)
    prefix = NAMES.exp_wildcard[:-1]
    res = await purge_acked(transport, NAMES.exp_stream, cfg, state, prefix)
    assert (res.purged, res.messages, res.first_seq) == (2, 2, 3)
    record = (await read_purged(state))[TRAIN_STAGE]
    assert (record.below_seq, record.messages, record.experiences) == (3, 2, 4)


async def test_acked_experience_younger_than_keep_acked_s_stays_while_the_stream_has_room() -> None:
    """Far from its limits the stream keeps acked messages younger than ``keep_acked_s``
    (a repeated forward must still find its first copy); near them, room comes first."""
    transport = MemoryTransport()
    explorer = await _bus("explorer", transport)
    for task in range(4):
        await explorer.publish_group(TRAIN_STAGE, _group(task), msg_id=f"g{task}")
    sub = await explorer.pull(NAMES.exp_stream, NAMES.trainer_consumer)
    for m in await sub.fetch(4, 0.01):
        await m.ack()
    prefix = NAMES.exp_wildcard[:-1]
    young = ExperienceStreamConfig(purge_acked=True, keep_acked_msgs=0, keep_acked_s=60.0)
    res = await purge_acked(transport, NAMES.exp_stream, young, await explorer.state(), prefix)
    assert (res.purged, res.messages) == (0, 4)
    # the same messages, the stream at half its bound: every acked one goes
    size = (await transport.stream_state(NAMES.exp_stream)).bytes
    near = ExperienceStreamConfig(
        purge_acked=True, keep_acked_msgs=0, keep_acked_s=60.0, max_bytes=2 * size
    )
    res = await purge_acked(transport, NAMES.exp_stream, near, await explorer.state(), prefix)
    assert (res.purged, res.messages) == (4, 0)


async def test_a_purge_keeps_the_forwards_of_what_an_operator_has_not_acked() -> None:
    """Raw 2's ack is lost: the operator may forward it again, so its first copy (train 4,
    trained) stays while raw 2 is unacked, for the server to deduplicate the repeat."""
    transport = MemoryTransport()
    bus = await _bus("operator", transport)
    for task in range(2):
        await bus.publish_group("raw", _group(task), msg_id=f"raw:{task}")  # seqs 1, 2
    op = await bus.pull(NAMES.exp_stream, NAMES.stage_consumer("raw", TRAIN_STAGE))
    raw0, raw1 = await op.fetch(2, 0.01)
    for task in range(2):
        await bus.publish_group(TRAIN_STAGE, _group(task), msg_id=f"train:raw:{task}")  # 3, 4
    await raw0.ack()
    trainer = await bus.pull(NAMES.exp_stream, NAMES.trainer_consumer)
    for m in await trainer.fetch(2, 0.01):
        await m.ack()
    cfg = ExperienceStreamConfig(purge_acked=True, keep_acked_msgs=0, keep_acked_s=0)
    prefix = NAMES.exp_wildcard[:-1]
    res = await purge_acked(transport, NAMES.exp_stream, cfg, await bus.state(), prefix)
    assert (res.purged, res.first_seq, res.messages) == (1, 2, 3)  # raw 1 only
    await raw1.ack()
    res = await purge_acked(transport, NAMES.exp_stream, cfg, await bus.state(), prefix)
    assert (res.purged, res.messages) == (3, 0)


async def test_a_purge_keeps_what_came_after_the_first_young_message() -> None:
    transport = MemoryTransport()
    explorer = await _bus("explorer", transport)
    for task in range(2):
        await explorer.publish_group(TRAIN_STAGE, _group(task), msg_id=f"old{task}")
    await anyio.sleep(0.3)
    for task in range(2, 4):
        await explorer.publish_group(TRAIN_STAGE, _group(task), msg_id=f"new{task}")
    sub = await explorer.pull(NAMES.exp_stream, NAMES.trainer_consumer)
    for m in await sub.fetch(4, 0.01):
        await m.ack()
    cfg = ExperienceStreamConfig(purge_acked=True, keep_acked_msgs=0, keep_acked_s=0.2)
    prefix = NAMES.exp_wildcard[:-1]
    res = await purge_acked(transport, NAMES.exp_stream, cfg, await explorer.state(), prefix)
    assert (res.purged, res.first_seq) == (2, 3)


async def test_a_purge_goes_by_the_trainers_acked_below_record_where_it_is_higher() -> None:
    """The trainer acked sequences 1-3 but (as after a server crash) the floor says 1: its
    ``trainer.acked_below`` record of 4 lets the explorers' purge take 1-3."""
    from rftstream.wire import TRAINER_ACKED_BELOW, AckedBelow

    transport = MemoryTransport()
    explorer = await _bus("explorer", transport)
    for task in range(5):
        await explorer.publish_group(TRAIN_STAGE, _group(task), msg_id=f"g{task}")
    sub = await explorer.pull(NAMES.exp_stream, NAMES.trainer_consumer)
    msgs = await sub.fetch(4, 0.01)
    await msgs[0].ack()  # the memory server's floor: 1 (the rest stay held for the test)
    state = await explorer.state()
    cfg = ExperienceStreamConfig(purge_acked=True, keep_acked_msgs=0, keep_acked_s=0)
    prefix = NAMES.exp_wildcard[:-1]
    res = await purge_acked(transport, NAMES.exp_stream, cfg, state, prefix)
    assert (res.purged, res.first_seq) == (1, 2)  # by the server's floor alone
    await state.put(TRAINER_ACKED_BELOW, AckedBelow(durable=NAMES.trainer_consumer, below=4))
    res = await purge_acked(transport, NAMES.exp_stream, cfg, state, prefix)
    assert (res.purged, res.first_seq, res.messages) == (2, 4, 2)
    record = (await read_purged(state))[TRAIN_STAGE]
    assert record.below_seq == 4


async def test_the_dead_letter_watcher_counts_what_is_dead_lettered_after_it_started() -> None:
    from rftstream.actors.dead_letters import DeadLetterThresholdError, DeadLetterWatcher

    transport = MemoryTransport()
    operator = await _bus("operator", transport)
    trainer = await _bus("trainer", transport)
    await operator.publish(NAMES.dlq_subject("raw"), b"old", headers={H_DLQ_REASON: "before"})
    watcher = DeadLetterWatcher(trainer, lambda: 0, window=2, max_share=1.0)
    await watcher.start()  # from now on: the dead letter stored before is not counted
    assert watcher.window.dead_total == 0
    for i in range(2):
        await operator.publish_group("raw", _group(i), msg_id=f"g{i}")
    await operator.ensure_consumer(
        NAMES.exp_stream, "op_raw_to_x", NAMES.exp_subject("raw"), description="", role="operator"
    )
    sub = await operator.pull(NAMES.exp_stream, "op_raw_to_x")
    for msg in await sub.fetch(2, 0.01):
        await operator.dead_letter("x", msg, "op: broken")
    assert watcher.window.dead_total == 2
    with pytest.raises(DeadLetterThresholdError, match="the last 2 groups were all"):
        await watcher.check_final(trained_steps=0)
    await watcher.stop()
