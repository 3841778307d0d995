"""Loading Hugging Face models safely from several threads of one process.

transformers initialises parameters on the ``meta`` device through process-wide
context managers while ``from_pretrained`` runs; two loads in concurrent
threads (an explorer's engine and the trainer, both in ``rftstream up``) can
leave tied weights on ``meta``. Every load goes through :func:`load_causal_lm`,
which serialises them. Blocks for the load.

Importing transformers' lazy ``Auto*`` classes from two threads at once can
also fail (``cannot import name 'AutoTokenizer'``: one thread sees the other's
half-initialised submodule), so :func:`hf_classes` resolves them under the
same (re-entrant) lock; use it instead of ``from transformers import ...`` in
code that may run in a worker thread.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch

HF_LOAD_LOCK = threading.RLock()

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def torch_dtype(name: str | torch.dtype) -> torch.dtype:
    """``"float32"``/``"bf16"``/... → torch dtype."""
    if isinstance(name, torch.dtype):
        return name
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(_DTYPES)}") from None


def load_causal_lm(path: str, dtype: str | torch.dtype = "float32", **kwargs: Any) -> Any:
    """``AutoModelForCausalLM.from_pretrained`` under the process-wide load lock, without
    transformers' progress bar."""
    with HF_LOAD_LOCK, quiet_progress_bars():
        (AutoModelForCausalLM,) = hf_classes("AutoModelForCausalLM")
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype(dtype), **kwargs)


@contextlib.contextmanager
def quiet_progress_bars() -> Iterator[None]:
    """Silence transformers' tqdm bars (loading / saving shards) inside the block."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def load_tokenizer(path: str, **kwargs: Any) -> Any:
    """``AutoTokenizer.from_pretrained`` under the process-wide load lock."""
    with HF_LOAD_LOCK:
        (AutoTokenizer,) = hf_classes("AutoTokenizer")
        return AutoTokenizer.from_pretrained(path, **kwargs)


def pad_token_id_from_files(path: str) -> int | None:
    """The id the trainer pads with (the tokenizer's pad token, else its eos token), read
    from the checkpoint's tokenizer files without transformers; None where the files do
    not settle it, and then the tokenizer says (:func:`load_tokenizer`).

    Settled: ``tokenizer_config.json`` names ``pad_token`` (a string, ``{"content": ...}``
    or null: then ``eos_token``), there is no ``special_tokens_map.json`` that could name
    another, and the token's id is in ``tokenizer.json`` (``added_tokens`` or the model's
    vocabulary) or in ``added_tokens_decoder``. Reads two small files; a file that cannot
    be read or parsed gives None.
    """
    import json
    from pathlib import Path

    root = Path(path)
    try:
        config = json.loads((root / "tokenizer_config.json").read_text(encoding="utf-8"))
        if not isinstance(config, dict) or "pad_token" not in config:
            return None  # a tokenizer class may set its own
        if (root / "special_tokens_map.json").exists():
            return None
        name = _token_content(config.get("pad_token"))
        if name is None:
            name = _token_content(config.get("eos_token"))
        if name is None:
            return None
        for key, entry in (config.get("added_tokens_decoder") or {}).items():
            if isinstance(entry, dict) and entry.get("content") == name:
                return int(key)
        tokenizer = json.loads((root / "tokenizer.json").read_text(encoding="utf-8"))
        for entry in tokenizer.get("added_tokens") or []:
            if isinstance(entry, dict) and entry.get("content") == name:
                return int(entry["id"])
        vocab = (tokenizer.get("model") or {}).get("vocab")
        if isinstance(vocab, dict) and isinstance(vocab.get(name), int):
            return int(vocab[name])
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None
    return None


def _token_content(value: Any) -> str | None:
    """A special token's text as ``tokenizer_config.json`` gives it: a string, or an added
    token's ``{"content": ...}``."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def hf_classes(*names: str) -> tuple[Any, ...]:
    """``transformers.<name>`` for each name, imported under :data:`HF_LOAD_LOCK`."""
    with HF_LOAD_LOCK:
        import transformers

        return tuple(getattr(transformers, name) for name in names)


def forward_kwargs(model: Any) -> tuple[str, str | None]:
    """How ``model.forward`` takes a KV cache and a logits limit, by its signature:
    ``(cache argument, logits-to-keep argument or None)``.

    transformers 5 calls the cache ``cache`` (``past_key_values`` is deprecated and
    warns on every call) and the limit ``logits_to_keep`` (``num_logits_to_keep``
    before 4.50); older versions and other models keep the older names.
    """
    import inspect

    forward = getattr(model, "forward", model)
    try:
        params = inspect.signature(forward).parameters
    except (TypeError, ValueError):
        return "past_key_values", None
    cache = "cache" if "cache" in params else "past_key_values"
    keep = next((n for n in ("logits_to_keep", "num_logits_to_keep") if n in params), None)
    return cache, keep


def output_cache(out: Any) -> Any:
    """The KV cache of a forward's output (``cache``, or ``past_key_values`` before 5.0)."""
    if isinstance(out, dict) and "cache" in out:
        return out["cache"]
    return out.past_key_values
