"""A Llama-family causal LM's parameters without transformers' modeling code.

Importing a ``transformers`` model class (``modeling_qwen2``, ``modeling_llama``, ...)
imports ``transformers.masking_utils``, which imports ``torch._dynamo`` and
``torch.export``: about 1.6 s of CPU in every process that loads a model, before any
weight is read. The explorer's :class:`~rftstream.engines.fast_decoder.FastDecoder`
never runs that code: it reads the parameters and computes the forward itself. So
where the decoder covers a checkpoint exactly, the transformers engine loads it as a
:class:`LightCausalLM`: the same parameters under the same names
(``model.layers.0.self_attn.q_proj.weight``, ...), read from the checkpoint's
safetensors files, with the rotary frequencies computed as transformers computes
them (``transformers.modeling_rope_utils``, a light import). Called as HF's model is
(``model(input_ids=..., attention_mask=...).logits``), it runs the fast decoder over every
position, and refuses what it does not do (a KV cache, position ids).

The trainer loads its policy the same way where its lean forward
(:mod:`rftstream.training.lean_forward`) will train it (float32 on the CPU, no dropout,
no adapters, no gradient checkpointing, ZeRO below 3): the lean forward reads the
parameters and never calls the module's forward, and :meth:`LightCausalLM.save_pretrained`
writes the HF-format checkpoint ``save_pretrained`` writes (config, generation config,
safetensors, sharded at the same size). It reads the config without transformers
(:class:`JsonConfig`) where ``config.json`` settles every value the model reads, so
that its process imports the library only when it saves a checkpoint.

:func:`load_light_causal_lm` returns None, and the engine loads the model with
``from_pretrained`` as before, for anything it does not cover exactly: another
architecture or option (:func:`~rftstream.engines.fast_decoder.config_reason`), a
checkpoint without ``model.safetensors`` (or the shards of its index), one whose tensor
names or shapes are not the ones the model's config implies, or one whose config ties
the LM head to the embeddings while its file holds another LM head.

Pure tensor and file code; every call blocks.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rftstream.engines.fast_decoder import (
    SUPPORTED_TYPES,
    FastDecoder,
    config_reason,
    rope_parameters,
)

__all__ = [
    "JsonConfig",
    "LightCausalLM",
    "LightOutput",
    "json_config",
    "load_light_causal_lm",
    "rope_frequencies",
]

#: transformers' class for each covered ``model_type`` (``config.architectures`` on save)
HF_CLASS = {
    "qwen2": "Qwen2ForCausalLM",
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
}
#: ``save_pretrained``'s default shard size in transformers 5 (one file below it)
MAX_SHARD_BYTES = 50 * 10**9

#: the keys a ``config.json`` must name for :class:`JsonConfig` (every one the model and
#: :func:`~rftstream.engines.fast_decoder.config_reason` read whose default is the config
#: class's, not the one they assume); by ``model_type``, the keys of that type
JSON_CONFIG_KEYS = (
    "model_type",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_hidden_layers",
    "num_key_value_heads",
    "vocab_size",
    "rms_norm_eps",
    "hidden_act",
    "tie_word_embeddings",
    "rope_parameters",
)
JSON_CONFIG_KEYS_BY_TYPE = {
    "qwen2": ("use_sliding_window",),
    "llama": ("attention_bias", "mlp_bias"),
    "mistral": ("sliding_window",),
}


class JsonConfig:
    """A checkpoint's ``config.json`` as attributes, read without transformers.

    What :func:`load_light_causal_lm` uses, with ``without_transformers``, in place of
    ``AutoConfig`` (whose first use imports transformers: about 1.2 s of CPU) where the
    file names every key the light model reads (:data:`JSON_CONFIG_KEYS`) and its rotary
    embedding is the default one: then the attributes are the ones ``AutoConfig`` would
    give. ``source`` is the checkpoint directory; :meth:`to_transformers` builds the
    transformers config (``AutoConfig`` of ``source`` with every attribute set since
    loading), which :meth:`LightCausalLM.save_pretrained` writes.
    """

    def __init__(self, source: Path, values: dict[str, Any]) -> None:
        object.__setattr__(self, "source", source)
        object.__setattr__(self, "changed", {})
        for key, value in values.items():
            object.__setattr__(self, key, value)

    def __setattr__(self, name: str, value: Any) -> None:
        self.changed[name] = value
        object.__setattr__(self, name, value)

    def to_transformers(self) -> Any:
        """``AutoConfig.from_pretrained(source)`` with the attributes set since loading."""
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(str(self.source))
        for key, value in self.changed.items():
            setattr(config, key, value)
        return config


def json_config(path: Path, declared: dict[str, Any]) -> JsonConfig | None:
    """``declared`` (``path``'s ``config.json``) as a :class:`JsonConfig`, or None where it
    leaves a key the light model reads to the config class's default, or names a rotary
    embedding other than the default one (then ``AutoConfig`` reads it)."""
    keys = JSON_CONFIG_KEYS + JSON_CONFIG_KEYS_BY_TYPE.get(str(declared.get("model_type")), ())
    if any(key not in declared for key in keys):
        return None
    rope = declared["rope_parameters"]
    if (
        not isinstance(rope, dict)
        or rope.get("rope_type", "default") != "default"
        or "rope_theta" not in rope
        or "partial_rotary_factor" in rope
        or "partial_rotary_factor" in declared
    ):
        return None
    return JsonConfig(path, declared)


def rope_frequencies(config: Any) -> tuple[torch.Tensor, float, str]:
    """``(inv_freq, attention_scaling, rope_type)`` of ``config``, as the model's rotary
    module computes them (the default formula, or ``ROPE_INIT_FUNCTIONS``)."""
    rope_type, params = rope_parameters(config)
    if rope_type == "default":
        base = float(params["rope_theta"])
        dim = int(
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        return inv_freq, 1.0, rope_type
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, None)
    return inv_freq.float(), float(scaling), rope_type


class _Rotary(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        inv_freq, self.attention_scaling, self.rope_type = rope_frequencies(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)


# every module is built on the ``meta`` device (no memory, no initialisation: the
# checkpoint's tensors are assigned to it), by argument: ``with torch.device("meta")``
# would import torch._dynamo, the very cost this module avoids
_META = torch.device("meta")


class _RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, device=_META))
        self.variance_epsilon = eps


class _Attention(nn.Module):
    def __init__(self, config: Any, qkv_bias: bool, o_bias: bool) -> None:
        super().__init__()
        hidden = config.hidden_size
        heads = config.num_attention_heads
        kv = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or hidden // heads
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=qkv_bias, device=_META)
        self.k_proj = nn.Linear(hidden, kv * head_dim, bias=qkv_bias, device=_META)
        self.v_proj = nn.Linear(hidden, kv * head_dim, bias=qkv_bias, device=_META)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=o_bias, device=_META)


class _MLP(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        hidden, inner = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(hidden, inner, bias=False, device=_META)
        self.up_proj = nn.Linear(hidden, inner, bias=False, device=_META)
        self.down_proj = nn.Linear(inner, hidden, bias=False, device=_META)


class _Block(nn.Module):
    def __init__(self, config: Any, qkv_bias: bool, o_bias: bool) -> None:
        super().__init__()
        eps = float(getattr(config, "rms_norm_eps", 1e-6))
        self.self_attn = _Attention(config, qkv_bias, o_bias)
        self.mlp = _MLP(config)
        self.input_layernorm = _RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = _RMSNorm(config.hidden_size, eps)


class _Inner(nn.Module):
    def __init__(self, config: Any, qkv_bias: bool, o_bias: bool) -> None:
        super().__init__()
        # an explicit (meta) weight: nn.Embedding's random init on meta imports torch._dynamo
        shape = (config.vocab_size, config.hidden_size)
        self.embed_tokens = nn.Embedding(*shape, _weight=torch.empty(shape, device=_META))
        self.layers = nn.ModuleList(
            _Block(config, qkv_bias, o_bias) for _ in range(config.num_hidden_layers)
        )
        self.norm = _RMSNorm(config.hidden_size, float(getattr(config, "rms_norm_eps", 1e-6)))
        self.rotary_emb = _Rotary(config)


@dataclass
class LightOutput:
    """What the engine and the tests read of a forward: ``logits`` [B, T, vocab]."""

    logits: torch.Tensor


class LightCausalLM(nn.Module):
    """The parameters of a Qwen2 / Llama / Mistral causal LM under the names
    ``transformers`` gives them (``state_dict()`` keys and shapes are the same), with
    ``config`` and ``generation_config`` as a transformers model has them (or, loaded
    ``without_transformers``, a :class:`JsonConfig` and no generation config until
    :meth:`save_pretrained` reads it). Nothing of transformers' modeling code is
    imported. Built on the ``meta`` device (parameters without memory):
    :func:`load_light_causal_lm` assigns the checkpoint's tensors."""

    def __init__(self, config: Any, generation_config: Any = None) -> None:
        super().__init__()
        self.config = config
        self.generation_config = generation_config
        qkv_bias = config.model_type == "qwen2" or bool(getattr(config, "attention_bias", False))
        o_bias = config.model_type != "qwen2" and bool(getattr(config, "attention_bias", False))
        self.model = _Inner(config, qkv_bias, o_bias)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, device=_META)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def save_pretrained(
        self,
        save_directory: str | Path,
        *,
        state_dict: dict[str, torch.Tensor] | None = None,
        safe_serialization: bool = True,
    ) -> None:
        """Write what transformers' ``save_pretrained`` writes for this model:
        ``config.json`` (``architectures`` and ``dtype`` set as it sets them),
        ``generation_config.json``, and ``state_dict`` (default: this model's, a tied LM
        head left out) as ``model.safetensors``, or as shards with
        ``model.safetensors.index.json`` above :data:`MAX_SHARD_BYTES`. Blocks.

        Raises:
            ValueError: ``safe_serialization=False`` (only safetensors is written).
        """
        from safetensors.torch import save_file

        if not safe_serialization:
            raise ValueError("LightCausalLM.save_pretrained writes safetensors only")
        out = Path(save_directory)
        out.mkdir(parents=True, exist_ok=True)
        if state_dict is None:
            state_dict = {k: v.detach() for k, v in self.state_dict().items()}
            if getattr(self.config, "tie_word_embeddings", False):
                state_dict.pop("lm_head.weight", None)
        dtype = next(self.parameters()).dtype
        config = self.config
        generation = self.generation_config
        if isinstance(config, JsonConfig):  # read without transformers: its classes now
            if generation is None:
                generation = _generation_config(config.source)
            config = config.to_transformers()
        config.dtype = str(dtype).removeprefix("torch.")
        config.architectures = [HF_CLASS.get(config.model_type, "LightCausalLM")]
        config.save_pretrained(str(out))
        if generation is None:
            from transformers import GenerationConfig

            generation = GenerationConfig.from_model_config(config)
        generation.save_pretrained(str(out))
        shards: list[dict[str, torch.Tensor]] = [{}]
        size = total = 0
        for name, tensor in state_dict.items():
            nbytes = tensor.numel() * tensor.element_size()
            if shards[-1] and size + nbytes > MAX_SHARD_BYTES:
                shards.append({})
                size = 0
            shards[-1][name] = tensor.contiguous()
            size += nbytes
            total += nbytes
        metadata = {"format": "pt"}
        if len(shards) == 1:
            save_file(shards[0], str(out / "model.safetensors"), metadata=metadata)
            return
        weight_map: dict[str, str] = {}
        for i, shard in enumerate(shards, 1):
            name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(out / name), metadata=metadata)
            weight_map.update(dict.fromkeys(shard, name))
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        logits_to_keep: int = 0,
        use_cache: bool | None = None,
        **unsupported: Any,
    ) -> LightOutput:
        """The logits of the last ``logits_to_keep`` positions (all with 0) of left-padded
        ``input_ids``: one full forward of the fast decoder, as HF's with ``use_cache=False``.
        Inference only (under ``torch.inference_mode``; raises ``ValueError`` in training
        mode). Raises ``TypeError`` for what it does not do (a KV cache, position ids,
        any other argument of HF's forward) rather than ignore it."""
        given = sorted(k for k, v in unsupported.items() if v is not None)
        if use_cache or given:
            what = given if given else ["use_cache=True"]
            raise TypeError(
                f"LightCausalLM.forward computes a full forward from input_ids and "
                f"attention_mask only; got {what} (load the model with from_pretrained, "
                "or the engine with fast_decoder=False, for the rest of HF's forward)"
            )
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        keep = int(logits_to_keep) or input_ids.shape[1]
        return LightOutput(FastDecoder(self).logits(input_ids, attention_mask, keep))


def _checkpoint_files(path: Path) -> list[Path] | None:
    """The safetensors files ``from_pretrained`` reads: the shards its index names, else
    ``model.safetensors``; None when there are neither."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        with open(index, encoding="utf-8") as f:
            shards = sorted(set(json.load(f).get("weight_map", {}).values()))
        files = [path / name for name in shards]
        return files if files and all(f.is_file() for f in files) else None
    single = path / "model.safetensors"
    return [single] if single.is_file() else None


def _checkpoint_tensors(path: Path) -> dict[str, torch.Tensor] | None:
    """Every tensor of the checkpoint's safetensors files (:func:`_checkpoint_files`), or
    None when there are none or a name is in two of them."""
    from safetensors import safe_open

    files = _checkpoint_files(path)
    if files is None:
        return None
    out: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                if key in out:
                    return None
                out[key] = f.get_tensor(key)
    return out


def _generation_config(path: Path) -> Any:
    """The checkpoint's ``generation_config.json`` as a ``GenerationConfig`` (None without one)."""
    if not (path / "generation_config.json").is_file():
        return None
    from transformers import GenerationConfig

    return GenerationConfig.from_pretrained(str(path))


def load_light_causal_lm(
    model_path: str, dtype: torch.dtype, *, without_transformers: bool = False
) -> LightCausalLM | None:
    """The checkpoint at ``model_path`` as a :class:`LightCausalLM` in ``dtype``, in eval
    mode, or None where it cannot be loaded exactly (see the module docstring): then
    load it with ``from_pretrained``. Raises what reading the config or the files raises
    (``OSError``, ``ValueError``).

    ``without_transformers``: read the config as a :class:`JsonConfig` where it can be
    (else with ``AutoConfig``) and leave ``generation_config`` None, read from the
    checkpoint when the model is saved: nothing of transformers is imported (the
    trainer's start-up; the explorer needs the library for its tokenizer anyway)."""
    path = Path(model_path)
    if not (path / "config.json").is_file():
        return None  # a hub id, or no checkpoint: from_pretrained says what is wrong
    with open(path / "config.json", encoding="utf-8") as f:
        declared = json.load(f)
    if declared.get("model_type") not in SUPPORTED_TYPES:
        return None  # no config class of another architecture is read either
    config: Any = json_config(path, declared) if without_transformers else None
    if config is None:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(str(path))
    if config_reason(config) is not None:
        return None
    tensors = _checkpoint_tensors(path)
    if tensors is None:
        return None
    model = LightCausalLM(config)  # on the meta device until the tensors are assigned
    expected = {k: v.shape for k, v in model.state_dict().items()}
    tied = bool(getattr(config, "tie_word_embeddings", False))
    if tied:
        head = tensors.pop("lm_head.weight", None)
        embed = tensors.get("model.embed_tokens.weight")
        if head is not None and (embed is None or not torch.equal(head, embed)):
            return None  # tied by the config, not by the file: transformers decides
        expected.pop("lm_head.weight", None)
    if set(tensors) != set(expected) or any(
        tuple(tensors[k].shape) != tuple(shape) for k, shape in expected.items()
    ):
        return None
    model.load_state_dict({k: v.to(dtype) for k, v in tensors.items()}, strict=False, assign=True)
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    if not isinstance(config, JsonConfig):
        model.generation_config = _generation_config(path)
    return model.eval()
