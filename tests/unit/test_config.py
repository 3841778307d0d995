"""Config loading: YAML, env interpolation, key-path errors, overrides, validation."""

from __future__ import annotations

import re
from pathlib import Path

import msgspec
import pytest
import yaml

from rftstream.config import (
    Config,
    OperatorConfig,
    apply_overrides,
    config_from_dict,
    config_to_dict,
    dump_config_yaml,
    load_config,
    run_id_from_name,
    validate_config,
)
from rftstream.config.resolve import resolve_config
from rftstream.config.trinity import TrinityConfigWarning
from rftstream.errors import ConfigError

FULL_YAML = """\
mode: both
project: trinity-demo
name: gsm8k-grpo
checkpoint_root_dir: /tmp/ckpts
model:
  model_path: Qwen/Qwen2.5-1.5B-Instruct
buffer:
  batch_size: 96
  train_batch_size: 768
  total_epochs: 2
  total_steps: 50
  explorer_input:
    taskset:
      path: openai/gsm8k
      format:
        prompt_key: question
        response_key: answer
        system_prompt: You are a helpful assistant.
      rollout_args:
        temperature: 0.7
        max_tokens: 1024
      default_workflow_type: math_workflow
      default_reward_fn_type: math_reward
      workflow_args:
        use_base: true
        n_shots: 2
explorer:
  runner_num: 32
  max_timeout: 120.5
  max_retry_times: 3
  rollout_model:
    engine_type: vllm
synchronizer:
  sync_method: nccl
  sync_style: fixed
  sync_interval: 4
  sync_offset: 1
  sync_timeout: 1200
algorithm:
  algorithm_type: grpo
  repeat_times: 8
  advantage_fn: grpo
  advantage_fn_args:
    epsilon: 1.0e-6
  policy_loss_fn: ppo
  policy_loss_fn_args:
    clip_range: 0.2
  kl_loss_fn: k2
  kl_loss_fn_args:
    kl_coef: 0.001
  optimizer:
    lr: 2.0e-6
data_processor:
  experience_pipeline:
    operators:
      - name: reward_filter
        args:
          threshold: 0.5
trainer:
  save_interval: 100
monitor:
  monitor_type: swanlab
"""


def write(tmp_path: Path, text: str, name: str = "cfg.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def raises_config_error(fn, *args, **kwargs) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        fn(*args, **kwargs)
    return info.value


# ------------------------------------------------------------------ loading


def test_defaults_without_file() -> None:
    cfg = load_config(None)
    assert cfg == Config()
    assert cfg.mode == "both"
    assert cfg.buffer.batch_size == 8
    assert cfg.synchronizer.sync_style == "dynamic_by_explorer"
    assert cfg.data_processor.experience_pipeline.operators == []


def test_empty_file_gives_defaults(tmp_path: Path) -> None:
    assert load_config(write(tmp_path, "")) == Config()


def test_full_trinity_yaml_lands(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("rftstream.config.trinity._torch_cuda_available", lambda: True)
    with pytest.warns(TrinityConfigWarning, match="monitor.monitor_type"):
        cfg = load_config(write(tmp_path, FULL_YAML))
    assert (cfg.mode, cfg.project, cfg.name) == ("both", "trinity-demo", "gsm8k-grpo")
    assert cfg.checkpoint_root_dir == "/tmp/ckpts"
    assert cfg.model.model_path == "Qwen/Qwen2.5-1.5B-Instruct"
    buf = cfg.buffer
    assert (buf.batch_size, buf.train_batch_size, buf.total_epochs, buf.total_steps) == (
        96,
        768,
        2,
        50,
    )
    ts = buf.explorer_input.taskset
    assert ts.path == "openai/gsm8k"
    assert ts.format.prompt_key == "question"
    assert ts.format.response_key == "answer"
    assert ts.format.system_prompt == "You are a helpful assistant."
    assert ts.rollout_args.temperature == 0.7
    assert ts.rollout_args.max_tokens == 1024
    assert ts.default_workflow_type == "math_workflow"
    assert ts.default_reward_fn_type == "math_reward"
    assert ts.workflow_args == {"use_base": True, "n_shots": 2}
    assert cfg.explorer.runner_num == 32
    assert cfg.explorer.max_timeout == 120.5
    assert cfg.explorer.max_retry_times == 3
    assert cfg.explorer.rollout_model.engine_type == "vllm"
    sync = cfg.synchronizer
    assert (sync.sync_method, sync.sync_style, sync.sync_interval, sync.sync_offset) == (
        "nccl",
        "fixed",
        4,
        1,
    )
    assert sync.sync_timeout == 1200.0
    alg = cfg.algorithm
    assert alg.algorithm_type == "grpo"
    assert alg.repeat_times == 8
    assert alg.advantage_fn == "grpo"
    assert alg.advantage_fn_args == {"epsilon": 1e-6}
    assert alg.policy_loss_fn == "ppo"
    assert alg.policy_loss_fn_args == {"clip_range": 0.2}
    assert alg.kl_loss_fn == "k2"
    assert alg.kl_loss_fn_args == {"kl_coef": 0.001}
    assert alg.optimizer.lr == 2e-6
    assert cfg.data_processor.experience_pipeline.operators == [
        OperatorConfig(name="reward_filter", args={"threshold": 0.5})
    ]
    assert cfg.trainer.save_interval == 100
    assert cfg.monitor.monitor_type == "jsonl"  # swanlab is not a monitor here: warned
    # untouched keys keep their defaults
    assert cfg.nats == Config().nats


def test_dump_and_reload_round_trip(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, FULL_YAML))
    text = dump_config_yaml(cfg)
    assert isinstance(yaml.safe_load(text), dict)
    again = load_config(write(tmp_path, text, "dumped.yaml"))
    assert again == cfg
    data = config_to_dict(cfg)
    assert data["buffer"]["explorer_input"]["taskset"]["path"] == "openai/gsm8k"
    assert data["data_processor"]["experience_pipeline"]["operators"][0]["name"] == "reward_filter"
    assert config_from_dict(data) == cfg


def test_load_config_accepts_pathlike_and_str(tmp_path: Path) -> None:
    path = write(tmp_path, "buffer:\n  batch_size: 3\n")
    assert load_config(path).buffer.batch_size == 3
    assert load_config(str(path)).buffer.batch_size == 3


def test_missing_file_names_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    err = raises_config_error(load_config, missing)
    assert str(missing) in str(err)
    assert "not found" in str(err)


# ------------------------------------------------------------------ interpolation


def test_env_interpolation_set(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RFT_TEST_MODEL", "/models/qwen")
    path = write(tmp_path, "model:\n  model_path: ${oc.env:RFT_TEST_MODEL,/default}\n")
    assert load_config(path).model.model_path == "/models/qwen"


def test_env_interpolation_default_when_unset(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("RFT_TEST_MODEL", raising=False)
    path = write(tmp_path, "model:\n  model_path: ${oc.env:RFT_TEST_MODEL,/default/path}\n")
    assert load_config(path).model.model_path == "/default/path"


def test_env_interpolation_empty_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RFT_TEST_URL", raising=False)
    path = write(tmp_path, 'nats:\n  url: "${oc.env:RFT_TEST_URL,}"\n')
    assert load_config(path).nats.url == ""


def test_env_interpolation_typed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RFT_TEST_BS", raising=False)
    monkeypatch.setenv("RFT_TEST_LR", "3.0e-5")
    text = (
        "buffer:\n  batch_size: ${oc.env:RFT_TEST_BS,3}\n"
        "algorithm:\n  optimizer:\n    lr: ${oc.env:RFT_TEST_LR}\n"
        "monitor:\n  plot: ${oc.env:RFT_TEST_PLOT,false}\n"
    )
    cfg = load_config(write(tmp_path, text))
    assert cfg.buffer.batch_size == 3 and isinstance(cfg.buffer.batch_size, int)
    assert cfg.algorithm.optimizer.lr == 3e-5
    assert cfg.monitor.plot is False


def test_env_interpolation_string_field_stays_string(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RFT_TEST_KEY", "12345")
    path = write(tmp_path, "explorer:\n  rollout_model:\n    api_key: ${oc.env:RFT_TEST_KEY}\n")
    assert load_config(path).explorer.rollout_model.api_key == "12345"


def test_env_interpolation_embedded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RFT_TEST_HOST", "nats.local")
    monkeypatch.delenv("RFT_TEST_PORT", raising=False)
    path = write(
        tmp_path,
        "nats:\n  url: nats://${oc.env:RFT_TEST_HOST,localhost}:${oc.env:RFT_TEST_PORT,4222}\n"
        "project: a-${oc.env:RFT_TEST_NOPE,y}-b\n",
    )
    cfg = load_config(path)
    assert cfg.nats.url == "nats://nats.local:4222"
    assert cfg.project == "a-y-b"


def test_env_interpolation_in_list_and_dict(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RFT_TEST_THRESHOLD", "0.25")
    text = (
        "data_processor:\n  experience_pipeline:\n    operators:\n"
        "      - name: reward_filter\n        args:\n"
        "          threshold: ${oc.env:RFT_TEST_THRESHOLD}\n"
    )
    cfg = load_config(write(tmp_path, text))
    assert cfg.data_processor.experience_pipeline.operators[0].args == {"threshold": 0.25}


def test_env_missing_without_default_names_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("RFT_TEST_UNSET", raising=False)
    path = write(
        tmp_path, "buffer:\n  explorer_input:\n    taskset:\n      path: ${oc.env:RFT_TEST_UNSET}\n"
    )
    err = raises_config_error(load_config, path)
    assert err.key_path == "buffer.explorer_input.taskset.path"
    assert "RFT_TEST_UNSET" in str(err)
    assert str(path) in str(err)


# ------------------------------------------------------------------ unknown keys / types


def test_unknown_key_with_suggestion(tmp_path: Path) -> None:
    path = write(tmp_path, "buffer:\n  batchsize: 4\n")
    err = raises_config_error(load_config, path)
    assert err.key_path == "buffer.batchsize"
    assert "unknown key `buffer.batchsize` (did you mean `batch_size`?)" in str(err)
    assert str(path) in str(err)


def test_every_unknown_key_reported_by_full_path(tmp_path: Path) -> None:
    text = (
        "bogus_top: 1\n"
        "buffer:\n  batchsize: 4\n  explorer_input:\n    taskset:\n      pth: x\n"
        "      format:\n        promt_key: q\n"
        "data_processor:\n  experience_pipeline:\n    operators:\n"
        "      - name: reward_filter\n        args: {threshold: 0.5}\n"
        "      - nmae: dedup\n"
        "buffer2: {}\n"
    )
    err = raises_config_error(load_config, write(tmp_path, text))
    msg = str(err)
    for key in (
        "bogus_top",
        "buffer.batchsize",
        "buffer.explorer_input.taskset.pth",
        "buffer.explorer_input.taskset.format.promt_key",
        "data_processor.experience_pipeline.operators[1].nmae",
        "buffer2",
    ):
        assert f"unknown key `{key}`" in msg, key
    assert "6 unknown keys" in msg
    assert "(did you mean `name`?)" in msg
    assert "(did you mean `prompt_key`?)" in msg
    assert "(did you mean `buffer`?)" in msg
    # args of an operator are free-form: not reported
    assert "threshold" not in msg


def test_unknown_key_inside_dict_of_structs() -> None:
    data = {"buffer": {"trainer_input": {"auxiliary_buffers": {"sft": {"path": "x", "splt": "a"}}}}}
    err = raises_config_error(config_from_dict, data)
    assert err.key_path == "buffer.trainer_input.auxiliary_buffers.sft.splt"
    assert "did you mean `split`?" in str(err)


def test_unknown_key_without_close_match_lists_valid_keys() -> None:
    err = raises_config_error(config_from_dict, {"monitor": {"zzzzzz": 1}})
    assert "valid keys: monitor_type, plot" in str(err)


def test_wrong_type_names_key_value_and_file(tmp_path: Path) -> None:
    path = write(tmp_path, "buffer:\n  batch_size: lots\n")
    err = raises_config_error(load_config, path)
    assert err.key_path == "buffer.batch_size"
    assert err.value == "lots"
    msg = str(err)
    assert str(path) in msg
    assert "config key `buffer.batch_size`" in msg
    assert "'lots'" in msg
    assert "$." not in msg


def test_wrong_type_deep_path(tmp_path: Path) -> None:
    path = write(tmp_path, "buffer:\n  explorer_input:\n    taskset:\n      path: [1, 2]\n")
    err = raises_config_error(load_config, path)
    assert err.key_path == "buffer.explorer_input.taskset.path"
    assert err.value == [1, 2]


def test_wrong_type_in_list_item() -> None:
    err = raises_config_error(config_from_dict, {"algorithm": {"optimizer": {"betas": [0.9, "x"]}}})
    assert err.key_path == "algorithm.optimizer.betas[1]"
    assert err.value == "x"


def test_wrong_type_inside_dict_of_structs_names_the_key() -> None:
    data = {
        "buffer": {
            "trainer_input": {"auxiliary_buffers": {"ok": {"path": "a"}, "bad": {"path": 3}}}
        }
    }
    err = raises_config_error(config_from_dict, data, "x.yaml")
    assert err.key_path == "buffer.trainer_input.auxiliary_buffers.bad.path"
    assert err.value == 3
    assert str(err).startswith("x.yaml: ")


def test_missing_required_operator_name() -> None:
    data = {"data_processor": {"experience_pipeline": {"operators": [{"args": {}}]}}}
    err = raises_config_error(config_from_dict, data)
    assert err.key_path == "data_processor.experience_pipeline.operators[0]"
    assert "name" in str(err)


def test_non_mapping_top_level(tmp_path: Path) -> None:
    path = write(tmp_path, "- a\n- b\n")
    err = raises_config_error(load_config, path)
    assert str(path) in str(err)
    assert "the top level of a config file must be a mapping, not list" in str(err)


def test_config_from_dict_takes_none_as_empty_and_refuses_a_non_mapping() -> None:
    assert config_from_dict(None, "x.yaml") == config_from_dict({})  # type: ignore[arg-type]
    err = raises_config_error(config_from_dict, ["a"], "x.yaml")
    assert "the config must be a mapping, not list" in str(err)
    assert err.value == ["a"] and "x.yaml" in str(err)


def test_non_mapping_section() -> None:
    err = raises_config_error(config_from_dict, {"buffer": 5})
    assert err.key_path == "buffer"
    assert err.value == 5


def test_yaml_syntax_error_names_file_and_line(tmp_path: Path) -> None:
    path = write(tmp_path, "mode: both\nbuffer:\n  batch_size: [1, 2\nname: x\n")
    err = raises_config_error(load_config, path)
    msg = str(err)
    assert str(path) in msg
    assert "line 4" in msg


def test_yaml_syntax_error_bad_indent_line(tmp_path: Path) -> None:
    path = write(tmp_path, "a: 1\nb: 2\n c: 3\n")
    msg = str(raises_config_error(load_config, path))
    assert "line 3" in msg


# ------------------------------------------------------------------ overrides


def test_overrides_applied_before_conversion(tmp_path: Path) -> None:
    path = write(tmp_path, FULL_YAML)
    cfg = load_config(
        path,
        [
            "buffer.total_steps=3",
            "model.model_path=/m",
            "mode=explore",
            "explorer.rollout_model.engine_type=openai",
            "data_processor.experience_pipeline.operators[0].args.threshold=0.7",
            "algorithm.optimizer.betas=[0.8, 0.9]",
            "nats.url=",
        ],
    )
    assert cfg.buffer.total_steps == 3
    assert cfg.model.model_path == "/m"
    assert cfg.explorer.rollout_model.engine_type == "openai" and cfg.mode == "explore"
    assert cfg.data_processor.experience_pipeline.operators[0].args == {"threshold": 0.7}
    assert cfg.algorithm.optimizer.betas == [0.8, 0.9]
    assert cfg.nats.url == ""


def test_overrides_without_file_create_sections() -> None:
    cfg = load_config(None, ["buffer.batch_size=5", "synchronizer.max_staleness=null"])
    assert cfg.buffer.batch_size == 5
    assert cfg.synchronizer.max_staleness is None


def test_override_unknown_key_reported() -> None:
    err = raises_config_error(load_config, None, ["buffer.batchsize=5"])
    assert err.key_path == "buffer.batchsize"


def test_override_with_env_interpolation(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RFT_TEST_STEPS", "9")
    assert (
        load_config(None, ["buffer.total_steps=${oc.env:RFT_TEST_STEPS}"]).buffer.total_steps == 9
    )


def test_apply_overrides_does_not_mutate_input() -> None:
    data = {"buffer": {"batch_size": 1}}
    out = apply_overrides(data, ["buffer.batch_size=2", "mode=train"])
    assert data == {"buffer": {"batch_size": 1}}
    assert out == {"buffer": {"batch_size": 2}, "mode": "train"}


@pytest.mark.parametrize("bad", ["no_equals_sign", "=3", "a..b=1", "a]=1"])
def test_malformed_override(bad: str) -> None:
    err = raises_config_error(apply_overrides, {}, [bad])
    assert "override" in str(err)


def test_override_through_scalar_fails() -> None:
    err = raises_config_error(apply_overrides, {"mode": "both"}, ["mode.x=1"])
    assert err.key_path == "mode"


def test_override_list_index_out_of_range() -> None:
    err = raises_config_error(apply_overrides, {"a": [1]}, ["a[3]=1"])
    assert err.key_path == "a[3]"


def test_list_items_are_indexed_either_way() -> None:
    data = {"eval": [{"path": "a"}, {"path": "b"}]}
    assert apply_overrides(data, ["eval[1].path=x"]) == apply_overrides(data, ["eval.1.path=x"])
    assert apply_overrides(data, ["eval.1.path=x"])["eval"][1] == {"path": "x"}
    err = raises_config_error(apply_overrides, data, ["eval.path=x"])
    assert err.key_path == "eval" and "eval[0].path" in str(err) and "eval.0.path" in str(err)
    err = raises_config_error(apply_overrides, data, ["eval.5.path=x"])
    assert err.key_path == "eval[5]"


@pytest.mark.parametrize(
    ("raw", "value"),
    [
        ("3", 3),
        ("1e-4", 1e-4),
        ("true", True),
        ("", ""),
        ("[a, b]", ["a", "b"]),
        ("{k: 1}", {"k": 1}),
        ("Answer: $Answer", "Answer: $Answer"),  # not a mapping: a prompt template
        ("- first", "- first"),
        ("The answer is #1", "The answer is #1"),  # YAML would cut at the comment
        ("a: b: c", "a: b: c"),  # not YAML at all: taken as written
    ],
)
def test_override_values_are_yaml_only_where_clearly_meant(raw: str, value: object) -> None:
    assert apply_overrides({}, [f"x={raw}"]) == {"x": value}


def test_a_broken_flow_value_is_refused() -> None:
    err = raises_config_error(apply_overrides, {}, ["x=[a, b"])
    assert err.key_path == "x" and "not valid YAML" in str(err)


# ------------------------------------------------------------------ validation


def cfg_with(**sections: dict) -> Config:
    return config_from_dict(sections)  # type: ignore[arg-type]


def test_valid_defaults_pass() -> None:
    validate_config(Config())  # raises nothing


# keys whose type is a Literal: decoding rejects any other value, naming the key path and
# the allowed values (config_from_dict, so load_config with validate=False too)
NOT_A_CHOICE = [
    ({"mode": "serve"}, "mode", "serve", "both, explore, train, bench"),
    (
        {"synchronizer": {"sync_style": "sometimes"}},
        "synchronizer.sync_style",
        "sometimes",
        "fixed, dynamic_by_explorer, dynamic_by_trainer, fully_async, explorer_driven",
    ),
    (
        {"synchronizer": {"sync_method": "carrier_pigeon"}},
        "synchronizer.sync_method",
        "carrier_pigeon",
        "jetstream, checkpoint, memory, nccl",
    ),
    (
        {"explorer": {"rollout_model": {"engine_type": "sglang"}}},
        "explorer.rollout_model.engine_type",
        "sglang",
        "transformers, vllm, openai",
    ),
    (
        {"algorithm": {"loss_agg_mode": "sum"}},
        "algorithm.loss_agg_mode",
        "sum",
        "token-mean, seq-mean-token-sum, seq-mean-token-mean, seq-mean-token-sum-norm",
    ),
    (
        {"algorithm": {"logprobs_of": "engine"}},
        "algorithm.logprobs_of",
        "engine",
        "sampler, model",
    ),
    (
        {"monitor": {"monitor_type": "graphite"}},
        "monitor.monitor_type",
        "graphite",
        "jsonl, tensorboard, wandb, mlflow, none",
    ),
    (
        {"monitor": {"monitor_type": ["jsonl", "graphite"]}},
        "monitor.monitor_type[1]",
        "graphite",
        "jsonl, tensorboard, wandb, mlflow, none",
    ),
    (
        {"explorer": {"rollout_model": {"logprobs_mode": "processed"}}},
        "explorer.rollout_model.logprobs_mode",
        "processed",
        "processed_logprobs, raw_logprobs",
    ),
    (
        {"explorer": {"auxiliary_models": [{"model_path": "/m", "engine_type": "openai"}]}},
        "explorer.auxiliary_models[0].engine_type",
        "openai",
        "transformers, vllm",
    ),
    (
        {"buffer": {"explorer_input": {"taskset": {"format": {"prompt_type": "chat"}}}}},
        "buffer.explorer_input.taskset.format.prompt_type",
        "chat",
        '"", messages, plaintext, chatpair',
    ),
    (
        {"buffer": {"trainer_input": {"experience_buffer": {"storage_type": "sql"}}}},
        "buffer.trainer_input.experience_buffer.storage_type",
        "sql",
        "file, queue",
    ),
    ({"trainer": {"zero_stage": 4}}, "trainer.zero_stage", 4, "0, 1, 2, 3"),
    ({"trainer": {"zero_stage": -1}}, "trainer.zero_stage", -1, "0, 1, 2, 3"),
    ({"trainer": {"mixed_precision": "fp16"}}, "trainer.mixed_precision", "fp16", "fp32, bf16"),
    (
        {"trainer": {"critic": {"loss_agg_mode": "mean"}}},
        "trainer.critic.loss_agg_mode",
        "mean",
        "token-mean, seq-mean-token-sum",
    ),
    (
        {"algorithm": {"optimizer": {"warmup_style": "linear"}}},
        "algorithm.optimizer.warmup_style",
        "linear",
        "constant, cosine",
    ),
    (
        {"nats": {"streams": {"metrics": {"discard": "oldest"}}}},
        "nats.streams.metrics.discard",
        "oldest",
        "new, old",
    ),
]


@pytest.mark.parametrize(
    ("data", "key", "value", "choices"),
    NOT_A_CHOICE,
    ids=[i[1] + "=" + repr(i[2]) for i in NOT_A_CHOICE],
)
def test_decoding_rejects_a_value_outside_the_choices(
    data: dict, key: str, value: object, choices: str
) -> None:
    err = raises_config_error(config_from_dict, data, "run.yaml")
    assert err.key_path == key
    assert err.value == value
    msg = str(err)
    assert msg.startswith("run.yaml: ")
    assert f"config key `{key}`: must be one of {choices}" in msg
    assert repr(value) in msg


# the Literal keys validate_config checks itself (monitor.monitor_type: rftstream.monitors;
# trainer.critic.loss_agg_mode and the warmup styles: when the run is prepared)
CHECKED_BY_VALIDATE = (
    "mode",
    "synchronizer.sync_style",
    "synchronizer.sync_method",
    "explorer.rollout_model.engine_type",
    "algorithm.loss_agg_mode",
    "trainer.zero_stage",
    "trainer.mixed_precision",
    "nats.streams.metrics.discard",
)
PYTHON_BUILT = [c for c in NOT_A_CHOICE if c[1] in CHECKED_BY_VALIDATE]


@pytest.mark.parametrize(
    ("data", "key", "value", "choices"), PYTHON_BUILT, ids=[i[1] for i in PYTHON_BUILT]
)
def test_validate_checks_the_choices_of_a_config_built_in_python(
    data: dict, key: str, value: object, choices: str
) -> None:
    """A Struct built in Python is not type-checked: validate_config checks the same choices
    with the same words."""
    cfg = Config()
    *parents, leaf = key.split(".")
    node = cfg
    for part in parents:
        node = getattr(node, part)
    setattr(node, leaf, value)
    err = raises_config_error(validate_config, cfg, "run.yaml")
    assert err.key_path == key
    assert f"config key `{key}`: must be one of {choices}" in str(err)


INVALID = [
    ({"buffer": {"batch_size": 0}}, "buffer.batch_size", 0),
    ({"buffer": {"total_epochs": 0}}, "buffer.total_epochs", 0),
    ({"buffer": {"total_steps": 0}}, "buffer.total_steps", 0),
    ({"buffer": {"train_batch_size": -1}}, "buffer.train_batch_size", -1),
    ({"explorer": {"runner_num": 0}}, "explorer.runner_num", 0),
    ({"explorer": {"max_retry_times": -1}}, "explorer.max_retry_times", -1),
    ({"explorer": {"max_timeout": 0}}, "explorer.max_timeout", 0),
    ({"explorer": {"max_timeout": -2.5}}, "explorer.max_timeout", -2.5),
    ({"synchronizer": {"sync_interval": 0}}, "synchronizer.sync_interval", 0),
    ({"synchronizer": {"sync_offset": -1}}, "synchronizer.sync_offset", -1),
    ({"synchronizer": {"max_staleness": -1}}, "synchronizer.max_staleness", -1),
    ({"trainer": {"save_interval": -1}}, "trainer.save_interval", -1),
    ({"nats": {"max_payload": 1023}}, "nats.max_payload", 1023),
    ({"nats": {"max_payload": 64 * 1024 * 1024 + 1}}, "nats.max_payload", 64 * 1024 * 1024 + 1),
    ({"algorithm": {"repeat_times": 0}}, "algorithm.repeat_times", 0),
    (
        {"explorer": {"rollout_model": {"engine_num": 0}}},
        "explorer.rollout_model.engine_num",
        0,
    ),
    (
        {"explorer": {"rollout_model": {"engine_type": "openai"}}},  # mode: both
        "explorer.rollout_model.engine_type",
        "openai",
    ),
    (
        {"mode": "train", "explorer": {"rollout_model": {"engine_type": "openai"}}},
        "explorer.rollout_model.engine_type",
        "openai",
    ),
    ({"mode": "bench"}, "buffer.explorer_input.eval_tasksets", []),
    ({"name": ""}, "name", ""),
]


@pytest.mark.parametrize(
    ("data", "key", "value"), INVALID, ids=[i[1] + "=" + repr(i[2]) for i in INVALID]
)
def test_validate_rejects(data: dict, key: str, value: object) -> None:
    cfg = config_from_dict(data)
    err = raises_config_error(validate_config, cfg, "run.yaml")
    assert err.key_path == key
    assert err.value == value
    msg = str(err)
    assert msg.startswith("run.yaml: ")
    assert f"config key `{key}`" in msg
    assert repr(value) in msg


def test_validate_runs_in_load_config(tmp_path: Path) -> None:
    path = write(tmp_path, "trainer:\n  save_interval: -3\n")
    err = raises_config_error(load_config, path)
    assert err.key_path == "trainer.save_interval"
    assert str(path) in str(err)
    # and can be turned off
    assert load_config(path, validate=False).trainer.save_interval == -3


VALID_EDGES = [
    {"buffer": {"total_steps": None, "train_batch_size": 0}},
    {"buffer": {"total_steps": 1, "batch_size": 1, "total_epochs": 1}},
    {"synchronizer": {"max_staleness": 0, "sync_offset": 0, "sync_interval": 1}},
    {"trainer": {"zero_stage": 3, "save_interval": 0}},
    {"trainer": {"zero_stage": 0}},
    {"nats": {"max_payload": 1024}},
    {"nats": {"max_payload": 64 * 1024 * 1024}},
    {"explorer": {"max_retry_times": 0, "runner_num": 1, "max_timeout": 0.001}},
    {
        "mode": "bench",
        "monitor": {"monitor_type": "none"},
        "buffer": {"explorer_input": {"eval_tasksets": [{"name": "e", "is_eval": True}]}},
    },
    {
        "mode": "bench",
        "buffer": {"explorer_input": {"eval_tasksets": [{"name": "e", "is_eval": True}]}},
        "explorer": {"rollout_model": {"engine_type": "openai"}},
    },
    {"mode": "explore", "explorer": {"rollout_model": {"engine_type": "openai"}}},
    {"mode": "train", "algorithm": {"loss_agg_mode": "seq-mean-token-sum-norm"}},
    {"synchronizer": {"sync_style": "fully_async", "sync_method": "memory"}},
]


@pytest.mark.parametrize("data", VALID_EDGES)
def test_validate_accepts_edges(data: dict) -> None:
    cfg = config_from_dict(data)
    before = msgspec.to_builtins(cfg)
    validate_config(cfg)  # raises nothing
    assert msgspec.to_builtins(cfg) == before  # and changes nothing


@pytest.mark.parametrize(
    ("alias", "canonical"),
    [("explorer_driven", "dynamic_by_explorer"), ("trainer_driven", "dynamic_by_trainer")],
)
def test_sync_style_alias_normalised(alias: str, canonical: str) -> None:
    cfg = config_from_dict({"synchronizer": {"sync_style": alias, "sync_interval": 3}})
    validate_config(cfg)
    out = resolve_config(cfg)
    assert out.synchronizer.sync_style == canonical
    assert out.synchronizer.sync_interval == 3
    assert cfg.synchronizer.sync_style == alias  # input untouched (new Struct)
    assert msgspec.structs.replace(out, synchronizer=cfg.synchronizer) == cfg


def test_alias_normalised_by_load_config(tmp_path: Path) -> None:
    path = write(tmp_path, "synchronizer:\n  sync_style: trainer_driven\n")
    assert load_config(path).synchronizer.sync_style == "dynamic_by_trainer"


def test_choice_error_suggests_close_value() -> None:
    err = raises_config_error(config_from_dict, {"mode": "explorer"})
    assert "did you mean 'explore'?" in str(err)
    err = raises_config_error(config_from_dict, {"synchronizer": {"sync_style": "fixd"}})
    assert "did you mean 'fixed'?" in str(err)


# ------------------------------------------------------------------ run id


@pytest.mark.parametrize(
    ("name", "run_id"),
    [
        ("default", "default"),
        ("GSM8K-GRPO", "gsm8k_grpo"),
        ("qwen2.5-math", "qwen2_5_math"),
        ("a", "a"),
        ("x" * 16, "x" * 16),
        ("a_b-c.D", "a_b_c_d"),
    ],
)
def test_run_id_from_name(name: str, run_id: str) -> None:
    assert run_id_from_name(name) == run_id


@pytest.mark.parametrize("name", ["", "   ", None, 3])
def test_run_id_from_name_rejects(name: object) -> None:
    err = raises_config_error(run_id_from_name, name)
    assert err.key_path == "name"
    assert "config key `name`" in str(err)


@pytest.mark.parametrize(
    ("name", "prefix"),
    [
        ("x" * 17, "xxxxxxxxx"),
        ("has space", "has_space"),
        ("slash/name", "slash_nam"),
        ("ümlaut", "mlaut"),
        ("qwen2.5-1.5B-gsm8k", "qwen2_5_1"),
        ("  A very long run name. With dots, spaces " + "y" * 60, "a_very_lo"),
    ],
)
def test_long_or_odd_names_get_prefix_and_hash(name: str, prefix: str) -> None:
    import hashlib

    run_id = run_id_from_name(name)
    assert run_id == f"{prefix}_{hashlib.sha256(name.encode()).hexdigest()[:6]}"
    assert re.fullmatch(r"[a-z0-9_]{1,16}", run_id)
    assert run_id_from_name(name + "!") != run_id


def test_yaml_1_1_exponent_floats_are_numbers(tmp_path: Path) -> None:
    """`lr: 5e-3` is a string to YAML 1.1; Trinity users write it anyway."""
    p = tmp_path / "c.yaml"
    p.write_text("algorithm:\n  optimizer:\n    lr: 5e-3\nbuffer:\n  batch_size: '4'\n")
    cfg = load_config(p)
    assert cfg.algorithm.optimizer.lr == 0.005
    assert cfg.buffer.batch_size == 4
    p.write_text("buffer:\n  batch_size: four\n")
    with pytest.raises(ConfigError, match="buffer.batch_size"):
        load_config(p)


def test_engine_errors_say_what_to_do() -> None:
    err = raises_config_error(
        validate_config, cfg_with(explorer={"rollout_model": {"engine_type": "openai"}}), None
    )
    assert "mode: explore or bench" in str(err) and "mode: both" in str(err)
