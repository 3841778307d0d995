"""Operators and the experience pipeline, on asyncio and trio."""

from __future__ import annotations

import math
import time

import anyio
import anyio.lowlevel
import numpy as np
import pytest

from operators import (
    EXPERIENCE_OPERATORS,
    AsyncExperienceOperator,
    ExperienceOperator,
    ExperiencePipeline,
    GroupAdvantageOperator,
    RewardFilter,
    create_operators,
)
from rftstream.config.schema import OperatorConfig
from rftstream.errors import ConfigError, OperatorError
from rftstream.experience import EID, Experience

pytestmark = pytest.mark.anyio


def mk(reward, task="t", run=0) -> Experience:
    return Experience(
        tokens=[1, 2, 3, 4, 5], prompt_length=2, reward=reward, eid=EID(task=task, run=run)
    )


def group(task, rewards):
    return [mk(r, task=task, run=i) for i, r in enumerate(rewards)]


# ------------------------------------------------------------------ filters (sync API)


async def test_reward_filter_seed_semantics():
    exps = [mk(r, run=i) for i, r in enumerate([0.5, -0.1, 0.0, 0.2])]
    kept, metrics = RewardFilter(threshold=0.1).process(exps)
    assert [e.reward for e in kept] == [0.5, 0.2]
    assert metrics == {"filtered_count": 2}
    kept, _ = RewardFilter().process(exps)  # default threshold 0.0 keeps 0.0
    assert [e.reward for e in kept] == [0.5, 0.0, 0.2]


async def test_reward_std_filter_population_std():
    flat = group("flat", [1.0, 1.0, 1.0])
    low = group("low", [0.0, 0.2])  # np.std = 0.1
    high = group("high", [0.0, 1.0])  # np.std = 0.5
    single = group("single", [1.0])
    op = EXPERIENCE_OPERATORS.get("reward_std_filter")(threshold=0.1)
    kept, metrics = op.process(flat + low + high + single)
    assert kept == high
    assert metrics == {"filtered_count": 6, "filtered_group_count": 3}
    kept, _ = EXPERIENCE_OPERATORS.get("reward_std_filter")().process(flat + low)
    assert kept == low
    assert float(np.std([0.0, 0.2])) == pytest.approx(0.1)


async def test_invalid_reward_filter():
    exps = [mk(None), mk(float("nan"), run=1), mk(math.inf, run=2), mk(0.0, run=3), mk(-1.0, run=4)]
    kept, metrics = EXPERIENCE_OPERATORS.get("invalid_reward_filter")().process(exps)
    assert [e.reward for e in kept] == [0.0, -1.0]
    assert metrics == {"filtered_count": 3}


# ------------------------------------------------------------------ pipeline


async def test_reward_filter_through_the_pipeline(anyio_backend):
    rewards = [0.9, 0.1, 0.5, -2.0, 0.49, 3.0]
    exps = [mk(r, task=f"t{i // 2}", run=i) for i, r in enumerate(rewards)]
    pipeline = ExperiencePipeline.from_config(
        [OperatorConfig(name="reward_filter", args={"threshold": 0.5})]
    )
    async with pipeline:
        out, metrics = await pipeline.process(exps)
    kept = [e for e, r in zip(exps, rewards, strict=True) if r >= 0.5]  # 0.9, 0.5, 3.0
    assert out == kept and len(kept) == 3
    assert metrics["pipeline/in"] == 6 and metrics["pipeline/out"] == 3
    assert metrics["filtered/reward_filter"] == 3
    assert metrics["reward_filter/filtered_count"] == 3
    again, _ = await pipeline.process(out)  # idempotent on what it kept
    assert again == kept


async def test_pipeline_filters_then_grpo_advantage(anyio_backend):
    configs = [
        OperatorConfig(name="invalid_reward_filter"),
        OperatorConfig(name="reward_std_filter"),
        OperatorConfig(name="group_advantage", args={"advantage_fn": "grpo", "epsilon": 1e-6}),
    ]
    pipeline = ExperiencePipeline.from_config(configs)
    a = group("a", [1.0, 0.0, 0.0, 1.0])
    b = group("b", [1.0, 1.0])
    c = [mk(None, task="c", run=0), mk(0.5, task="c", run=1)]
    async with pipeline:
        out, metrics = await pipeline.process(a + b + c)
    assert out == a
    mean, std = 0.5, math.sqrt(sum((r - 0.5) ** 2 for r in [1, 0, 0, 1]) / 3)
    for exp in out:
        expected = (exp.reward - mean) / (std + 1e-6)
        np.testing.assert_allclose(exp.advantages.numpy(), [expected] * 3, rtol=1e-5)
    assert metrics["pipeline/in"] == 8 and metrics["pipeline/out"] == 4
    assert metrics["filtered/invalid_reward_filter"] == 1
    assert metrics["invalid_reward_filter/filtered_count"] == 1
    assert metrics["filtered/reward_std_filter"] == 3  # b (flat) and c (now a group of one)
    assert metrics["filtered/group_advantage"] == 0
    assert metrics["group_advantage/reward_mean"] == pytest.approx(0.5)
    assert metrics["group_advantage/group_count"] == 1
    assert "pipeline/time/group_advantage" in metrics


async def test_pipeline_wraps_operator_errors(anyio_backend):
    class Boom(ExperienceOperator):
        def process(self, exps):
            raise ZeroDivisionError("bad batch")

    pipeline = ExperiencePipeline([RewardFilter(), Boom()])
    with pytest.raises(OperatorError) as info:
        await pipeline.process([mk(1.0)])
    assert "operator [1] 'Boom'" in str(info.value)
    assert "ZeroDivisionError: bad batch" in str(info.value)
    assert isinstance(info.value.__cause__, ZeroDivisionError)
    # a reward of None makes the seed's reward_filter raise TypeError -> OperatorError [0]
    with pytest.raises(OperatorError, match=r"operator \[0\] 'reward_filter'") as info:
        await ExperiencePipeline([RewardFilter()]).process([mk(None)])
    assert isinstance(info.value.__cause__, TypeError)


async def test_pipeline_rejects_bad_return_value(anyio_backend):
    class Bad(ExperienceOperator):
        def process(self, exps):
            return exps

    with pytest.raises(OperatorError, match="must return"):
        await ExperiencePipeline([Bad()]).process([mk(1.0)])


async def test_sync_operator_runs_off_the_event_loop(anyio_backend):
    class Slow(ExperienceOperator):
        def process(self, exps):
            time.sleep(0.2)  # blocking work
            return exps, {}

    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            await anyio.sleep(0.01)
            ticks += 1

    async with anyio.create_task_group() as tg:
        tg.start_soon(ticker)
        out, _ = await ExperiencePipeline([Slow()]).process([mk(1.0)])
        tg.cancel_scope.cancel()
    assert len(out) == 1
    assert ticks >= 5  # the loop kept running while Slow.process blocked its thread


async def test_async_operator_lifecycle_and_trinity_sync_close(anyio_backend):
    calls: list[str] = []

    class Scale(AsyncExperienceOperator):
        async def prepare(self):
            calls.append("prepare")

        async def process_async(self, exps):
            await anyio.lowlevel.checkpoint()
            for e in exps:
                e.reward *= 2
            return exps, {"scaled": len(exps)}

        async def close(self):
            calls.append("close")

    class TrinityStyle(ExperienceOperator):
        def process(self, exps):
            return exps[:1], {}

        def close(self):  # Trinity-RFT's close() is synchronous
            calls.append("sync-close")

    pipeline = ExperiencePipeline([Scale(), TrinityStyle(), Scale()])
    assert pipeline.names == ["Scale", "TrinityStyle", "Scale#2"]
    async with pipeline:
        out, metrics = await pipeline.process([mk(1.0), mk(2.0, run=1)])
    assert [e.reward for e in out] == [4.0]
    assert metrics["Scale/scaled"] == 2 and metrics["Scale#2/scaled"] == 1
    assert metrics["filtered/TrinityStyle"] == 1
    assert calls == ["prepare", "prepare", "close", "sync-close", "close"]
    with pytest.raises(TypeError, match="asynchronous"):
        Scale().process([])


async def test_close_runs_all_and_reports_first_failure(anyio_backend):
    closed: list[int] = []

    class Op(ExperienceOperator):
        def __init__(self, i, fail):
            self.i, self.fail = i, fail

        def process(self, exps):
            return exps, {}

        async def close(self):
            closed.append(self.i)
            if self.fail:
                raise RuntimeError(f"close {self.i}")

    pipeline = ExperiencePipeline([Op(0, True), Op(1, False), Op(2, True)])
    with pytest.raises(OperatorError, match=r"\[0\].*close 0"):
        await pipeline.close()
    assert closed == [0, 1, 2]


async def test_empty_batch(anyio_backend):
    pipeline = ExperiencePipeline.from_config(
        [OperatorConfig(name="reward_filter"), OperatorConfig(name="group_advantage")]
    )
    out, metrics = await pipeline.process([])
    assert out == [] and metrics["pipeline/out"] == 0


# ------------------------------------------------------------------ create_operators


async def test_create_operators_errors():
    with pytest.raises(ConfigError) as info:
        create_operators(
            [OperatorConfig(name="reward_filter"), OperatorConfig(name="reward_filtr")]
        )
    err = info.value
    assert err.key_path == "data_processor.experience_pipeline.operators[1].name"
    assert "unknown operator 'reward_filtr'" in str(err) and "reward_std_filter" in str(err)
    with pytest.raises(ConfigError) as info:
        create_operators([OperatorConfig(name="reward_filter", args={"thresh": 1})])
    assert info.value.key_path == "data_processor.experience_pipeline.operators[0].args"
    assert "thresh" in str(info.value)
    with pytest.raises(ConfigError, match=r"operators\[0\]\.args.*'grpoo'"):
        create_operators([OperatorConfig(name="group_advantage", args={"advantage_fn": "grpoo"})])
    with pytest.raises(ConfigError, match="computed in the trainer"):
        create_operators([OperatorConfig(name="group_advantage", args={"advantage_fn": "ppo"})])
    ops = ExperienceOperator.create_operators(
        [OperatorConfig(name="reward_filter", args={"threshold": 0.3})]
    )
    assert isinstance(ops[0], RewardFilter) and ops[0].threshold == 0.3


async def test_group_advantage_operator_opmd(anyio_backend):
    op = GroupAdvantageOperator(advantage_fn="opmd", tau=0.5)
    assert op.advantage_fn.tau == 0.5 and op.advantage_fn.opmd_baseline == "mean"
    exps = group("g", [1.0, 0.0])
    out, metrics = await op.process_async(exps)
    np.testing.assert_allclose(out[0].advantages.numpy(), [0.5, 0.5, 0.5])
    np.testing.assert_allclose(out[1].advantages.numpy(), [-0.5, -0.5, -0.5])
    assert metrics["group_baseline"] == pytest.approx(0.5)
