"""REINFORCE++ advantage (computed in the trainer, over the whole batch).

As in Trinity-RFT ``reinforce_plus_plus_advantage.py`` (verl
``compute_reinforce_plus_plus_outcome_advantage``; paper arXiv:2501.03262):
token-level discounted returns, whitened over every masked token of the batch.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from algorithms.advantage_fn.advantage_fn import ADVANTAGE_FN, AdvantageFn
from algorithms.utils import masked_count, masked_mean, masked_var, masked_whiten
from rftstream.experience import Experience


def token_level_rewards(exp: Experience) -> torch.Tensor:
    """The response's per-token rewards (float32, response length).

    ``exp.token_level_reward`` if set; else ``exp.reward`` on the last response
    token (where Trinity-RFT puts it: the last attended token, whatever its
    ``action_mask``). Raises ValueError for a None/NaN reward without
    ``token_level_reward``.
    """
    if exp.token_level_reward is not None:
        return exp.token_level_reward.to(torch.float32)
    if exp.reward is None or math.isnan(exp.reward):
        raise ValueError(
            f"experience {exp.eid.uid} has reward {exp.reward!r}; an advantage needs a "
            f"numeric reward (add the `invalid_reward_filter` operator before it)"
        )
    scores = torch.zeros(exp.response_length, dtype=torch.float32)
    if exp.response_length > 0:
        scores[-1] = float(exp.reward)
    return scores


def discounted_returns(rewards: torch.Tensor, gamma: float) -> torch.Tensor:
    """``G_t = r_t + gamma * G_{t+1}`` along the last dim (``G_T = 0``), float32."""
    out = torch.zeros_like(rewards, dtype=torch.float32)
    running = torch.zeros(rewards.shape[:-1], dtype=torch.float32)
    for t in reversed(range(rewards.shape[-1])):
        running = rewards[..., t] + gamma * running
        out[..., t] = running
    return out


@ADVANTAGE_FN.register_module("reinforceplusplus")
class REINFORCEPLUSPLUSAdvantageFn(AdvantageFn):
    """REINFORCE++: ``returns`` = discounted reward-to-go; ``advantages`` = whitened returns.

    Per experience, ``G_t = r_t + gamma * G_{t+1}`` over the response, with the
    rewards of :func:`token_level_rewards`. The advantages are
    ``(G - mean) / sqrt(var + 1e-8)`` with the mean and unbiased variance over
    the masked (``action_mask``) tokens of *all* experiences passed in, so it
    runs in the trainer on the whole batch (``compute_in_trainer() -> True``).
    With fewer than two masked tokens in the batch the advantages are 0 (the
    centred value of a single token). Both tensors are zeroed where
    ``action_mask`` is False (Trinity-RFT leaves ``returns`` unmasked; the
    trainer only reads masked positions). Metrics (Trinity-RFT reports none):
    ``return_mean`` and ``return_std``, the masked mean and unbiased std of
    the returns used for the whitening (0 without masked tokens; std 0 with
    fewer than two).
    """

    def __init__(self, gamma: float = 1.0, **kwargs) -> None:
        super().__init__(**kwargs)
        self.gamma = float(gamma)

    def __call__(self, exps: list[Experience], **kwargs: Any) -> tuple[list[Experience], dict]:
        if not exps:
            return [], {}
        with torch.no_grad():
            returns = [discounted_returns(token_level_rewards(e), self.gamma) for e in exps]
            masks = [e.action_mask.to(torch.bool) for e in exps]
            flat_ret = torch.cat(returns)
            flat_mask = torch.cat(masks)
            count = masked_count(flat_mask)  # the whole batch's, with several ranks
            return_mean = float(masked_mean(flat_ret, flat_mask))
            return_std = 0.0
            if count >= 2:
                flat_adv = masked_whiten(flat_ret, flat_mask)
                return_std = float(masked_var(flat_ret, flat_mask, unbiased=True).sqrt())
            else:
                flat_adv = torch.zeros_like(flat_ret)
            offset = 0
            for exp, ret, mask in zip(exps, returns, masks, strict=True):
                n = ret.numel()
                fmask = mask.to(torch.float32)
                exp.advantages = (flat_adv[offset : offset + n] * fmask).contiguous()
                exp.returns = ret * fmask
                offset += n
        return exps, {"return_mean": return_mean, "return_std": return_std}

    @classmethod
    def default_args(cls) -> dict:
        return {"gamma": 1.0}

    @classmethod
    def compute_in_trainer(cls) -> bool:
        return True
