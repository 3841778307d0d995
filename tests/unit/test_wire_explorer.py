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
    encode_json,
)


def test_templated_keys_are_filled_in_and_keep_their_record_type() -> None:
    assert EXPLORER_STEP.of(name="e0").name == "explorer.e0.step"
    assert EXPLORER_DONE.of(name="e0").type is ExplorerDone
    assert HEARTBEAT.of(actor="trainer").name == "heartbeat.trainer"
    assert TASKSET_CLAIM.name == "taskset.published.claim"


def test_a_heartbeat_is_one_flat_object_on_the_bus() -> None:
    beat = Heartbeat(actor="e0", role="explorer", ts=2.0, step=3, model_version=1)
    value = msgspec.json.decode(encode_json(beat))
    # the fields of other kinds of actor are left out
    assert value == {"actor": "e0", "role": "explorer", "ts": 2.0, "step": 3, "model_version": 1}
    assert msgspec.json.decode(encode_json(beat), type=Heartbeat) == beat
    assert beat.fields() == {"step": 3, "model_version": 1}
    # a record with a field of a newer release still decodes; one of another shape does not
    newer = {**value, "gpu_memory": 7}
    assert HEARTBEAT.convert(newer) == beat
    assert HEARTBEAT.convert({"role": "trainer", "ts": 1.0}) is None  # no actor


def test_a_claim_written_by_an_older_explorer_still_decodes() -> None:
    claim = msgspec.json.decode(b'{"by": "e1", "ts": 1.0, "seq": 64}', type=TasksetClaim)
    assert claim == TasksetClaim(by="e1", ts=1.0, seq=64, taken_over_from="")
