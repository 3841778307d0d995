"""The trainer's :class:`ExperienceFeed` on the in-memory transport: it fetches only what a
step needs, serves the rest from its buffer, and still runs the splice poll (``on_idle``) at
every step. Acking what was trained: tests/unit/test_bus_on_memory.py."""

from __future__ import annotations

import anyio
import pytest

from rftstream.actors.common import InProgressTicker
from rftstream.actors.feed import ExperienceFeed
from rftstream.bus.client import Bus
from rftstream.subjects import TRAIN_STAGE, RunNames
from tests.integration._util import _group

pytestmark = pytest.mark.anyio

NAMES = RunNames("feed")


async def test_feed_fetches_about_what_the_step_needs_and_polls_every_step() -> None:
    bus = Bus.in_memory(NAMES)
    await bus.provision()
    for i in range(10):  # ten groups of four
        await bus.publish_group(TRAIN_STAGE, _group(i, 1.0, 4), msg_id=f"g{i}")
    consumer = await bus.pull(NAMES.exp_stream, NAMES.trainer_consumer)

    async def never() -> bool:
        return False

    feed = ExperienceFeed(bus, consumer, InProgressTicker(5.0), never, group_size=4)
    polls = 0

    async def poll() -> None:
        nonlocal polls
        polls += 1

    feed.on_idle = poll
    with anyio.fail_after(5):
        assert len(await feed.read(8)) == 8
    info = await consumer.info()
    # two groups make the step: not the 64 messages a fetch may take at most
    assert info.delivered == 2 and feed.buffered == 0
    await feed.commit()
    with anyio.fail_after(5):
        assert len(await feed.read(6)) == 6  # two messages, two experiences left over
        assert feed.buffered == 2
        polls_before = polls
        assert len(await feed.read(2)) == 2  # served from the buffer ...
    assert polls == polls_before + 1  # ... and the splice poll still ran
    info = await consumer.info()
    assert info.delivered == 4 and feed.buffered == 0
