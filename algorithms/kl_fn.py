"""KL divergence estimators, used as a reward penalty or as a loss term.

Ref: verl ``core_algos.kl_penalty`` / ``AdaptiveKLController``, Trinity-RFT
``trinity.algorithm.kl_fn``, Schulman's "Approximating KL divergence" (k1, k2,
k3). All estimators are per token, with ``logprob`` of the current (or
rollout) policy and ``ref_logprob`` of the reference model, shape
``(batch, response_length)`` or ``(response_length,)``.

Registered: ``none`` (zero), ``k1`` (``logprob - ref``), ``k2`` (``0.5 *
(logprob - ref)^2``), ``k3`` (``exp(ref - logprob) - (ref - logprob) - 1``),
``low_var_kl`` (k3 with ``ref - logprob`` clamped to ``[-20, 20]`` and the
result clamped to ``[-10, 10]``), ``abs`` (``|logprob - ref|``) and
``corrected_k3`` (k3 times the importance ratio ``clamp(exp(logprob -
old_logprob), 0, 2)``; plain k3 without ``old_logprob``). No I/O.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

from algorithms.utils import check_loss_agg_mode, masked_loss, masked_mean
from rftstream.experience import Experience
from rftstream.registry import Registry

KL_FN: Registry[type[KLFn]] = Registry("kl_fn")


class KLFn(ABC):
    """A per-token KL estimator with a (fixed or adaptive) coefficient.

    ``adaptive=True`` needs ``target_kl`` and ``horizon`` and updates
    ``kl_coef`` after every :meth:`apply_kl_penalty_to_reward` (verl's
    ``AdaptiveKLController``). ``loss_agg_mode`` is the default aggregation
    for :meth:`calculate_kl_loss`.
    """

    def __init__(
        self,
        kl_coef: float = 0.001,
        adaptive: bool = False,
        target_kl: float | None = None,
        horizon: float | None = None,
        loss_agg_mode: str = "token-mean",
    ) -> None:
        self.kl_coef = float(kl_coef)
        self.adaptive = bool(adaptive)
        self.target_kl = target_kl
        self.horizon = horizon
        self.loss_agg_mode = check_loss_agg_mode(loss_agg_mode)
        if self.adaptive and (target_kl is None or horizon is None):
            raise ValueError("target_kl and horizon must be given for an adaptive KL coefficient")

    @abstractmethod
    def calculate_kl(
        self,
        logprob: torch.Tensor,
        ref_logprob: torch.Tensor,
        old_logprob: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Per-token KL estimate, same shape as ``logprob``."""

    def update_kl_coef(self, current_kl: float, batch_size: int) -> None:
        """Adaptive controller (no-op unless ``adaptive``).

        ``error = clip(current_kl / target_kl - 1, -0.2, 0.2)``;
        ``kl_coef *= 1 + error * batch_size / horizon``.
        """
        if not self.adaptive:
            return
        error = min(max(current_kl / self.target_kl - 1.0, -0.2), 0.2)  # type: ignore[operator]
        self.kl_coef *= 1.0 + error * batch_size / self.horizon  # type: ignore[operator]

    def apply_kl_penalty_to_reward(
        self,
        exps: list[Experience],
        ref_logprobs: Sequence[torch.Tensor] | None = None,
    ) -> tuple[list[Experience], dict]:
        """Set ``token_level_reward = scores - kl_coef * kl * action_mask`` on every experience.

        ``scores`` is the experience's ``token_level_reward`` if already set,
        else its ``reward`` on the last response token. ``kl`` uses
        ``exp.logprobs`` (rollout policy) and the reference logprobs: the
        ``ref_logprobs`` argument (one response-length tensor per experience)
        or else ``exp.info["ref_logprobs"]``. Without reference logprobs (or
        rollout logprobs) no penalty is applied and the reported ``kl_coef`` is 0.

        Metrics: ``kl`` (mean over experiences of the per-sequence masked mean
        KL) and ``kl_coef`` (the coefficient applied). Afterwards the adaptive
        controller is updated with ``kl`` and ``batch_size = len(exps)``.
        """
        if ref_logprobs is not None and len(ref_logprobs) != len(exps):
            raise ValueError(f"got {len(ref_logprobs)} ref_logprobs for {len(exps)} experiences")
        seq_kls: list[float] = []
        applied = False
        for i, exp in enumerate(exps):
            scores = _token_scores(exp)
            ref = ref_logprobs[i] if ref_logprobs is not None else exp.info.get("ref_logprobs")
            if ref is None or exp.logprobs is None:
                exp.token_level_reward = scores
                seq_kls.append(0.0)
                continue
            ref_t = torch.as_tensor(ref, dtype=torch.float32)
            mask = exp.action_mask
            with torch.no_grad():
                kl = self.calculate_kl(exp.logprobs.to(torch.float32), ref_t)
                kl = torch.where(mask, kl, torch.zeros((), dtype=kl.dtype))
            exp.token_level_reward = (scores - self.kl_coef * kl).to(torch.float32)
            seq_kls.append(float(masked_mean(kl, mask)))
            applied = True
        current_kl = sum(seq_kls) / len(seq_kls) if seq_kls else 0.0
        metrics = {"kl": current_kl, "kl_coef": self.kl_coef if applied else 0.0}
        if applied:
            self.update_kl_coef(current_kl=current_kl, batch_size=len(exps))
        return exps, metrics

    def calculate_kl_loss(
        self,
        logprob: torch.Tensor,
        ref_logprob: torch.Tensor,
        response_mask: torch.Tensor,
        loss_agg_mode: str | None = None,
        old_logprob: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict]:
        """KL loss term: ``kl_coef * masked_loss(kl, response_mask, loss_agg_mode)``.

        ``loss_agg_mode`` None means the one given at construction. Metrics:
        ``kl_loss`` (the aggregated KL, before the coefficient) and ``kl_coef``.
        """
        mode = self.loss_agg_mode if loss_agg_mode is None else loss_agg_mode
        kl = self.calculate_kl(logprob, ref_logprob, old_logprob)
        kl_loss = masked_loss(kl, response_mask, loss_agg_mode=mode)
        metrics = {"kl_loss": kl_loss.detach().item(), "kl_coef": self.kl_coef}
        return kl_loss * self.kl_coef, metrics

    @classmethod
    def default_args(cls) -> dict:
        """Default constructor arguments."""
        return {"adaptive": False, "kl_coef": 0.001}


def _token_scores(exp: Experience) -> torch.Tensor:
    if exp.token_level_reward is not None:
        return exp.token_level_reward.to(torch.float32)
    scores = torch.zeros(exp.response_length, dtype=torch.float32)
    if exp.response_length > 0 and exp.reward is not None:
        scores[-1] = float(exp.reward)
    return scores


@KL_FN.register_module("none")
class DummyKLFn(KLFn):
    """No KL: zero estimate, no reward penalty, zero loss (and no metrics)."""

    def calculate_kl(
        self,
        logprob: torch.Tensor,
        ref_logprob: torch.Tensor,
        old_logprob: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return torch.zeros_like(logprob)

    def apply_kl_penalty_to_reward(
        self, exps: list[Experience], ref_logprobs: Sequence[torch.Tensor] | None = None
    ) -> tuple[list[Experience], dict]:
        for exp in exps:
            exp.token_level_reward = _token_scores(exp)
        return exps, {}

    def calculate_kl_loss(
        self,
        logprob: torch.Tensor,
        ref_logprob: torch.Tensor,
        response_mask: torch.Tensor,
        loss_agg_mode: str | None = None,
        old_logprob: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict]:
        return torch.tensor(0.0, device=logprob.device), {}


@KL_FN.register_module("k1")
class K1Fn(KLFn):
    """k1: ``logprob - ref_logprob``."""

    def calculate_kl(self, logprob, ref_logprob, old_logprob=None) -> torch.Tensor:  # type: ignore[override]
        return logprob - ref_logprob


@KL_FN.register_module("k2")
class K2Fn(KLFn):
    """k2: ``0.5 * (logprob - ref_logprob)^2``."""

    def calculate_kl(self, logprob, ref_logprob, old_logprob=None) -> torch.Tensor:  # type: ignore[override]
        return (logprob - ref_logprob).square() * 0.5


@KL_FN.register_module("k3")
class K3Fn(KLFn):
    """k3: ``exp(ref - logprob) - (ref - logprob) - 1`` (unbiased, non-negative)."""

    def calculate_kl(self, logprob, ref_logprob, old_logprob=None) -> torch.Tensor:  # type: ignore[override]
        logr = ref_logprob - logprob
        return logr.exp() - 1 - logr


@KL_FN.register_module("low_var_kl")
class LowVarKLFn(KLFn):
    """verl's ``low_var_kl``: k3 with ``ref - logprob`` clamped to [-20, 20], result clamped to [-10, 10]."""

    def calculate_kl(self, logprob, ref_logprob, old_logprob=None) -> torch.Tensor:  # type: ignore[override]
        kl = torch.clamp(ref_logprob - logprob, min=-20, max=20)
        ratio = torch.exp(kl)
        kld = ratio - kl - 1
        return torch.clamp(kld, min=-10, max=10)


@KL_FN.register_module("abs")
class AbsFn(KLFn):
    """``|logprob - ref_logprob|``."""

    def calculate_kl(self, logprob, ref_logprob, old_logprob=None) -> torch.Tensor:  # type: ignore[override]
        return torch.abs(logprob - ref_logprob)


@KL_FN.register_module("corrected_k3")
class CorrectedK3Fn(KLFn):
    """k3 corrected by the importance ratio ``clamp(exp(logprob - old_logprob), 0, 2)``.

    Falls back to plain k3 when ``old_logprob`` is None.
    """

    def calculate_kl(self, logprob, ref_logprob, old_logprob=None) -> torch.Tensor:  # type: ignore[override]
        logr = ref_logprob - logprob
        kl_term = torch.exp(logr) - logr - 1
        if old_logprob is None:
            return kl_term
        ratio_is = torch.clamp(torch.exp(logprob - old_logprob), min=0.0, max=2.0)
        return ratio_is * kl_term
