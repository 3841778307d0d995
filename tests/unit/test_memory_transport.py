"""The in-memory transport keeps the JetStream semantics the actors rely on: sequences,
deduplication, limits, durable pull consumers (acks, naks, redelivery, start sequences,
filters), ordered reads and watches, KV revisions and compare-and-set conflicts."""

from __future__ import annotations

import pytest

from rftstream.bus.memory import MemoryTransport, subject_matches
from rftstream.bus.transport import ConsumerSpec, Delivery, StreamSpec
from rftstream.errors import (
    BucketNotFound,
    BusError,
    BusTimeout,
    CasConflict,
    ConsumerNotFound,
    KeyNotFound,
    MessageNotFound,
    StreamFullError,
    StreamNotFound,
)

pytestmark = pytest.mark.anyio

ID = "Nats-Msg-Id"


class Clock:
    """A clock the test moves: ack waits and nak delays pass without sleeping."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def _transport(clock: Clock | None = None, **spec: object) -> MemoryTransport:
    t = MemoryTransport(clock=clock or Clock())
    await t.ensure_stream(StreamSpec(name="S", subjects=("s.>",), **spec), "test")  # type: ignore[arg-type]
    return t


async def _durable(t: MemoryTransport, name: str = "d", **spec: object) -> None:
    await t.ensure_consumer("S", ConsumerSpec(durable=name, **{"filter_subject": "s.>", **spec}))  # type: ignore[arg-type]


def test_subject_wildcards() -> None:
    assert subject_matches("a.*.c", "a.b.c") and not subject_matches("a.*.c", "a.b.d")
    assert subject_matches("a.>", "a.b.c") and not subject_matches("a.>", "a")
    assert not subject_matches("a.b", "a.b.c") and not subject_matches("a.b.c", "a.b")


async def test_publish_numbers_messages_and_drops_duplicates_by_msg_id() -> None:
    t = await _transport()
    a = await t.publish("s.a", b"1", {ID: "m1"}, 1.0)
    b = await t.publish("s.b", b"2", None, 1.0)
    again = await t.publish("s.a", b"1", {ID: "m1"}, 1.0)
    assert (a.seq, a.duplicate, b.seq) == (1, False, 2)
    assert again.duplicate and again.seq == 1
    state = await t.stream_state("S", subjects_filter="s.>")
    assert (state.first_seq, state.last_seq, state.messages) == (1, 2, 2)
    assert state.subjects == {"s.a": 1, "s.b": 1}
    assert (await t.last_msg("S", "s.a")).data == b"1"
    assert (await t.get_msg("S", 2)).subject == "s.b"
    with pytest.raises(MessageNotFound):
        await t.get_msg("S", 9)
    with pytest.raises(BusTimeout, match="no stream"):
        await t.publish("other.x", b"", None, 1.0)


async def test_a_duplicate_after_the_window_is_stored_again() -> None:
    clock = Clock()
    t = await _transport(clock, duplicate_window=10.0)
    await t.publish("s.a", b"1", {ID: "m"}, 1.0)
    clock.now += 11
    assert not (await t.publish("s.a", b"1", {ID: "m"}, 1.0)).duplicate


async def test_discard_new_refuses_and_discard_old_drops_the_oldest() -> None:
    full = await _transport(max_msgs=2)
    await full.publish("s.a", b"1", None, 1.0)
    await full.publish("s.a", b"2", None, 1.0)
    with pytest.raises(StreamFullError):
        await full.publish("s.a", b"3", None, 1.0)
    rolling = await _transport(max_msgs=2, discard="old")
    for i in range(3):
        await rolling.publish("s.a", str(i).encode(), None, 1.0)
    state = await rolling.stream_state("S")
    assert (state.first_seq, state.last_seq, state.messages) == (2, 3, 2)
    small = await _transport(max_msg_size=4)
    with pytest.raises(BusError, match="size"):
        await small.publish("s.a", b"12345", None, 1.0)


async def test_a_durable_delivers_in_order_and_acks_move_its_floor() -> None:
    t = await _transport()
    for i in range(4):
        await t.publish("s.a", str(i).encode(), None, 1.0)
    await _durable(t)
    sub = await t.pull("S", "d")
    first = await sub.fetch(3, 0.01)
    assert [m.metadata.sequence.stream for m in first] == [1, 2, 3]
    # still to deliver after each, when it was handed out
    assert [m.metadata.num_pending for m in first] == [3, 2, 1]
    info = await sub.info()
    assert (info.delivered, info.ack_floor, info.num_pending, info.num_ack_pending) == (3, 0, 1, 3)
    await first[1].ack()
    assert (await sub.info()).ack_floor == 0  # 1 is not acked yet
    await first[0].ack()
    await first[2].term()
    info = await t.consumer_state("S", "d")
    assert (info.ack_floor, info.num_ack_pending) == (3, 0)
    assert [m.data for m in await sub.fetch(10, 0.01)] == [b"3"]
    assert await sub.fetch(10, 0.01) == []


async def test_unacked_messages_come_again_after_ack_wait_and_naks_after_their_delay() -> None:
    clock = Clock()
    t = await _transport(clock)
    await t.publish("s.a", b"x", None, 1.0)
    await t.publish("s.a", b"y", None, 1.0)
    await _durable(t, ack_wait=30.0)
    sub = await t.pull("S", "d")
    x, y = await sub.fetch(2, 0.01)
    await y.nak(delay=5.0)
    assert await sub.fetch(2, 0.01) == []
    clock.now += 6
    (again,) = await sub.fetch(2, 0.01)
    assert again.data == b"y" and again.metadata.num_delivered == 2
    await again.ack()
    await x.in_progress()  # at 1006: its ack wait starts over
    clock.now += 29
    assert await sub.fetch(2, 0.01) == []
    clock.now += 2
    (late,) = await sub.fetch(2, 0.01)
    assert late.data == b"x" and late.metadata.num_delivered == 2
    assert (await sub.info()).num_redelivered == 1


async def test_max_deliver_stops_redelivery() -> None:
    clock = Clock()
    t = await _transport(clock)
    await t.publish("s.a", b"x", None, 1.0)
    await _durable(t, ack_wait=1.0, max_deliver=2)
    sub = await t.pull("S", "d")
    assert len(await sub.fetch(1, 0.01)) == 1
    clock.now += 2
    assert len(await sub.fetch(1, 0.01)) == 1
    clock.now += 2
    assert await sub.fetch(1, 0.01) == []


async def test_replicas_binding_one_durable_share_its_messages() -> None:
    t = await _transport()
    for i in range(4):
        await t.publish("s.a", str(i).encode(), None, 1.0)
    await _durable(t)
    a, b = await t.pull("S", "d"), await t.pull("S", "d")
    got = [m.data for m in await a.fetch(2, 0.01)] + [m.data for m in await b.fetch(5, 0.01)]
    assert got == [b"0", b"1", b"2", b"3"]


async def test_filters_start_sequences_and_max_ack_pending() -> None:
    t = await _transport()
    for subject in ("s.a", "s.b", "s.a", "s.b"):
        await t.publish(subject, subject.encode(), None, 1.0)
    await _durable(t, "only_b", filter_subject="s.b")
    await _durable(t, "from3", start_seq=3)
    await _durable(t, "one", max_ack_pending=1)
    assert [
        m.metadata.sequence.stream for m in await (await t.pull("S", "only_b")).fetch(9, 0.01)
    ] == [2, 4]
    assert [
        m.metadata.sequence.stream for m in await (await t.pull("S", "from3")).fetch(9, 0.01)
    ] == [3, 4]
    one = await t.pull("S", "one")
    (m,) = await one.fetch(9, 0.01)
    assert await one.fetch(9, 0.01) == []  # one unacked at most
    await m.ack()
    assert len(await one.fetch(9, 0.01)) == 1


async def test_a_fetch_waits_for_a_publish() -> None:
    import anyio

    t = await _transport()
    await _durable(t)
    sub = await t.pull("S", "d")
    got: list[Delivery] = []

    async def fetch() -> None:
        got.extend(await sub.fetch(1, 5.0))

    async with anyio.create_task_group() as tg:
        tg.start_soon(fetch)
        await anyio.wait_all_tasks_blocked()
        await t.publish("s.a", b"late", None, 1.0)
    assert [m.data for m in got] == [b"late"]


async def test_a_work_queue_forgets_what_was_acked() -> None:
    t = await _transport(retention="work_queue")
    await t.publish("s.a", b"task", None, 1.0)
    await _durable(t)
    (m,) = await (await t.pull("S", "d")).fetch(1, 0.01)
    await m.ack()
    assert (await t.stream_state("S")).messages == 0
    with pytest.raises(BusError, match="retention"):
        await t.ensure_stream(StreamSpec(name="S", subjects=("s.>",)), "test")


async def test_purge_keeps_the_newer_part_of_a_subject() -> None:
    t = await _transport()
    for subject in ("s.a", "s.b", "s.a", "s.a"):
        await t.publish(subject, b"", None, 1.0)
    await t.purge("S", "s.a", 4)
    state = await t.stream_state("S", subjects_filter=">")
    assert state.subjects == {"s.a": 1, "s.b": 1} and state.first_seq == 2


async def test_ordered_reads_and_watches_see_every_message_in_order() -> None:
    t = await _transport()
    for i in range(3):
        await t.publish(f"s.{i}", str(i).encode(), {"H": str(i)}, 1.0)
    reader = await t.read(None, "s.>", start_seq=2, headers_only=True)
    m = await reader.next(0.01)
    assert m is not None and m.data == b"" and m.headers == {"H": "1"}
    assert m.metadata.num_pending == 1
    seen: list[int] = []

    async def on_msg(msg: Delivery) -> None:
        seen.append(msg.metadata.sequence.stream)

    watch = await t.watch("S", "s.>", on_msg, start_seq=2)
    assert seen == [2, 3]
    assert any(not c.durable for c in await t.consumers("S"))
    await t.publish("s.x", b"", None, 1.0)
    assert seen == [2, 3, 4] and (await watch.info()).delivered == 4
    await watch.unsubscribe()
    await reader.close()
    await t.publish("s.x", b"", None, 1.0)
    assert seen == [2, 3, 4]
    assert all(c.durable for c in await t.consumers("S"))


async def test_missing_names_raise_the_neutral_errors() -> None:
    t = await _transport()
    with pytest.raises(StreamNotFound):
        await t.stream_state("NOPE")
    with pytest.raises(ConsumerNotFound):
        await t.pull("S", "nope")
    with pytest.raises(ConsumerNotFound):
        await t.delete_consumer("S", "nope")
    with pytest.raises(BucketNotFound):
        await t.kv("nope", create=False)


async def test_kv_revisions_and_compare_and_set() -> None:
    t = MemoryTransport()
    kv = await t.kv("b", create=True)
    assert await t.kv("b", create=False) is kv
    r1 = await kv.create("k", b"1")
    with pytest.raises(CasConflict):
        await kv.create("k", b"2")
    r2 = await kv.update("k", b"3", last=r1)
    with pytest.raises(CasConflict):
        await kv.update("k", b"4", last=r1)
    entry = await kv.get("k")
    assert (entry.value, entry.revision) == (b"3", r2) and r2 > r1
    await kv.put("other.x", b"5")
    assert await kv.keys() == ["k", "other.x"] and await kv.keys("other.") == ["other.x"]
    await kv.delete("k")
    with pytest.raises(KeyNotFound):
        await kv.get("k")
    assert await kv.create("k", b"again") > r2  # a deleted key can be created again
    assert "KV_b" in await t.streams()
    await t.delete_kv("b")
    with pytest.raises(BucketNotFound):
        await t.kv("b", create=False)


async def test_kv_write_notifications() -> None:
    t = MemoryTransport()
    kv = await t.kv("b", create=True)
    fired: list[int] = []

    async def changed() -> None:
        fired.append(1)

    sub = await kv.on_write(("watched",), changed)
    await kv.put("watched", b"1")
    await kv.put("other", b"1")
    await kv.delete("watched")
    assert len(fired) == 2
    await sub.unsubscribe()
    await kv.put("watched", b"2")
    assert len(fired) == 2


async def test_a_second_connection_shares_the_server_and_closes_alone() -> None:
    t = await _transport()
    other = t.connection()
    await _durable(other)
    await other.publish("s.a", b"1", None, 1.0)
    (msg,) = await (await t.pull("S", "d")).fetch(1, 0.01)  # the durable made on `other`
    assert msg.data == b"1"
    kv = await other.kv("b", create=True)
    await kv.put("k", b"v")
    assert (await (await t.kv("b", create=False)).get("k")).value == b"v"
    await other.close()
    assert other.is_closed and not t.is_closed
    with pytest.raises(BusError, match="connection closed"):
        await other.publish("s.a", b"2", None, 1.0)
    assert not (await t.publish("s.a", b"2", None, 1.0)).duplicate
