"""Clip_B and Clip_V: GRPO advantages plus entropy-guided token clipping (trainer-side).

Ref: "On the Entropy Dynamics in Reinforcement Fine-Tuning of Large Language
Models" (arXiv:2602.03392) and Trinity-RFT's ``clipb`` / ``clipv`` advantage
functions (``examples/entropy``). Both compute the GRPO advantage of every
experience, then drop some negative-advantage tokens from the trained mask
using the current policy's per-token statistics, which the trainer computes
in a no-grad forward pass over the batch (Trinity: the old-log-prob pass):

* ``S = p * (H + log p)`` per token, ``p`` the sampled token's probability and
  ``H`` the entropy of the next-token distribution: the first-order change of
  the entropy when that token is pushed up.
* Clip_B keeps every token with advantage ``>= 0`` and a negative-advantage
  token only if ``S - mean(S) >= -mu * std(S)``.
* Clip_V uses ``D = N - S`` with ``N = H * sum(p^2) + sum(p^2 log p)`` and
  clips a token whose advantage is not positive when ``D > mu * std(D)``; at
  most ``max_frac`` of the tokens (at least one) are clipped: beyond that only
  the negative-advantage tokens with the largest ``D`` are.

``mean`` and ``std`` are over every trained token of the call (population
variance); when the std is below ``1e-12`` nothing is clipped. The advantage
itself is GRPO's, ``(r - mean(group)) / (std(group) + epsilon)`` with the
unbiased std, groups by task (``eid.tid``), as rftstream's ``grpo``: a group of
one has advantage 0 (Trinity divides its raw reward by ``1 + epsilon``).
Advantages and returns are set over the original mask (as Trinity); the
narrowed mask is written to ``exp.action_mask``, which the trainer then trains
on (``rewrites_action_mask``).

Pure tensor logic on CPU, no I/O; the trainer calls it off its event loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from algorithms.advantage_fn.advantage_fn import ADVANTAGE_FN, AdvantageFn
from algorithms.advantage_fn.grpo_advantage import group_rewards
from rftstream.experience import Experience, group_by

STD_FLOOR = 1e-12
"""Below this std of the clipping signal nothing is clipped (Trinity's bound)."""


def entropy_change_signal(logprob: torch.Tensor, entropy: torch.Tensor) -> torch.Tensor:
    """``S = exp(logprob) * (entropy + logprob)`` per token, float32."""
    lp = logprob.to(torch.float32)
    return lp.exp() * (entropy.to(torch.float32) + lp)


def masked_population_stats(
    values: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and population variance (denominator ``n``) of ``values`` where ``mask`` is set.

    An empty mask gives mean 0 and variance 0 (the count is clamped to 1).
    """
    m = mask.to(torch.float32)
    n = m.sum().clamp_min(1.0)
    mean = (values * m).sum() / n
    var = ((values - mean) ** 2 * m).sum() / n
    return mean, var


def clip_b_keep(
    advantages: torch.Tensor,
    logprob: torch.Tensor,
    entropy: torch.Tensor,
    mask: torch.Tensor,
    mu: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clip_B's keep mask ``(B, T)`` (bool) and its statistics ``ES`` / ``varS``.

    Tokens with advantage ``>= 0`` are kept; a negative-advantage token is kept
    when ``S - mean(S) >= -mu * std(S)`` (:func:`entropy_change_signal`, stats
    over ``mask``). Positions outside ``mask`` come back True (the caller ANDs).
    """
    signal = entropy_change_signal(logprob, entropy)
    mean, var = masked_population_stats(signal, mask)
    std = var.sqrt()
    stats = {"ES": float(mean), "varS": float(var)}
    if float(std) < STD_FLOOR:
        return torch.ones_like(mask, dtype=torch.bool), stats
    keep_neg = (signal - mean) >= -(mu * std)
    return torch.where(advantages < 0, keep_neg, torch.ones_like(keep_neg)), stats


def clip_v_keep(
    advantages: torch.Tensor,
    logprob: torch.Tensor,
    entropy: torch.Tensor,
    nec: torch.Tensor,
    mask: torch.Tensor,
    mu: float,
    max_frac: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clip_V's keep mask ``(B, T)`` (bool) and ``stdD``.

    ``D = nec - S``. A token whose advantage is not positive is clipped when
    ``D > mu * std(D)`` (as Trinity-RFT: zero-advantage tokens too; they carry
    no policy gradient). When that clips more than ``max_frac`` of the masked
    tokens and more than ``k = max(int(max_frac * tokens), 1)`` of them have a
    negative advantage, only the ``k`` negative-advantage tokens with the
    largest ``D`` are clipped among those (zero-advantage ones stay clipped).
    """
    m = mask.to(torch.bool)
    d = nec.to(torch.float32) - entropy_change_signal(logprob, entropy)
    mean, var = masked_population_stats(d, m)
    std = var.sqrt()
    stats = {"stdD": float(std)}
    if float(std) < STD_FLOOR:
        return torch.ones_like(m), stats
    keep_neg = d <= mu * std
    keep = torch.where(advantages > 0, torch.ones_like(keep_neg), keep_neg)
    total = float(m.to(torch.float32).sum().clamp_min(1.0))
    clipped = float((m & ~keep).sum()) / total
    if clipped <= max_frac:
        return keep, stats
    budget = max(int(max_frac * total), 1)
    candidates = (advantages < 0) & m & ~keep_neg
    count = int(candidates.sum())
    if count <= budget:
        return keep, stats
    scores = d.masked_fill(~candidates, float("-inf")).reshape(-1)
    top = torch.topk(scores, budget, largest=True).indices
    limited = torch.zeros_like(scores, dtype=torch.bool)
    limited[top] = True
    final = keep.clone()
    final[candidates] = True
    final[limited.view_as(d)] = False
    return final, stats


def clip_fractions(
    mask: torch.Tensor, kept: torch.Tensor, advantages: torch.Tensor
) -> dict[str, float]:
    """``frac_clipped`` of all masked tokens, ``frac_clipped_pos`` / ``_neg`` of those with
    positive / negative advantage (``kept`` is the narrowed mask; counts clamped to 1)."""
    m = mask.to(torch.float32)
    k = kept.to(torch.float32)
    pos = (advantages > 0).to(torch.float32)
    neg = (advantages < 0).to(torch.float32)

    def frac(weight: torch.Tensor) -> float:
        return 1.0 - float((k * weight).sum() / (m * weight).sum().clamp_min(1.0))

    return {
        "frac_clipped": frac(torch.ones_like(m)),
        "frac_clipped_pos": frac(pos),
        "frac_clipped_neg": frac(neg),
    }


def grpo_scores(exps: list[Experience], epsilon: float) -> torch.Tensor:
    """GRPO's normalised reward of each experience, ``(len(exps),)`` float32, in input order.

    Groups by task; ``(r - mean) / (std + epsilon)`` with the unbiased std; a
    group of one gets 0. Raises ValueError naming an experience without a
    numeric reward.
    """
    scores = torch.zeros(len(exps), dtype=torch.float32)
    index = {id(e): i for i, e in enumerate(exps)}
    for group in group_by(exps, id_type="task").values():
        if len(group) < 2:
            continue
        rewards = group_rewards(group)
        normed = (rewards - rewards.mean()) / (rewards.std() + epsilon)
        for exp, value in zip(group, normed, strict=True):
            scores[index[id(exp)]] = value
    return scores


class _EntropyClipAdvantage(AdvantageFn):
    """GRPO advantages, then a token clip on the padded batch (subclasses: :meth:`_keep`)."""

    rewrites_action_mask = True
    name = ""

    def __init__(self, epsilon: float = 1e-6, mu: float = 2.5, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if not mu >= 0:
            raise ValueError(f"{self.name}: mu must be >= 0, got {mu!r}")
        self.epsilon = float(epsilon)
        self.mu = float(mu)

    def _keep(
        self, adv: torch.Tensor, mask: torch.Tensor, inputs: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, float]]:
        raise NotImplementedError

    def _rows(
        self, exps: list[Experience], given: dict[str, Sequence[torch.Tensor] | None]
    ) -> tuple[dict[str, list[torch.Tensor]], list[int]]:
        """The per-experience inputs and the token count each covers (checked to agree)."""
        rows: dict[str, list[torch.Tensor]] = {}
        for name, values in given.items():
            if values is None:
                raise ValueError(
                    f"advantage_fn {self.name} needs per-token {name!r}: the trainer computes "
                    f"it (algorithm_type grpo_verl or another that computes advantages in the "
                    f"trainer); a direct call passes {name}=[one tensor per experience]"
                )
            if len(values) != len(exps):
                raise ValueError(
                    f"advantage_fn {self.name}: got {len(values)} {name!r} tensors for "
                    f"{len(exps)} experiences"
                )
            rows[name] = [torch.as_tensor(v, dtype=torch.float32).reshape(-1) for v in values]
        lengths = []
        for i, exp in enumerate(exps):
            sizes = {name: int(r[i].numel()) for name, r in rows.items()}
            n = min(sizes.values())
            if len(set(sizes.values())) != 1 or n > exp.response_length:
                raise ValueError(
                    f"advantage_fn {self.name}: experience {exp.eid.uid} has "
                    f"{exp.response_length} response tokens but inputs of lengths {sizes} "
                    f"(they must agree and not exceed the response)"
                )
            lengths.append(n)
        return rows, lengths

    def _compute(
        self, exps: list[Experience], given: dict[str, Sequence[torch.Tensor] | None]
    ) -> tuple[list[Experience], dict]:
        if not exps:
            return [], {}
        rows, lengths = self._rows(exps, given)
        scores = grpo_scores(exps, self.epsilon)
        width = max(max(lengths), 1)
        mask = torch.zeros(len(exps), width, dtype=torch.bool)
        padded = {name: torch.zeros(len(exps), width) for name in rows}
        for i, (exp, n) in enumerate(zip(exps, lengths, strict=True)):
            mask[i, :n] = exp.action_mask[:n].to(torch.bool)
            for name, r in rows.items():
                padded[name][i, :n] = r[i]
        adv = scores.unsqueeze(1) * mask.to(torch.float32)
        keep, stats = self._keep(adv, mask, padded)
        kept = mask & keep
        for i, (exp, n) in enumerate(zip(exps, lengths, strict=True)):
            full = exp.action_mask.to(torch.bool)
            exp.advantages = scores[i] * full.to(torch.float32)
            exp.returns = exp.advantages.clone()
            narrowed = full.clone()
            narrowed[:n] = kept[i, :n]
            exp.action_mask = narrowed
        return exps, {**clip_fractions(mask, kept, adv), **stats}


@ADVANTAGE_FN.register_module("clipb")
class ClipBAdvantageFn(_EntropyClipAdvantage):
    """Clip_B: GRPO advantages; negative-advantage tokens with an outlying low
    ``S = p * (H + log p)`` leave the trained mask (module docstring).

    ``__call__(exps, entropy=..., rollout_logprob=...)``: one tensor per
    experience each (the trainer passes them); ``rollout_logprob`` defaults to
    each ``exp.logprobs``. Arguments: ``epsilon`` (GRPO's), ``mu`` (clip bound in
    standard deviations). Metrics: ``frac_clipped``, ``frac_clipped_pos``,
    ``frac_clipped_neg``, ``ES``, ``varS``.
    """

    trainer_inputs = frozenset({"entropy", "rollout_logprob"})
    name = "clipb"

    def __init__(self, epsilon: float = 1e-6, mu: float = 2.5, **kwargs: Any) -> None:
        super().__init__(epsilon=epsilon, mu=mu, **kwargs)

    def __call__(
        self,
        exps: list[Experience],
        entropy: Sequence[torch.Tensor] | None = None,
        rollout_logprob: Sequence[torch.Tensor] | None = None,
        **kwargs: Any,
    ) -> tuple[list[Experience], dict]:
        if rollout_logprob is None and all(e.logprobs is not None for e in exps):
            rollout_logprob = [e.logprobs for e in exps]
        return self._compute(exps, {"entropy": entropy, "rollout_logprob": rollout_logprob})

    def _keep(
        self, adv: torch.Tensor, mask: torch.Tensor, inputs: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, float]]:
        return clip_b_keep(adv, inputs["rollout_logprob"], inputs["entropy"], mask, self.mu)

    @classmethod
    def default_args(cls) -> dict:
        return {"epsilon": 1e-6, "mu": 2.5}

    @classmethod
    def compute_in_trainer(cls) -> bool:
        return True


@ADVANTAGE_FN.register_module("clipv")
class ClipVAdvantageFn(_EntropyClipAdvantage):
    """Clip_V: GRPO advantages; tokens that are not positive with an outlying high
    ``D = N - S`` leave the trained mask, at most ``max_frac`` of them (module docstring).

    ``__call__(exps, entropy=..., nec=..., old_logprob=...)``: one tensor per
    experience each, from the trainer's no-grad pass (Trinity's ``entropys``,
    ``necs``, ``old_log_probs``). Arguments: ``epsilon``, ``mu``, ``max_frac``.
    As in Trinity-RFT the constructor's ``mu`` defaults to 2.0 and the config's
    (:meth:`default_args`) to 8.5. Metrics: ``frac_clipped``,
    ``frac_clipped_pos``, ``frac_clipped_neg``, ``stdD``.
    """

    trainer_inputs = frozenset({"entropy", "nec", "old_logprob"})
    name = "clipv"

    def __init__(
        self, epsilon: float = 1e-6, mu: float = 2.0, max_frac: float = 1e-4, **kwargs: Any
    ) -> None:
        super().__init__(epsilon=epsilon, mu=mu, **kwargs)
        if not 0 <= max_frac <= 1:
            raise ValueError(f"clipv: max_frac must be in [0, 1], got {max_frac!r}")
        self.max_frac = float(max_frac)

    def __call__(
        self,
        exps: list[Experience],
        entropy: Sequence[torch.Tensor] | None = None,
        nec: Sequence[torch.Tensor] | None = None,
        old_logprob: Sequence[torch.Tensor] | None = None,
        **kwargs: Any,
    ) -> tuple[list[Experience], dict]:
        return self._compute(exps, {"entropy": entropy, "nec": nec, "old_logprob": old_logprob})

    def _keep(
        self, adv: torch.Tensor, mask: torch.Tensor, inputs: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, float]]:
        return clip_v_keep(
            adv,
            inputs["old_logprob"],
            inputs["entropy"],
            inputs["nec"],
            mask,
            self.mu,
            self.max_frac,
        )

    @classmethod
    def default_args(cls) -> dict:
        return {"epsilon": 1e-6, "mu": 8.5, "max_frac": 1e-4}

    @classmethod
    def compute_in_trainer(cls) -> bool:
        return True
