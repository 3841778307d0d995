"""Policy loss functions: the ``PolicyLossFn`` interface.

As in Trinity-RFT: the trainer scans the parameter list of a loss function's
``__call__`` and passes exactly those tensors, by name. Write every tensor a
loss needs as a named parameter (``logprob``, ``old_logprob``, ``action_mask``,
``advantages``, ``expert_mask``, ...) rather than reading it from ``kwargs``.
:func:`~rftstream.training.loss_inputs.loss_inputs_for` returns those names;
:func:`~rftstream.training.loss_inputs.check_loss_inputs` checks them against the
fields the trainer can provide, at config time.

All tensors are ``(batch, response_length)`` (``expert_mask``: ``(batch,)``);
``logprob`` is the current policy's, with gradient. A loss returns
``(scalar loss tensor, metrics dict of floats)``. No I/O.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from algorithms.utils import check_loss_agg_mode
from rftstream.plugins.registries import POLICY_LOSS_FN
from rftstream.training.loss_inputs import loss_inputs_for

__all__ = ["POLICY_LOSS_FN", "PolicyLossFn"]


class PolicyLossFn(ABC):
    """Computes the policy loss from named per-token tensors.

    ``loss_agg_mode`` (one of :data:`algorithms.utils.LOSS_AGG_MODES`) is
    accepted by every loss through this constructor; it defaults to the class
    attribute ``"token-mean"``, so a subclass that never calls
    ``super().__init__`` still has ``self.loss_agg_mode``. ``backend`` is kept
    for Trinity-RFT compatibility (tensor names here are always the Trinity
    names, whatever the backend).
    """

    loss_agg_mode: str = "token-mean"
    backend: str = "verl"

    def __init__(self, backend: str = "verl", **kwargs: Any) -> None:
        loss_agg_mode = kwargs.pop("loss_agg_mode", None)
        if kwargs:
            raise TypeError(f"{type(self).__name__}: unexpected argument(s) {sorted(kwargs)}")
        self.backend = backend
        if loss_agg_mode is not None:
            self.loss_agg_mode = check_loss_agg_mode(loss_agg_mode)

    @abstractmethod
    def __call__(self, logprob: torch.Tensor, **kwargs: Any) -> tuple[torch.Tensor, dict]:
        """Calculate the policy loss.

        Args:
            logprob: log-probabilities of the response tokens under the current policy.
            kwargs: the other tensors named in the subclass's signature.

        Returns:
            The scalar loss and a metrics dict.
        """

    @classmethod
    def default_args(cls) -> dict:
        """Default constructor arguments, used where the config gives none."""
        return {}

    @property
    def select_keys(self) -> list[str]:
        """The tensor names this loss reads besides ``logprob`` (Trinity-RFT's ``select_keys``)."""
        return [k for k in loss_inputs_for(self) if k != "logprob"]
