"""What a feed that holds trained messages for the next checkpoint (``hold_trained``)
tells the trainer: how many and how large they are, what a checkpoint written now must
remember (a batch taken but not trained included), and when a retired consumer waits
only for those acks (the trainer then checkpoints so a splice can finish)."""

from __future__ import annotations

import anyio
import pytest

from rftstream.subjects import RunNames
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
