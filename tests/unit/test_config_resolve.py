"""rftstream.config.resolve: every value a config derives from other keys, checked against
values written here."""

from __future__ import annotations

import msgspec
import pytest

from rftstream.config import config_from_dict
from rftstream.config.resolve import (
    can_be_stale,
    canonical_sync_style,
    dataset_epochs,
    default_run_dir,
    eval_repeat_times,
    fill_loss_batch_args,
    prefer_decoupled_ppo,
    resolve_config,
    resolve_run,
    run_repeat_times,
    taskset_repeat_times,
    train_batch_size,
    with_train_batch_size,
)
from rftstream.config.schema import MONITOR_TYPES, BufferConfig, Config
from rftstream.errors import ConfigError
from rftstream.monitors import BACKENDS

# ------------------------------------------------------------------ sync style


@pytest.mark.parametrize(
    ("name", "canonical"),
    [
        ("explorer_driven", "dynamic_by_explorer"),
        ("trainer_driven", "dynamic_by_trainer"),
        ("fixed", "fixed"),
        ("dynamic_by_explorer", "dynamic_by_explorer"),
        ("dynamic_by_trainer", "dynamic_by_trainer"),
        ("fully_async", "fully_async"),
    ],
)
def test_canonical_sync_style(name: str, canonical: str) -> None:
    assert canonical_sync_style(name) == canonical


def test_an_unknown_sync_style_names_the_key() -> None:
    with pytest.raises(ConfigError) as info:
        canonical_sync_style("weekly")
    assert info.value.key_path == "synchronizer.sync_style"
    assert info.value.value == "weekly"


# ------------------------------------------------------------------ a loaded config


def test_resolve_config_fills_the_derived_keys_and_leaves_its_input() -> None:
    cfg = config_from_dict(
        {
            "synchronizer": {"sync_style": "trainer_driven", "sync_interval": 2},
            "monitor": {"monitor_type": ["tensorboard"]},
            "buffer": {
                "explorer_input": {"eval_tasksets": [{"name": "a"}, {"name": "b", "is_eval": True}]}
            },
        }
    )
    out = resolve_config(cfg)
    assert out.synchronizer.sync_style == "dynamic_by_trainer"
    assert out.synchronizer.sync_interval == 2
    assert out.monitor.monitor_type == "tensorboard"
    assert [ts.is_eval for ts in out.buffer.explorer_input.eval_tasksets] == [True, True]
    # the input is not modified
    assert cfg.synchronizer.sync_style == "trainer_driven"
    assert cfg.monitor.monitor_type == ["tensorboard"]
    assert [ts.is_eval for ts in cfg.buffer.explorer_input.eval_tasksets] == [False, True]
    # resolving twice gives the same config
    assert resolve_config(out) == out


def test_resolve_config_keeps_what_needs_nothing() -> None:
    cfg = config_from_dict({"monitor": {"monitor_type": ["jsonl", "mlflow"]}})
    out = resolve_config(cfg)
    assert out is cfg  # nothing to derive: the same Struct
    assert out.monitor.monitor_type == ["jsonl", "mlflow"]
    assert out.synchronizer.sync_style == "dynamic_by_explorer"


def test_every_monitor_backend_is_a_monitor_type() -> None:
    assert set(BACKENDS) <= set(MONITOR_TYPES)
    assert set(MONITOR_TYPES) - set(BACKENDS) == {"jsonl", "none"}


# ------------------------------------------------------------------ a run


def test_resolve_run_applies_the_command_line() -> None:
    cfg = config_from_dict(
        {
            "name": "exp1",
            "buffer": {"total_steps": 100},
            "nats": {"servers": ["nats://a:4222", "nats://b:4222"]},
            "synchronizer": {"sync_style": "explorer_driven"},
        }
    )
    out = resolve_run(cfg, steps=3, run_dir="/tmp/r", nats_url="nats://c:4222")
    assert out.buffer.total_steps == 3
    assert out.run_dir == "/tmp/r"
    assert out.nats.url == "nats://c:4222"
    assert out.nats.servers == []
    assert out.synchronizer.sync_style == "dynamic_by_explorer"  # resolve_config too


def test_resolve_run_without_the_command_line() -> None:
    cfg = config_from_dict({"name": "exp1", "buffer": {"total_steps": 100}})
    out = resolve_run(cfg)
    assert out.buffer.total_steps == 100
    assert out.run_dir == "runs/exp1"
    assert out.nats == cfg.nats
    mine = config_from_dict({"name": "exp1", "run_dir": "/data/exp1"})
    assert resolve_run(mine).run_dir == "/data/exp1"
    assert resolve_run(mine, run_dir="/elsewhere").run_dir == "/elsewhere"
    assert resolve_run(mine, run_dir="./runs/x/").run_dir == "runs/x"


def test_default_run_dir() -> None:
    assert default_run_dir(Config(name="gsm8k")) == "runs/gsm8k"
    assert default_run_dir(Config(name="gsm8k", run_dir="/x")) == "/x"


# ------------------------------------------------------------------ the train batch


@pytest.mark.parametrize(
    ("batch_size", "train_batch", "repeat", "expected"),
    [(8, 0, 4, 32), (8, 0, 1, 8), (8, 12, 4, 12), (3, 5, None, 5), (96, 0, 8, 768)],
)
def test_train_batch_size(
    batch_size: int, train_batch: int, repeat: int | None, expected: int
) -> None:
    buffer = BufferConfig(batch_size=batch_size, train_batch_size=train_batch)
    assert train_batch_size(buffer, repeat) == expected


def test_train_batch_size_needs_repeat_times_when_it_is_zero() -> None:
    with pytest.raises(ConfigError) as info:
        train_batch_size(BufferConfig(batch_size=8, train_batch_size=0), None)
    assert info.value.key_path == "buffer.train_batch_size"


def test_with_train_batch_size() -> None:
    cfg = Config(buffer=BufferConfig(batch_size=6, train_batch_size=0))
    assert with_train_batch_size(cfg, 4).buffer.train_batch_size == 24
    assert cfg.buffer.train_batch_size == 0
    given = Config(buffer=BufferConfig(batch_size=6, train_batch_size=10))
    assert with_train_batch_size(given, 4) is given


# ------------------------------------------------------------------ staleness


@pytest.mark.parametrize(
    ("data", "stale"),
    [
        ({}, True),  # mode both, dynamic_by_explorer
        ({"synchronizer": {"sync_style": "fixed"}}, False),  # strictly on-policy
        ({"synchronizer": {"sync_style": "fixed", "sync_interval": 2}}, True),
        ({"synchronizer": {"sync_style": "fixed", "sync_offset": 1}}, True),
        ({"synchronizer": {"max_staleness": 0}}, False),
        ({"synchronizer": {"max_staleness": 1}}, True),
        ({"mode": "explore"}, False),  # nothing is trained here
        ({"mode": "bench"}, False),
        (
            {"mode": "train", "buffer": {"trainer_input": {"experience_buffer": {"path": "d"}}}},
            False,  # a dataset
        ),
        (
            {
                "mode": "train",
                "buffer": {"trainer_input": {"experience_buffer": {"storage_type": "queue"}}},
            },
            True,  # the trainer half of an explorer/trainer pair
        ),
    ],
)
def test_can_be_stale(data: dict, stale: bool) -> None:
    assert can_be_stale(config_from_dict(data)) is stale


def test_prefer_decoupled_ppo() -> None:
    stale = config_from_dict({})
    out = prefer_decoupled_ppo(stale, "ppo")
    assert out.algorithm.policy_loss_fn == "decoupled_ppo"
    assert stale.algorithm.policy_loss_fn is None
    # the user's choice, another preset loss, an unknown preset or an on-policy run: unchanged
    named = config_from_dict({"algorithm": {"policy_loss_fn": "ppo"}})
    assert prefer_decoupled_ppo(named, "ppo") is named
    assert prefer_decoupled_ppo(stale, "sft") is stale
    assert prefer_decoupled_ppo(stale, None) is stale
    on_policy = config_from_dict({"synchronizer": {"sync_style": "fixed"}})
    assert prefer_decoupled_ppo(on_policy, "ppo") is on_policy


# ------------------------------------------------------------------ a loss's batch arguments


class _MixLikeLoss:
    """A policy loss that weights micro-batches itself (MIX's constructor arguments)."""

    def __init__(
        self,
        ppo_mini_batch_size: int = 1,
        ppo_micro_batch_size_per_gpu: int = 1,
        ngpus_trainer: int = 1,
        train_batch_size_usual: int = 1,
        train_batch_size_expert: int = 1,
        use_dynamic_bsz: bool = False,
        clip_range: float = 0.2,
    ) -> None:
        pass


class _PlainLoss:
    def __init__(self, clip_range: float = 0.2) -> None:
        pass


def test_fill_loss_batch_args_derives_mix_sizes() -> None:
    cfg = config_from_dict(
        {
            "buffer": {"batch_size": 4, "train_batch_size": 0},
            "trainer": {"ppo_micro_batch_size_per_gpu": 8},
            "algorithm": {"policy_loss_fn_args": {"clip_range": 0.1}},
        }
    )
    out, shape = fill_loss_batch_args(cfg, _MixLikeLoss, repeat_times=8, expert_ratio=0.25)
    assert out.algorithm.policy_loss_fn_args == {
        "clip_range": 0.1,
        "ppo_mini_batch_size": 32,  # 4 tasks x 8 rollouts
        "ppo_micro_batch_size_per_gpu": 8,
        "ngpus_trainer": 1,
        "train_batch_size_usual": 24,
        "train_batch_size_expert": 8,  # ceil(0.25 x 32)
    }
    assert shape is not None
    assert (shape.mini_batch, shape.micro_batch, shape.ngpus) == (32, 8, 1)
    assert shape.gradient_accumulation == 4 and shape.mini_per_gpu == 32
    assert not shape.use_dynamic_bsz
    assert cfg.algorithm.policy_loss_fn_args == {"clip_range": 0.1}  # input untouched


def test_fill_loss_batch_args_keeps_what_the_user_set() -> None:
    cfg = config_from_dict(
        {
            "buffer": {"train_batch_size": 16},
            "trainer": {"use_dynamic_bsz": True},
            "algorithm": {"policy_loss_fn_args": {"ngpus_trainer": 2, "ppo_mini_batch_size": 16}},
        }
    )
    out, shape = fill_loss_batch_args(cfg, _MixLikeLoss, repeat_times=4, expert_ratio=0.5)
    args = out.algorithm.policy_loss_fn_args
    assert args["ngpus_trainer"] == 2 and args["ppo_mini_batch_size"] == 16
    assert args["use_dynamic_bsz"] is True
    assert args["train_batch_size_expert"] == 8 and args["train_batch_size_usual"] == 8
    assert shape is not None and shape.use_dynamic_bsz and shape.mini_per_gpu == 8


def test_fill_loss_batch_args_needs_micro_batches_that_divide_the_batch() -> None:
    cfg = config_from_dict(
        {"buffer": {"train_batch_size": 10}, "trainer": {"ppo_micro_batch_size_per_gpu": 4}}
    )
    with pytest.raises(ConfigError) as info:
        fill_loss_batch_args(cfg, _MixLikeLoss, repeat_times=1, expert_ratio=0.5)
    assert info.value.key_path == "trainer.ppo_micro_batch_size_per_gpu"
    assert "train batch 10 is not a multiple of the micro batch 4" in str(info.value)
    # with use_dynamic_bsz micro-batches weigh by their rows: any size is fine
    dynamic = msgspec.structs.replace(
        cfg, trainer=msgspec.structs.replace(cfg.trainer, use_dynamic_bsz=True)
    )
    out, _ = fill_loss_batch_args(dynamic, _MixLikeLoss, repeat_times=1, expert_ratio=0.5)
    assert out.algorithm.policy_loss_fn_args["ppo_mini_batch_size"] == 10


def test_fill_loss_batch_args_leaves_a_loss_without_batch_arguments() -> None:
    cfg = config_from_dict({})
    out, shape = fill_loss_batch_args(cfg, _PlainLoss, repeat_times=8, expert_ratio=0.5)
    assert out is cfg and shape is None


def test_a_taskset_repeats_and_passes_as_it_says_else_as_the_run_says() -> None:
    cfg = resolve_config(
        config_from_dict(
            {
                "algorithm": {"repeat_times": 8},
                "buffer": {
                    "total_epochs": 3,
                    "explorer_input": {
                        "taskset": {"path": "a.jsonl"},
                        "eval_tasksets": [{"name": "e", "path": "e.jsonl"}],
                    },
                },
            }
        )
    )
    train, (evals,) = cfg.buffer.explorer_input.taskset, cfg.buffer.explorer_input.eval_tasksets
    assert run_repeat_times(cfg) == 8
    assert taskset_repeat_times(train, 8) == 8 and dataset_epochs(cfg, train) == 3
    assert taskset_repeat_times(evals, 8) == 1  # marked is_eval when loaded
    assert eval_repeat_times(train) == 1
    own = msgspec.structs.replace(train, repeat_times=2, total_epochs=5)
    assert (
        taskset_repeat_times(own, 8) == 2
        and eval_repeat_times(own) == 2
        and dataset_epochs(cfg, own) == 5
    )
