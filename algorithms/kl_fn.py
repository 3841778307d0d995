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
from typing import Any

import torch

from algorithms.utils import check_loss_agg_mode, masked_loss, masked_mean
from rftstream.experience import Experience
from rftstream.plugins.registries import KL_FN


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
        if self.adaptive and (target_kl <= 0 or horizon <= 0):  # type: ignore[operator]
            raise ValueError(
                f"target_kl and horizon must be > 0 for an adaptive KL coefficient, "
                f"got target_kl={target_kl}, horizon={horizon}"
            )

    @abstractmethod
    def calculate_kl(
        self,
        logprob: torch.Tensor,
        ref_logprob: torch.Tensor,
        old_logprob: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Per-token KL estimate, same shape as ``logprob``."""

    def update_kl_coef(self, current_kl: float, batch_size: int) -> None:
        """Adaptive controller (no-op unless ``adaptive``); verl's ``AdaptiveKLController.update``.

        ``error = clip(current_kl / target_kl - 1, -0.2, 0.2)``;
        ``kl_coef *= 1 + error * batch_size / horizon`` (``batch_size`` is
        verl's ``n_steps``).
        """
        if not self.adaptive:
            return
        error = min(max(current_kl / self.target_kl - 1.0, -0.2), 0.2)  # type: ignore[operator]
        self.kl_coef *= 1.0 + error * batch_size / self.horizon  # type: ignore[operator]

    def apply_kl_penalty_to_reward(
        self,
        exps: list[Experience],
        ref_logprobs: torch.Tensor | Sequence[Any] | None = None,
        logprobs: torch.Tensor | Sequence[Any] | None = None,
    ) -> tuple[list[Experience], dict]:
        """Penalise the token-level rewards with the KL to the reference model.

        Contract (the trainer's side of Trinity-RFT / verl ``apply_kl_penalty``):

        * ``exps``: the step's experiences, in batch order. Each gets
          ``token_level_reward = scores - kl_coef * kl`` (float32, CPU, shape
          ``(response_length,)``), set *in place*; the same list is returned.
          ``scores`` is the experience's existing ``token_level_reward``, else
          its ``reward`` on the last response token (zeros without a reward).
          ``kl[j] = calculate_kl(logprob[j], ref_logprob[j])`` where
          ``exp.action_mask[j]`` is set, else 0.
        * ``ref_logprobs``: the reference model's logprobs of the response
          tokens: a ``(batch, width)`` tensor with responses right-padded
          (row ``i`` column ``j`` is response token ``j`` of ``exps[i]``, as
          in ``rftstream.training.batch``), or a sequence of one 1-D tensor /
          list per experience. None: each experience's
          ``exp.info["ref_logprobs"]``.
        * ``logprobs``: the policy logprobs to compare, same layout. Trinity
          and verl use the trainer's recomputed ``old_logprob`` here; None:
          each experience's rollout ``exp.logprobs``.
        * A row shorter than the response (a truncated batch) covers only its
          first ``width`` tokens; the tokens after it get no penalty and are
          left out of the ``kl`` metric. Tensors may live on any device and
          are detached; no gradient flows.
        * Either every experience has both logprobs and reference logprobs,
          or none has: then the rewards are just ``scores``, the metrics are
          ``{"kl": 0.0, "kl_coef": 0.0}`` and the coefficient is not updated.
          A mixture raises ValueError, as does a ``ref_logprobs`` /
          ``logprobs`` with a row count other than ``len(exps)``.

        Metrics: ``kl`` (mean over experiences of each one's masked mean KL;
        a fully masked experience counts as 0, as in verl) and ``kl_coef``
        (the coefficient applied, i.e. before this call's adaptive update).
        Afterwards the adaptive controller (if any) is updated with ``kl`` and
        ``batch_size = len(exps)``. An empty ``exps`` gives ``{"kl": 0.0,
        "kl_coef": 0.0}`` and no update.
        """
        n = len(exps)
        for name, src in (("ref_logprobs", ref_logprobs), ("logprobs", logprobs)):
            if src is not None and len(src) != n:
                raise ValueError(f"got {len(src)} rows of {name} for {n} experiences")
        pairs: list[tuple[torch.Tensor, torch.Tensor] | None] = []
        for i, exp in enumerate(exps):
            ref = ref_logprobs[i] if ref_logprobs is not None else exp.info.get("ref_logprobs")
            lp = logprobs[i] if logprobs is not None else exp.logprobs
            pairs.append(None if ref is None or lp is None else (_as_f32(lp), _as_f32(ref)))
        have = sum(p is not None for p in pairs)
        if 0 < have < n:
            raise ValueError(
                f"{n - have} of {n} experiences lack logprobs or reference logprobs; "
                "a KL penalty needs them for all or none"
            )
        if have == 0:
            for exp in exps:
                exp.token_level_reward = _token_scores(exp)
            return exps, {"kl": 0.0, "kl_coef": 0.0}
        seq_kls: list[float] = []
        coef = self.kl_coef
        for exp, pair in zip(exps, pairs, strict=True):
            lp, ref = pair  # type: ignore[misc]
            scores = _token_scores(exp)
            width = min(
                int(lp.numel()), int(ref.numel()), int(exp.action_mask.numel()), int(scores.numel())
            )
            mask = exp.action_mask.to(torch.bool)[:width]
            with torch.no_grad():
                kl = self.calculate_kl(lp[:width], ref[:width]).to(torch.float32)
                kl = torch.where(mask, kl, torch.zeros((), dtype=kl.dtype))
            scores[:width] = scores[:width] - coef * kl
            exp.token_level_reward = scores
            seq_kls.append(float(masked_mean(kl, mask)))
        current_kl = sum(seq_kls) / len(seq_kls)
        self.update_kl_coef(current_kl=current_kl, batch_size=n)
        return exps, {"kl": current_kl, "kl_coef": coef}

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
        return exp.token_level_reward.detach().to(torch.float32).clone()
    scores = torch.zeros(exp.response_length, dtype=torch.float32)
    if exp.response_length > 0 and exp.reward is not None:
        scores[-1] = float(exp.reward)
    return scores


def _as_f32(x: Any) -> torch.Tensor:
    """A detached, 1-D float32 CPU tensor of ``x`` (tensor, list or array)."""
    if isinstance(x, torch.Tensor):
        return x.detach().to(device="cpu", dtype=torch.float32).reshape(-1)
    return torch.as_tensor(x, dtype=torch.float32).reshape(-1)


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
        self,
        exps: list[Experience],
        ref_logprobs: torch.Tensor | Sequence[Any] | None = None,
        logprobs: torch.Tensor | Sequence[Any] | None = None,
    ) -> tuple[list[Experience], dict]:
        """Only sets ``token_level_reward = scores`` (see :meth:`KLFn.apply_kl_penalty_to_reward`)."""
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
