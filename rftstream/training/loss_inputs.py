"""The tensors the trainer passes to an algorithm's functions, found by name.

As in Trinity-RFT: the trainer scans the parameter list of a policy loss's
``__call__`` and passes exactly those tensors, by keyword
(:func:`loss_inputs_for`, checked against what the experiences provide at config
time by :func:`check_loss_inputs`). An advantage fn computed in the trainer may
declare per-token statistics in ``trainer_inputs``, from
:data:`TRAINER_ADVANTAGE_INPUTS`. Pure: no I/O.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any

from rftstream.errors import ConfigError

TRAINER_ADVANTAGE_INPUTS: frozenset[str] = frozenset(
    {"entropy", "nec", "old_logprob", "rollout_logprob"}
)
"""Per-token tensors the trainer can compute for an advantage fn that declares them in
:attr:`AdvantageFn.trainer_inputs` (each passed as a keyword argument: one float32
tensor per experience, covering the response tokens the trainer trains on):

* ``old_logprob``: log-probs of the response under the current policy (no-grad pass);
* ``entropy``: entropy of the current policy's next-token distribution per token;
* ``nec``: ``H * sum(p^2) + sum(p^2 log p)`` of that distribution (Clip_V's ``necs``);
* ``rollout_logprob``: the experience's rollout log-probs where it has usable ones,
  else ``old_logprob``.

All use the rollout temperature, as the log-probs of the loss do.
"""

_PARAM_KINDS = (
    inspect.Parameter.POSITIONAL_ONLY,
    inspect.Parameter.POSITIONAL_OR_KEYWORD,
    inspect.Parameter.KEYWORD_ONLY,
)


def loss_parameters(fn: Any) -> list[inspect.Parameter]:
    """The parameters of ``fn.__call__`` (``fn`` a class or instance) the trainer fills by name:
    positional or keyword ones, without ``self``, ``*args`` and ``**kwargs``."""
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
    return [p.name for p in loss_parameters(fn)]


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
    for p in loss_parameters(fn):
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
