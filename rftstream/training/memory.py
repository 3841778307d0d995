"""Memory savers of the policy trainer: gradient checkpointing and bf16 mixed precision.

* :func:`enable_gradient_checkpointing` makes every decoder layer of a
  ``transformers`` model recompute its activations in the backward pass
  (``trainer.gradient_checkpointing``; verl's
  ``actor_rollout_ref.model.enable_gradient_checkpointing``): the same loss and
  gradients for less activation memory. Non-reentrant checkpointing, so a
  frozen base under a LoRA adapter needs no input gradients.
* :func:`mixed_precision_config` is the DeepSpeed section of
  ``trainer.mixed_precision``: ``bf16`` runs the model in bfloat16 with
  float32 master weights in the optimizer (DeepSpeed's ``bf16``), after
  :func:`check_bf16_supported` confirmed the accelerator has bf16.

Pure apart from the accelerator probe; nothing here blocks for long.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from rftstream.errors import ConfigError

__all__ = ["check_bf16_supported", "enable_gradient_checkpointing", "mixed_precision_config"]


def enable_gradient_checkpointing(model: torch.nn.Module) -> None:
    """Turn on non-reentrant activation checkpointing of ``model`` (a ``transformers`` model).

    Uses ``activation_checkpointing_enable`` (transformers 5) or
    ``gradient_checkpointing_enable`` (4.x). While it is on and the model is in
    training mode, transformers runs without a KV cache.

    Raises:
        ConfigError: at ``trainer.gradient_checkpointing`` for a model without support.
    """
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    elif getattr(model, "supports_gradient_checkpointing", False):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    else:
        raise ConfigError(
            "trainer.gradient_checkpointing",
            f"{type(model).__name__} does not support gradient checkpointing",
            value=True,
        )


def check_bf16_supported(is_supported: Callable[[], bool] | None = None) -> None:
    """Raise unless the training accelerator computes in bfloat16.

    ``is_supported`` (default: DeepSpeed's accelerator, ``is_bf16_supported()``:
    true on CPU, on CUDA from compute capability 8.0) is injectable for tests.

    Raises:
        ConfigError: at ``trainer.mixed_precision``, naming the accelerator.
    """
    name = "the accelerator"
    if is_supported is None:
        from deepspeed.accelerator import get_accelerator

        acc = get_accelerator()
        name = f"the {acc.device_name()} accelerator"
        is_supported = acc.is_bf16_supported
    if not is_supported():
        raise ConfigError(
            "trainer.mixed_precision",
            f"bf16 is not supported by {name}; use fp32 (the run would otherwise "
            "train in a precision it does not claim)",
            value="bf16",
        )


def mixed_precision_config(mode: str) -> dict[str, Any]:
    """The DeepSpeed ``bf16`` / ``fp16`` sections of ``trainer.mixed_precision`` ``mode``.

    Raises:
        ConfigError: an unknown mode (validation rejects it earlier).
    """
    if mode == "fp32":
        return {"bf16": {"enabled": False}, "fp16": {"enabled": False}}
    if mode == "bf16":
        return {"bf16": {"enabled": True}, "fp16": {"enabled": False}}
    raise ConfigError("trainer.mixed_precision", "must be fp32 or bf16", value=mode)
