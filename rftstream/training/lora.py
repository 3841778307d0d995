"""LoRA for the policy trainer, through ``peft`` (the optional extra ``rftstream[lora]``).

:func:`wrap_with_lora` turns the loaded policy into a ``peft`` model whose
only trainable parameters are the adapter's ``lora_A`` / ``lora_B`` matrices;
the trainer hands DeepSpeed those parameters only. :class:`LoraPolicy` keeps
what the trainer needs afterwards:

* :meth:`LoraPolicy.merged` turns a state dict of the peft model into the
  plain model's state dict with every adapted weight merged
  (``W + scaling * B @ A``, ``scaling = lora_alpha / lora_rank``), computed
  from the tensors of that state dict (so it works on whatever gathered copy
  the trainer takes), in float32 and cast back to ``W``'s dtype. Explorers
  load it into a plain ``transformers`` model: they never need ``peft``.
* :meth:`LoraPolicy.reference` is the frozen reference model for KL: the
  same module with its adapter disabled (``peft``'s ``disable_adapter()``, as
  verl does), so no second copy of the base weights is kept.
* :meth:`LoraPolicy.save` writes an HF checkpoint of the merged weights, and
  the adapter alone (peft format) in ``<checkpoint>/lora_adapter``.

Everything here blocks (tensor work, file writes).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from rftstream.config.schema import LoRAConfig
from rftstream.errors import ConfigError
from rftstream.training.zero import tied_aliases

__all__ = ["ADAPTER_DIR", "LoraPolicy", "peft_lora_config", "wrap_with_lora"]

ADAPTER_DIR = "lora_adapter"  # the adapter's directory inside a checkpoint
_KEY = "model.lora_configs[0]"
_PEFT_PREFIX = "base_model.model."  # PeftModel -> LoraModel -> the wrapped model


def _peft() -> Any:
    try:
        import peft
    except ImportError as e:
        raise ConfigError(
            "model.lora_configs",
            "LoRA needs the `peft` package: pip install 'rftstream[lora]'",
        ) from e
    return peft


def peft_lora_config(cfg: LoRAConfig) -> Any:
    """The ``peft.LoraConfig`` of ``cfg`` (causal LM, no bias trained).

    Raises:
        ConfigError: ``peft`` is not installed.
    """
    peft = _peft()
    return peft.LoraConfig(
        r=cfg.lora_rank,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=cfg.lora_dropout,
        target_modules=cfg.target_modules,
        exclude_modules=cfg.exclude_modules,
        bias="none",
        task_type="CAUSAL_LM",
    )


def wrap_with_lora(model: torch.nn.Module, cfg: LoRAConfig) -> LoraPolicy:
    """Wrap ``model`` (a ``transformers`` causal LM) with the adapter ``cfg`` describes.

    A fresh adapter (``B = 0``: the wrapped model computes what ``model`` did),
    or the one saved at ``cfg.path`` (trainable). Every base parameter is
    frozen. Blocks (reads the adapter at ``path``).

    Raises:
        ConfigError: ``peft`` is missing, ``path`` holds no adapter, or
            ``target_modules`` matches no module of the model (naming the key).
    """
    peft = _peft()
    with _quiet_peft():
        return _wrap(peft, model, cfg)


@contextlib.contextmanager
def _quiet_peft() -> Iterator[None]:
    """peft asks transformers 5 ``is_gradient_checkpointing``, which warns it is deprecated."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning
        )
        yield


def _wrap(peft: Any, model: torch.nn.Module, cfg: LoRAConfig) -> LoraPolicy:
    if cfg.path:
        if not (Path(cfg.path) / "adapter_config.json").is_file():
            raise ConfigError(
                f"{_KEY}.path",
                "is not a peft adapter directory (no adapter_config.json)",
                value=cfg.path,
            )
        wrapped = peft.PeftModel.from_pretrained(model, cfg.path, is_trainable=True)
    else:
        try:
            wrapped = peft.get_peft_model(model, peft_lora_config(cfg))
        except ValueError as e:  # peft: "Target modules {...} not found in the base model"
            names = sorted({n.rsplit(".", 1)[-1] for n, _ in model.named_modules() if n})
            raise ConfigError(
                f"{_KEY}.target_modules",
                f"{e}; the model's module names: {', '.join(names)}",
                value=cfg.target_modules,
            ) from e
    return LoraPolicy(wrapped, save_adapter=cfg.save_adapter)


class _AdapterDisabled(torch.nn.Module):
    """Calls the peft model with its adapter disabled: the base model's function."""

    def __init__(self, peft_model: Any) -> None:
        super().__init__()
        # a plain attribute, not a submodule: the reference owns no parameters of its own
        object.__setattr__(self, "_peft_model", peft_model)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with self._peft_model.disable_adapter():
            return self._peft_model(*args, **kwargs)


class LoraPolicy:
    """A peft-wrapped policy: the module to train, its merged export and its reference.

    ``module`` is the ``peft.PeftModel`` (hand it to DeepSpeed; DeepSpeed keeps
    the same object). ``layers`` maps each adapted layer's state-dict prefix to
    its ``scaling``.
    """

    def __init__(self, module: Any, *, save_adapter: bool = True) -> None:
        self.module = module
        self.save_adapter = save_adapter
        self.adapter = str(module.active_adapter)
        self.layers = _adapted_layers(module, self.adapter)

    def trainable_parameters(self) -> Iterator[torch.nn.Parameter]:
        """The adapter's parameters (everything else is frozen)."""
        return (p for p in self.module.parameters() if p.requires_grad)

    def reference(self) -> torch.nn.Module:
        """The reference model for KL: the policy with its adapter disabled (no weights copied)."""
        return _AdapterDisabled(self.module)

    def merged(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The plain model's state dict from the peft model's ``state``: adapter merged.

        Keys lose peft's ``base_model.model.`` prefix (and a leading ``module.``
        of a wrapper); ``<layer>.base_layer.weight`` becomes ``<layer>.weight``
        = ``W + scaling * B @ A`` (float32 product, cast to ``W``'s dtype), the
        layer's bias ``<layer>.bias``; the ``lora_*`` tensors are dropped.
        ``state`` is not modified.

        Raises:
            KeyError: ``state`` lacks a tensor of an adapted layer.
        """
        plain = {_strip(k): v for k, v in state.items()}
        out: dict[str, torch.Tensor] = {}
        for key, value in plain.items():
            if ".lora_" in key:
                continue
            out[key.replace(".base_layer.", ".")] = value
        for layer, scaling in self.layers.items():
            weight = plain[f"{layer}.base_layer.weight"]
            a = plain[f"{layer}.lora_A.{self.adapter}.weight"].float()
            b = plain[f"{layer}.lora_B.{self.adapter}.weight"].float()
            merged = weight.float() + scaling * (b @ a)
            out[f"{layer}.weight"] = merged.to(weight.dtype)
        return out

    def adapter_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The adapter of the peft model's ``state`` as explorers receive it: for every
        adapted layer, ``<layer>.lora_A.weight`` and ``<layer>.lora_B.weight`` in float32
        (peft's and a wrapper's prefixes and the adapter's name dropped).

        Raises:
            KeyError: ``state`` lacks a tensor of an adapted layer.
        """
        plain = {_strip(k): v for k, v in state.items()}
        out: dict[str, torch.Tensor] = {}
        for layer in self.layers:
            for part in ("lora_A", "lora_B"):
                tensor = plain[f"{layer}.{part}.{self.adapter}.weight"]
                out[f"{layer}.{part}.weight"] = tensor.to(torch.float32).contiguous()
        return out

    def save(self, path: Path, state: dict[str, torch.Tensor]) -> None:
        """Write the merged weights of ``state`` (the peft model's state dict) as an HF
        checkpoint at ``path`` (safetensors, the base model's config), and the adapter
        alone in ``path / lora_adapter`` when ``save_adapter``. Blocks."""
        base = self.module.get_base_model()
        merged = self.merged(state)
        for key in tied_aliases(base):  # tied weights once, as save_pretrained writes them
            merged.pop(key, None)
        base.save_pretrained(path, state_dict=merged, safe_serialization=True)
        if self.save_adapter:
            self.module.save_pretrained(path / ADAPTER_DIR, safe_serialization=True)


def _strip(key: str) -> str:
    key = key.removeprefix("module.")
    return key.removeprefix(_PEFT_PREFIX)


def _adapted_layers(module: Any, adapter: str) -> dict[str, float]:
    """``{state-dict prefix of the layer (peft prefix stripped): scaling}`` of every LoRA layer.

    Raises:
        ConfigError: a layer variant whose merge is not ``W + scaling * B @ A``
            (DoRA, transposed ``fan_in_fan_out`` weights, adapted embeddings).
    """
    from peft.tuners.lora import LoraLayer

    layers: dict[str, float] = {}
    for name, layer in module.named_modules():
        if not isinstance(layer, LoraLayer) or adapter not in layer.lora_A:
            if isinstance(layer, LoraLayer) and adapter in getattr(layer, "lora_embedding_A", {}):
                raise ConfigError(
                    f"{_KEY}.target_modules",
                    f"adapts the embedding {name!r}; only linear layers can be merged here",
                )
            continue
        if getattr(layer, "fan_in_fan_out", False) or getattr(layer, "use_dora", {}).get(adapter):
            raise ConfigError(
                f"{_KEY}.target_modules",
                f"layer {name!r} is a DoRA or fan_in_fan_out (Conv1D) layer; only plain linear "
                "layers can be merged here",
            )
        layers[_strip(name)] = float(layer.scaling[adapter])
    return layers
