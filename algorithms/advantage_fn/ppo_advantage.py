"""PPO's GAE advantage (computed in the trainer: it needs the critic's values).

Ref: verl ``core_algos.compute_gae_advantage_return``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from algorithms.advantage_fn.advantage_fn import ADVANTAGE_FN, AdvantageFn
from algorithms.utils import masked_count, masked_whiten
from rftstream.experience import Experience


def compute_gae_advantage_return(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation on a right-padded batch ``(batch, T)``.

    ``delta_t = r_t + gamma * V_{t+1} - V_t`` (``V_T = 0``),
    ``A_t = delta_t + gamma * lam * A_{t+1}``, ``returns = A + V``; then the
    advantages are whitened over the masked tokens of the batch (skipped when
    fewer than two tokens are unmasked). Both results are zeroed where the
    mask is False. Returns ``(advantages, returns)``, float32, shape ``(batch, T)``.
    """
    with torch.no_grad():
        rewards = token_level_rewards.to(torch.float32)
        vals = values.to(torch.float32)
        mask = response_mask.to(torch.bool)
        length = rewards.shape[-1]
        last = torch.zeros(rewards.shape[0], dtype=torch.float32)
        reversed_adv: list[torch.Tensor] = []
        for t in reversed(range(length)):
            next_values = vals[:, t + 1] if t < length - 1 else torch.zeros_like(last)
            delta = rewards[:, t] + gamma * next_values - vals[:, t]
            last = delta + gamma * lam * last
            reversed_adv.append(last)
        if reversed_adv:
            advantages = torch.stack(reversed_adv[::-1], dim=1)
        else:
            advantages = torch.zeros_like(rewards)
        returns = advantages + vals
        if masked_count(mask) >= 2:  # the whole batch's, with several ranks
            advantages = masked_whiten(advantages, mask)
        fmask = mask.to(torch.float32)
        return advantages * fmask, returns * fmask


def outcome_token_rewards(exp: Experience) -> torch.Tensor:
    """``exp.token_level_reward`` if set, else ``exp.reward`` on the last response token (float32)."""
    if exp.token_level_reward is not None:
        return exp.token_level_reward.to(torch.float32)
    scores = torch.zeros(exp.response_length, dtype=torch.float32)
    if exp.response_length > 0 and exp.reward is not None:
        scores[-1] = float(exp.reward)
    return scores


def _pad(rows: Sequence[torch.Tensor], length: int, dtype: torch.dtype) -> torch.Tensor:
    out = torch.zeros(len(rows), length, dtype=dtype)
    for i, row in enumerate(rows):
        out[i, : row.numel()] = row.to(dtype)
    return out


@ADVANTAGE_FN.register_module("ppo")
class PPOAdvantageFn(AdvantageFn):
    """GAE advantages for PPO; the trainer calls it with critic values.

    ``__call__(exps, values=...)``: ``values`` is one response-length tensor per
    experience (the critic's value of each response token); without it each
    ``exp.info["values"]`` is used. Rewards: ``token_level_reward`` if set,
    else ``reward`` on the last response token. Metrics ``advantages/mean``,
    ``returns/mean`` over masked tokens.
    """

    def __init__(self, gamma: float = 1.0, lam: float = 1.0, **kwargs) -> None:
        super().__init__(**kwargs)
        self.gamma = float(gamma)
        self.lam = float(lam)

    def __call__(
        self,
        exps: list[Experience],
        values: Sequence[torch.Tensor] | None = None,
        **kwargs: Any,
    ) -> tuple[list[Experience], dict]:
        if not exps:
            return [], {}
        if values is None:
            missing = [e.eid.uid for e in exps if "values" not in e.info]
            if missing:
                raise ValueError(
                    f"PPO advantage needs critic values: pass values=... or set exp.info['values'] "
                    f"(missing for {missing[:3]})"
                )
            values = [torch.as_tensor(e.info["values"], dtype=torch.float32) for e in exps]
        if len(values) != len(exps):
            raise ValueError(f"got {len(values)} value tensors for {len(exps)} experiences")
        length = max(e.response_length for e in exps)
        rewards = _pad([outcome_token_rewards(e) for e in exps], length, torch.float32)
        vals = _pad(list(values), length, torch.float32)
        mask = _pad([e.action_mask for e in exps], length, torch.bool)
        adv, ret = compute_gae_advantage_return(rewards, vals, mask, self.gamma, self.lam)
        for i, exp in enumerate(exps):
            n = exp.response_length
            exp.advantages = adv[i, :n].clone()
            exp.returns = ret[i, :n].clone()
        count = max(int(mask.sum()), 1)
        metrics = {
            "advantages/mean": float(adv.sum()) / count,
            "returns/mean": float(ret.sum()) / count,
        }
        return exps, metrics

    @classmethod
    def default_args(cls) -> dict:
        return {"gamma": 1.0, "lam": 1.0}

    @classmethod
    def compute_in_trainer(cls) -> bool:
        return True
