"""prepare_run's run-level config checks: dataset algorithms, mode train, KL penalty, MIX args."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from rftstream.config import config_from_dict
from rftstream.errors import ConfigError
from rftstream.runtime import prepare_run, roles_for
from tests.integration._util import small_config


@pytest.fixture
def cfg(tmp_path: Path, tiny_model_path: str) -> dict[str, Any]:
    return small_config(tmp_path, tiny_model_path, name="checks")


@pytest.fixture
def dataset(tmp_path: Path) -> str:
    path = tmp_path / "data.jsonl"
    row = {
        "messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
        "question": "a",
        "chosen": "b",
        "rejected": "c",
    }
    path.write_text(json.dumps(row) + "\n", encoding="utf-8")
    return str(path)


def prep(data: dict[str, Any]):
    return prepare_run(config_from_dict(copy.deepcopy(data)))


def set_train_dataset(data: dict[str, Any], path: str) -> None:
    data["buffer"]["trainer_input"] = {"experience_buffer": {"path": path}}


# ----------------------------------------------------------------------- sft / dpo


@pytest.mark.parametrize("algo", ["sft", "dpo"])
def test_dataset_algorithms_in_mode_both_are_rejected(
    cfg: dict[str, Any], dataset: str, algo: str
) -> None:
    cfg["algorithm"]["algorithm_type"] = algo
    set_train_dataset(cfg, dataset)  # even with a dataset: the mode is wrong
    with pytest.raises(ConfigError) as ei:
        prep(cfg)
    assert ei.value.key_path == "algorithm.algorithm_type"
    assert "mode: train" in str(ei.value)


@pytest.mark.parametrize("algo", ["sft", "dpo"])
@pytest.mark.parametrize("trainer_input", [None, {"experience_buffer": {"path": ""}}])
def test_dataset_algorithms_need_the_dataset_path(
    cfg: dict[str, Any], algo: str, trainer_input: dict | None
) -> None:
    cfg["algorithm"]["algorithm_type"] = algo
    cfg["mode"] = "train"
    if trainer_input is not None:
        cfg["buffer"]["trainer_input"] = trainer_input
    with pytest.raises(ConfigError) as ei:
        prep(cfg)
    assert ei.value.key_path == "buffer.trainer_input.experience_buffer.path"
    assert "mode: train" in str(ei.value)


@pytest.mark.parametrize("algo", ["sft", "dpo"])
def test_dataset_algorithms_in_mode_train_are_accepted(
    cfg: dict[str, Any], dataset: str, algo: str
) -> None:
    cfg["algorithm"]["algorithm_type"] = algo
    cfg["mode"] = "train"
    set_train_dataset(cfg, dataset)
    run = prep(cfg)
    assert run.cfg.mode == "train"
    assert roles_for(run.cfg) == ("trainer",)
    assert run.cfg.buffer.trainer_input.experience_buffer.path == dataset
    assert run.algorithm.name == algo


def test_mode_train_without_experience_buffer_is_rejected(cfg: dict[str, Any]) -> None:
    cfg["mode"] = "train"
    cfg["algorithm"]["algorithm_type"] = "sft"
    cfg["algorithm"].pop("repeat_times", None)
    with pytest.raises(ConfigError) as ei:
        prep(cfg)
    assert ei.value.key_path.startswith("buffer.trainer_input.experience_buffer")


def test_mode_train_with_an_empty_experience_buffer_path_is_rejected(
    cfg: dict[str, Any],
) -> None:
    cfg["mode"] = "train"
    cfg["algorithm"]["algorithm_type"] = "dpo"
    cfg["buffer"]["trainer_input"] = {"experience_buffer": {"path": ""}}
    with pytest.raises(ConfigError) as ei:
        prep(cfg)
    assert ei.value.key_path.startswith("buffer.trainer_input.experience_buffer")


def test_mode_train_with_a_rollout_preset_is_rejected(cfg: dict[str, Any], dataset: str) -> None:
    cfg["mode"] = "train"
    set_train_dataset(cfg, dataset)
    with pytest.raises(ConfigError) as ei:
        prep(cfg)
    assert ei.value.key_path == "mode" and "grpo" in str(ei.value)


def test_kl_loss_without_a_reference_model_is_rejected(cfg: dict[str, Any]) -> None:
    cfg["algorithm"].update({"algorithm_type": "asymre", "kl_loss_fn": "k2"})
    with pytest.raises(ConfigError) as ei:
        prep(cfg)
    assert ei.value.key_path == "algorithm.kl_loss_fn"


def test_critic_loss_agg_mode_is_checked(cfg: dict[str, Any]) -> None:
    cfg["algorithm"]["algorithm_type"] = "ppo"
    cfg["trainer"]["critic"] = {"loss_agg_mode": "token-sum"}
    with pytest.raises(ConfigError) as ei:
        prep(cfg)
    assert ei.value.key_path == "trainer.critic.loss_agg_mode"


def test_mix_needs_a_train_batch_divisible_by_the_micro_batch(
    cfg: dict[str, Any], dataset: str
) -> None:
    data = mix(cfg, dataset)
    data["buffer"]["train_batch_size"] = 12
    data["trainer"]["ppo_micro_batch_size_per_gpu"] = 8
    with pytest.raises(ConfigError) as ei:
        prep(data)
    assert ei.value.key_path == "trainer.ppo_micro_batch_size_per_gpu"


def test_mix_expert_ratio_defaults_to_the_strategy_default(
    cfg: dict[str, Any], dataset: str
) -> None:
    data = mix(cfg, dataset)
    data["algorithm"].pop("sample_strategy_args", None)
    args = prep(data).cfg.algorithm.policy_loss_fn_args
    assert (args["train_batch_size_usual"], args["train_batch_size_expert"]) == (4, 4)  # 0.5 of 8


def test_roles(cfg: dict[str, Any], dataset: str) -> None:
    assert roles_for(prep(cfg).cfg) == ("explorer", "operator", "trainer")
    cfg["mode"] = "train"
    cfg["algorithm"]["algorithm_type"] = "sft"
    cfg["algorithm"].pop("repeat_times", None)
    set_train_dataset(cfg, dataset)
    assert roles_for(prep(cfg).cfg) == ("trainer",)


# ----------------------------------------------------------------------- kl_penalty_fn


def test_kl_penalty_with_pipeline_advantage_is_rejected(cfg: dict[str, Any]) -> None:
    cfg["algorithm"]["kl_penalty_fn"] = "k2"
    with pytest.raises(ConfigError) as ei:
        prep(cfg)
    assert ei.value.key_path == "algorithm.kl_penalty_fn"
    assert "k2" in str(ei.value)


@pytest.mark.parametrize("fn", ["k1", "k2", "k3"])
def test_kl_penalty_with_trainer_advantage_is_accepted(cfg: dict[str, Any], fn: str) -> None:
    cfg["algorithm"]["algorithm_type"] = "reinforceplusplus"
    cfg["algorithm"]["kl_penalty_fn"] = fn
    run = prep(cfg)
    assert run.algorithm.compute_advantage_in_trainer
    assert run.cfg.algorithm.kl_penalty_fn == fn


def test_no_kl_penalty_with_grpo_is_fine(cfg: dict[str, Any]) -> None:
    cfg["algorithm"]["kl_penalty_fn"] = "none"
    run = prep(cfg)
    assert run.cfg.buffer.train_batch_size == 8


# ----------------------------------------------------------------------- MIX batch args


def mix(cfg: dict[str, Any], dataset: str, ratio: float | None = 0.25) -> dict[str, Any]:
    cfg["algorithm"]["algorithm_type"] = "mix"
    if ratio is not None:
        cfg["algorithm"]["sample_strategy_args"] = {"expert_data_ratio": ratio}
    cfg["buffer"]["trainer_input"] = {"auxiliary_buffers": {"sft_dataset": {"path": dataset}}}
    return cfg


def test_mix_batch_args_are_filled(cfg: dict[str, Any], dataset: str) -> None:
    run = prep(mix(cfg, dataset))
    args = run.cfg.algorithm.policy_loss_fn_args
    # batch_size 2 x repeat_times 4 = 8; expert = ceil(0.25 * 8) = 2; usual = 6
    assert args["ppo_mini_batch_size"] == 8
    assert args["ppo_micro_batch_size_per_gpu"] == 4
    assert args["train_batch_size_expert"] == 2
    assert args["train_batch_size_usual"] == 6
    assert run.cfg.buffer.train_batch_size == 8
    # the resolved loss is built with them
    loss = run.algorithm.policy_loss_fn
    assert (loss.train_batch_size_usual, loss.train_batch_size_expert) == (6, 2)
    assert loss.gradient_accumulation == 8 // 4


def test_mix_batch_args_follow_the_batch_config(cfg: dict[str, Any], dataset: str) -> None:
    cfg["buffer"]["batch_size"] = 3
    cfg["algorithm"]["repeat_times"] = 5
    cfg["trainer"]["ppo_micro_batch_size_per_gpu"] = 64
    args = prep(mix(cfg, dataset, ratio=0.3)).cfg.algorithm.policy_loss_fn_args
    total = 3 * 5
    expert = -(-3 * total // 10)  # ceil(0.3 * 15) = 5
    assert expert == 5
    assert args["ppo_mini_batch_size"] == total
    assert args["ppo_micro_batch_size_per_gpu"] == total  # capped at the batch
    assert args["train_batch_size_expert"] == expert
    assert args["train_batch_size_usual"] == total - expert


def test_mix_explicit_train_batch_size_wins(cfg: dict[str, Any], dataset: str) -> None:
    cfg["buffer"]["train_batch_size"] = 16
    args = prep(mix(cfg, dataset)).cfg.algorithm.policy_loss_fn_args
    assert args["ppo_mini_batch_size"] == 16
    assert args["train_batch_size_expert"] == 4
    assert args["train_batch_size_usual"] == 12


def test_mix_user_args_are_kept(cfg: dict[str, Any], dataset: str) -> None:
    data = mix(cfg, dataset)
    data["algorithm"]["policy_loss_fn_args"] = {
        "train_batch_size_usual": 5,
        "ppo_mini_batch_size": 16,
        "mu": 0.3,
    }
    args = prep(data).cfg.algorithm.policy_loss_fn_args
    assert args["train_batch_size_usual"] == 5
    assert args["ppo_mini_batch_size"] == 16
    assert args["mu"] == 0.3
    # the ones not set are still derived
    assert args["train_batch_size_expert"] == 2
    assert args["ppo_micro_batch_size_per_gpu"] == 4


def test_mix_default_ratio_is_half(cfg: dict[str, Any], dataset: str) -> None:
    args = prep(mix(cfg, dataset, ratio=None)).cfg.algorithm.policy_loss_fn_args
    assert args["train_batch_size_expert"] == 4
    assert args["train_batch_size_usual"] == 4


def test_mix_needs_the_expert_dataset(cfg: dict[str, Any], dataset: str) -> None:
    data = mix(cfg, dataset)
    data["buffer"].pop("trainer_input")
    with pytest.raises(ConfigError) as ei:
        prep(data)
    assert ei.value.key_path == "buffer.trainer_input.auxiliary_buffers.sft_dataset"


def test_non_mix_losses_get_no_batch_args(cfg: dict[str, Any]) -> None:
    args = prep(cfg).cfg.algorithm.policy_loss_fn_args
    for key in (
        "ppo_mini_batch_size",
        "ppo_micro_batch_size_per_gpu",
        "train_batch_size_usual",
        "train_batch_size_expert",
    ):
        assert key not in args


def test_mix_micro_batch_never_exceeds_a_user_mini_batch(cfg: dict[str, Any], dataset: str) -> None:
    data = mix(cfg, dataset)
    data["algorithm"]["policy_loss_fn_args"] = {"ppo_mini_batch_size": 3}
    run = prep(data)
    args = run.cfg.algorithm.policy_loss_fn_args
    assert args["ppo_mini_batch_size"] == 3  # the user's value stays
    assert args["ppo_micro_batch_size_per_gpu"] == 3  # min(4, 3): gradient accumulation 1, not 0
    assert run.algorithm.policy_loss_fn.gradient_accumulation == 1


def test_mix_batch_shape_is_computed_once_for_the_trainer(
    cfg: dict[str, Any], dataset: str
) -> None:
    """prepare_run hands the trainer verl's arithmetic for the args the loss was built with."""
    shape = prep(mix(cfg, dataset)).algorithm.batch_shape
    # train batch 2 x 4 = 8 (the mini batch), micro batch 4: accumulation 8 // 4 = 2
    assert (shape.use_dynamic_bsz, shape.mini_batch, shape.micro_batch, shape.ngpus) == (
        False,
        8,
        4,
        1,
    )
    assert (shape.gradient_accumulation, shape.mini_per_gpu) == (2, 8)
    data = mix(cfg, dataset)
    data["algorithm"]["policy_loss_fn_args"] = {"use_dynamic_bsz": True, "ngpus_trainer": 2}
    run = prep(data)
    shape = run.algorithm.batch_shape
    assert shape.use_dynamic_bsz and shape.ngpus == 2 and shape.mini_per_gpu == 8 // 2
    assert run.algorithm.policy_loss_fn.experience_per_gpu == shape.mini_per_gpu  # as built


def test_non_mix_losses_get_no_batch_shape(cfg: dict[str, Any]) -> None:
    assert prep(cfg).algorithm.batch_shape is None


def test_loss_batch_args_fall_back_to_the_constructor_defaults() -> None:
    from rftstream.config.resolve import loss_batch_args

    class TakesSome:
        def __init__(self, ppo_mini_batch_size: int = 1, ngpus_trainer: int = 4) -> None:
            pass

    fill, shape = loss_batch_args(
        TakesSome, {"ngpus_trainer": 2}, train_batch_size=12, micro_batch=5, expert_ratio=0.5
    )
    assert fill == {"ppo_mini_batch_size": 12}  # the only one it takes that is not set
    # micro batch: not a constructor argument, not filled: verl's default 1
    assert (shape.mini_batch, shape.micro_batch, shape.ngpus) == (12, 1, 2)
    assert (shape.gradient_accumulation, shape.mini_per_gpu) == (12, 6)

    class TakesNone:
        def __init__(self, train_batch_size_usual: int = 1) -> None:
            pass

    fill, shape = loss_batch_args(
        TakesNone, {}, train_batch_size=10, micro_batch=2, expert_ratio=0.25
    )
    assert fill == {"train_batch_size_usual": 10 - 3} and shape is None  # ceil(2.5) experts
