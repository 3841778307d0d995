"""Entropy regularisation terms.

Registered: ``default`` (``-entropy_coef * agg(entropy)``) and ``none`` (zero).
The returned loss already carries its sign, so the trainer *adds* it:
``total = policy_loss + kl_loss + entropy_loss`` (a positive ``entropy_coef``
rewards entropy). ``entropy`` and ``action_mask`` are ``(batch,
response_length)``. No I/O.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from algorithms.utils import check_loss_agg_mode, masked_loss
from rftstream.registry import Registry

ENTROPY_LOSS_FN: Registry[type[EntropyLossFn]] = Registry("entropy_loss_fn")


class EntropyLossFn(ABC):
    """Turns per-token entropies into a loss term and metrics."""

    loss_agg_mode: str = "token-mean"

    @abstractmethod
    def __call__(
        self,
        entropy: torch.Tensor,
        action_mask: torch.Tensor,
        loss_agg_mode: str | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, dict]:
        """Return ``(loss, metrics)`` for per-token ``entropy`` under ``action_mask``.

        ``loss_agg_mode`` None means the one given at construction.
        """

    @classmethod
    def default_args(cls) -> dict:
        """Default constructor arguments."""
        return {"entropy_coef": 0.0}


@ENTROPY_LOSS_FN.register_module("default")
class DefaultEntropyLossFn(EntropyLossFn):
    """``loss = -entropy_coef * masked_loss(entropy, action_mask, loss_agg_mode)``.

    Metric ``entropy_loss``: the aggregated entropy itself (before the
    coefficient and sign), as in Trinity-RFT.
    """

    def __init__(self, entropy_coef: float = 0.0, loss_agg_mode: str = "token-mean") -> None:
        self.entropy_coef = float(entropy_coef)
        self.loss_agg_mode = check_loss_agg_mode(loss_agg_mode)

    def __call__(
        self,
        entropy: torch.Tensor,
        action_mask: torch.Tensor,
        loss_agg_mode: str | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, dict]:
        mode = self.loss_agg_mode if loss_agg_mode is None else loss_agg_mode
        entropy_agg = masked_loss(entropy, action_mask, loss_agg_mode=mode)
        return -self.entropy_coef * entropy_agg, {"entropy_loss": entropy_agg.detach().item()}


@ENTROPY_LOSS_FN.register_module("none")
class DummyEntropyLossFn(EntropyLossFn):
    """No entropy term: a zero loss and no metrics. Accepts (and ignores) ``entropy_coef``."""

    def __init__(self, entropy_coef: float = 0.0, loss_agg_mode: str = "token-mean") -> None:
        self.entropy_coef = float(entropy_coef)
        self.loss_agg_mode = check_loss_agg_mode(loss_agg_mode)

    def __call__(
        self,
        entropy: torch.Tensor,
        action_mask: torch.Tensor,
        loss_agg_mode: str | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, dict]:
        return torch.tensor(0.0, device=entropy.device), {}

    @classmethod
    def default_args(cls) -> dict:
        return {}
