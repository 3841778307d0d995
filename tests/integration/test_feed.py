"""The trainer's feed fetches only what a step needs, and lets the splice poll run at every
step (real nats-server)."""

from __future__ import annotations

import anyio
import pytest

from rftstream.actors.common import InProgressTicker
from rftstream.actors.feed import ExperienceFeed
from rftstream.bus.client import Bus
from rftstream.config import config_from_dict
from rftstream.runtime import prepare_run, provision
from tests.integration._util import _group, small_config

pytestmark = pytest.mark.integration


def test_feed_fetches_about_what_the_step_needs_and_polls_every_step(
    tmp_path, tiny_model_path: str, nats_url: str
) -> None:
    run = prepare_run(config_from_dict(small_config(tmp_path, tiny_model_path)))

    async def main() -> None:
        await provision(run, nats_url)
        n = run.names
        async with await Bus.connect(nats_url, n, run.cfg.nats, "t") as bus:
            for i in range(10):  # ten groups of four
                await bus.publish_group("train", _group(i, 1.0, 4), msg_id=f"g{i}")
            consumer = await bus.pull(n.exp_stream, n.trainer_consumer)

            async def never() -> bool:
                return False

            feed = ExperienceFeed(bus, consumer, InProgressTicker(5.0), never, group_size=4)
            polls = 0

            async def poll() -> None:
                nonlocal polls
                polls += 1

            feed.on_idle = poll
            with anyio.fail_after(30):
                assert len(await feed.read(8)) == 8
            info = await consumer.info()
            # two groups make the step: not the 64 messages a fetch may take at most
            assert info.delivered == 2 and feed.buffered == 0  # exp.train only: seq = count
            await feed.commit()
            with anyio.fail_after(30):
                assert len(await feed.read(6)) == 6  # two messages, two experiences left over
                polls_before = polls
                assert len(await feed.read(2)) == 2  # served from the buffer ...
            assert polls == polls_before + 1  # ... and the splice poll still ran
            info = await consumer.info()
            assert info.delivered == 4 and feed.buffered == 0

    anyio.run(main, backend="asyncio")
