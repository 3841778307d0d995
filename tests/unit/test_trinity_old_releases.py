"""Config files of older Trinity-RFT releases (0.1-0.5) load: keys a release dropped or
renamed are mapped where they mean something here and otherwise named once with the
release that had them; the pre-0.1 ``data:`` layout gets one message; 0.1-0.3.0's SFT
warm-up becomes ``stages:``; MIX/CHORD arguments of older releases are accepted.
Release facts: Trinity-RFT's ``trinity/common/config.py`` and ``trinity/algorithm`` of the
PyPI wheels 0.1.0-0.6.0."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import yaml

from algorithms.policy_loss_fn.chord_policy_loss import MIXCHORDPolicyLossFn
from algorithms.policy_loss_fn.mix_policy_loss import MIXPolicyLossFn
from rftstream.config import config_from_dict, load_config
from rftstream.config.stages import load_stages
from rftstream.config.trinity import TrinityConfigWarning
from rftstream.errors import ConfigError


def load_warned(data: dict[str, Any]) -> tuple[Any, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = config_from_dict(data, cuda_available=lambda: False)
    return cfg, [str(w.message) for w in caught if issubclass(w.category, TrinityConfigWarning)]


def test_keys_of_0_1_and_0_2_load_mapped_or_named_with_their_release() -> None:
    cfg, messages = load_warned(
        {
            "buffer": {
                "max_retry_times": 3,
                "max_retry_interval": 1,
                "explore_batch_size": 6,
                "explorer_input": {"taskset": {"path": "t.jsonl", "algorithm_type": "grpo"}},
                "trainer_input": {
                    "experience_buffer": {"path": "d.jsonl", "algorithm_type": "dpo"},
                },
            },
            "model": {"max_token_len": 2048},
            "data_processor": {"data_processor_url": "http://127.0.0.1:5005/data_processor"},
            "algorithm": {"algorithm_type": "grpo", "use_token_level_loss": False},
        }
    )
    assert cfg.buffer.batch_size == 6
    assert cfg.buffer.trainer_input.experience_buffer.schema_type == "dpo"
    assert cfg.algorithm.loss_agg_mode == "seq-mean-token-mean"
    text = "\n".join(messages)
    for key in (
        "buffer.max_retry_times",
        "buffer.max_retry_interval",
        "buffer.explorer_input.taskset.algorithm_type",
        "model.max_token_len",
        "data_processor.data_processor_url",
    ):
        assert text.count(f"`{key}`") == 1, (key, text)
    assert "Trinity-RFT 0.1-0.2" in text and "Trinity-RFT 0.2" in text


def test_mix_expert_data_of_0_2_is_the_auxiliary_sft_dataset() -> None:
    cfg, _ = load_warned(
        {
            "algorithm": {"algorithm_type": "mix"},
            "buffer": {
                "trainer_input": {
                    "sft_warmup_dataset": {
                        "name": "expert",
                        "path": "expert.jsonl",
                        "algorithm_type": "sft",
                        "format": {"prompt_type": "messages", "messages_key": "messages"},
                    },
                    "sft_warmup_steps": 0,
                }
            },
        }
    )
    sft = cfg.buffer.trainer_input.auxiliary_buffers["sft_dataset"]
    assert sft.path == "expert.jsonl" and sft.schema_type == "sft"
    assert sft.format.messages_key == "messages"


def test_a_sft_warmup_becomes_a_stage_before_the_run(tmp_path: Path) -> None:
    path = tmp_path / "old.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "name": "old",
                "algorithm": {"algorithm_type": "grpo", "repeat_times": 4},
                "buffer": {
                    "batch_size": 4,
                    "total_steps": 9,
                    "trainer_input": {
                        "sft_warmup_dataset": {
                            "path": str(tmp_path / "sft.jsonl"),
                            "algorithm_type": "sft",
                        },
                        "sft_warmup_steps": 3,
                    },
                },
            }
        )
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        stages = load_stages(path)
    said = [str(w.message) for w in caught if issubclass(w.category, TrinityConfigWarning)]
    assert any("sft_warmup_dataset" in m and "stages" in m for m in said), said
    assert [s.raw.stage_name for s in stages] == ["sft_warmup", "rft"]
    warm, rft = stages[0].config, stages[1].config
    assert warm.mode == "train" and warm.algorithm.algorithm_type == "sft"
    assert warm.buffer.total_steps == 3
    assert warm.buffer.trainer_input.experience_buffer.path == str(tmp_path / "sft.jsonl")
    assert rft.algorithm.algorithm_type == "grpo" and rft.buffer.total_steps == 9


def test_the_pre_0_1_data_layout_gets_one_message(tmp_path: Path) -> None:
    path = tmp_path / "pre.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "mode": "both",
                "data": {
                    "dataset_path": "/data/gsm8k",
                    "train_split": "train",
                    "format_config": {"prompt_key": "question", "response_key": "answer"},
                    "total_epochs": 1,
                    "batch_size": 96,
                },
                "model": {"model_path": "/m"},
            }
        )
    )
    with pytest.raises(ConfigError) as info:
        load_config(path)
    text = str(info.value)
    assert "before its 0.1.0 release" in text and str(path) in text
    assert "data.dataset_path -> buffer.explorer_input.taskset.path" in text
    assert text.count("unknown key") == 0


def test_mix_and_chord_take_the_argument_names_of_older_releases() -> None:
    old = MIXPolicyLossFn(read_batch_size_usual=48, read_batch_size_expert=16)
    new = MIXPolicyLossFn(train_batch_size_usual=48, train_batch_size_expert=16)
    assert (old.train_batch_size_usual, old.train_batch_size_expert) == (48, 16)
    assert old.batch_weights == new.batch_weights
    chord = MIXCHORDPolicyLossFn(use_token_level_loss_in_sft=False)
    assert chord.sft_loss_fn.loss_agg_mode == "seq-mean-token-mean"
    assert MIXCHORDPolicyLossFn(use_token_level_loss_in_sft=True).sft_loss_fn.loss_agg_mode == (
        "token-mean"
    )


def test_mix_read_batch_sizes_survive_resolution() -> None:
    """The resolver fills train_batch_size_* only where the older names are not given."""
    cfg, _ = load_warned(
        {
            "algorithm": {
                "algorithm_type": "mix",
                "policy_loss_fn_args": {"read_batch_size_usual": 24, "read_batch_size_expert": 8},
            },
            "buffer": {
                "batch_size": 4,
                "trainer_input": {"auxiliary_buffers": {"sft_dataset": {"path": "x.jsonl"}}},
            },
        }
    )
    from algorithms.algorithm import resolve_algorithm

    r = resolve_algorithm(cfg.algorithm, cfg.buffer)
    assert r.policy_loss_fn.train_batch_size_usual == 24
    assert r.policy_loss_fn.train_batch_size_expert == 8
