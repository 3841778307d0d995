"""The checks and conversions the transformers and vLLM engines share (rftstream.engines.base)."""

from __future__ import annotations

import re

import pytest

from rftstream.engines.base import eos_ids, prompt_ids, score_ids, strip_module_prefix
from rftstream.errors import RftError


def test_eos_ids_from_ids_lists_and_none() -> None:
    assert eos_ids(2, [2, 7], None, (9,)) == {2, 7, 9}
    assert eos_ids(None, None) == set()


def test_prompt_ids() -> None:
    assert prompt_ids((1, 2, 3), 4) == [1, 2, 3]
    with pytest.raises(RftError, match="^cannot generate from an empty prompt$"):
        prompt_ids([], 4)
    msg = (
        "prompt of 4 tokens leaves no room in the model context of 4 tokens "
        "(see model.max_prompt_tokens)"
    )
    with pytest.raises(RftError, match=f"^{re.escape(msg)}$"):
        prompt_ids([1, 2, 3, 4], 4)


def test_score_ids() -> None:
    assert score_ids((5, 6, 7, 8), 4) == [5, 6, 7, 8]
    with pytest.raises(RftError, match=r"^cannot score 5 tokens: the model context has 4$"):
        score_ids([1, 2, 3, 4, 5], 4)


def test_strip_module_prefix() -> None:
    assert strip_module_prefix("module.model.embed.weight") == "model.embed.weight"
    assert strip_module_prefix("model.module.x") == "model.module.x"
    assert strip_module_prefix("lm_head.weight") == "lm_head.weight"
