"""The explorer's kept KV values (:class:`~rftstream.bus.state.MirroredState`) on both
transports, and on a real nats-server the ordering it is used for: a write another
connection made before a reply this one then got is in the kept value once the reply is
in, every time, with no KV read in between."""

from __future__ import annotations

from collections.abc import AsyncIterator

import anyio
import nats
import pytest

from rftstream.bus.jetstream import JetStreamTransport
from rftstream.bus.memory import MemoryTransport
from rftstream.bus.state import MirroredState, RunState
from rftstream.bus.transport import KeyValueStore, StreamSpec, Transport
from rftstream.wire import STATUS, TRAINER_STEP, TRAINER_UNACKED, TrainedUnacked

pytestmark = [pytest.mark.integration, pytest.mark.anyio]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # nats-py runs on asyncio only


async def _jetstream(url: str) -> JetStreamTransport:
    return JetStreamTransport(await nats.connect(url), retry_window=5.0, max_inflight_bytes=1 << 20)


@pytest.fixture(params=["memory", "nats"])
async def transport(request: pytest.FixtureRequest) -> AsyncIterator[Transport]:
    t: Transport = (
        MemoryTransport()
        if request.param == "memory"
        else await _jetstream(request.getfixturevalue("nats_url"))
    )
    try:
        yield t
    finally:
        await t.close()


class CountingKV:
    """A bucket that counts the reads that reach it."""

    def __init__(self, kv: KeyValueStore) -> None:
        self._kv = kv
        self.gets: list[str] = []

    def __getattr__(self, name: str) -> object:
        return getattr(self._kv, name)

    async def get(self, key: str):  # type: ignore[no-untyped-def]
        self.gets.append(key)
        return await self._kv.get(key)


async def _settled(read, expected) -> None:  # type: ignore[no-untyped-def]
    with anyio.fail_after(5):
        while await read() != expected:
            await anyio.sleep(0.005)


async def test_on_value_hands_on_each_write_of_the_keys(transport: Transport) -> None:
    kv = await transport.kv("V", create=True)
    seen: list[tuple[str, bytes | None]] = []
    writes = await kv.on_value(("a", "b.c"), lambda k, v: seen.append((k, v)))
    await kv.put("a", b"1")
    await kv.put("b.c", b"2")
    await kv.put("b", b"not kept")
    await kv.put("b.c.d", b"a longer key is another key")
    await kv.delete("a")
    await kv.put("a", b"3")
    await kv.put("a", b"4")
    with anyio.fail_after(5):
        while len(seen) < 5:
            await anyio.sleep(0.005)
    await anyio.sleep(0.1)  # and no more than that
    assert seen == [("a", b"1"), ("b.c", b"2"), ("a", None), ("a", b"3"), ("a", b"4")]
    assert writes.missed() is False
    await writes.unsubscribe()
    await kv.put("a", b"5")
    await anyio.sleep(0.1)
    assert len(seen) == 5


async def test_kept_keys_are_read_once_and_then_follow_the_writes(transport: Transport) -> None:
    kv = await transport.kv("M", create=True)
    await RunState(kv).put(STATUS, "running")
    counting = CountingKV(kv)
    async with MirroredState(counting, (STATUS, TRAINER_UNACKED)) as state:  # type: ignore[arg-type]
        assert sorted(counting.gets) == ["status", "trainer.trained_unacked"]  # one read each
        assert await state.status() == "running"
        assert await state.get(TRAINER_UNACKED) is None
        writer = RunState(kv)
        await writer.put(TRAINER_UNACKED, TrainedUnacked(trained=64, acked=0))
        await writer.set_status("finished")
        await _settled(state.status, "finished")
        got = await state.get(TRAINER_UNACKED)
        assert got is not None and (got.trained, got.acked) == (64, 0)
        await writer.delete(STATUS)
        await _settled(state.status, "")
        assert sorted(counting.gets) == ["status", "trainer.trained_unacked"]  # no more reads
        # a key not kept is read from the bucket, as are revisions of kept keys
        await writer.put(TRAINER_STEP, 3)
        assert await state.get(TRAINER_STEP) == 3
        assert (await state.entry(TRAINER_UNACKED))[1] is not None
        assert counting.gets[2:] == ["trainer.step", "trainer.trained_unacked"]
    # stopped: reads go to the bucket again
    assert await state.status() == ""
    assert counting.gets[-1] == "status"


async def test_a_write_before_a_reply_is_kept_once_the_reply_is_in(nats_url: str) -> None:
    """The trainer writes ``weights.pending`` and then acks; the explorer reads the queues
    (a reply) and then the kept value: it must be the new one. Here another connection
    writes the value, then publishes to a stream (a reply to it marks the write as done
    at the server), and the reader asks for the stream's state (its reply comes after
    both) and reads the kept value with no KV read in between, 300 times."""
    writer = await _jetstream(nats_url)
    reader = await _jetstream(nats_url)
    try:
        await writer.ensure_stream(StreamSpec(name="ORD", subjects=("ord.>",)), "test")
        wkv = await writer.kv("O", create=True)
        await RunState(wkv).put(TRAINER_STEP, 0)
        counting = CountingKV(await reader.kv("O", create=False))
        async with MirroredState(counting, (TRAINER_STEP,)) as state:  # type: ignore[arg-type]
            reads = len(counting.gets)
            for i in range(1, 301):
                await RunState(wkv).put(TRAINER_STEP, i)
                await writer.publish("ord.x", b"acked", None, 5.0)
                assert (await reader.stream_state("ORD")).messages == i
                assert await state.get(TRAINER_STEP) == i, f"write {i} not kept after the reply"
            assert len(counting.gets) == reads
    finally:
        await writer.close()
        await reader.close()
