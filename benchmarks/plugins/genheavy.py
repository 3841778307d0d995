"""A generation-heavy workload for ``benchmarks/vs_trl.py``: long replies, a reward per token.

On a GPU with a real model, generation is most of a step. The tiny model answers the
arithmetic task in two or three tokens, so here every reply is made long: no
end-of-sequence token before :data:`MIN_NEW_TOKENS` new tokens (``rollout_args.min_tokens``
here, ``generation_kwargs={"min_new_tokens": ...}`` in TRL), at most
:data:`MAX_NEW_TOKENS`. The reward is the share of the reply's characters that are
letters (``letter_share_reward``): the tiny model, trained on arithmetic, writes digits
(about 8% letters at the start), and every token of the reply moves the reward, so the
policy learns it in a few hundred steps. (A reward on the answer alone, with 30 tokens
of filler after it, gives each answer token a thirtieth of the gradient: neither TRL nor
rftstream reached 0.7 in 240 s.) Both sides generate, train on and score the same
32-48 tokens per reply.

Load it with ``--plugin-dir benchmarks/plugins`` and set
``buffer.explorer_input.taskset.default_reward_fn_type=letter_share_reward``.
"""

from __future__ import annotations

from typing import Any

from workflows import REWARD_FUNCTIONS
from workflows.rewards import RewardFn

MIN_NEW_TOKENS = 32
MAX_NEW_TOKENS = 48


def letter_share(response: str) -> float:
    """The share of the reply's characters that are ASCII letters (0.0 when empty)."""
    text = response or ""
    return sum(ch.isascii() and ch.isalpha() for ch in text) / len(text) if text else 0.0


@REWARD_FUNCTIONS.register_module("letter_share_reward")
class LetterShareReward(RewardFn):
    """``{"letters": share of the reply's characters that are ASCII letters}``."""

    fast = True  # a character count: no worker thread needed

    def __call__(self, response: str, truth: str | None = None, **kwargs: Any) -> dict[str, float]:
        return {"letters": letter_share(response)}
