"""Models with the shape of a real one, built locally: ``model.model_path: builtin:<shape>``.

The tiny model (:mod:`rftstream.tiny_model`) learns in a minute on a laptop, but it
is 2 layers of width 64: it cannot show what weight syncs, trainer steps or
rollouts cost at a realistic size. A *shaped* model has the layer count, widths,
heads and MLP of a published model, random weights (a fixed seed) and the tiny
model's character tokenizer (so its vocabulary, and with it the embedding, is
small: the transformer blocks are what a real model of that shape has). It
answers nonsense; it is for measuring, not learning.

``builtin:qwen2.5-0.5b-shape``: Qwen2.5-0.5B's blocks: 24 layers, hidden 896,
14 attention heads / 2 KV heads, MLP 4864; 358M parameters, 1.43 GB in float32,
saved in float32. Built once (about 20 s on 2 CPU cores, most of it writing the
file) into ``<cache>/<shape>-<version>`` (the cache of the tiny model:
``$RFTSTREAM_CACHE``, else ``~/.cache/rftstream``), atomically, like the tiny
model. Blocks: call it from a worker thread in async code.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rftstream.errors import ConfigError

BUILTIN_PREFIX = "builtin:"

#: the shapes ``builtin:<name>`` builds (Hugging Face ``Qwen2Config`` fields)
SHAPES: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b-shape": {
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
    },
}
_SEED = 0
_MARKER = "rftstream_shape.json"


def builtin_names() -> list[str]:
    """Every ``builtin:<name>`` a config may name (the tiny model first)."""
    return ["builtin:tiny", *(BUILTIN_PREFIX + name for name in SHAPES)]


def resolve_builtin(
    path: str, key: str = "model.model_path", progress: Callable[[str], None] | None = None
) -> str | None:
    """The local directory of a ``builtin:`` model path (built and cached on first use), or
    None for any other path. Blocks for a build. Raises :class:`ConfigError` naming ``key``
    for an unknown builtin name."""
    if not path or path == "builtin:tiny":
        from rftstream.tiny_model import ensure_tiny_model

        return str(ensure_tiny_model(progress=progress))
    if not path.startswith(BUILTIN_PREFIX):
        return None
    name = path[len(BUILTIN_PREFIX) :]
    if name not in SHAPES:
        raise ConfigError(
            key,
            f"unknown builtin model; the builtin ones are {', '.join(builtin_names())}",
            value=path,
        )
    return str(ensure_shaped_model(name, progress=progress))


def shape_version(name: str) -> str:
    """A short hash of what determines the built model (the cache key)."""
    import importlib.metadata

    from rftstream.tiny_model import tiny_model_version

    payload = {
        "shape": SHAPES[name],
        "seed": _SEED,
        "tokenizer": tiny_model_version(),
        "transformers_major": importlib.metadata.version("transformers").split(".")[0],
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:12]


def ensure_shaped_model(
    name: str,
    cache_dir: str | Path | None = None,
    *,
    progress: Callable[[str], None] | None = None,
) -> Path:
    """The directory of shaped model ``name`` (a key of :data:`SHAPES`), built first if it
    is not cached. Concurrent builders serialise on a lock file; the result appears by an
    atomic rename. Blocks."""
    from rftstream.tiny_model import _cache_root, build_once

    say = progress or (lambda _msg: None)
    return build_once(
        _cache_root(cache_dir) / f"{name}-{shape_version(name)}",
        lambda path: (path / _MARKER).is_file(),
        lambda tmp: build_shaped_model(name, tmp),
        say,
        f"{BUILTIN_PREFIX}{name} (one-time, random weights)",
    )


def build_shaped_model(name: str, out_dir: str | Path) -> dict[str, Any]:
    """Build shaped model ``name`` into ``out_dir`` (no caching, no atomicity): random
    weights from a fixed seed, the tiny model's tokenizer. Returns its metadata. Blocks."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rftstream.model_loading import quiet_progress_bars
    from rftstream.tiny_model import IM_START, _set_tokenizer_class, build_tokenizer

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    tokenizer = build_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.convert_tokens_to_ids(IM_START),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **SHAPES[name],
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_SEED)
        model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    params = sum(p.numel() for p in model.parameters())
    with quiet_progress_bars():
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
    _set_tokenizer_class(out, "Qwen2Tokenizer")
    meta = {
        "shape": name,
        "version": shape_version(name),
        "parameters": params,
        "build_seconds": round(time.perf_counter() - t0, 2),
    }
    (out / _MARKER).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    return meta
