"""Trinity-RFT compatibility shims: get_buffer_reader, Experiences, Timer."""

from __future__ import annotations

import time

import anyio
import anyio.lowlevel
import pytest
import torch

from algorithms import CustomField
from rftstream.buffer import BufferReader, get_buffer_reader
from rftstream.buffer.readers import TrainerInputs, trainer_inputs
from rftstream.config.schema import BufferConfig, StorageConfig
from rftstream.experience import EID, Experience, Experiences
from rftstream.utils import Timer
from tests.unit._sources import ListSource


def mk(i: int) -> Experience:
    return Experience(tokens=[1, 2, 3], prompt_length=1, reward=float(i), eid=EID(task=i))


class Opener:
    """``open_dataset``: records the storages it was asked to open."""

    def __init__(self) -> None:
        self.opened: list[StorageConfig] = []
        self.sources: list[ListSource] = []

    def __call__(self, storage: StorageConfig) -> ListSource:
        self.opened.append(storage)
        src = ListSource([mk(100 + i) for i in range(10)])
        self.sources.append(src)
        return src


def test_get_buffer_reader_outside_a_trainer_raises() -> None:
    with pytest.raises(RuntimeError, match="inside a trainer"):
        get_buffer_reader(None, BufferConfig(train_batch_size=4))


def test_none_and_own_experience_buffer_give_the_main_source() -> None:
    main = ListSource([])
    own = StorageConfig(path="/data/sft.jsonl")
    opener = Opener()
    with trainer_inputs(TrainerInputs(own, main, opener)):
        r1 = get_buffer_reader(None, BufferConfig(train_batch_size=4))
        r2 = get_buffer_reader(own, BufferConfig(train_batch_size=4))
        r3 = get_buffer_reader(StorageConfig(path="/data/sft.jsonl"), BufferConfig())  # equal
    assert isinstance(r1, BufferReader)
    assert r1.source is main and r2.source is main and r3.source is main
    assert opener.opened == []
    # the context is gone after the block
    with pytest.raises(RuntimeError):
        get_buffer_reader(None, BufferConfig(train_batch_size=4))


def test_other_storage_goes_through_open_dataset() -> None:
    main = ListSource([])
    opener = Opener()
    aux = StorageConfig(name="sft_dataset", path="/data/expert.jsonl")
    with trainer_inputs(TrainerInputs(None, main, opener)):
        r = get_buffer_reader(aux, BufferConfig(train_batch_size=3))
        r_none = get_buffer_reader(None, BufferConfig(train_batch_size=3))
    assert opener.opened == [aux]
    assert r.source is opener.sources[0]
    assert r_none.source is main
    assert r.batch_size == 3


def test_nested_trainer_inputs_restore_the_outer_one() -> None:
    outer, inner = ListSource([]), ListSource([])
    with trainer_inputs(TrainerInputs(None, outer, Opener())):
        with trainer_inputs(TrainerInputs(None, inner, Opener())):
            assert get_buffer_reader(None, BufferConfig()).source is inner
        assert get_buffer_reader(None, BufferConfig()).source is outer


@pytest.mark.anyio
async def test_read_async_returns_train_batch_size() -> None:
    main = ListSource([mk(i) for i in range(10)])
    with trainer_inputs(TrainerInputs(None, main, Opener())):
        reader = get_buffer_reader(None, BufferConfig(batch_size=2, train_batch_size=4))
    got = await reader.read_async()
    assert [e.reward for e in got] == [0.0, 1.0, 2.0, 3.0]
    assert main.asked == [4]
    got = await reader.read_async(batch_size=2)  # an explicit size wins
    assert [e.reward for e in got] == [4.0, 5.0]
    got = await reader.read_async()
    assert [e.reward for e in got] == [6.0, 7.0, 8.0, 9.0]
    with pytest.raises(StopAsyncIteration):  # exhausted: Trinity-RFT readers end this way
        await reader.read_async()
    assert main.asked == [4, 2, 4, 4]


@pytest.mark.anyio
async def test_reader_opened_inside_a_child_task() -> None:
    """The inputs are a context variable: tasks started inside the block see them."""
    main = ListSource([mk(i) for i in range(6)])
    seen: list[list[Experience]] = []

    async def strategy() -> None:
        reader = get_buffer_reader(None, BufferConfig(train_batch_size=3))
        seen.append(await reader.read_async())

    with trainer_inputs(TrainerInputs(None, main, Opener())):
        async with anyio.create_task_group() as tg:
            tg.start_soon(strategy)
    assert [e.reward for e in seen[0]] == [0.0, 1.0, 2.0]


def test_gather_experiences_is_a_list_with_custom_fields() -> None:
    exps = [mk(0), mk(1), mk(2)]
    fields = [CustomField("is_expert", "expert_mask", torch.bool)]
    batch = Experiences.gather_experiences(exps, pad_token_id=0, custom_fields=fields)
    assert isinstance(batch, list)
    assert isinstance(batch, Experiences)
    assert len(batch) == 3
    assert all(a is b for a, b in zip(batch, exps, strict=True))
    assert batch.custom_fields == fields
    assert batch.pad_token_id == 0
    exps.append(mk(3))
    assert len(batch) == 3  # its own list
    plain = Experiences.gather_experiences(iter([mk(5)]))
    assert plain.custom_fields == []
    assert len(plain) == 1
    assert Experiences().custom_fields == [] and list(Experiences()) == []


def test_timer_accumulates() -> None:
    metrics: dict[str, float] = {}
    with Timer(metrics, "read_time"):
        time.sleep(0.02)
    first = metrics["read_time"]
    assert first >= 0.015
    with Timer(metrics, "read_time") as tm:
        time.sleep(0.02)
    assert isinstance(tm, Timer)
    assert metrics["read_time"] >= first + 0.015
    assert set(metrics) == {"read_time"}
    preset = {"x": 10.0}
    with Timer(preset, "x"):
        pass
    assert 10.0 <= preset["x"] < 11.0


def test_timer_records_when_the_block_raises() -> None:
    metrics: dict[str, float] = {}
    with pytest.raises(ValueError), Timer(metrics, "t"):
        time.sleep(0.01)
        raise ValueError("boom")
    assert metrics["t"] >= 0.005
