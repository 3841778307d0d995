"""The staleness gate's :class:`~rftstream.control.staleness.ConsumerListing` on both
transports: the experience stream's consumers are listed once and again only when they
change, and a consumer another connection creates is counted by the next look, on a real
nats-server every time (the server's advisory is out before its creator is answered)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import anyio
import msgspec
import nats
import pytest

from rftstream.bus.client import Bus
from rftstream.bus.jetstream import JetStreamTransport
from rftstream.bus.memory import MemoryTransport
from rftstream.bus.transport import ConsumerSpec, Transport
from rftstream.config.schema import NatsConfig
from rftstream.control.staleness import ConsumerListing, experience_backlog
from rftstream.experience import EID, Experience
from rftstream.subjects import RAW_STAGE, RunNames

pytestmark = [pytest.mark.integration, pytest.mark.anyio]

NAMES = RunNames("listing")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # nats-py runs on asyncio only


@pytest.fixture(params=["memory", "nats"])
async def connections(request: pytest.FixtureRequest) -> AsyncIterator[list[Transport]]:
    """Two connections to one server (memory: one in-memory server)."""
    if request.param == "memory":
        first = MemoryTransport()
        pair: list[Transport] = [first, first.connection()]
    else:
        url = request.getfixturevalue("nats_url")
        pair = [
            JetStreamTransport(
                await nats.connect(url), retry_window=5.0, max_inflight_bytes=1 << 20
            )
            for _ in range(2)
        ]
    try:
        yield pair
    finally:
        for t in pair:
            await t.close()


async def _bus(transport: Transport, actor: str) -> Bus:
    bus = Bus(transport, NAMES, msgspec.convert({}, NatsConfig), actor)
    await bus.provision()
    return bus


def _group(task: int) -> list[Experience]:
    return [Experience(tokens=[5, 6, 7, 8], prompt_length=2, reward=1.0, eid=EID(0, task, 0))]


async def _until(check: Callable[[], bool]) -> None:
    with anyio.fail_after(5):
        while not check():
            await anyio.sleep(0.005)


async def test_listed_again_only_when_the_consumers_change(connections: list[Transport]) -> None:
    explorer, other = await _bus(connections[0], "explorer"), await _bus(connections[1], "op")
    listing = ConsumerListing(explorer, NAMES.exp_stream, max_age=3600)
    await listing.start()
    # the advisories of the consumers the two buses provisioned may still be on their way
    await anyio.sleep(0.3)
    try:
        first = await listing.durables()
        assert NAMES.trainer_consumer in dict(first)
        base = listing.listings
        for _ in range(5):
            assert await listing.durables() == first
        assert listing.listings == base
        spec = ConsumerSpec(durable="op_raw_to_extra", filter_subject=NAMES.exp_subject(RAW_STAGE))
        await other.transport.ensure_consumer(NAMES.exp_stream, spec)
        await _until(lambda: listing._listed is None)  # the change was noticed
        assert "op_raw_to_extra" in dict(await listing.durables())
        assert listing.listings == base + 1
        assert "op_raw_to_extra" not in dict(await listing.durables(exclude=("op_raw_to_extra",)))
        await other.transport.delete_consumer(NAMES.exp_stream, "op_raw_to_extra")
        await _until(lambda: listing._listed is None)
        assert "op_raw_to_extra" not in dict(await listing.durables())
        assert listing.listings == base + 2
        listing.forget()  # a listed consumer was not found when its counts were read
        await listing.durables()
        assert listing.listings == base + 3
        listing.max_age = 0.0  # a list older than max_age is listed again
        await listing.durables()
        assert listing.listings == base + 4
    finally:
        await listing.stop()


async def test_a_consumer_created_elsewhere_is_in_the_next_look(
    connections: list[Transport],
) -> None:
    """Another connection creates an operator's consumer and pulls a message from it
    (held, unacked); the look that follows must count it: 30 times over."""
    explorer, other = await _bus(connections[0], "explorer"), await _bus(connections[1], "op")
    listing = ConsumerListing(explorer, NAMES.exp_stream, max_age=3600)
    await listing.start()
    try:
        raw = NAMES.exp_subject(RAW_STAGE)
        for i in range(30):
            before = await experience_backlog(explorer, NAMES.exp_stream, listing=listing)
            await explorer.publish_group(RAW_STAGE, _group(i), msg_id=f"g{i}")
            name = f"op_raw_to_s{i}"
            spec = ConsumerSpec(durable=name, filter_subject=raw, start_seq=None)
            await other.transport.ensure_consumer(NAMES.exp_stream, spec)
            pulled = await (await other.pull(NAMES.exp_stream, name)).fetch(1, 1.0)
            assert len(pulled) == 1
            after = await experience_backlog(explorer, NAMES.exp_stream, listing=listing)
            # the new consumer holds one message, unacked, as each earlier one still does
            assert (before.held_by_operators, after.held_by_operators) == (i, i + 1)
        assert listing.listings < 2 * 30  # two looks an iteration: not listed at each
    finally:
        await listing.stop()
