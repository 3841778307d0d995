"""Policy loss functions: the ``PolicyLossFn`` interface and input discovery.

As in Trinity-RFT: the trainer scans the parameter list of a loss function's
``__call__`` and passes exactly those tensors, by name. Write every tensor a
loss needs as a named parameter (``logprob``, ``old_logprob``, ``action_mask``,
``advantages``, ``expert_mask``, ...) rather than reading it from ``kwargs``.
:func:`loss_inputs_for` returns those names; :func:`check_loss_inputs` checks
them against the fields the trainer can provide, at config time.

All tensors are ``(batch, response_length)`` (``expert_mask``: ``(batch,)``);
``logprob`` is the current policy's, with gradient. A loss returns
``(scalar loss tensor, metrics dict of floats)``. No I/O.
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import Any

import torch

from algorithms.utils import check_loss_agg_mode
from rftstream.errors import ConfigError
from rftstream.registry import Registry

POLICY_LOSS_FN: Registry[type[PolicyLossFn]] = Registry("policy_loss_fn")

_PARAM_KINDS = (
    inspect.Parameter.POSITIONAL_ONLY,
    inspect.Parameter.POSITIONAL_OR_KEYWORD,
    inspect.Parameter.KEYWORD_ONLY,
)


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


def _call_parameters(fn: Any) -> list[inspect.Parameter]:
    cls = fn if isinstance(fn, type) else type(fn)
    call = cls.__call__
    params = list(inspect.signature(call).parameters.values())
    if params and params[0].name == "self":
        params = params[1:]
    return [p for p in params if p.kind in _PARAM_KINDS]


def loss_inputs_for(fn: Any) -> list[str]:
    """The tensor parameter names of ``fn.__call__``, in order (without ``self``, ``*args``, ``**kwargs``).

    ``fn`` is a loss function instance or class. The trainer passes exactly
    these tensors, by keyword.
    """
    return [p.name for p in _call_parameters(fn)]


def check_loss_inputs(
    fn: Any, available: Iterable[str], key_path: str = "algorithm.policy_loss_fn"
) -> list[str]:
    """Check that every required input of ``fn.__call__`` is in ``available``.

    A parameter with a default is optional. Returns the input names that are
    available (what the trainer should pass). Raises :class:`ConfigError` at
    ``key_path`` naming the first missing input.
    """
    have = set(available)
    names: list[str] = []
    cls = fn if isinstance(fn, type) else type(fn)
    for p in _call_parameters(fn):
        if p.name in have:
            names.append(p.name)
        elif p.default is inspect.Parameter.empty:
            raise ConfigError(
                key_path,
                f"{cls.__name__}.__call__ needs field {p.name!r} which no experience field "
                f"provides; available: {sorted(have)} (fields beyond these come from the "
                f"sample strategy's custom_fields, e.g. sample_strategy 'mix' adds 'expert_mask')",
            )
    return names
