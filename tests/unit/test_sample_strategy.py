"""Sample strategies over a fake experience source, on asyncio and trio."""

from __future__ import annotations

import anyio
import anyio.lowlevel
import pytest
import torch

from algorithms import SAMPLE_STRATEGY, ExperienceSource, gather_custom_fields
from algorithms.sample_strategy import (
    DefaultSampleStrategy,
    MixSampleStrategy,
    WarmupSampleStrategy,
    representative_sample,
)
from rftstream.config.schema import BufferConfig, StorageConfig, TrainerInput
from rftstream.errors import ConfigError
from rftstream.experience import EID, Experience
from tests.unit._sources import ListSource, StreamSource

pytestmark = pytest.mark.anyio


def mk(reward, i=0, tag="u") -> Experience:
    return Experience(
        tokens=[1, 2, 3, 4, 5, 6],
        prompt_length=2,
        reward=reward,
        logprobs=[-0.5] * 4,
        prompt_text=f"{tag}-p{i}",
        response_text=f"{tag}-r{i}",
        eid=EID(task=f"{tag}{i}"),
    )


def buf(train_batch_size=4, batch_size=2, aux=None) -> BufferConfig:
    return BufferConfig(
        batch_size=batch_size,
        train_batch_size=train_batch_size,
        trainer_input=TrainerInput(auxiliary_buffers=aux or {}),
    )


async def test_default_reads_train_batch_size(anyio_backend):
    exps = [mk(r, i) for i, r in enumerate([0.5, 0.1, 0.9, 0.3, 0.7, 0.2])]
    source = ListSource(exps)
    assert isinstance(source, ExperienceSource)
    ss = SAMPLE_STRATEGY.get("default")(buf(4), source)
    batch, metrics, reprs = await ss.sample(step=1)
    assert batch == exps[:4] and source.asked == [4]
    assert set(metrics) == {"sample/read_time", "sample/count"}
    assert metrics["sample/count"] == 4 and metrics["sample/read_time"] >= 0
    assert reprs == [
        {"prompt": "u-p1", "response": "u-r1", "reward": 0.1},
        {"prompt": "u-p2", "response": "u-r2", "reward": 0.9},
    ]
    batch, metrics, _ = await ss.sample(step=2)  # only 2 left: fewer at the end
    assert batch == exps[4:] and metrics["sample/count"] == 2
    batch, _, reprs = await ss.sample(step=3)
    assert batch == [] and reprs == []


async def test_warmup_is_default_and_waits_for_data(anyio_backend):
    assert issubclass(SAMPLE_STRATEGY.get("warmup"), DefaultSampleStrategy)
    send, receive = anyio.create_memory_object_stream[Experience](10)
    ss = WarmupSampleStrategy(buf(3), StreamSource(receive))
    result = {}

    async def consumer():
        result["batch"], result["metrics"], _ = await ss.sample(0)

    async with anyio.create_task_group() as tg:
        tg.start_soon(consumer)
        for i in range(3):
            await anyio.sleep(0.02)
            assert "batch" not in result  # still waiting for the 3rd experience
            await send.send(mk(float(i), i))
    assert [e.reward for e in result["batch"]] == [0.0, 1.0, 2.0]
    assert result["metrics"]["sample/read_time"] >= 0.04
    send.close()


async def test_train_batch_size_zero_uses_repeat_times(anyio_backend):
    source = ListSource([mk(0.0, i) for i in range(10)])
    ss = DefaultSampleStrategy(buf(0, batch_size=2), source, repeat_times=3)
    batch, _, _ = await ss.sample(0)
    assert len(batch) == 6
    with pytest.raises(ConfigError) as info:
        DefaultSampleStrategy(buf(0), source)
    assert info.value.key_path == "buffer.train_batch_size"


async def test_no_source(anyio_backend):
    ss = DefaultSampleStrategy(buf(2))
    with pytest.raises(RuntimeError, match="no experience source"):
        await ss.sample(0)
    ss.source = ListSource([mk(1.0)])
    batch, _, reprs = await ss.sample(0)
    assert len(batch) == 1
    assert reprs == [{"prompt": "u-p0", "response": "u-r0", "reward": 1.0}]


async def test_mix_sample_strategy(anyio_backend):
    aux = {"sft_dataset": StorageConfig(path="expert.jsonl")}
    usual = ListSource([mk(0.25 * i, i) for i in range(10)])
    expert = ListSource([mk(None, i, tag="e") for i in range(10)])
    ss = MixSampleStrategy(buf(8, aux=aux), usual, expert_source=expert, expert_data_ratio=0.25)
    batch, metrics, _ = await ss.sample(step=7)
    assert usual.asked == [6] and expert.asked == [2]  # ceil(0.25 * 8) = 2 expert
    assert len(batch) == 8 and metrics["sample/expert_count"] == 2
    for exp in batch[:6]:
        assert exp.info == {"is_expert": False, "step": 7}
        assert exp.logprobs.tolist() == [-0.5] * 4
    for exp in batch[6:]:
        assert exp.info == {"is_expert": True, "step": 7}
        assert exp.reward == 0.0
        assert exp.logprobs.tolist() == [0.0] * 4 and exp.logprobs.dtype == torch.float32
        assert exp.advantages.tolist() == [0.0] * 4
    fields = gather_custom_fields(batch, MixSampleStrategy.custom_fields)
    assert fields["expert_mask"].tolist() == [False] * 6 + [True] * 2
    assert fields["expert_mask"].dtype == torch.bool
    assert fields["step"].tolist() == [7] * 8 and fields["step"].dtype == torch.int32
    assert MixSampleStrategy.provided_fields() == {"expert_mask", "step"}


async def test_mix_requires_auxiliary_buffer_and_expert_source(anyio_backend):
    with pytest.raises(ConfigError) as info:
        MixSampleStrategy(buf(8), ListSource([]), sft_dataset_name="experts")
    assert info.value.key_path == "buffer.trainer_input.auxiliary_buffers.experts"
    aux = {"sft_dataset": StorageConfig(path="expert.jsonl")}
    ss = MixSampleStrategy(buf(8, aux=aux), ListSource([]))
    assert (ss.usual_batch_size, ss.expert_batch_size) == (4, 4)  # default ratio 0.5
    ss = MixSampleStrategy(buf(8, aux=aux), ListSource([]), expert_data_ratio=0.3)
    assert (ss.usual_batch_size, ss.expert_batch_size) == (5, 3)  # ceil(2.4) expert
    with pytest.raises(RuntimeError, match="expert_source"):
        await ss.sample(0)


async def test_gather_custom_fields_missing_key():
    with pytest.raises(KeyError, match="is_expert"):
        gather_custom_fields([mk(1.0)], MixSampleStrategy.custom_fields)


async def test_representative_sample_without_rewards():
    assert representative_sample([mk(None, 3), mk(None, 4)]) == [
        {"prompt": "u-p3", "response": "u-r3"}
    ]
    one = mk(0.5)
    assert representative_sample([one]) == [{"prompt": "u-p0", "response": "u-r0", "reward": 0.5}]


async def test_mix_ends_when_the_rollouts_are_exhausted(anyio_backend):
    """Expert data cycles forever; the run still ends when no rollout is left."""
    aux = {"sft_dataset": StorageConfig(path="expert.jsonl")}
    usual = ListSource([mk(0.5, i) for i in range(8)])
    expert = ListSource([mk(None, i, tag="e") for i in range(100)])
    ss = MixSampleStrategy(buf(8, aux=aux), usual, expert_source=expert, expert_data_ratio=0.25)
    first, _, _ = await ss.sample(step=1)
    assert len(first) == 8
    last, _, _ = await ss.sample(step=2)  # 2 rollouts left: a short final step
    assert [e.info["is_expert"] for e in last] == [False, False, True, True]
    done, metrics, _ = await ss.sample(step=3)
    assert done == [] and metrics["sample/count"] == 0.0
    assert expert.asked == [2, 2]  # no expert read for the empty step
