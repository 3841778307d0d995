"""The bus's own publish and fetch paths against a real nats-server: acks and duplicates,
rejections and timeouts as BusError, the in-flight byte cap, cancellation that leaks
nothing, and a fetch that returns what is there, acks nothing and loses nothing."""

from __future__ import annotations

from typing import Any

import anyio
import msgspec
import nats
import pytest

from rftstream.bus.client import Bus
from rftstream.bus.transport import PullSubscription
from rftstream.config.schema import NatsConfig
from rftstream.errors import BusError
from rftstream.experience import H_MSG_ID, decode_group
from rftstream.subjects import RunNames
from tests.integration._util import _group

pytestmark = pytest.mark.integration

NAMES = RunNames("bc")


async def _bus(url: str, **cfg: Any) -> Bus:
    bus = await Bus.connect(url, NAMES, msgspec.structs.replace(NatsConfig(), **cfg), "t")
    await bus.provision()
    return bus


async def _consumer(bus: Bus) -> PullSubscription:
    consumer = await bus.pull(NAMES.exp_stream, NAMES.stage_consumer("raw", "train"))
    assert consumer._direct  # the nats-py in use has what the direct fetch reads
    return consumer


async def _ack_pending(bus: Bus) -> tuple[int, int]:
    info = await bus.transport.js.consumer_info(
        NAMES.exp_stream, NAMES.stage_consumer("raw", "train")
    )
    return int(info.num_pending), int(info.num_ack_pending)


async def _ack_pending_settles(bus: Bus, expected: tuple[int, int], within: float = 10) -> None:
    """Poll the consumer until it reports `expected`; fail with the last count after `within` s.

    A plain ack is fire-and-forget: nats-server queues acks to the consumer's own goroutine, so
    even after a flush its info may lag by a moment.
    """
    last = await _ack_pending(bus)
    with anyio.move_on_after(within):
        while last != expected:
            await anyio.sleep(0.05)
            last = await _ack_pending(bus)
    assert last == expected


def test_publish_acks_duplicates_and_headers(nats_url: str) -> None:
    async def main() -> None:
        async with await _bus(nats_url) as bus:
            subject = NAMES.exp_subject("raw")
            a = await bus.publish(subject, b"a", headers={"Rft-X": "1"}, msg_id="m1")
            b = await bus.publish(subject, b"b", msg_id="m2")
            again = await bus.publish(subject, b"a", msg_id="m1")
            assert (a.stream, a.seq, a.duplicate) == (NAMES.exp_stream, 1, False)
            assert (b.seq, b.duplicate) == (2, False)
            assert again.duplicate and again.seq == 1
            msg = await bus.transport.js.get_msg(NAMES.exp_stream, 1)
            assert msg.headers is not None
            assert msg.headers[H_MSG_ID] == "m1" and msg.headers["Rft-X"] == "1"
            assert bus.transport._limiter.inflight == 0 and not bus.transport._replies._pending

    anyio.run(main, backend="asyncio")


def test_rejected_and_unrouted_publishes_raise_bus_error(nats_url: str) -> None:
    async def main() -> None:
        async with await _bus(nats_url, retry_window=0.0) as bus:
            wrong = {"Nats-Expected-Stream": "NOT_THIS_ONE"}  # the stream answers 400
            with pytest.raises(BusError, match="rejected"):
                await bus.publish(NAMES.exp_subject("raw"), b"x", headers=wrong, retries=0)
            with pytest.raises(BusError, match="timed out 2 times"):  # no stream: 503
                await bus.publish("nowhere.at.all", b"x", msg_id="n", retries=1)
            assert bus.transport._limiter.inflight == 0 and not bus.transport._replies._pending

    anyio.run(main, backend="asyncio")


def test_unanswered_publish_times_out_and_cancel_leaks_nothing(nats_url: str) -> None:
    async def main() -> None:
        async with await _bus(nats_url, retry_window=0.0) as bus:
            nc = await nats.connect(nats_url)
            try:
                await nc.subscribe("blackhole.x")  # receives it, never replies
                await nc.flush()
                with pytest.raises(BusError, match="timed out 2 times"):
                    await bus.publish("blackhole.x", b"x", msg_id="b", timeout=0.2, retries=1)
                # past `retries`, a timeout is retried until nats.retry_window is over
                bus.cfg = msgspec.structs.replace(bus.cfg, retry_window=1.0)
                with pytest.raises(BusError, match=r"timed out [3-9] times") as err:
                    await bus.publish("blackhole.x", b"x", msg_id="w", timeout=0.2, retries=0)
                assert "nats.retry_window 1 s" in str(err.value)
                assert bus.transport._limiter.inflight == 0 and not bus.transport._replies._pending
                with anyio.move_on_after(0.3) as scope:
                    await bus.publish("blackhole.x", b"y", msg_id="c", timeout=30)
                assert scope.cancelled_caught
                assert bus.transport._limiter.inflight == 0 and not bus.transport._replies._pending
            finally:
                await nc.close()

    anyio.run(main, backend="asyncio")


def test_inflight_bytes_stay_under_the_cap(nats_url: str) -> None:
    async def main() -> None:
        async with await _bus(nats_url, max_inflight_bytes=4000) as bus:
            seen: list[int] = []
            real = bus.transport._replies.request

            async def request(*args: Any, **kw: Any) -> Any:
                seen.append(bus.transport._limiter.inflight)
                return await real(*args, **kw)

            bus.transport._replies.request = request  # type: ignore[method-assign]
            subject = NAMES.exp_subject("raw")
            async with anyio.create_task_group() as tg:
                for i in range(40):
                    tg.start_soon(lambda i=i: bus.publish(subject, b"x" * 1000, msg_id=f"m{i}"))
            assert len(seen) == 40 and max(seen) <= 4000
            assert bus.transport._limiter.inflight == 0 and bus.transport._limiter.waiting == 0
            info = await bus.transport.js.stream_info(NAMES.exp_stream)
            assert info.state.messages == 40

    anyio.run(main, backend="asyncio")


def test_fetch_returns_what_is_there_and_acks_nothing(nats_url: str) -> None:
    async def main() -> None:
        async with await _bus(nats_url) as bus:
            consumer = await _consumer(bus)
            assert await consumer.fetch(10, timeout=0.3) == []  # nothing there
            for t in range(5):
                await bus.publish_group("raw", _group(t, 1.0), msg_id=f"g{t}")
            first = await consumer.fetch(3, timeout=2)
            rest = await consumer.fetch(10, timeout=2)  # the 2 left, without waiting for 10
            assert (len(first), len(rest)) == (3, 2)
            tasks = [decode_group(m.data)[0].eid.task for m in first + rest]
            assert tasks == [0, 1, 2, 3, 4]
            assert await _ack_pending(bus) == (0, 5)  # delivered, none acked
            for m in first + rest:
                await m.ack()
            await bus.transport.nc.flush()
            await _ack_pending_settles(bus, (0, 0))
            with pytest.raises(ValueError):
                await consumer.fetch(0, timeout=1)

    anyio.run(main, backend="asyncio")


def test_fetch_waits_for_a_message_published_meanwhile(nats_url: str) -> None:
    async def main() -> None:
        async with await _bus(nats_url) as bus:
            consumer = await _consumer(bus)
            got: list[Any] = []

            async def fetch() -> None:
                got.extend(await consumer.fetch(10, timeout=10))

            async with anyio.create_task_group() as tg:
                tg.start_soon(fetch)
                await anyio.sleep(0.2)  # the fetch is waiting on the server
                await bus.publish_group("raw", _group(7, 1.0), msg_id="late")
            assert [decode_group(m.data)[0].eid.task for m in got] == [7]

    anyio.run(main, backend="asyncio")


def test_cancelled_fetch_loses_nothing(nats_url: str) -> None:
    async def main() -> None:
        async with await _bus(nats_url) as bus:
            consumer = await _consumer(bus)
            with anyio.move_on_after(0.3):  # its pull request stays open on the server
                await consumer.fetch(10, timeout=30)
            for t in range(3):
                await bus.publish_group("raw", _group(t, 1.0), msg_id=f"g{t}")
            got: list[Any] = []
            with anyio.fail_after(20):
                while len(got) < 3:
                    got.extend(await consumer.fetch(10, timeout=1))
            assert sorted(decode_group(m.data)[0].eid.task for m in got) == [0, 1, 2]
            assert all(m.metadata.num_delivered == 1 for m in got)  # not redeliveries

    anyio.run(main, backend="asyncio")


def test_fetch_cancelled_with_messages_in_hand_gives_them_to_the_next_fetch(
    nats_url: str,
) -> None:
    """A fetch cancelled after it took some messages (the trainer's prefetch, cancelled when
    the training step ends) must not drop them: they were delivered (ack pending), and no
    other fetch would see them before ``ack_wait`` ran out."""

    async def main() -> None:
        async with await _bus(nats_url) as bus:
            consumer = await _consumer(bus)
            for t in range(2):
                await bus.publish_group("raw", _group(t, 1.0), msg_id=f"h{t}")
            # the fetch takes both, then waits for the end of its pull request: hold that
            # end back (as a busy event loop would) and cancel the fetch meanwhile
            took: list[Any] = []
            real_next = consumer._next

            async def slow_end() -> Any:
                if len(took) == 2:
                    await anyio.sleep_forever()
                msg = await real_next()
                took.append(msg)
                return msg

            consumer._next = slow_end  # type: ignore[method-assign]
            with anyio.move_on_after(1.0) as scope:
                await consumer.fetch(10, timeout=30)
            assert scope.cancelled_caught and len(took) == 2
            consumer._next = real_next  # type: ignore[method-assign]
            assert await _ack_pending(bus) == (0, 2)  # delivered to the cancelled fetch
            await bus.publish_group("raw", _group(2, 1.0), msg_id="h2")
            got: list[Any] = []
            with anyio.fail_after(20):
                while len(got) < 3:
                    got.extend(await consumer.fetch(10, timeout=1))
            assert [decode_group(m.data)[0].eid.task for m in got] == [0, 1, 2]
            assert all(m.metadata.num_delivered == 1 for m in got)
            for m in got:
                await m.ack_sync()
            assert await _ack_pending(bus) == (0, 0)

    anyio.run(main, backend="asyncio")


def test_fetch_falls_back_to_nats_py_and_translates_a_closed_connection(nats_url: str) -> None:
    async def main() -> None:
        bus = await _bus(nats_url)
        consumer = await _consumer(bus)
        consumer._direct = False  # as with a nats-py without the attributes it reads
        await bus.publish_group("raw", _group(1, 1.0), msg_id="g1")
        (m,) = await consumer.fetch(5, timeout=2)
        await m.ack()
        assert await consumer.fetch(5, timeout=0.2) == []
        consumer._direct = True
        await bus.close()
        with pytest.raises(BusError, match="connection closed"):
            await consumer.fetch(5, timeout=0.2)

    anyio.run(main, backend="asyncio")


def test_concurrent_large_publishes_with_headers_stay_whole(nats_url: str) -> None:
    """Many publishes of large bodies with headers at once: more than nats-py's pending
    buffer holds, so queueing a command flushes (and yields) mid-way; every message is
    stored whole, with its headers, and the connection never breaks (a command split by
    another publish's bytes makes the server close it with a parser error)."""

    async def main() -> None:
        async with await _bus(nats_url, max_inflight_bytes=64 << 20) as bus:
            subject = NAMES.exp_subject("raw")
            bodies = {i: bytes([i % 251]) * (300_000 + i) for i in range(48)}
            async with anyio.create_task_group() as tg:
                for i, body in bodies.items():
                    tg.start_soon(
                        lambda i=i, body=body: bus.publish(
                            subject, body, headers={"Rft-Index": str(i)}, msg_id=f"big{i}"
                        )
                    )
            info = await bus.transport.js.stream_info(NAMES.exp_stream)
            assert info.state.messages == len(bodies)
            for seq in range(1, len(bodies) + 1):
                msg = await bus.transport.js.get_msg(NAMES.exp_stream, seq)
                assert msg.headers is not None
                i = int(msg.headers["Rft-Index"])
                assert msg.data == bodies[i] and msg.headers[H_MSG_ID] == f"big{i}"

    anyio.run(main, backend="asyncio")
