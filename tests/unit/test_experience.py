"""Experience wire schema: round trips, zero-copy decode, headers, splitting, errors."""

from __future__ import annotations

import math

import msgspec
import numpy as np
import pytest
import torch

from rftstream.errors import PayloadTooLargeError, SchemaError
from rftstream.experience import (
    EID,
    H_ACTOR,
    H_COUNT,
    H_MODEL_VERSION,
    H_MSG_ID,
    H_PART,
    H_REWARD_MEAN,
    H_SCHEMA,
    H_TASK,
    H_TOKENS,
    SCHEMA_NAME,
    Experience,
    ExperienceGroupMsg,
    decode_group,
    decode_group_msg,
    encode_group,
    group_by,
    headers_size,
    pack_group,
    summary_headers,
)


def full_experience(run: int = 0, *, reward: float | None = 0.75, version: int = 3) -> Experience:
    """An experience with every field set to a distinctive non-default value."""
    return Experience(
        tokens=[101, 102, 103, 7, 8, 9, 2**31 - 1],
        prompt_length=3,
        logprobs=[-0.5, -1.25, -0.125, -3.0],
        reward=reward,
        token_level_reward=[0.0, 0.0, 0.5, 0.25],
        advantages=[1.5, -1.5, 0.5, 0.0],
        returns=[0.9, 0.8, 0.7, 0.6],
        info={"task_desc": "2+2", "nested": {"k": [1, 2.5, "x", None, True]}, "n": 4},
        metrics={"accuracy": 1.0, "format_score": 0.5},
        response_text="The answer is 4",
        prompt_text="What is 2+2?",
        action_mask=[True, False, True, True],
        messages=[
            {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "4", "tool_calls": []},
        ],
        chosen=[5, 6, 7],
        rejected=[8, 9],
        chosen_text="good",
        rejected_text="bad",
        model_version=version,
        eid=EID(batch=12, task="task-7", run=run, step=2, suffix=f"sfx{run}"),
    )


def assert_same(a: Experience, b: Experience) -> None:
    for name in ("tokens", "chosen", "rejected"):
        ta, tb = getattr(a, name), getattr(b, name)
        if ta is None:
            assert tb is None, name
            continue
        assert tb.dtype == torch.int32, name
        assert torch.equal(ta, tb), name
    for name in ("logprobs", "token_level_reward", "advantages", "returns"):
        ta, tb = getattr(a, name), getattr(b, name)
        if ta is None:
            assert tb is None, name
            continue
        assert tb.dtype == torch.float32, name
        assert torch.equal(ta, tb), name
    assert b.action_mask.dtype == torch.bool
    assert torch.equal(a.action_mask, b.action_mask)
    for name in (
        "prompt_length",
        "reward",
        "info",
        "metrics",
        "response_text",
        "prompt_text",
        "messages",
        "chosen_text",
        "rejected_text",
        "model_version",
        "eid",
    ):
        assert getattr(a, name) == getattr(b, name), name


# ------------------------------------------------------------------ round trips


def test_round_trip_every_field() -> None:
    exps = [full_experience(0), full_experience(1, reward=-0.25, version=5)]
    decoded = decode_group(encode_group(exps))
    assert len(decoded) == 2
    for a, b in zip(exps, decoded, strict=True):
        assert_same(a, b)
    d = decoded[0]
    # spot-check concrete values, not only equality with the source
    assert d.tokens.tolist() == [101, 102, 103, 7, 8, 9, 2**31 - 1]
    assert d.prompt_length == 3
    assert d.logprobs.tolist() == [-0.5, -1.25, -0.125, -3.0]
    assert d.reward == 0.75
    assert d.token_level_reward.tolist() == [0.0, 0.0, 0.5, 0.25]
    assert d.advantages.tolist() == [1.5, -1.5, 0.5, 0.0]
    assert d.returns.tolist() == pytest.approx([0.9, 0.8, 0.7, 0.6])
    assert d.info == {"task_desc": "2+2", "nested": {"k": [1, 2.5, "x", None, True]}, "n": 4}
    assert d.metrics == {"accuracy": 1.0, "format_score": 0.5}
    assert d.response_text == "The answer is 4"
    assert d.prompt_text == "What is 2+2?"
    assert d.action_mask.tolist() == [True, False, True, True]
    assert d.messages is not None and d.messages[1]["content"] == "4"
    assert d.chosen.tolist() == [5, 6, 7]
    assert d.rejected.tolist() == [8, 9]
    assert (d.chosen_text, d.rejected_text) == ("good", "bad")
    assert d.model_version == 3
    assert decoded[1].model_version == 5
    assert decoded[1].reward == -0.25


def test_round_trip_eid_parts_and_types() -> None:
    exp = Experience(
        tokens=[1, 2], prompt_length=1, eid=EID(batch=4, task="abc", run=3, step=1, suffix="zz")
    )
    (d,) = decode_group(encode_group([exp]))
    assert d.eid.batch == 4 and isinstance(d.eid.batch, int)
    assert d.eid.task == "abc" and isinstance(d.eid.task, str)
    assert (d.eid.run, d.eid.step, d.eid.suffix) == (3, 1, "zz")
    assert d.eid.uid == "4/abc/3/1/zz"
    assert d.group_id == exp.group_id == "4/abc"


def test_round_trip_minimal_experience_defaults() -> None:
    exp = Experience(tokens=[5, 6, 7], prompt_length=1)
    (d,) = decode_group(encode_group([exp]))
    assert d.tokens.tolist() == [5, 6, 7]
    for name in (
        "logprobs",
        "token_level_reward",
        "advantages",
        "returns",
        "chosen",
        "rejected",
        "reward",
        "response_text",
        "prompt_text",
        "messages",
        "chosen_text",
        "rejected_text",
    ):
        assert getattr(d, name) is None, name
    assert d.info == {} and d.metrics == {}
    assert d.model_version == 0
    assert d.action_mask.tolist() == [True, True]


@pytest.mark.parametrize(
    "mask",
    [[False, False, False], [True, False, True], [False, True, True], [True, True, False]],
)
def test_round_trip_partial_action_masks(mask: list[bool]) -> None:
    exp = Experience(tokens=[1, 2, 3, 4, 5], prompt_length=2, action_mask=mask)
    (d,) = decode_group(encode_group([exp]))
    assert d.action_mask.dtype == torch.bool
    assert d.action_mask.tolist() == mask


def test_round_trip_from_numpy_and_tensor_inputs() -> None:
    exp = Experience(
        tokens=torch.tensor([9, 8, 7, 6], dtype=torch.int64),
        prompt_length=2,
        logprobs=np.array([-0.25, -0.5], dtype=np.float64),
        action_mask=torch.tensor([1, 0], dtype=torch.uint8),
    )
    (d,) = decode_group(encode_group([exp]))
    assert d.tokens.dtype == torch.int32 and d.tokens.tolist() == [9, 8, 7, 6]
    assert d.logprobs.dtype == torch.float32 and d.logprobs.tolist() == [-0.25, -0.5]
    assert d.action_mask.tolist() == [True, False]


def test_round_trip_nan_and_inf_values() -> None:
    exp = Experience(
        tokens=[1, 2, 3], prompt_length=1, reward=float("nan"), logprobs=[float("-inf"), 0.0]
    )
    (d,) = decode_group(encode_group([exp]))
    assert d.reward is not None and math.isnan(d.reward)
    assert d.logprobs.tolist() == [float("-inf"), 0.0]


def test_fields_assigned_after_construction_are_encoded() -> None:
    # Trinity-style code assigns tensors after construction:
    # `exp.advantages = score * exp.action_mask`; a bf16 or numpy value must still
    # travel as float32 (the wire format), not crash the encoder.
    exp = Experience(tokens=[1, 2, 3, 4], prompt_length=2, reward=1.0)
    exp.advantages = torch.tensor([0.5, 0.25], dtype=torch.bfloat16)
    exp.returns = np.array([1.0, 2.0], dtype=np.float64)
    (d,) = decode_group(encode_group([exp]))
    assert d.advantages.dtype == torch.float32
    assert d.advantages.tolist() == [0.5, 0.25]
    assert d.returns.tolist() == [1.0, 2.0]


def test_advantages_computed_from_mask_round_trip() -> None:
    exp = Experience(tokens=[1, 2, 3, 4], prompt_length=1, action_mask=[True, False, True])
    exp.advantages = 0.5 * exp.action_mask
    (d,) = decode_group(encode_group([exp]))
    assert d.advantages.tolist() == [0.5, 0.0, 0.5]


def test_group_message_metadata() -> None:
    exps = [full_experience(0)]
    body = encode_group(exps, group_id="g-1", producer="explorer-0", part=1, parts=3)
    msg = decode_group_msg(body)
    assert isinstance(msg, ExperienceGroupMsg)
    assert msg.schema == SCHEMA_NAME
    assert (msg.group_id, msg.producer, msg.part, msg.parts) == ("g-1", "explorer-0", 1, 3)
    assert len(msg.experiences) == 1
    # default group id is the first experience's tid
    assert decode_group_msg(encode_group(exps)).group_id == "12/task-7"


# ------------------------------------------------------------------ zero copy / byte order


def _body_range(body: bytes) -> tuple[int, int]:
    start = np.frombuffer(body, np.uint8).ctypes.data
    return start, start + len(body)


def test_decoded_arrays_are_zero_copy_views_of_the_body() -> None:
    body = encode_group([full_experience(0), full_experience(1)])
    start, end = _body_range(body)
    body_view = np.frombuffer(body, np.uint8)
    for d in decode_group(body):
        for name in ("tokens", "logprobs", "advantages", "returns", "token_level_reward", "chosen"):
            t = getattr(d, name)
            ptr = t.data_ptr()
            assert start <= ptr and ptr + t.numel() * t.element_size() <= end, name
            assert np.shares_memory(t.numpy(), body_view), name


def test_decode_from_memoryview_is_zero_copy() -> None:
    body = bytearray(encode_group([full_experience(0)]))
    (d,) = decode_group(memoryview(body))
    start = np.frombuffer(body, np.uint8).ctypes.data
    assert start <= d.tokens.data_ptr() < start + len(body)
    assert start <= d.logprobs.data_ptr() < start + len(body)


def test_arrays_are_little_endian_on_the_wire() -> None:
    values = [0x01020304, -2, 0x7F000001]
    exp = Experience(tokens=values, prompt_length=1, logprobs=[1.5, -2.25])
    body = encode_group([exp])
    le_tokens = np.array(values, dtype="<i4").tobytes()
    be_tokens = np.array(values, dtype=">i4").tobytes()
    assert le_tokens in body
    assert be_tokens not in body
    assert np.array([1.5, -2.25], dtype="<f4").tobytes() in body
    assert bytes([4, 3, 2, 1]) in body


# ------------------------------------------------------------------ headers


def test_summary_headers_mapping() -> None:
    exps = [
        Experience(
            tokens=[1, 2, 3],
            prompt_length=1,
            reward=1.0,
            model_version=5,
            eid=EID(batch=2, task=9, run=0),
        ),
        Experience(
            tokens=[1, 2, 3, 4],
            prompt_length=1,
            reward=0.0,
            model_version=3,
            eid=EID(batch=2, task=9, run=1),
        ),
        Experience(
            tokens=[1, 2],
            prompt_length=1,
            reward=0.5,
            model_version=4,
            eid=EID(batch=2, task=9, run=2),
        ),
    ]
    h = summary_headers(exps, actor="explorer-1", msg_id="run1/2/9")
    assert h == {
        H_SCHEMA: SCHEMA_NAME,
        H_TASK: "2/9",
        H_MODEL_VERSION: "3",
        H_COUNT: "3",
        H_REWARD_MEAN: "0.5000",
        H_TOKENS: "9",
        H_ACTOR: "explorer-1",
        H_MSG_ID: "run1/2/9",
    }
    assert H_SCHEMA == "Rft-Schema" and H_MSG_ID == "Nats-Msg-Id"


def test_summary_headers_four_decimals_and_group_override() -> None:
    exps = [Experience(tokens=[1], reward=r) for r in (1.0, 0.0, 0.0)]
    h = summary_headers(exps, actor="a", msg_id="m", group_id="custom", part=1, parts=3)
    assert h[H_REWARD_MEAN] == "0.3333"
    assert h[H_TASK] == "custom"
    assert h[H_PART] == "2/3"


def test_summary_headers_nan_when_no_rewards() -> None:
    exps = [Experience(tokens=[1, 2]), Experience(tokens=[3], reward=float("nan"))]
    h = summary_headers(exps, actor="a", msg_id="m")
    assert h[H_REWARD_MEAN] == "nan"
    assert H_PART not in h
    assert summary_headers([], actor="a", msg_id="m")[H_REWARD_MEAN] == "nan"


def test_headers_size_counts_every_byte() -> None:
    h = {"Rft-Task": "1/2", "Nats-Msg-Id": "abc"}
    wire = "NATS/1.0\r\n" + "".join(f"{k}: {v}\r\n" for k, v in h.items()) + "\r\n"
    assert headers_size(h) >= len(wire.encode())
    assert headers_size(h) - len(wire.encode()) <= 4  # a small safety margin at most


# ------------------------------------------------------------------ pack_group


def big_group(n: int, tokens: int = 500) -> list[Experience]:
    return [
        Experience(
            tokens=list(range(tokens)),
            prompt_length=10,
            logprobs=[-0.1] * (tokens - 10),
            reward=float(i),
            model_version=i,
            eid=EID(batch=1, task="t", run=i, suffix=f"s{i}"),
        )
        for i in range(n)
    ]


def test_pack_group_single_message_when_it_fits() -> None:
    exps = big_group(3)
    (msg,) = pack_group(exps, actor="explorer-0", msg_id_prefix="run/1/t", max_payload=1 << 20)
    assert msg.msg_id == "run/1/t"
    assert msg.headers[H_MSG_ID] == "run/1/t"
    assert H_PART not in msg.headers
    assert msg.count == 3
    assert [e.eid.run for e in decode_group(msg.data)] == [0, 1, 2]


def test_pack_group_splits_over_max_payload() -> None:
    exps = big_group(8)
    one = len(encode_group(exps[:1]))
    max_payload = 3 * one  # room for about two experiences plus headers
    parts = pack_group(exps, actor="explorer-0", msg_id_prefix="run/1/t", max_payload=max_payload)
    assert len(parts) > 1
    n = len(parts)
    seen: list[str] = []
    for i, part in enumerate(parts):
        assert part.msg_id == f"run/1/t#{i}"
        assert part.headers[H_MSG_ID] == f"run/1/t#{i}"
        assert part.headers[H_PART] == f"{i + 1}/{n}"
        assert part.headers[H_TASK] == "1/t"
        assert len(part.data) + headers_size(part.headers) <= max_payload
        msg = decode_group_msg(part.data)
        assert (msg.part, msg.parts, msg.group_id, msg.producer) == (i, n, "1/t", "explorer-0")
        decoded = decode_group(part.data)
        assert part.count == len(decoded) == int(part.headers[H_COUNT])
        seen += [e.eid.uid for e in decoded]
    assert sorted(seen) == sorted(e.eid.uid for e in exps)
    assert len(seen) == len(set(seen)) == 8


def test_pack_group_counts_headers_against_payload() -> None:
    exps = big_group(1)
    body = len(encode_group(exps, group_id="1/t", producer="a"))
    hdr = headers_size(summary_headers(exps, actor="a", msg_id="m", group_id="1/t"))
    (msg,) = pack_group(exps, actor="a", msg_id_prefix="m", max_payload=body + hdr)
    assert msg.count == 1
    with pytest.raises(PayloadTooLargeError):
        pack_group(exps, actor="a", msg_id_prefix="m", max_payload=body + hdr - 1)


def test_pack_group_is_deterministic() -> None:
    exps = big_group(6)
    max_payload = 3 * len(encode_group(exps[:1]))
    a = pack_group(exps, actor="x", msg_id_prefix="p", max_payload=max_payload)
    b = pack_group(exps, actor="x", msg_id_prefix="p", max_payload=max_payload)
    assert [(m.msg_id, m.data, m.headers) for m in a] == [(m.msg_id, m.data, m.headers) for m in b]


def test_pack_group_single_experience_too_large() -> None:
    exps = big_group(2, tokens=5000)
    with pytest.raises(PayloadTooLargeError) as info:
        pack_group(exps, actor="a", msg_id_prefix="m", max_payload=4096)
    assert "4096" in str(info.value)
    assert "1/t" in str(info.value)


# ------------------------------------------------------------------ errors


@pytest.mark.parametrize(
    "garbage",
    [b"", b"\x00\x01\x02garbage", b"\xc1", msgspec.msgpack.encode({"a": 1}), b"not msgpack at all"],
)
def test_decode_garbage_raises_schema_error(garbage: bytes) -> None:
    with pytest.raises(SchemaError):
        decode_group(garbage)


def test_decode_truncated_body_raises_schema_error() -> None:
    body = encode_group([full_experience(0)])
    with pytest.raises(SchemaError):
        decode_group(body[: len(body) // 2])


def test_decode_wrong_schema_name_raises_schema_error() -> None:
    body = msgspec.msgpack.encode(
        ExperienceGroupMsg(schema="rft.experience.v0", group_id="g", experiences=[])
    )
    with pytest.raises(SchemaError) as info:
        decode_group(body)
    assert "rft.experience.v0" in str(info.value)
    assert SCHEMA_NAME in str(info.value)


def test_decode_misaligned_array_raises_schema_error() -> None:
    msg = decode_group_msg(encode_group([Experience(tokens=[1, 2, 3], prompt_length=1)]))
    rec = msgspec.structs.replace(msg.experiences[0], tokens=memoryview(b"\x01\x02\x03"))
    body = msgspec.msgpack.encode(msgspec.structs.replace(msg, experiences=[rec]))
    with pytest.raises(SchemaError):
        decode_group(body)


def test_tensor_in_info_raises_schema_error_naming_field() -> None:
    exp = Experience(tokens=[1, 2], prompt_length=1, info={"bad": torch.tensor([1.0])})
    with pytest.raises(SchemaError) as info:
        encode_group([exp])
    msg = str(info.value)
    assert "`info`" in msg
    assert exp.eid.uid in msg


def test_unencodable_metrics_and_messages_name_field() -> None:
    exp = Experience(tokens=[1, 2], prompt_length=1, metrics={"m": object()})  # type: ignore[dict-item]
    with pytest.raises(SchemaError) as info:
        encode_group([exp])
    assert "`metrics`" in str(info.value)
    exp = Experience(tokens=[1, 2], prompt_length=1, messages=[{"content": object()}])
    with pytest.raises(SchemaError) as info:
        encode_group([exp])
    assert "`messages`" in str(info.value)


# ------------------------------------------------------------------ group_by


def test_group_by_task_run_step() -> None:
    def e(batch: int, task: int, run: int, step: int) -> Experience:
        return Experience(tokens=[1], eid=EID(batch=batch, task=task, run=run, step=step))

    exps = [e(0, 1, 0, 0), e(0, 2, 0, 0), e(0, 1, 1, 0), e(0, 1, 0, 1), e(1, 1, 0, 0)]
    by_task = group_by(exps, "task")
    assert list(by_task) == ["0/1", "0/2", "1/1"]
    assert by_task["0/1"] == [exps[0], exps[2], exps[3]]
    by_run = group_by(exps, "run")
    assert list(by_run) == ["0/1/0", "0/2/0", "0/1/1", "1/1/0"]
    assert by_run["0/1/0"] == [exps[0], exps[3]]
    by_step = group_by(exps, "step")  # as in Trinity-RFT: the runs of a task share a step
    assert list(by_step) == ["0/1/0", "0/2/0", "0/1/1", "1/1/0"]
    assert by_step["0/1/0"] == [exps[0], exps[2]]
    assert by_step["0/1/1"] == [exps[3]]
    assert group_by(exps) == by_task
    assert group_by([], "task") == {}


def test_eid_ids_are_trinity_rft_s() -> None:
    """tid / rid / sid / uid spelled as Trinity-RFT 0.6 spells them: sid has no run index."""
    eid = EID(batch=3, task=7, run=2, step=5, suffix="abc")
    assert eid.tid == "3/7"
    assert eid.rid == "3/7/2"
    assert eid.sid == "3/7/5"
    assert eid.uid == "3/7/2/5/abc"
    assert str(eid) == eid.uid
    # two runs of one task at one step: one sid, two rids, two uids
    other = EID(batch=3, task=7, run=0, step=5, suffix="abc")
    assert other.sid == eid.sid and other.rid != eid.rid and other.uid != eid.uid


def test_group_by_bad_id_type() -> None:
    with pytest.raises(ValueError, match="id_type"):
        group_by([Experience(tokens=[1])], "episode")
