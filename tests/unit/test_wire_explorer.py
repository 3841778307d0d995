"""The explorer side's control records (:mod:`rftstream.wire`): shapes on the bus and key handles."""

from __future__ import annotations

import msgspec

from rftstream.wire import (
    EXPLORER_DONE,
    EXPLORER_STEP,
    HEARTBEAT,
    TASKSET_CLAIM,
    ExplorerDone,
    Heartbeat,
    TasksetClaim,
)


def test_templated_keys_are_filled_in_and_keep_their_record_type() -> None:
    assert EXPLORER_STEP.of(name="e0").name == "explorer.e0.step"
    assert EXPLORER_DONE.of(name="e0").type is ExplorerDone
    assert HEARTBEAT.of(actor="trainer").name == "heartbeat.trainer"
    assert TASKSET_CLAIM.name == "taskset.published.claim"


def test_a_heartbeat_is_one_flat_object_on_the_bus() -> None:
    beat = Heartbeat(actor="e0", role="explorer", ts=2.0, info={"step": 3, "model_version": 1})
    value = beat.to_value()
    assert value == {"actor": "e0", "role": "explorer", "ts": 2.0, "step": 3, "model_version": 1}
    assert Heartbeat.from_value(msgspec.json.decode(msgspec.json.encode(value))) == beat
    # an older record without "actor" takes the key's
    assert Heartbeat.from_value({"role": "trainer", "ts": 1.0}, actor="t").actor == "t"


def test_a_claim_written_by_an_older_explorer_still_decodes() -> None:
    claim = msgspec.json.decode(b'{"by": "e1", "ts": 1.0, "seq": 64}', type=TasksetClaim)
    assert claim == TasksetClaim(by="e1", ts=1.0, seq=64, taken_over_from="")
