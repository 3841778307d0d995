"""Summaries printed by `rftstream decode` / `rftstream tail`."""

from __future__ import annotations

import pytest

from rftstream.errors import SchemaError
from rftstream.experience import Experience, encode_group
from rftstream.presentation.message_summaries import summarize_body, summarize_message
from rftstream.wire import H_DLQ_REASON, TaskMsg, encode_json


def test_experience_group_summary() -> None:
    group = [
        Experience(
            tokens=[1, 2, 3, 4], prompt_length=2, reward=r, response_text="7", model_version=v
        )
        for r, v in ((1.0, 3), (0.0, 2))
    ]
    s = summarize_body(encode_group(group, producer="explorer-0"))
    assert s["count"] == 2 and s["rewards"] == [1.0, 0.0] and s["reward_mean"] == 0.5
    assert s["model_versions"] == [2, 3] and s["tokens"] == 8 and s["response_lengths"] == [2, 2]
    assert (
        s["producer"] == "explorer-0"
        and s["first_response"] == "7"
        and s["has_advantages"] is False
    )


def test_task_json_passes_through_and_garbage_is_reported() -> None:
    task = TaskMsg(taskset="t", index=3, epoch=0, seq=3, raw_task={"question": "1+1="})
    assert summarize_body(encode_json(task))["raw_task"] == {"question": "1+1="}
    with pytest.raises(SchemaError, match="not an rftstream message"):
        summarize_body(b"\x00\x01")
    with pytest.raises(SchemaError, match="known rftstream schema"):
        summarize_body(b'{"a": 1}')
    m = summarize_message("rft.r.dlq.raw", 7, {H_DLQ_REASON: "boom", "Other": "x"}, b"\x00")
    assert m["dead_letter"] == {H_DLQ_REASON: "boom"} and m["seq"] == 7 and "undecodable" in m


def _stage(operator: str, from_stage: str, to_stage: str) -> dict[str, object]:
    """A ``stage.<Y>`` record as the trainer writes it."""
    return {
        "operator": operator,
        "from_stage": from_stage,
        "to_stage": to_stage,
        "durable": f"op_{from_stage}_to_{to_stage}",
        "owner": {"actor": operator, "pid": 1, "host": "h", "ts": 990.0, "token": "t"},
    }


def test_status_report_versions_staleness_heartbeats_and_chain() -> None:
    from rftstream.presentation.message_summaries import status_report

    now = 1000.0
    values = {
        "status": "running",
        "trainer.step": 5,
        "weights.latest": {"version": 4, "method": "checkpoint", "uri": "x", "ts": 990.0},
        "heartbeat.trainer": {"actor": "trainer", "role": "trainer", "ts": 999.0, "version": 4},
        "heartbeat.e1": {"actor": "e1", "role": "explorer", "ts": 997.0, "model_version": 3},
        "heartbeat.e2": {"actor": "e2", "role": "explorer", "ts": 980.0, "model_version": 5},
        "heartbeat.f-0": {"actor": "f-0", "role": "operator", "ts": 998.5, "messages_in": 7},
        "explorer.e1.step": 7,
        "explorer.e2.step": 9,
        "explorer.e2.done": {"step": 9},
        "explorers.in_flight.e1": {"claimed": 40, "done": 34, "reserved": 2, "since": 1.0},
        "trainer.input": {"stage": "f2", "consumer": "trainer_f2"},
        "stage.f2": _stage("dedup", "filtered", "f2"),
        "stage.filtered": _stage("reward_filter", "train", "filtered"),
        "splice": {"id": "a", "kind": "unsplice", "state": "cut", "to_stage": "x"},
        "trainer.waiting": {"message": "restart it", "ts": 999.0},
    }
    r = status_report(values, now)
    assert r["status"] == "running"
    assert r["trainer"]["step"] == 5 and r["trainer"]["version"] == 5  # newest of step/hb/weights
    assert r["weights"] == {"version": 4, "method": "checkpoint", "age": 10.0}
    assert r["explorers"] == [
        {
            "name": "e1",
            "step": 7,
            "model_version": 3,
            "staleness": 2,
            "heartbeat_age": 3.0,
            "done": False,
            "tasks_in_flight": 6,
        },
        {
            "name": "e2",
            "step": 9,
            "model_version": 5,
            "staleness": 0,
            "heartbeat_age": 20.0,
            "done": True,
            "tasks_in_flight": None,
        },
    ]
    ages = {h["actor"]: (h["role"], h["age"]) for h in r["heartbeats"]}
    assert ages == {
        "trainer": ("trainer", 1.0),
        "e1": ("explorer", 3.0),
        "e2": ("explorer", 20.0),
        "f-0": ("operator", 1.5),
    }
    assert r["chain"] == "raw -> train -> filtered (reward_filter) -> f2 (dedup) -> trainer"
    assert r["change"]["kind"] == "unsplice" and r["waiting"] == "restart it"


def test_status_report_of_an_empty_bucket() -> None:
    from rftstream.presentation.message_summaries import status_report

    r = status_report({}, 5.0)
    assert r["trainer"] == {"step": None, "version": None, "heartbeat_age": None, "done": None}
    assert r["explorers"] == [] and r["heartbeats"] == [] and r["change"] is None
    assert r["chain"] == "raw -> train -> trainer"
    done = status_report({"splice": {"kind": "splice", "state": "cut"}}, 5.0)
    assert done["change"] is None  # a finished change is not "under way"
