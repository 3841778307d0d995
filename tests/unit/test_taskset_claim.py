"""The taskset claim protocol (:mod:`rftstream.control.taskset_claim`): pure steps, injected time."""

from __future__ import annotations

import pytest

from rftstream.control.taskset_claim import (
    Claiming,
    ClaimLost,
    ClaimProtocol,
    Done,
    Finished,
    Look,
    Observed,
    Progressed,
    Publishing,
    Seeking,
    StartPublishing,
    Tick,
    Wait,
    WriteClaim,
    WriteFailed,
    Wrote,
)
from rftstream.wire import TasksetClaim

A = ClaimProtocol("a", stale_s=30.0, keepalive_s=5.0)
B = ClaimProtocol("b", stale_s=30.0, keepalive_s=5.0)


def _claim(by: str, seq: int = 0) -> TasksetClaim:
    return TasksetClaim(by=by, ts=0.0, seq=seq)


def _publishing(protocol: ClaimProtocol, now: float = 0.0) -> Publishing:
    """Run ``protocol`` from the start to winning a fresh claim at revision 1."""
    state, actions = protocol.start()
    assert actions == [Look()]
    state, actions = protocol.step(state, Observed(published=False), now)
    assert actions == [WriteClaim(seq=0, revision=None)]
    state, actions = protocol.step(state, Wrote(revision=1), now)
    assert actions == [StartPublishing(start=0)]
    assert isinstance(state, Publishing)
    return state


def test_the_first_explorer_creates_the_claim_and_records_each_chunk() -> None:
    state = _publishing(A)
    assert state == Publishing(revision=1, seq=0, written_at=0.0)
    state, actions = A.step(state, Progressed(seq=64), 1.0)
    assert actions == [WriteClaim(seq=64, revision=1)]
    state, actions = A.step(state, Wrote(revision=2), 1.1)
    assert (state, actions) == (Publishing(revision=2, seq=64, written_at=1.1), [])


def test_a_published_taskset_ends_the_protocol() -> None:
    state, _ = A.start()
    state, actions = A.step(state, Observed(published=True, claim=_claim("b", 60), revision=9), 0)
    assert (state, actions) == (Finished(), [Done()])
    assert A.step(state, Tick(), 100.0) == (Finished(), [])


def test_two_claimants_one_publishes_the_other_watches() -> None:
    a, _ = A.start()
    b, _ = B.start()
    a, a_actions = A.step(a, Observed(published=False), 0.0)
    b, b_actions = B.step(b, Observed(published=False), 0.0)
    assert a_actions == b_actions == [WriteClaim(seq=0, revision=None)]
    a, a_actions = A.step(a, Wrote(revision=1), 0.1)  # a's create is first
    b, b_actions = B.step(b, Wrote(revision=None), 0.1)
    assert a_actions == [StartPublishing(start=0)]
    assert b_actions == [Look()]  # the claim exists now: look at it at once
    # b watches a publishing claim: it moves, so b never takes it over
    revision, now = 1, 0.2
    for seq in range(64, 64 * 20, 64):
        b, b_actions = B.step(
            b, Observed(published=False, claim=_claim("a", seq), revision=revision), now
        )
        assert b_actions == [Wait(seconds=B.poll_s), Look()]
        a, _ = A.step(a, Progressed(seq=seq), now)
        revision += 1
        a, _ = A.step(a, Wrote(revision=revision), now)
        now += 20.0  # each chunk well within stale_s of the last
    assert isinstance(b, Seeking) and isinstance(a, Publishing)


def test_a_publisher_that_died_mid_taskset_is_taken_over_from_its_progress() -> None:
    b, _ = B.start()
    seen = Observed(published=False, claim=_claim("a", 128), revision=5)
    b, actions = B.step(b, seen, 100.0)
    assert actions == [Wait(seconds=B.poll_s), Look()]
    b, actions = B.step(b, seen, 129.0)  # unchanged for 29 s: not yet stale
    # the pause ends when the claim goes stale (a little after), not a whole poll_s later
    assert actions == [Wait(seconds=pytest.approx(1.01)), Look()]
    b, actions = B.step(b, seen, 130.5)  # unchanged for more than stale_s
    assert actions == [WriteClaim(seq=128, revision=5, taken_over_from="a")]
    assert isinstance(b, Claiming) and b.stale
    b, actions = B.step(b, Wrote(revision=6), 130.6)
    assert actions == [StartPublishing(start=128, taken_over_from="a", stale=True)]
    assert b == Publishing(revision=6, seq=128, written_at=130.6)


def test_a_publisher_back_from_a_pause_finds_its_claim_taken_over() -> None:
    a = _publishing(A)
    a, actions = A.step(a, Progressed(seq=64), 40.0)
    assert actions == [WriteClaim(seq=64, revision=1)]
    a, actions = A.step(a, Wrote(revision=None), 40.1)  # b took revision 1 over meanwhile
    assert actions == [ClaimLost(), Look()]
    assert a == Seeking()


def test_a_restarted_explorer_takes_its_own_claim_over_at_once() -> None:
    a, _ = A.start()
    a, actions = A.step(a, Observed(published=False, claim=_claim("a", 320), revision=12), 0.0)
    assert actions == [WriteClaim(seq=320, revision=12, taken_over_from="a")]
    a, actions = A.step(a, Wrote(revision=13), 0.1)
    assert actions == [StartPublishing(start=320, taken_over_from="a", stale=False)]


def test_of_two_heirs_the_one_that_loses_the_take_over_watches_the_winner() -> None:
    b, _ = B.start()
    seen = Observed(published=False, claim=_claim("a", 64), revision=3)
    b, _ = B.step(b, seen, 0.0)
    b, actions = B.step(b, seen, 31.0)
    assert actions == [WriteClaim(seq=64, revision=3, taken_over_from="a")]
    b, actions = B.step(b, Wrote(revision=None), 31.1)  # c was quicker
    assert actions == [Wait(seconds=B.poll_s), Look()]
    # c's claim is a new revision: its clock starts again, no take-over before stale_s
    c_claim = Observed(published=False, claim=_claim("c", 64), revision=4)
    b, actions = B.step(b, c_claim, 31.3)
    assert actions == [Wait(seconds=B.poll_s), Look()]
    b, actions = B.step(b, c_claim, 60.0)
    assert actions == [Wait(seconds=pytest.approx(31.3 + 30.0 - 60.0 + 0.01)), Look()]
    b, actions = B.step(b, c_claim, 61.5)
    assert actions == [WriteClaim(seq=64, revision=4, taken_over_from="c")]


def test_a_failed_write_is_retried_after_a_pause() -> None:
    a, _ = A.start()
    a, _ = A.step(a, Observed(published=False), 0.0)
    a, actions = A.step(a, WriteFailed(reason="timeout"), 0.1)
    assert actions == [Wait(seconds=A.retry_s), Look()]
    assert isinstance(a, Seeking)


def test_a_claim_that_does_not_decode_is_never_taken_over() -> None:
    b, _ = B.start()
    for now in (0.0, 10.0, 100.0, 1000.0):
        b, actions = B.step(b, Observed(published=False, claim=None, revision=7), now)
        assert actions == [Wait(seconds=B.poll_s), Look()]


def test_the_publisher_keeps_its_claim_alive_only_when_due() -> None:
    a = _publishing(A, now=10.0)
    a, actions = A.step(a, Tick(), 14.9)
    assert actions == []
    a, actions = A.step(a, Tick(), 15.0)
    assert actions == [WriteClaim(seq=0, revision=1)]
    a, actions = A.step(a, Wrote(revision=2), 15.1)
    assert a == Publishing(revision=2, seq=0, written_at=15.1)
    a, actions = A.step(a, Tick(), 16.0)  # written 0.9 s ago
    assert actions == []


def test_a_progress_write_abandoned_without_an_answer_is_forgotten() -> None:
    a = _publishing(A)
    a, _ = A.step(a, Progressed(seq=64), 1.0)
    a, actions = A.step(a, WriteFailed(reason="cancelled"), 1.1)
    assert (a, actions) == (Publishing(revision=1, seq=0, written_at=0.0), [])
    a, actions = A.step(a, Progressed(seq=64), 2.0)  # tried again on the revision it knows
    assert actions == [WriteClaim(seq=64, revision=1)]


def test_events_a_state_cannot_receive_are_driver_bugs() -> None:
    a, _ = A.start()
    with pytest.raises(ValueError, match="Progressed while Seeking"):
        A.step(a, Progressed(seq=1), 0.0)
    p = _publishing(A)
    p, _ = A.step(p, Progressed(seq=64), 1.0)
    with pytest.raises(ValueError, match="already in flight"):
        A.step(p, Progressed(seq=128), 1.0)
    with pytest.raises(ValueError, match="Observed while publishing"):
        A.step(p, Observed(published=False), 1.0)
