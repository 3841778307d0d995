"""Entropy regularisation terms.

Registered: ``default`` (``entropy_coef * agg(entropy)``), ``mix`` (the same,
over the non-expert rows only; Trinity-RFT's ``MixEntropyLossFn``) and
``none`` (zero).

Sign convention (Trinity-RFT's): an entropy fn returns the entropy *bonus*
``+entropy_coef * H`` and the trainer *subtracts* it:
``total = policy_loss + kl_loss - entropy_loss``, so a positive
``entropy_coef`` rewards entropy. An entropy fn ported from Trinity-RFT
therefore means the same here. ``entropy`` and ``action_mask`` are
``(batch, response_length)``; ``expert_mask`` is ``(batch,)``. No I/O.

Calling convention: the trainer calls every entropy fn the same way,
``fn(entropy=..., action_mask=..., loss_agg_mode=..., **fields)``, where
``fields`` are the extra per-row batch tensors it has (e.g. ``expert_mask``
from the ``mix`` sample strategy). Every entropy fn accepts and ignores
keyword tensors it does not use. :attr:`EntropyLossFn.required_fields` names
the extra tensors a fn cannot do without (``{"expert_mask"}`` for ``mix``,
empty otherwise), so the trainer can check them at config time, e.g.
``missing = fn.required_fields - available``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch

from algorithms.utils import check_loss_agg_mode, masked_loss
from rftstream.plugins.registries import ENTROPY_LOSS_FN


class EntropyLossFn(ABC):
    """Turns per-token entropies into an entropy bonus (which the trainer subtracts) and metrics.

    ``required_fields``: names of the extra keyword tensors (besides
    ``entropy`` and ``action_mask``) that ``__call__`` needs.
    """

    loss_agg_mode: str = "token-mean"
    required_fields: ClassVar[frozenset[str]] = frozenset()

    @abstractmethod
    def __call__(
        self,
        entropy: torch.Tensor,
        action_mask: torch.Tensor,
        loss_agg_mode: str | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, dict]:
        """Return ``(bonus, metrics)`` for per-token ``entropy`` under ``action_mask``.

        The trainer computes ``loss = ... - bonus`` (Trinity-RFT's convention).

        ``loss_agg_mode`` None means the one given at construction. Extra
        keyword tensors (``expert_mask``, ...) are ignored unless the fn uses them.
        """

    @classmethod
    def default_args(cls) -> dict:
        """Default constructor arguments."""
        return {"entropy_coef": 0.0}


@ENTROPY_LOSS_FN.register_module("default")
class DefaultEntropyLossFn(EntropyLossFn):
    """``bonus = entropy_coef * masked_loss(entropy, action_mask, loss_agg_mode)``.

    The trainer subtracts the returned value from the loss (see the module docstring).

    Metric ``entropy_loss``: the aggregated entropy itself (before the
    coefficient and sign), as in Trinity-RFT. Extra keyword tensors (e.g.
    ``expert_mask``) are ignored: every row counts.
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
        return self.entropy_coef * entropy_agg, {"entropy_loss": entropy_agg.detach().item()}


@ENTROPY_LOSS_FN.register_module("mix")
class MixEntropyLossFn(DefaultEntropyLossFn):
    """``default`` restricted to the usual (non-expert) rows, for the MIX algorithm.

    ``bonus = entropy_coef * masked_loss(entropy[~expert_mask],
    action_mask[~expert_mask], loss_agg_mode)``: expert (SFT) rows neither add
    to nor dilute the entropy term. ``expert_mask`` is ``(batch,)``, True for
    expert rows (any dtype; nonzero means expert); it is required and must
    have one entry per row (ValueError otherwise). With no usual row (every
    row expert, or an empty batch) the loss and the metric are 0.

    Metric ``entropy_loss``: the aggregated entropy of the usual rows.
    """

    required_fields: ClassVar[frozenset[str]] = frozenset({"expert_mask"})

    def __call__(  # type: ignore[override]
        self,
        entropy: torch.Tensor,
        action_mask: torch.Tensor,
        loss_agg_mode: str | None = None,
        expert_mask: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, dict]:
        if expert_mask is None:
            raise ValueError(
                "entropy_loss_fn 'mix' needs expert_mask (the 'mix' sample strategy provides it)"
            )
        expert = torch.as_tensor(expert_mask, device=entropy.device).to(torch.bool).reshape(-1)
        if expert.numel() != entropy.shape[0]:
            raise ValueError(
                f"expert_mask has {expert.numel()} entries for {entropy.shape[0]} rows of entropy"
            )
        usual = ~expert
        return super().__call__(entropy[usual], action_mask[usual], loss_agg_mode)


@ENTROPY_LOSS_FN.register_module("none")
class DummyEntropyLossFn(EntropyLossFn):
    """No entropy term: a zero loss and no metrics.

    Accepts (and ignores) ``entropy_coef``, ``loss_agg_mode`` and any extra
    keyword tensors (``expert_mask``).
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
        return torch.tensor(0.0, device=entropy.device), {}

    @classmethod
    def default_args(cls) -> dict:
        return {}
