"""Summaries printed by `rftstream decode` / `rftstream tail`."""

from __future__ import annotations

import pytest

from rftstream.errors import SchemaError
from rftstream.experience import Experience, encode_group
from rftstream.inspect import summarize_body, summarize_message
from rftstream.messages import H_DLQ_REASON, TaskMsg, encode_json


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
