"""The trainer's collate reads decoded experiences' arrays straight off the wire
(experience.array_numpy): the same batch as from tensors, no tensor made per array."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rftstream.experience import Experience, array_numpy, decode_group, encode_group
from rftstream.training.batch import collate


def _group() -> list[Experience]:
    out = []
    for i in range(4):
        n_resp = 3 + i
        out.append(
            Experience(
                tokens=torch.arange(5 + n_resp, dtype=torch.int32) + i,
                prompt_length=5 - (i % 2),
                logprobs=torch.linspace(-1.0, -0.1, n_resp + (i % 2)),
                advantages=torch.full((n_resp + (i % 2),), 0.5 * i),
                returns=torch.full((n_resp + (i % 2),), -0.25 * i),
                action_mask=None
                if i == 0
                else torch.tensor([j % 2 == 0 for j in range(n_resp + (i % 2))]),
                reward=float(i),
            )
        )
    return out


def test_array_numpy_matches_the_tensors_on_and_off_the_wire() -> None:
    exps = _group()
    decoded = decode_group(encode_group(exps))
    for made, wire in zip(exps, decoded, strict=True):
        for name in ("tokens", "logprobs", "advantages", "returns", "action_mask"):
            want = getattr(made, name)
            want = want.to(torch.uint8) if want.dtype == torch.bool else want
            got_wire = array_numpy(wire, name)
            assert name not in wire.__dict__  # read without materialising a tensor
            assert got_wire is not None and np.array_equal(got_wire, want.numpy()), name
            np.testing.assert_array_equal(array_numpy(made, name), want.numpy())
        assert array_numpy(wire, "token_level_reward") is None


@pytest.mark.parametrize("materialise", [False, True])
def test_collate_of_decoded_experiences_equals_collate_of_the_originals(materialise: bool) -> None:
    exps = _group()
    decoded = decode_group(encode_group(exps))
    if materialise:  # arrays read as tensors first (a validator did): the tensor path
        for e in decoded:
            _ = (e.tokens, e.logprobs, e.advantages, e.returns, e.action_mask)
    a = collate(exps, pad_token_id=0)
    b = collate(decoded, pad_token_id=0)
    for field in ("input_ids", "attention_mask", "position_ids", "response_mask", "advantages"):
        assert torch.equal(getattr(a, field), getattr(b, field)), field
    assert torch.equal(a.returns, b.returns) and torch.equal(a.rollout_logprobs, b.rollout_logprobs)
    assert torch.equal(a.rewards, b.rewards) and a.prompt_width == b.prompt_width


def test_a_wire_mask_byte_other_than_one_counts_as_set() -> None:
    exp = _group()[1]
    decoded = decode_group(encode_group([exp]))[0]
    raw = bytearray(decoded.__dict__["_wire"].action_mask)
    raw[0] = 7
    decoded.__dict__["_wire"].action_mask = memoryview(bytes(raw))
    assert array_numpy(decoded, "action_mask")[0] == 1
