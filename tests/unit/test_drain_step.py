"""drain_step on the in-memory transport: draining a durable up to a cut, one rule for the
trainer's retired consumers and a spliced operator's hosts. The transport applies an ack at
once, so how many messages after the cut are fetched (and acked unprocessed) is exact here;
tests/integration/test_drain.py proves the same loop against nats-server."""

from __future__ import annotations

import anyio
import pytest

from rftstream.actors.common import drain_step
from rftstream.bus.client import Bus
from rftstream.bus.transport import PullSubscription
from rftstream.subjects import TRAIN_STAGE, RunNames
from tests.integration._util import _group

pytestmark = pytest.mark.anyio

NAMES = RunNames("drain")


async def _drain(consumer: PullSubscription, cut: int) -> tuple[list[int], int]:
    """Drain to the end, acking what is processed: (stream sequences processed, skipped)."""
    processed: list[int] = []
    skipped = 0
    with anyio.fail_after(10):
        while True:
            step = await drain_step(consumer, cut, batch=3, timeout=0.01)
            if step.done:
                return processed, skipped
            skipped += step.skipped
            for m in step.mine:
                processed.append(m.metadata.sequence.stream)
                await m.ack()


@pytest.mark.parametrize(("stage_after", "skipped"), [(False, 1), (True, 0)])
async def test_drain_takes_every_message_up_to_the_cut_and_skips_the_rest(
    stage_after: bool, skipped: int
) -> None:
    """The durable has not delivered anything yet: nothing unacked is not "drained" while
    messages up to the cut wait to be delivered. ``stage_after``: the stream's last
    message is on another subject, so the cut is not one of this consumer's sequences.
    exp.a holds 1, 3, 5, ...; the cut is 10 (on exp.b): fetched three at a time, 11 is the
    one message after the cut fetched and acked unprocessed (when exp.a goes on)."""
    bus = Bus.in_memory(NAMES)
    await bus.provision()
    seqs = []
    for i in range(5 if stage_after else 8):  # stage_after: nothing on exp.a after it
        seqs.append((await bus.publish(NAMES.exp_subject("a"), b"x", msg_id=f"a{i}")).seq)
        await bus.publish(NAMES.exp_subject("b"), b"y", msg_id=f"b{i}")
    cut = seqs[4] + 1
    await bus.ensure_consumer(
        NAMES.exp_stream, "d", NAMES.exp_subject("a"), description="t", role="t", start_seq=1
    )
    consumer = await bus.pull(NAMES.exp_stream, "d")
    assert await _drain(consumer, cut) == ([1, 3, 5, 7, 9], skipped)
    info = await consumer.info()
    assert info.num_ack_pending == 0 and info.num_pending == (2 if not stage_after else 0)


async def test_drain_with_an_open_cut_returns_everything_unacked() -> None:
    bus = Bus.in_memory(NAMES)
    await bus.provision()
    for i in range(3):
        await bus.publish_group(TRAIN_STAGE, _group(i, 1.0), msg_id=f"g{i}")
    consumer = await bus.pull(NAMES.exp_stream, NAMES.trainer_consumer)
    step = await drain_step(consumer, None, batch=10, timeout=0.01)
    assert not step.done and step.skipped == 0 and len(step.mine) == 3
    assert (await consumer.info()).num_ack_pending == 3  # the caller acks what it processed
