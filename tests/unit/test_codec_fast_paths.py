"""The codec's fast paths give what the general conversions give: every dataclass field on
decode (arrays on first access, untouched ones re-encoded as they came), the same wire bytes for every kind of array input, a normalised action mask, and no
warning even on a process's first decode."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import msgspec
import numpy as np
import pytest
import torch

from rftstream.experience import (
    _WIRE_ARRAYS,
    EID,
    Experience,
    decode_group,
    decode_group_msg,
    encode_group,
    from_record,
    to_record,
)


def _experience() -> Experience:
    return Experience(
        tokens=[1, 2, 3, 4, 5],
        prompt_length=2,
        logprobs=[-0.5, -1.0, -2.0],
        reward=1,
        token_level_reward=[0.0, 0.0, 1.0],
        advantages=[0.5, 0.5, 0.5],
        returns=[1.0, 1.0, 1.0],
        info={"k": [1, "x"]},
        metrics={"m": 0.5},
        response_text="r",
        prompt_text="p",
        action_mask=[True, False, True],
        messages=[{"role": "user", "content": "hi"}],
        chosen=[7, 8],
        rejected=[9],
        chosen_text="c",
        rejected_text="j",
        model_version=4,
        eid=EID(1, "t", 2, 3, "s"),
        allowed_logprobs=[-3.5, 0.0, 0.0],
        banned_ids=[0, 2],
    )


@pytest.mark.parametrize("minimal", [False, True])
def test_decode_sets_every_field_as_init_would(minimal: bool) -> None:
    exp = Experience(tokens=[1, 2, 3], prompt_length=1) if minimal else _experience()
    (d,) = decode_group(encode_group([exp]))
    names = {f.name for f in dataclasses.fields(Experience)}
    # a field added to Experience must be added to from_record (or to the lazy arrays)
    assert (set(vars(d)) - {"_wire"}) | set(_WIRE_ARRAYS) == names
    ref = Experience(**{n: getattr(d, n) for n in names})  # through __post_init__
    for n in names:
        a, b = getattr(d, n), getattr(ref, n)
        assert type(a) is type(b), n
        if isinstance(a, torch.Tensor):
            assert a.dtype == b.dtype and torch.equal(a, b), n
        else:
            assert a == b, n


def test_decoded_defaults_are_not_shared() -> None:
    a, b = decode_group(encode_group([Experience(tokens=[1, 2]), Experience(tokens=[3, 4])]))
    a.info["x"] = 1
    a.metrics["y"] = 2.0
    assert b.info == {} and b.metrics == {}
    assert a.action_mask.tolist() == [True] and a.action_mask.dtype == torch.bool


_F32_INPUTS = {
    "contiguous": torch.tensor([0.5, -1.5, 2.0]),
    "strided view": torch.tensor([0.5, 9.0, -1.5, 9.0, 2.0])[::2],
    "requires grad": torch.tensor([0.5, -1.5, 2.0], requires_grad=True),
    "bfloat16": torch.tensor([0.5, -1.5, 2.0], dtype=torch.bfloat16),
    "float64 numpy": np.array([0.5, -1.5, 2.0]),
    "list": [0.5, -1.5, 2.0],
    "negative view": torch.tensor([-0.5, 1.5, -2.0])._neg_view(),
}


@pytest.mark.parametrize("name", list(_F32_INPUTS))
def test_float_arrays_encode_to_the_same_bytes_whatever_the_input(name: str) -> None:
    exp = Experience(tokens=[1, 2, 3, 4], prompt_length=1)
    exp.logprobs = _F32_INPUTS[name]  # assigned after construction: the encoder converts
    rec = to_record(exp)
    assert bytes(rec.logprobs) == np.array([0.5, -1.5, 2.0], dtype="<f4").tobytes()


@pytest.mark.parametrize(
    "tokens",
    [
        torch.tensor([3, 1, 2], dtype=torch.int32),
        torch.tensor([3, 0, 1, 0, 2], dtype=torch.int32)[::2],
        torch.tensor([3, 1, 2], dtype=torch.int64),
        np.array([3, 1, 2], dtype=np.int16),
        [3, 1, 2],
    ],
)
def test_token_arrays_encode_to_the_same_bytes_whatever_the_input(tokens: object) -> None:
    exp = Experience(tokens=[0], prompt_length=0)
    exp.tokens = tokens
    assert bytes(to_record(exp).tokens) == np.array([3, 1, 2], dtype="<i4").tobytes()


@pytest.mark.parametrize(
    "mask",
    [
        torch.tensor([True, False, True]),
        torch.tensor([True, True, False, True, True])[::2],
        torch.tensor([2, 0, 1]),
        [1.0, 0.0, 3.0],
    ],
)
def test_action_mask_is_one_byte_zero_or_one(mask: object) -> None:
    exp = Experience(tokens=[1, 2, 3, 4], prompt_length=1)
    exp.action_mask = mask
    assert bytes(to_record(exp).action_mask) == b"\x01\x00\x01"


def test_decoded_action_mask_treats_any_nonzero_byte_as_true() -> None:
    msg = decode_group_msg(encode_group([Experience(tokens=[1, 2, 3, 4], prompt_length=1)]))
    rec = msgspec.structs.replace(msg.experiences[0], action_mask=memoryview(b"\x00\x02\xff"))
    d = from_record(rec)
    assert d.action_mask.dtype == torch.bool
    assert d.action_mask.tolist() == [False, True, True]
    assert d.action_mask.to(torch.uint8).tolist() == [0, 1, 1]


def test_first_decode_of_a_process_warns_nothing() -> None:
    code = (
        "from rftstream.experience import Experience, decode_group, encode_group\n"
        "(d,) = decode_group(encode_group([Experience(tokens=[1, 2, 3], logprobs=[0.5, 0.25])]))\n"
        "assert d.tokens.tolist() == [1, 2, 3]\n"
    )
    out = subprocess.run(
        [sys.executable, "-W", "error::UserWarning", "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]


def test_untouched_arrays_are_reencoded_as_they_came_without_a_conversion() -> None:
    body = encode_group([_experience()])
    (d,) = decode_group(body)
    assert d.response_length == 3  # from the wire's length, nothing materialised
    d.advantages = torch.tensor([1.0, 2.0, 3.0])  # what an operator does
    d.reward = 2.0
    rec = to_record(d)
    for name in ("tokens", "logprobs", "token_level_reward", "returns", "action_mask", "chosen"):
        assert name not in vars(d), name  # passed through, never converted
    src = decode_group_msg(body).experiences[0]
    for name in set(_WIRE_ARRAYS) - {"advantages"}:
        assert bytes(getattr(rec, name)) == bytes(getattr(src, name)), name
    assert bytes(rec.advantages) == np.array([1.0, 2.0, 3.0], dtype="<f4").tobytes()
    (again,) = decode_group(encode_group([d]))
    assert again.tokens.tolist() == [1, 2, 3, 4, 5]
    assert again.action_mask.tolist() == [True, False, True]
    assert again.advantages.tolist() == [1.0, 2.0, 3.0] and again.reward == 2.0


def test_a_field_read_after_decode_is_a_tensor_of_the_wire_dtype_and_stays() -> None:
    (d,) = decode_group(encode_group([Experience(tokens=[1, 2, 3], prompt_length=1)]))
    assert "tokens" not in vars(d)
    tokens = d.tokens
    assert tokens.dtype == torch.int32 and d.tokens is tokens  # materialised once
    assert d.action_mask.tolist() == [True, True]  # a missing mask: every response token
    assert d.logprobs is None
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        d.nope  # noqa: B018


def test_copies_of_a_decoded_experience_hold_their_arrays() -> None:
    import copy

    (d,) = decode_group(encode_group([_experience()]))
    deep = copy.deepcopy(d)
    shallow = copy.copy(d)
    for c in (deep, shallow):
        assert "_wire" not in vars(c)
        assert c.tokens.tolist() == [1, 2, 3, 4, 5]
        assert c.chosen.tolist() == [7, 8] and c.returns.tolist() == [1.0, 1.0, 1.0]
    deep.info["k"].append(2)
    assert d.info == {"k": [1, "x"]}


def test_a_ragged_array_is_refused_at_decode_not_at_first_read() -> None:
    from rftstream.errors import SchemaError

    msg = decode_group_msg(encode_group([Experience(tokens=[1, 2, 3, 4], prompt_length=1)]))
    rec = msgspec.structs.replace(msg.experiences[0], logprobs=memoryview(b"\0" * 6))
    bad = msgspec.structs.replace(msg, experiences=[rec])
    with pytest.raises(SchemaError, match="logprobs: 6 bytes"):
        decode_group(msgspec.msgpack.encode(bad))
