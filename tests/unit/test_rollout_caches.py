"""The explorer's per-call savings must not change what a call returns.

* ModelWrapper renders a chat once per distinct input (template, messages,
  tools, flags): a repeated call is not rendered again, returns the same
  prompt, can be changed by its caller without corrupting the next call, and
  still enforces ``model.max_prompt_tokens``.
* ``call_reward_fn`` reads a reward fn's signature once; extras still reach only
  the fns that accept them.
"""

from __future__ import annotations

from typing import Any

import pytest

from rftstream.errors import RftError
from rftstream.workflow import call_reward_fn
from tests.unit._util import wrapper

pytestmark = pytest.mark.anyio


async def test_chat_rendering_is_cached_per_input(tiny_model_path: str, monkeypatch) -> None:
    async with wrapper(tiny_model_path, max_response_tokens=3) as model:
        tok = model.tokenizer
        renders: list[Any] = []
        original = tok.apply_chat_template

        def counting(*args: Any, **kwargs: Any) -> Any:
            renders.append(args[0])
            return original(*args, **kwargs)

        monkeypatch.setattr(tok, "apply_chat_template", counting)
        q1 = [{"role": "user", "content": "1+2="}]
        first = await model.chat_async(q1, n=2)
        again = await model.chat_async([dict(m) for m in q1], n=2)
        assert len(renders) == 1  # the same input: rendered once
        assert first[0].tokens[: first[0].prompt_length].tolist() == (
            again[0].tokens[: again[0].prompt_length].tolist()
        )
        assert again[0].prompt_text == first[0].prompt_text
        assert first[0].info["temperature"] == 1.0  # what the trainer checks the log-probs by
        await model.chat_async([{"role": "user", "content": "2+2="}])
        await model.chat_async(q1, temperature=0.5)  # sampling args are not part of the input
        await model.chat_async([*q1, {"role": "assistant", "content": "3"}])  # continues
        assert len(renders) == 3
        # a caller that changes the returned prompt ids does not change the cached ones
        params = model._params(1, 1.0, 2, 1.0, None, {})
        _, ids, _ = await model._chat(q1, params)
        expected = list(ids)
        ids.append(99)
        _, ids_again, _ = await model._chat(q1, params)
        assert ids_again == expected
        assert len(renders) == 3
        # the prompt limit holds on a cache hit too
        model.max_prompt_tokens = 3
        with pytest.raises(RftError, match="more than model.max_prompt_tokens=3"):
            await model.chat_async(q1)
        clone = model.clone()  # clones share the cache
        clone.max_prompt_tokens = None
        await clone.chat_async(q1)
        assert len(renders) == 3


def test_reward_fn_extras_reach_only_fns_that_take_them() -> None:
    seen: list[dict[str, Any]] = []

    def narrow(response: str, truth: str) -> float:
        return float(response == truth)

    def wide(response: str, truth: str, **kwargs: Any) -> dict[str, float]:
        seen.append(kwargs)
        return {"accuracy": 1.0, "bonus": 0.5}

    class WithPrompt:
        def __call__(self, response: str, truth: str, prompt: str = "") -> float:
            return float(bool(prompt))

    for _ in range(2):  # the second call comes from the cache
        assert call_reward_fn(narrow, response="3", truth="3", prompt="1+2=") == {"reward": 1.0}
        assert call_reward_fn(wide, response="3", truth="4", prompt="p", extra=1) == {
            "accuracy": 1.0,
            "bonus": 0.5,
        }
        assert call_reward_fn(WithPrompt(), response="", truth="", prompt="p", other=2) == {
            "reward": 1.0
        }
    assert seen == [{"prompt": "p", "extra": 1}] * 2
