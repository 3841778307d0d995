"""torch's ``AdamW`` without its ``torch.compile`` guards: the same update, and no
``torch._dynamo`` import.

torch wraps ``Optimizer.add_param_group``, ``zero_grad``, ``state_dict`` and
``load_state_dict`` in ``torch._disable_dynamo``, and each built-in optimizer's ``step``
in ``_use_grad_for_differentiable``; both import ``torch._dynamo`` on their first call,
about 1.2 s of CPU here, and in the trainer that import falls on the start-up's critical
path (the first batch is waiting by then), or blocks its first resumable checkpoint. The
guards keep dynamo from tracing into the optimizer when a model is compiled; the trainer
compiles nothing. :class:`EagerAdamW` calls the same functions undecorated: the
arithmetic is torch's own (``torch.optim.Adam.step`` with decoupled weight decay), under
``torch.no_grad()`` as the guard would set it.

It is used where DeepSpeed steps the optimizer itself (ZeRO stage 0: stages 1-3 accept
only the optimizer classes they know) in float32, without ``differentiable``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["EagerAdamW"]


# each without the wrappers that ``functools.wraps`` recorded (``__wrapped__``)
_ADAM_STEP = inspect.unwrap(torch.optim.Adam.step)
_ADD_PARAM_GROUP = inspect.unwrap(torch.optim.Optimizer.add_param_group)
_ZERO_GRAD = inspect.unwrap(torch.optim.Optimizer.zero_grad)
_STATE_DICT = inspect.unwrap(torch.optim.Optimizer.state_dict)
_LOAD_STATE_DICT = inspect.unwrap(torch.optim.Optimizer.load_state_dict)


class EagerAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` whose ``step``, ``add_param_group``, ``zero_grad``,
    ``state_dict`` and ``load_state_dict`` skip the ``torch.compile`` guards (see the
    module docstring). Same arguments, state and ``state_dict`` as ``AdamW``;
    ``differentiable=True`` is refused (the guard would then keep the graph, which this
    class does not)."""

    def __init__(self, params: Any, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("differentiable"):
            raise ValueError("EagerAdamW: differentiable=True needs torch.optim.AdamW")
        super().__init__(params, *args, **kwargs)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        _ADD_PARAM_GROUP(self, param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        _ZERO_GRAD(self, set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """torch's ``Optimizer.state_dict`` (a resumable checkpoint's first save would
        otherwise import ``torch._dynamo`` in the middle of a run)."""
        return _STATE_DICT(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's ``Optimizer.load_state_dict``."""
        _LOAD_STATE_DICT(self, state_dict)

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One AdamW update of every parameter with a gradient (torch's arithmetic), without
        autograd recording it; ``closure`` as in torch (evaluated with gradients on)."""
        with torch.no_grad():
            return _ADAM_STEP(self, closure)
