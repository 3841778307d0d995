"""The staleness gate's starving-trainer override (:meth:`SyncPolicy.starving_trainer_overrides`)."""

from __future__ import annotations

from rftstream.config.sync_policy import SyncPolicy
from rftstream.wire import TrainerStarving

POLICY = SyncPolicy("dynamic_by_explorer", interval=1, offset=0, max_staleness=1)


def test_a_starving_trainer_that_holds_all_the_backlog_is_never_stalled() -> None:
    starving = TrainerStarving(since=100.0, held=3)
    assert POLICY.starving_trainer_overrides(starving, held_by_trainer=3, ahead_of_trainer=0)
    # it took fewer than it said since (acked some): still starving
    assert POLICY.starving_trainer_overrides(starving, held_by_trainer=1, ahead_of_trainer=0)


def test_a_flag_said_before_more_was_delivered_is_stale() -> None:
    """It said so while waiting for its first batch, and holds two batches now."""
    starving = TrainerStarving(since=100.0, held=0)
    assert not POLICY.starving_trainer_overrides(starving, held_by_trainer=16, ahead_of_trainer=0)


def test_backlog_on_its_way_to_the_trainer_feeds_it_first() -> None:
    starving = TrainerStarving(since=100.0, held=3)
    assert not POLICY.starving_trainer_overrides(starving, held_by_trainer=3, ahead_of_trainer=1)


def test_a_fed_trainer_or_no_record_never_overrides() -> None:
    fed = TrainerStarving(since=None, held=3)
    assert not POLICY.starving_trainer_overrides(fed, held_by_trainer=0, ahead_of_trainer=0)
    assert not POLICY.starving_trainer_overrides(None, held_by_trainer=0, ahead_of_trainer=0)


def test_the_record_keeps_its_json_shape() -> None:
    """The trainer writes it, explorers and ``rftstream status`` read it: ``{"since", "held"}``."""
    import msgspec

    raw = msgspec.json.encode(TrainerStarving(since=1.5, held=2))
    assert msgspec.json.decode(raw) == {"since": 1.5, "held": 2}
    assert msgspec.json.decode(b'{"since": null, "held": 0}', type=TrainerStarving) == (
        TrainerStarving()
    )
