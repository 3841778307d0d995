"""Builtin models of a real model's shape (rftstream.shaped_models), and the weights
summary line of a run (rftstream.presentation.plot.sync_summary)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rftstream.config.loader import config_from_dict
from rftstream.config.resolve import weights_wire_dtype
from rftstream.config.validate import validate_config
from rftstream.errors import ConfigError
from rftstream.presentation.plot import sync_summary
from rftstream.shaped_models import SHAPES, builtin_names, ensure_shaped_model, resolve_builtin


def test_builtin_names_and_other_paths() -> None:
    assert builtin_names()[:2] == ["builtin:tiny", "builtin:qwen2.5-0.5b-shape"]
    assert resolve_builtin("/models/qwen") is None  # a path of the user's: not ours
    with pytest.raises(ConfigError, match=r"model\.model_path.*builtin:qwen2\.5-0\.5b-shape"):
        resolve_builtin("builtin:qwen9-shape")


def test_a_shape_is_built_once_with_its_blocks_and_the_tiny_tokenizer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    shape = dict(SHAPES["qwen2.5-0.5b-shape"], num_hidden_layers=2, hidden_size=56)
    shape.update(intermediate_size=96, num_attention_heads=7, num_key_value_heads=1)
    monkeypatch.setitem(SHAPES, "test-shape", shape)
    path = ensure_shaped_model("test-shape", tmp_path)
    assert ensure_shaped_model("test-shape", tmp_path) == path  # cached
    model = AutoModelForCausalLM.from_pretrained(path)
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size) == (2, 56, 96)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (7, 1)
    tok = AutoTokenizer.from_pretrained(path)
    assert cfg.vocab_size == len(tok) and tok.eos_token == "<|im_end|>"


def test_the_wire_dtype_follows_the_engine_or_is_refused_by_key() -> None:
    cfg = config_from_dict({"model": {"dtype": "bfloat16"}})
    assert weights_wire_dtype(cfg) == "bfloat16"
    cfg = config_from_dict(
        {"model": {"dtype": "bfloat16"}, "synchronizer": {"weights_dtype": "float32"}}
    )
    assert weights_wire_dtype(cfg) == "float32"
    with pytest.raises(ConfigError, match=r"synchronizer\.weights_dtype.*model\.dtype"):
        validate_config(config_from_dict({"model": {"dtype": "float64"}}))


def test_sync_summary_line() -> None:
    records = [
        {
            "step": s,
            "time/trainer_step_period": 1.0,
            "sync/trainer_blocking_seconds": 0.02,
            "sync/bytes": 100e6 if s == 2 else 10e6,
            "sync/raw_bytes": 200e6,
            "sync/versions_total": float(s - 1),
            "sync/bytes_total": 100e6 + 10e6 * (s - 2) if s > 1 else 0.0,
            "sync/explorer_pause_seconds": 1e-5,
            "sync/explorer_fetch_seconds": 0.5,
        }
        for s in range(1, 6)
    ]
    line = sync_summary(records, "jetstream")
    assert line == (
        "jetstream: 5 versions, 32.50 MB each (16% of their raw bytes); trainer blocked 20 ms "
        "a step (2% of it); explorers paused at most 0.01 ms; fetched in 500 ms"
    )
    assert sync_summary([{"step": 1}], "memory") is None
