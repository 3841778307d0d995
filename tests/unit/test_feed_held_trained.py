"""What a feed that holds trained messages for the next checkpoint (``hold_trained``)
tells the trainer: how many and how large they are, what a checkpoint written now must
remember (a batch taken but not trained included), and when a retired consumer waits
only for those acks (the trainer then checkpoints so a splice can finish)."""

from __future__ import annotations

import anyio
import pytest

from rftstream.subjects import TRAIN_STAGE, RunNames
from tests.unit._util import trainer_feed

pytestmark = pytest.mark.anyio

NAMES = RunNames("held")


async def test_held_messages_are_counted_remembered_and_free_a_retired_consumer() -> None:
    feed = await trainer_feed(NAMES, 2, hold_trained=True)  # two groups of four
    bus = feed.bus
    with anyio.fail_after(5):
        first = await feed.read(6)  # the first group and half of the second
    await feed.commit()
    assert feed.trained_unacked == 1 and feed.trained_unacked_bytes > 100
    assert sorted(feed.trained_uids()) == sorted(e.eid.uid for e in first)
    assert not feed.held_for_retired  # nothing retired

    # a splice: the consumer read so far is retired, a new one is read from now on
    await bus.ensure_consumer(
        NAMES.exp_stream, "trainer_next", NAMES.exp_subject("next"), description="t", role="trainer"
    )
    await feed.switch_to(await bus.pull(NAMES.exp_stream, "trainer_next"), cut_seq=2)
    with anyio.fail_after(5):
        rest = await feed.read(2)  # the rest of the second group, taken, not trained
    # a checkpoint written now (a trainer cancelled before training them) still remembers
    # the half of the second group trained before
    assert sorted(feed.trained_uids()) == sorted(e.eid.uid for e in first)
    assert not feed.held_for_retired  # the retired consumer's batch is not trained yet
    await feed.commit()
    assert feed.trained_unacked == 2
    assert feed.held_for_retired  # its messages are all trained: only the acks are missing
    assert len(feed.trained_uids()) == len(first) + len(rest)
    assert await feed.release_trained() == 2
    assert feed.trained_unacked == 0 and feed.trained_unacked_bytes == 0
    assert not feed.held_for_retired and feed.trained_uids() == []


async def test_a_resumed_feed_skips_every_experience_its_checkpoint_trained() -> None:
    """A checkpoint keeps a digest of every experience trained (not only those whose
    messages were unacked): a copy of an acked message that comes again (its ack lost with
    a killed server, or republished after the stream forgot the first) is skipped and
    acked, not trained a second time."""
    from rftstream.actors.feed import ExperienceFeed
    from rftstream.experience import uid_digests
    from tests.integration._util import _group

    feed = await trainer_feed(NAMES, 2, hold_trained=True)
    bus = feed.bus
    with anyio.fail_after(5):
        trained = await feed.read(8)
    await feed.commit()
    digests = feed.trained_digests()
    assert sorted(digests.tolist()) == sorted(uid_digests([e.eid.uid for e in trained]).tolist())
    await feed.release_trained()  # acked: the next checkpoint's trained_uids forget them
    assert feed.trained_uids() == []

    # the same experiences again in new messages, then one new group
    await bus.publish_group(TRAIN_STAGE, trained[:4], msg_id="again-0")
    await bus.publish_group(TRAIN_STAGE, trained[4:], msg_id="again-1")
    new = _group(9, 1.0, 4)
    await bus.publish_group(TRAIN_STAGE, new, msg_id="new")
    resumed = ExperienceFeed(
        bus, feed.consumer, feed.ticker, feed.exhausted, group_size=4, hold_trained=True
    )
    resumed.mark_trained([], digests)  # what the checkpoint's file gives back
    with anyio.fail_after(5):
        got = await resumed.read(4)
    assert sorted(e.eid.uid for e in got) == sorted(e.eid.uid for e in new)
    await resumed.commit()
    # the copies were acked; what the next checkpoint keeps covers all twelve
    info = await resumed.consumer.info()
    assert info.num_ack_pending == 1  # the new group's message, held for the checkpoint
    assert len(resumed.trained_digests()) == 12
