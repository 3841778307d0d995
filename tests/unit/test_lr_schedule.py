"""``algorithm.optimizer`` lr schedules as verl builds them for Trinity-RFT.

The expected multipliers are written out here from verl's definitions
(``get_constant_schedule_with_warmup`` / ``get_cosine_schedule_with_warmup``,
0-based steps, half a cosine from lr to ``min_lr_ratio * lr``), independently
of :mod:`rftstream.training.schedule`. The engine tests check the lr each
trainer step of the real DeepSpeed trainer trained with.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from rftstream.config import config_from_dict
from rftstream.config.schema import OptimizerConfig
from rftstream.errors import ConfigError
from rftstream.runtime import prepare_run
from rftstream.training.schedule import lr_schedule
from tests.integration._util import small_config
from tests.unit._trainer import short_exp


def verl_cosine(step: int, warmup: int, total: int, floor: float) -> float:
    """verl's cosine multiplier, spelled out: linear warm-up, then a half cosine to ``floor``."""
    if step < warmup:
        return step / max(1, warmup)
    progress = (step - warmup) / max(1, total - warmup)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))  # 1 -> 0 over the decay
    return max(floor, floor + (1.0 - floor) * cosine)


def verl_constant(step: int, warmup: int) -> float:
    return step / max(1, warmup) if step < warmup else 1.0


def opt(**kw: Any) -> OptimizerConfig:
    return OptimizerConfig(**kw)


def test_constant_with_warmup_steps() -> None:
    sched = lr_schedule(opt(lr_warmup_steps=4), None)
    assert sched is not None
    assert [sched(s) for s in range(7)] == [0.0, 0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert [sched(s) for s in range(7)] == [verl_constant(s, 4) for s in range(7)]


def test_constant_without_warmup_is_no_schedule() -> None:
    assert lr_schedule(opt(), None) is None
    assert lr_schedule(opt(warmup_style="constant"), 100) is None


def test_cosine_against_the_formula() -> None:
    sched = lr_schedule(opt(warmup_style="cosine", lr_warmup_steps=3, min_lr_ratio=0.1), 23)
    assert sched is not None
    for step in (0, 1, 2, 3, 4, 8, 13, 18, 22, 23, 30):
        assert sched(step) == pytest.approx(verl_cosine(step, 3, 23, 0.1), abs=1e-12), step
    # fixed points: the peak right after warm-up, the midpoint, the floor at the end
    assert sched(3) == pytest.approx(1.0)
    assert sched(13) == pytest.approx((1.0 + 0.1) / 2)
    assert sched(23) == pytest.approx(0.1)


def test_cosine_min_lr_ratio_zero_and_unset() -> None:
    zero = lr_schedule(opt(warmup_style="cosine", min_lr_ratio=0.0), 10)
    assert zero is not None
    assert [zero(s) for s in range(11)] == pytest.approx(
        [0.5 * (1 + math.cos(math.pi * s / 10)) for s in range(11)]
    )
    unset = lr_schedule(opt(warmup_style="cosine"), 10)  # Trinity-RFT's default floor 0.01
    assert unset is not None and unset(10) == pytest.approx(0.01)
    assert unset(5) == pytest.approx(0.01 + 0.99 * 0.5)


def test_warmup_ratio_is_a_share_of_total_steps() -> None:
    sched = lr_schedule(opt(warmup_style="cosine", lr_warmup_steps_ratio=0.25, min_lr_ratio=0), 10)
    assert sched is not None and sched.warmup_steps == 2  # int(0.25 * 10), as verl
    assert [sched(s) for s in range(11)] == pytest.approx(
        [verl_cosine(s, 2, 10, 0.0) for s in range(11)]
    )
    const = lr_schedule(opt(lr_warmup_steps_ratio=0.5), 7)
    assert const is not None and const.warmup_steps == 3
    # set steps win over the ratio
    steps = lr_schedule(opt(lr_warmup_steps=5, lr_warmup_steps_ratio=0.5), 100)
    assert steps is not None and steps.warmup_steps == 5


@pytest.mark.parametrize(
    "kw,total,key",
    [
        ({"warmup_style": "cosine"}, None, "buffer.total_steps"),
        ({"lr_warmup_steps_ratio": 0.1}, None, "buffer.total_steps"),
        ({"warmup_style": "linear"}, 10, "algorithm.optimizer.warmup_style"),
        ({"min_lr_ratio": 1.5, "warmup_style": "cosine"}, 10, "algorithm.optimizer.min_lr_ratio"),
        ({"lr_warmup_steps_ratio": -0.1}, 10, "algorithm.optimizer.lr_warmup_steps_ratio"),
    ],
)
def test_bad_schedules_name_the_key(kw: dict, total: int | None, key: str) -> None:
    with pytest.raises(ConfigError) as info:
        lr_schedule(opt(**kw), total)
    assert info.value.key_path == key


def test_prepare_run_refuses_a_cosine_without_total_steps(
    tmp_path: Path, tiny_model_path: str
) -> None:
    data = small_config(tmp_path, tiny_model_path)
    data["buffer"]["total_steps"] = None
    data["algorithm"]["optimizer"]["warmup_style"] = "cosine"
    with pytest.raises(ConfigError) as info:
        prepare_run(config_from_dict(data))
    assert info.value.key_path == "buffer.total_steps"
    assert "algorithm.optimizer.warmup_style: cosine" in str(info.value)


# ------------------------------------------------------------------ the real trainer


@pytest.mark.parametrize("ppo_epochs", [1, 2])
def test_trainer_steps_follow_the_cosine(
    tmp_path: Path, tiny_model_path: str, ppo_epochs: int
) -> None:
    """Each trainer step trains at ``lr * verl_cosine(step - 1)`` (one schedule step per trainer
    step, whatever ``ppo_epochs``), and reports that lr as ``actor/lr``."""
    from rftstream.training.policy_trainer import PolicyTrainer

    total, warmup, floor, lr = 6, 2, 0.2, 1e-3
    data = small_config(tmp_path, tiny_model_path)
    data["buffer"].update(total_steps=total, train_batch_size=4)
    data["algorithm"].update(kl_loss_fn="none")
    data["algorithm"]["optimizer"].update(
        lr=lr, warmup_style="cosine", lr_warmup_steps=warmup, min_lr_ratio=floor
    )
    data["trainer"].update(ppo_epochs=ppo_epochs, ppo_micro_batch_size_per_gpu=4)
    run = prepare_run(config_from_dict(data))
    trainer = PolicyTrainer(run.cfg, run.model_path, run.algorithm)
    seen = []
    for _ in range(total):
        before = float(trainer.optimizer.param_groups[0]["lr"])
        out = trainer.train_step([short_exp(i) for i in range(4)])
        assert out["actor/lr"] == pytest.approx(before)
        seen.append(out["actor/lr"])
    expected = [lr * verl_cosine(s, warmup, total, floor) for s in range(total)]
    assert seen == pytest.approx(expected, rel=1e-9)
    assert seen[0] == 0.0 and seen[warmup] == pytest.approx(lr)
