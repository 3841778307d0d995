"""A durable whose server-side ack floor lags the acks that landed (nats-server moves the
floor over contiguous acks only; after a server crash a gap in its restored state holds it
back while anything is unacked): the trainer's feed tells the true floor when the server's
count of unacked messages equals the messages it holds, the trainer records it
(``trainer.acked_below``), and the explorers' purges go by the higher of the two."""

from __future__ import annotations

import anyio
import pytest

from rftstream.actors.feed import ExperienceFeed
from rftstream.bus.transport import ConsumerState
from rftstream.retention.limits import ConsumerFloor, purge_points, with_acked_below
from rftstream.subjects import TRAIN_STAGE, RunNames
from rftstream.wire import AckedBelow
from tests.unit._util import trainer_feed

NAMES = RunNames("lag")
TRAIN = NAMES.exp_subject(TRAIN_STAGE)


async def _feed_holding_the_third_group(hold_trained: bool) -> ExperienceFeed:
    """Four groups of four on exp.train (sequences 1-4); the first two trained (and acked
    unless ``hold_trained``), the third read (held): the fourth is not delivered yet."""
    feed = await trainer_feed(NAMES, 4, hold_trained=hold_trained)
    with anyio.fail_after(5):
        await feed.read(8)
        await feed.commit()
        await feed.read(4)
    return feed


def _server(floor: int, ack_pending: int) -> ConsumerState:
    return ConsumerState(
        NAMES.trainer_consumer, ack_floor=floor, num_ack_pending=ack_pending, delivered=3
    )


@pytest.mark.anyio
async def test_the_feed_tells_the_floor_only_when_its_held_messages_are_the_servers() -> None:
    feed = await _feed_holding_the_third_group(hold_trained=False)
    # the server's floor stuck at 0 though sequences 1 and 2 were acked; it counts one
    # unacked message, and the feed holds one (sequence 3): everything below 3 is acked
    assert feed.acked_below(_server(0, 1)) == 3
    # the server counts two: one the feed does not hold (an ack not applied yet, a late
    # delivery): nothing can be told
    assert feed.acked_below(_server(0, 2)) is None
    # a floor that is right: nothing to tell
    assert feed.acked_below(_server(2, 1)) is None
    # and the in-memory server's own state agrees with the feed
    assert feed.acked_below(await feed.consumer.info()) is None


@pytest.mark.anyio
async def test_messages_held_for_a_checkpoint_count_as_held() -> None:
    """With ``hold_trained`` the first two groups stay unacked until the next checkpoint:
    the feed holds sequences 1-3, so the floor can lag at most below 1."""
    feed = await _feed_holding_the_third_group(hold_trained=True)
    assert feed.trained_unacked == 2
    assert feed.acked_below(_server(0, 3)) is None  # lowest held is 1: the floor 0 is right
    assert await feed.release_trained() == 2
    assert feed.acked_below(_server(0, 1)) == 3


def test_a_claim_raises_only_its_durables_floor_and_never_lowers_one() -> None:
    floors = [
        ConsumerFloor("trainer", TRAIN, 4, 6),
        ConsumerFloor("op_raw_to_train", NAMES.exp_subject("raw"), 9, 1),
    ]
    raised = with_acked_below(floors, AckedBelow(durable="trainer", below=40))
    assert [(c.name, c.ack_floor) for c in raised] == [("trainer", 39), ("op_raw_to_train", 9)]
    # the purge then goes past the server's floor of 4, up to 39 (less the kept window)
    assert purge_points(1, 60, floors, keep=0)[TRAIN] == 5
    assert purge_points(1, 60, raised, keep=0)[TRAIN] == 40
    stale = with_acked_below(raised, AckedBelow(durable="trainer", below=10))
    assert [c.ack_floor for c in stale] == [39, 9]
    assert with_acked_below(floors, None) == floors
