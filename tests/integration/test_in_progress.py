"""A held task is not redelivered however long its rollout takes: the explorer's
:class:`~rftstream.actors.common.InProgressTicker` sends ``+WPI`` every third of the ack
wait (real nats-server, a task consumer with a 1.5 s ack wait held for 5 s); released
and left unacked, the same message is redelivered after the ack wait."""

from __future__ import annotations

import anyio
import nats
import nats.errors
from nats.js import api

from rftstream.actors.common import InProgressTicker


def test_a_held_message_outlives_its_ack_wait_and_a_released_one_does_not(nats_url: str) -> None:
    async def main() -> None:
        nc = await nats.connect(nats_url)
        js = nc.jetstream()
        await js.add_stream(name="HOLD", subjects=["hold.tasks"])
        await js.add_consumer(
            "HOLD", api.ConsumerConfig(durable_name="x", ack_wait=1.5, max_deliver=5)
        )
        await js.publish("hold.tasks", b"task")
        sub = await js.pull_subscribe_bind("x", stream="HOLD")
        (msg,) = await sub.fetch(1, timeout=5)
        ticker = InProgressTicker(1.5 / 3)
        ticker.hold(msg)
        async with anyio.create_task_group() as tg:
            tg.start_soon(ticker.run)
            await anyio.sleep(4.0)  # > 2 ack waits
            try:  # a pull meanwhile gets nothing: the message is still held
                stolen = await sub.fetch(1, timeout=1.5)
            except nats.errors.TimeoutError:
                stolen = []
            assert stolen == []
            info = await js.consumer_info("HOLD", "x")
            assert info.num_redelivered == 0 and info.num_ack_pending == 1
            ticker.release(msg)
            tg.cancel_scope.cancel()
        # released without an ack: the server hands it out again after the ack wait
        (again,) = await sub.fetch(1, timeout=5)
        assert again.data == b"task" and again.metadata.num_delivered == 2
        await again.ack()
        await nc.close()

    anyio.run(main, backend="asyncio")
