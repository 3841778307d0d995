"""Config keys of LoRA, gradient checkpointing and mixed precision: Trinity-RFT's and verl's
spellings mapped, keys without meaning here warned by path, bad values errors naming the key."""

from __future__ import annotations

import warnings
from typing import Any

import pytest

from rftstream.config import config_from_dict
from rftstream.config.trinity import TrinityConfigWarning
from rftstream.config.validate import validate_config
from rftstream.errors import ConfigError

VERL = "trainer.trainer_config.actor_rollout_ref"


def load(data: dict[str, Any]) -> tuple[Any, dict[str, str]]:
    """The validated config and ``{warned key: message}``."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = config_from_dict(data, cuda_available=lambda: False)
        validate_config(cfg)
    messages = [str(w.message) for w in caught if issubclass(w.category, TrinityConfigWarning)]
    return cfg, {m.split("`")[1]: m for m in messages}


def test_trinity_lora_configs_are_read_and_vllm_keys_warned() -> None:
    cfg, warned = load(
        {
            "model": {
                "lora_configs": [
                    {
                        "name": "adapter",
                        "lora_rank": 16,
                        "lora_alpha": 32,
                        "target_modules": "all-linear",
                        "base_model_name": "qwen",
                        "lora_dtype": "auto",
                    }
                ],
                "max_cpu_loras": 2,
            }
        }
    )
    (lora,) = cfg.model.lora_configs
    assert (lora.name, lora.lora_rank, lora.lora_alpha) == ("adapter", 16, 32.0)
    assert lora.target_modules == "all-linear" and lora.lora_dropout == 0.0
    assert sorted(warned) == [
        "model.lora_configs[0].base_model_name",
        "model.lora_configs[0].lora_dtype",
        "model.max_cpu_loras",
    ]
    assert "merged weights" in warned["model.lora_configs[0].base_model_name"]


def test_lora_off_by_default_and_null_accepted() -> None:
    assert load({})[0].model.lora_configs is None
    assert load({"model": {"lora_configs": None}})[0].model.lora_configs is None


@pytest.mark.parametrize(
    "entries,key",
    [
        ([{"lora_rank": 8}, {"lora_rank": 8}], r"model\.lora_configs`: only one LoRA adapter"),
        ([{"lora_rank": 0}], r"model\.lora_configs\[0\]\.lora_rank`: must be >= 1"),
        ([{"lora_alpha": 0}], r"model\.lora_configs\[0\]\.lora_alpha`: must be > 0"),
        ([{"lora_dropout": 1.0}], r"model\.lora_configs\[0\]\.lora_dropout`: must be in"),
        ([{"target_modules": []}], r"model\.lora_configs\[0\]\.target_modules`"),
    ],
)
def test_bad_lora_values_name_the_key(entries: list[dict[str, Any]], key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        load({"model": {"lora_configs": entries}})


def test_verl_gradient_checkpointing_and_mixed_precision_are_mapped() -> None:
    cfg, warned = load(
        {
            "trainer": {
                "trainer_config": {
                    "actor_rollout_ref": {
                        "model": {"enable_gradient_checkpointing": True, "lora_rank": 8},
                        "actor": {
                            "fsdp_config": {
                                "mixed_precision": {
                                    "param_dtype": "bf16",
                                    "reduce_dtype": "fp32",
                                    "buffer_dtype": "fp32",
                                }
                            }
                        },
                    }
                }
            }
        }
    )
    assert cfg.trainer.gradient_checkpointing is True
    assert cfg.trainer.mixed_precision == "bf16"
    assert sorted(warned) == [f"{VERL}.model.lora_rank"]
    assert "model.lora_configs" in warned[f"{VERL}.model.lora_rank"]


def test_verl_fp16_has_no_counterpart_and_our_keys_win() -> None:
    mp = {"param_dtype": "fp16"}
    cfg, warned = load(
        {
            "trainer": {
                "trainer_config": {
                    "actor_rollout_ref": {"actor": {"fsdp_config": {"mixed_precision": mp}}}
                }
            }
        }
    )
    assert cfg.trainer.mixed_precision == "fp32"
    assert f"{VERL}.actor.fsdp_config.mixed_precision" in warned
    cfg, _ = load(
        {
            "trainer": {
                "mixed_precision": "fp32",
                "gradient_checkpointing": False,
                "trainer_config": {
                    "actor_rollout_ref": {
                        "model": {"enable_gradient_checkpointing": True},
                        "actor": {"fsdp_config": {"mixed_precision": {"param_dtype": "bf16"}}},
                    }
                },
            }
        }
    )
    assert cfg.trainer.mixed_precision == "fp32" and cfg.trainer.gradient_checkpointing is False
