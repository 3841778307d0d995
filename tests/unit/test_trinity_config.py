"""Trinity-RFT 0.6 configs: mapped keys converted, meaningless keys warned once, unknown keys errors."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest

from rftstream.config import config_from_dict, load_config
from rftstream.config.loader import translate_config
from rftstream.config.paths import config_info, type_at
from rftstream.config.trinity import TRINITY_KEYS, Ignored, TrinityConfigWarning
from rftstream.errors import ConfigError

GSM8K = Path(__file__).parents[1] / "compat" / "configs" / "grpo_gsm8k.yaml"


def load_warned(data: dict[str, Any], *, cuda: bool = False) -> tuple[Any, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = config_from_dict(data, cuda_available=lambda: cuda)
    return cfg, [str(w.message) for w in caught if issubclass(w.category, TrinityConfigWarning)]


def warned_keys(messages: list[str]) -> list[str]:
    return [m.split("`")[1] for m in messages]


def test_gsm8k_example_maps_and_warns_once_per_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("rftstream.config.trinity._torch_cuda_available", lambda: False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_config(GSM8K, validate=False)
    messages = [str(w.message) for w in caught if issubclass(w.category, TrinityConfigWarning)]
    assert sorted(warned_keys(messages)) == sorted(
        [
            "cluster.node_num",
            "cluster.gpu_per_node",
            "trainer.ulysses_sequence_parallel_size",
            "synchronizer.sync_method",
        ]
    )
    sync_warning = next(m for m in messages if "synchronizer.sync_method" in m)
    assert "CUDA" in sync_warning and "jetstream" in sync_warning
    assert cfg.synchronizer.sync_method == "jetstream"
    assert cfg.name == "qwen2.5-1.5B-gsm8k"
    # runner_per_model 8 x engine_num 2
    assert cfg.explorer.runner_num == 8 * 2
    # use_dynamic_bsz and its token budget are ours: micro-batches formed per step
    assert cfg.trainer.use_dynamic_bsz is True
    assert cfg.trainer.max_token_len_per_gpu == 16384
    assert cfg.model.dtype == "bfloat16"
    assert cfg.trainer.trainer_type == "deepspeed"
    inp = cfg.buffer.explorer_input
    assert inp.taskset.default_workflow_type == "math_workflow"
    assert inp.eval_tasksets[0].default_workflow_type == "math_workflow"
    assert inp.taskset.name == "gsm8k" and inp.taskset.subset_name == "main"
    assert cfg.buffer.trainer_input.experience_buffer is not None
    assert cfg.buffer.trainer_input.experience_buffer.storage_type == "queue"
    assert cfg.algorithm.optimizer.lr == 1e-5


def test_gsm8k_example_validates_but_for_engine_num(monkeypatch: pytest.MonkeyPatch) -> None:
    """The only remaining refusal is engine_num: 2 (another change makes N engines run)."""
    monkeypatch.setattr("rftstream.config.trinity._torch_cuda_available", lambda: False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TrinityConfigWarning)
        cfg = load_config(GSM8K, ["explorer.rollout_model.engine_num=1"])
    assert cfg.explorer.runner_num == 8


def test_nccl_kept_with_cuda() -> None:
    cfg, messages = load_warned({"synchronizer": {"sync_method": "nccl"}}, cuda=True)
    assert cfg.synchronizer.sync_method == "nccl"
    assert messages == []


def test_vllm_async_engines_are_the_vllm_engine_for_rollout_and_auxiliary_models() -> None:
    cfg, messages = load_warned(
        {
            "explorer": {
                "rollout_model": {"engine_type": "vllm_async"},
                "auxiliary_models": [{"model_path": "/judge", "engine_type": "vllm_async"}],
            }
        },
        cuda=True,
    )
    assert cfg.explorer.rollout_model.engine_type == "vllm"
    assert cfg.explorer.auxiliary_models[0].engine_type == "vllm"
    assert messages == []  # a value we map, not a key we drop: nothing to warn about


@pytest.mark.parametrize("engine", ["vllm", "vllm_async"])
def test_vllm_without_cuda_falls_back_to_transformers_at_load_with_one_warning(engine: str) -> None:
    """Refused at config time, not after the explorer processes started (Trinity's
    examples all say vllm); the rollout model and each auxiliary model say so once."""
    cfg, messages = load_warned(
        {
            "explorer": {
                "rollout_model": {"engine_type": engine},
                "auxiliary_models": [{"model_path": "/judge", "engine_type": engine}],
            }
        },
        cuda=False,
    )
    assert cfg.explorer.rollout_model.engine_type == "transformers"
    assert cfg.explorer.auxiliary_models[0].engine_type == "transformers"
    assert warned_keys(messages) == [
        "explorer.rollout_model.engine_type",
        "explorer.auxiliary_models[0].engine_type",
    ]
    assert all("needs a CUDA device" in m and "transformers" in m for m in messages)


@pytest.mark.parametrize("kind", ["wandb", "tensorboard", "mlflow"])
def test_monitor_backends_pass_through_with_their_args(kind: str) -> None:
    data = {"group": "g1", "monitor": {"monitor_type": kind, "monitor_args": {}}}
    cfg, messages = load_warned(data)
    assert (cfg.monitor.monitor_type, cfg.group) == (kind, "g1")
    assert messages == []


def test_swanlab_falls_back_to_jsonl_alone_and_in_a_list() -> None:
    cfg, messages = load_warned({"monitor": {"monitor_type": "swanlab"}})
    assert cfg.monitor.monitor_type == "jsonl"
    assert warned_keys(messages) == ["monitor.monitor_type"]
    assert "swanlab" in messages[0] and "jsonl" in messages[0]
    cfg, messages = load_warned({"monitor": {"monitor_type": ["tensorboard", "swanlab"]}})
    assert cfg.monitor.monitor_type == ["tensorboard"]
    assert warned_keys(messages) == ["monitor.monitor_type"]


def test_unknown_keys_in_either_schema_get_did_you_mean() -> None:
    with pytest.raises(ConfigError) as info:
        config_from_dict({"cluster": {"gpus_per_node": 8}})
    assert "cluster.gpus_per_node" in str(info.value)
    assert "did you mean `gpu_per_node`" in str(info.value)
    with pytest.raises(ConfigError) as info:
        config_from_dict({"explorer": {"runner_nun": 8}})
    assert "explorer.runner_nun" in str(info.value) and "did you mean `runner_num`" in str(
        info.value
    )


def test_queue_taskset_is_an_error_naming_the_key() -> None:
    with pytest.raises(ConfigError) as info:
        config_from_dict(
            {"buffer": {"explorer_input": {"taskset": {"path": "x", "storage_type": "queue"}}}},
            source="t.yaml",
        )
    assert info.value.key_path == "buffer.explorer_input.taskset.storage_type"
    assert "t.yaml" in str(info.value)


def test_workflow_defaults_fill_only_unset_tasksets() -> None:
    data = {
        "buffer": {
            "explorer_input": {
                "taskset": {"name": "a", "path": "p"},
                "tasksets": [{"name": "b", "path": "p", "default_workflow_type": "own"}],
                "eval_tasksets": [{"name": "e", "path": "p"}],
                "default_workflow_type": "math_workflow",
                "default_eval_workflow_type": "eval_wf",
                "default_reward_fn_type": "math_reward",
            }
        }
    }
    cfg, messages = load_warned(data)
    inp = cfg.buffer.explorer_input
    assert inp.taskset.default_workflow_type == "math_workflow"
    assert inp.tasksets[0].default_workflow_type == "own"
    assert inp.eval_tasksets[0].default_workflow_type == "eval_wf"
    assert {inp.taskset.default_reward_fn_type, inp.eval_tasksets[0].default_reward_fn_type} == {
        "math_reward"
    }
    assert messages == []


def test_dynamic_bsz_maps_onto_our_keys() -> None:
    prompt, response = 100, 60
    model = {"max_prompt_tokens": prompt, "max_response_tokens": response}
    # no max_model_len: our default budget, 2 x (max_prompt_tokens + max_response_tokens)
    cfg, messages = load_warned({"model": model, "trainer": {"use_dynamic_bsz": True}})
    assert messages == []
    assert cfg.trainer.use_dynamic_bsz and cfg.trainer.max_token_len_per_gpu is None
    assert cfg.trainer.token_budget(cfg.model) == 2 * (prompt + response)
    assert cfg.trainer.ppo_micro_batch_size_per_gpu == 16  # not derived from the budget
    # Trinity-RFT's default: 2 x max_model_len
    cfg, _ = load_warned(
        {"model": {**model, "max_model_len": 400}, "trainer": {"use_dynamic_bsz": True}}
    )
    assert cfg.trainer.max_token_len_per_gpu == 2 * 400
    # the older name maps onto ours; ours wins when both are set
    cfg, messages = load_warned(
        {"trainer": {"use_dynamic_bsz": True, "ppo_max_token_len_per_gpu": 3000}}
    )
    assert cfg.trainer.max_token_len_per_gpu == 3000 and messages == []
    both = {"ppo_max_token_len_per_gpu": 3000, "max_token_len_per_gpu": 5000}
    cfg, _ = load_warned({"trainer": {"use_dynamic_bsz": True, **both}})
    assert cfg.trainer.max_token_len_per_gpu == 5000
    # without use_dynamic_bsz our budget is kept but unused; the older name is dropped
    cfg, messages = load_warned(
        {"trainer": {"use_dynamic_bsz": False, "max_token_len_per_gpu": 4096}}
    )
    assert cfg.trainer.ppo_micro_batch_size_per_gpu == 16  # the default stays
    assert not cfg.trainer.use_dynamic_bsz and messages == []
    cfg, messages = load_warned({"trainer": {"ppo_max_token_len_per_gpu": 4096}})
    assert cfg.trainer.max_token_len_per_gpu is None
    assert warned_keys(messages) == ["trainer.ppo_max_token_len_per_gpu"]


def test_verl_trainer_config_keys_with_a_meaning_are_mapped() -> None:
    actor = {
        "optim": {"lr": 3e-6, "warmup_style": "cosine", "min_lr_ratio": 0.1},
        "clip_ratio": 0.25,
        "entropy_coeff": 0.002,
        "kl_loss_coef": 0.01,
        "kl_loss_type": "low_var_kl",
        "ppo_micro_batch_size_per_gpu": 4,
        "ppo_epochs": 2,
        "fsdp_config": {"param_offload": False, "wrap_policy": {"min_num_params": 0}},
    }
    data = {
        "algorithm": {"algorithm_type": "grpo"},
        "trainer": {
            "trainer_config": {
                "actor_rollout_ref": {"actor": actor, "rollout": {"n": 8}},
                "critic": {"cliprange_value": 0.3},
            }
        },
    }
    cfg, messages = load_warned(data)
    alg = cfg.algorithm
    assert alg.optimizer.lr == 3e-6
    assert alg.optimizer.warmup_style == "cosine"
    assert alg.optimizer.min_lr_ratio == 0.1
    assert alg.policy_loss_fn_args == {"clip_range": 0.25}
    assert alg.entropy_loss_fn_args == {"entropy_coef": 0.002}
    assert alg.kl_loss_fn == "low_var_kl" and alg.kl_loss_fn_args == {"kl_coef": 0.01}
    assert cfg.trainer.ppo_micro_batch_size_per_gpu == 4
    assert cfg.trainer.ppo_epochs == 2
    assert cfg.trainer.critic.cliprange_value == 0.3
    base = "trainer.trainer_config.actor_rollout_ref"
    # fsdp_config holds a mapped key (mixed_precision): its other keys are warned one by one
    assert sorted(warned_keys(messages)) == [
        f"{base}.actor.fsdp_config.param_offload",
        f"{base}.actor.fsdp_config.wrap_policy",
        f"{base}.rollout",
    ]


def test_our_keys_win_over_trinity_ones_and_explain_says_so() -> None:
    data = {
        "algorithm": {"optimizer": {"lr": 1e-4}},
        "explorer": {"runner_num": 3, "runner_per_model": 8},
        "trainer": {"trainer_config": {"actor_rollout_ref": {"actor": {"optim": {"lr": 9.0}}}}},
    }
    cfg, messages = load_warned(data)
    assert cfg.algorithm.optimizer.lr == 1e-4
    assert cfg.explorer.runner_num == 3
    assert messages == []
    notes = {n.path: n for n in translate_config(data).notes}
    assert notes["explorer.runner_per_model"].action == "overridden"
    assert "explorer.runner_num" in notes["explorer.runner_per_model"].reason
    assert notes["trainer.trainer_config.actor_rollout_ref.actor.optim.lr"].action == "overridden"


def test_use_kl_loss_false_turns_kl_loss_off() -> None:
    data = {
        "trainer": {
            "trainer_config": {
                "actor_rollout_ref": {"actor": {"use_kl_loss": False, "kl_loss_type": "mse"}}
            }
        }
    }
    cfg, messages = load_warned(data)
    assert cfg.algorithm.kl_loss_fn == "none"
    assert warned_keys(messages) == ["trainer.trainer_config.actor_rollout_ref.actor.kl_loss_type"]


ISSUE_KEYS = [
    "cluster.node_num",
    "cluster.gpu_per_node",
    "buffer.explorer_input.taskset.storage_type",
    "buffer.explorer_input.default_workflow_type",
    "explorer.runner_per_model",
    "explorer.rollout_model.dtype",
    "trainer.use_dynamic_bsz",
    "trainer.max_token_len_per_gpu",
    "trainer.ulysses_sequence_parallel_size",
    "trainer.trainer_config",
]


@pytest.mark.parametrize("key", ISSUE_KEYS)
def test_keys_named_by_the_issue_are_in_the_table(key: str) -> None:
    assert key in TRINITY_KEYS


def test_ignored_keys_are_not_keys_of_ours() -> None:
    """An Ignored rule on a key our schema declares would drop a working setting."""
    for pattern, rule in TRINITY_KEYS.items():
        if not isinstance(rule, Ignored):
            continue
        parts: list[str | int] = []
        for token in pattern.replace("[*]", ".0").split("."):
            parts.append(0 if token == "0" else ("x" if token == "*" else token))
        assert type_at(config_info(), tuple(parts)) is None, pattern
        assert rule.reason, pattern


# ------------------------------------------------------------------ rftstream config explain


def test_config_explain_prints_each_key_and_errors(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from rftstream.cli import main

    monkeypatch.setattr("rftstream.config.trinity._torch_cuda_available", lambda: False)
    code = main(["config", "explain", str(GSM8K)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "explorer.runner_per_model = 8 -> explorer.runner_num = 16" in out
    assert "cluster.node_num = 1: IGNORED" in out
    assert "trainer.use_dynamic_bsz = True: micro-batches formed per step" in out
    assert "trainer.max_token_len_per_gpu = 16384: the micro-batch token budget" in out
    assert (
        "synchronizer.sync_method = 'nccl': REPLACED by synchronizer.sync_method = 'jetstream'"
        in out
    )
    assert "model.max_model_len = 2048" in out
    assert "error:" not in out
    code = main(["config", "explain", str(GSM8K), "--set", "explorer.rollout_model.engine_num=1"])
    out = capsys.readouterr().out
    assert code == 0 and "error:" not in out
    assert "explorer.runner_num = 8 " in out
    code = main(["config", "explain", str(GSM8K), "--set", "explorer.rollout_model.engine_num=0"])
    out = capsys.readouterr().out
    assert code == 1
    assert "error:" in out and "explorer.rollout_model.engine_num" in out


def test_config_explain_unknown_key_is_an_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from rftstream.cli import main

    path = tmp_path / "c.yaml"
    path.write_text("cluster:\n  gpus_per_node: 8\n")
    assert main(["config", "explain", str(path)]) == 1
    out = capsys.readouterr().out
    assert "did you mean `gpu_per_node`" in out


def test_floats_are_read_as_omegaconf_reads_them(tmp_path: Path) -> None:
    """Trinity's examples write ``lr: 1e-6`` and ``clip_ratio_c: 1.0e6`` (strings for PyYAML)."""
    path = tmp_path / "c.yaml"
    path.write_text(
        "algorithm:\n  algorithm_type: dapo\n  optimizer:\n    lr: 1e-6\n"
        "  policy_loss_fn_args:\n    clip_range_low: 2e-1\n    clip_ratio_c: 1.0e6\n"
    )
    cfg = load_config(path, ["algorithm.optimizer.weight_decay=1e-2"])
    assert cfg.algorithm.optimizer.lr == 1e-6
    assert cfg.algorithm.optimizer.weight_decay == 0.01
    args = cfg.algorithm.policy_loss_fn_args or {}
    assert args["clip_ratio_c"] == 1e6 and isinstance(args["clip_ratio_c"], float)
    assert args["clip_range_low"] == 0.2
