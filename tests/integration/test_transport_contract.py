"""One contract, two transports: the same cases run on :class:`MemoryTransport` and on
:class:`JetStreamTransport` against a real nats-server, so the in-memory twin that the unit
tests use cannot drift from JetStream on what the actors rely on: sequences and
deduplication, stream state, durable pull consumers (order, acks, ack floor, filters, start
sequences), purges, ordered readers (and their descriptions), KV revisions and
compare-and-set, and the neutral errors for missing names. Time-driven behaviour (ack
waits, nak delays) is left to ``tests/unit/test_memory_transport.py`` with its fake clock.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import anyio
import nats
import pytest

from rftstream.bus.jetstream import JetStreamTransport
from rftstream.bus.memory import MemoryTransport
from rftstream.bus.transport import ConsumerSpec, StreamSpec, Transport
from rftstream.errors import (
    BucketNotFound,
    CasConflict,
    ConsumerNotFound,
    KeyNotFound,
    MessageNotFound,
    StreamNotFound,
)

pytestmark = [pytest.mark.integration, pytest.mark.anyio]

ID = "Nats-Msg-Id"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # nats-py runs on asyncio only


@pytest.fixture(params=["memory", "nats"])
async def transport(request: pytest.FixtureRequest) -> AsyncIterator[Transport]:
    if request.param == "memory":
        t: Transport = MemoryTransport()
        yield t
        await t.close()
        return
    url = request.getfixturevalue("nats_url")
    nc = await nats.connect(url)
    t = JetStreamTransport(nc, retry_window=5.0, max_inflight_bytes=1 << 20)
    try:
        yield t
    finally:
        await t.close()


async def _stream(t: Transport) -> None:
    await t.ensure_stream(StreamSpec(name="S", subjects=("s.>",)), "test")


async def _durable(t: Transport, name: str = "d", **spec: object) -> None:
    await t.ensure_consumer("S", ConsumerSpec(durable=name, **{"filter_subject": "s.>", **spec}))  # type: ignore[arg-type]


async def test_publish_numbers_deduplicates_and_reports_the_stream(transport: Transport) -> None:
    t = transport
    await _stream(t)
    a = await t.publish("s.a", b"1", {ID: "m1"}, 5.0)
    b = await t.publish("s.b", b"2", None, 5.0)
    again = await t.publish("s.a", b"1", {ID: "m1"}, 5.0)
    assert (a.seq, a.duplicate, b.seq, again.seq, again.duplicate) == (1, False, 2, 1, True)
    state = await t.stream_state("S", subjects_filter="s.>")
    assert (state.first_seq, state.last_seq, state.messages) == (1, 2, 2)
    assert state.subjects == {"s.a": 1, "s.b": 1}
    last = await t.last_msg("S", "s.a")
    assert (last.seq, last.data, last.subject) == (1, b"1", "s.a")
    assert (await t.get_msg("S", 2)).data == b"2"
    with pytest.raises(MessageNotFound):
        await t.get_msg("S", 9)
    with pytest.raises(MessageNotFound):
        await t.last_msg("S", "s.none")


async def test_a_durable_delivers_in_order_and_its_floor_follows_contiguous_acks(
    transport: Transport,
) -> None:
    t = transport
    await _stream(t)
    for i in range(4):
        await t.publish("s.a", str(i).encode(), None, 5.0)
    await _durable(t, description="a reader")
    sub = await t.pull("S", "d")
    first = await sub.fetch(3, 2.0)
    assert [m.metadata.sequence.stream for m in first] == [1, 2, 3]
    assert [m.data for m in first] == [b"0", b"1", b"2"]
    info = await sub.info()
    assert (info.delivered, info.ack_floor, info.num_pending, info.num_ack_pending) == (3, 0, 1, 3)
    await first[1].ack_sync()
    assert (await t.consumer_state("S", "d")).ack_floor == 0  # seq 1 is not acked yet
    await first[0].ack_sync()
    await first[2].ack_sync()
    state = await t.consumer_state("S", "d")
    assert (state.ack_floor, state.num_ack_pending, state.num_pending) == (3, 0, 1)
    assert state.durable and state.description == "a reader"
    assert [m.data for m in await sub.fetch(10, 1.0)] == [b"3"]
    await sub.unsubscribe()


async def test_unacked_messages_come_back_after_ack_wait_until_max_deliver(
    transport: Transport,
) -> None:
    """The time-driven side of a durable: what is not acked within ``ack_wait`` is
    delivered again (counted), ``max_deliver`` ends that, a nak with a delay holds the
    message back for the delay, and ``in_progress`` keeps it from coming back."""
    t = transport
    await _stream(t)
    for i in range(3):
        await t.publish("s.a", str(i).encode(), None, 5.0)
    await _durable(t, ack_wait=1.5, max_deliver=2)
    sub = await t.pull("S", "d")
    held = await sub.fetch(3, 2.0)
    assert [m.metadata.num_delivered for m in held] == [1, 1, 1]
    await held[0].nak(delay=1.8)  # back in 1.8 s
    await held[1].term()  # never again
    assert await sub.fetch(3, 0.3) == []  # nothing is due yet
    for _ in range(5):  # 0.4 s apart: seq 3 stays in progress past its ack_wait
        await anyio.sleep(0.4)
        await held[2].in_progress()
    again = await sub.fetch(3, 1.0)  # seq 1 after its delay; seq 3 kept by in_progress
    assert [(m.metadata.sequence.stream, m.metadata.num_delivered) for m in again] == [(1, 2)]
    await anyio.sleep(1.8)  # past ack_wait: seq 3 comes back; seq 1 is at max_deliver
    last = await sub.fetch(3, 1.0)
    assert [(m.metadata.sequence.stream, m.metadata.num_delivered) for m in last] == [(3, 2)]
    await last[0].ack_sync()
    await anyio.sleep(1.7)
    assert await sub.fetch(3, 0.5) == []  # seq 1 delivered max_deliver times: not again
    await sub.unsubscribe()


async def test_filters_and_start_sequences(transport: Transport) -> None:
    t = transport
    await _stream(t)
    for subject in ("s.a", "s.b", "s.a", "s.b", "s.b"):
        await t.publish(subject, subject.encode(), None, 5.0)
    await _durable(t, "b_from_4", filter_subject="s.b", start_seq=4)
    sub = await t.pull("S", "b_from_4")
    got = await sub.fetch(10, 1.0)
    assert [m.metadata.sequence.stream for m in got] == [4, 5]
    for m in got:
        await m.ack_sync()
    state = await t.consumer_state("S", "b_from_4")
    assert (state.filter_subject, state.ack_floor, state.num_pending) == ("s.b", 5, 0)
    await sub.unsubscribe()


async def test_purge_keeps_the_newer_part_of_a_subject(transport: Transport) -> None:
    t = transport
    await _stream(t)
    for subject in ("s.a", "s.b", "s.a", "s.a"):
        await t.publish(subject, b"x", None, 5.0)
    await t.purge("S", "s.a", 4)  # seq 1 and 3 go; seq 4 and the other subject stay
    state = await t.stream_state("S", subjects_filter="s.>")
    assert state.subjects == {"s.a": 1, "s.b": 1}
    assert (state.first_seq, state.last_seq, state.messages) == (2, 4, 2)
    with pytest.raises(MessageNotFound):
        await t.get_msg("S", 1)


async def test_an_ordered_reader_sees_every_message_and_is_listed_with_its_description(
    transport: Transport,
) -> None:
    t = transport
    await _stream(t)
    for i in range(3):
        await t.publish("s.a", str(i).encode(), {ID: f"m{i}", "Rft-Count": "2"}, 5.0)
    reader = await t.read("S", "s.a", start_seq=2, headers_only=True, description="who reads")
    got = []
    while (msg := await reader.next(1.0)) is not None:
        got.append(msg)
        if msg.metadata.num_pending == 0:
            break
    assert [m.metadata.sequence.stream for m in got] == [2, 3]
    assert all((m.headers or {}).get("Rft-Count") == "2" for m in got)
    readers = [c for c in await t.consumers("S") if not c.durable]
    assert [(c.filter_subject, c.description) for c in readers] == [("s.a", "who reads")]
    await reader.close()


async def test_kv_revisions_compare_and_set_and_keys(transport: Transport) -> None:
    t = transport
    kv = await t.kv("B", create=True)
    first = await kv.create("a.x", b"1")
    with pytest.raises(CasConflict):
        await kv.create("a.x", b"2")
    second = await kv.update("a.x", b"2", last=first)
    assert second > first
    with pytest.raises(CasConflict):
        await kv.update("a.x", b"3", last=first)
    entry = await kv.get("a.x")
    assert (entry.value, entry.revision) == (b"2", second)
    await kv.put("a.y", b"y")
    await kv.put("b.z", b"z")
    assert sorted(await kv.keys("a.")) == ["a.x", "a.y"]
    await kv.delete("a.y")
    with pytest.raises(KeyNotFound):
        await kv.get("a.y")
    # a deleted key keeps its entry (a delete marker): keys lists it, get tells
    assert sorted(await kv.keys("a.")) == ["a.x", "a.y"]
    assert (await kv.create("a.y", b"again")) > second  # a deleted key can be created again


async def test_kv_write_notifications_name_only_the_watched_keys(transport: Transport) -> None:
    """What the control plane waits on (rftstream.control.KeyWrites): every put, create,
    update and delete of a watched key calls back; other keys and writes after the
    unsubscribe do not."""
    kv = await transport.kv("W", create=True)
    calls = 0

    async def written() -> None:
        nonlocal calls
        calls += 1

    async def settled(expected: int) -> None:
        with anyio.fail_after(5):
            while calls < expected:
                await anyio.sleep(0.01)
        await anyio.sleep(0.1)  # and no more than that
        assert calls == expected

    sub = await kv.on_write(("splice", "stage.a"), written)
    rev = await kv.create("splice", b"1")
    await settled(1)
    await kv.update("splice", b"2", last=rev)
    await kv.put("stage.a", b"x")
    await settled(3)
    await kv.put("stage.b", b"y")  # not watched
    await kv.put("splice.more", b"z")  # a longer key is another key
    await settled(3)
    await kv.delete("stage.a")
    await settled(4)
    await sub.unsubscribe()
    await kv.put("splice", b"3")
    await settled(4)


async def test_missing_names_raise_the_neutral_errors(transport: Transport) -> None:
    t = transport
    with pytest.raises(StreamNotFound):
        await t.stream_state("NOPE")
    await _stream(t)
    with pytest.raises(ConsumerNotFound):
        await t.consumer_state("S", "nobody")
    with pytest.raises(ConsumerNotFound):
        await t.delete_consumer("S", "nobody")
    with pytest.raises(BucketNotFound):
        await t.kv("NO_BUCKET", create=False)
