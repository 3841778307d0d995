"""The ``staleness_control`` sample strategy over in-memory sources, on asyncio and trio.

Expected batches come from a plain-python simulation in the test, never from the implementation.
"""

from __future__ import annotations

import anyio
import anyio.lowlevel
import pytest

from algorithms import SAMPLE_STRATEGY, ExperienceSource
from algorithms.sample_strategy import DefaultSampleStrategy, StalenessControlSampleStrategy
from rftstream.config.schema import BufferConfig
from rftstream.errors import ConfigError
from rftstream.experience import EID, Experience
from tests.unit._sources import ListSource, StreamSource

pytestmark = pytest.mark.anyio


def mk(i: int, version: int, reward: float = 0.0) -> Experience:
    return Experience(
        tokens=[1, 2, 3, 4],
        prompt_length=2,
        reward=reward,
        model_version=version,
        prompt_text=f"p{i}",
        response_text=f"r{i}",
        eid=EID(task=f"t{i}"),
    )


MemorySource = ListSource  # returns up to n, fewer only when it has run dry


def buf(train_batch_size: int) -> BufferConfig:
    return BufferConfig(batch_size=2, train_batch_size=train_batch_size)


def simulate(versions, tbs, steps, max_staleness):
    """Reference: consume the queue in order; keep v >= (step - 1) - max_staleness."""
    queue = list(enumerate(versions))
    out = []
    for step in steps:
        lo = (step - 1) - max_staleness
        batch, dropped = [], 0
        while len(batch) < tbs and queue:
            idx, v = queue.pop(0)
            if v >= lo:
                batch.append(idx)
            else:
                dropped += 1
        out.append((batch, dropped))
    return out


async def test_registered_and_default_unchanged(anyio_backend):
    assert SAMPLE_STRATEGY.get("staleness_control") is StalenessControlSampleStrategy
    assert issubclass(StalenessControlSampleStrategy, DefaultSampleStrategy)
    assert StalenessControlSampleStrategy.default_args() == {"max_staleness": None}
    ss = SAMPLE_STRATEGY.get("default")(buf(2), MemorySource([mk(0, 0), mk(1, 0)]))
    _, metrics, _ = await ss.sample(1)
    assert set(metrics) == {"sample/read_time", "sample/count"}


async def test_drops_stale_and_reads_more(anyio_backend):
    versions = [0, 0, 1, 0, 2, 2, 1, 3, 0, 3, 3, 4, 2, 4, 4, 5]
    tbs, max_st, steps = 3, 1, [3, 4, 5, 6]
    source = MemorySource([mk(i, v, reward=float(i)) for i, v in enumerate(versions)])
    assert isinstance(source, ExperienceSource)
    ss = SAMPLE_STRATEGY.get("staleness_control")(buf(tbs), source, max_staleness=max_st)
    expected = simulate(versions, tbs, steps, max_st)
    total = 0
    for step, (want, want_dropped) in zip(steps, expected, strict=True):
        batch, metrics, reprs = await ss.sample(step)
        assert [int(e.reward) for e in batch] == want
        total += want_dropped
        assert metrics["sample/count"] == len(want)
        assert metrics["sample/stale_dropped"] == want_dropped
        assert metrics["sample/stale_dropped_total"] == total
        assert metrics["sample/min_model_version"] == max(step - 1 - max_st, 0)
        if want:
            vs = [versions[i] for i in want]
            assert metrics["sample/model_version/min"] == min(vs)
            assert metrics["sample/model_version/max"] == max(vs)
            assert metrics["sample/model_version/mean"] == pytest.approx(sum(vs) / len(vs))
            assert all(step - 1 - versions[i] <= max_st for i in want)
        assert metrics["sample/read_time"] >= 0 and len(reprs) <= 2
    # every read asked only for what was still missing
    assert all(1 <= n <= tbs for n in source.asked)


async def test_source_runs_dry(anyio_backend):
    # step 5, version 4, max_staleness 2: versions < 2 are stale
    versions = [0, 3, 1, 4, 1]
    source = MemorySource([mk(i, v, reward=float(i)) for i, v in enumerate(versions)])
    ss = StalenessControlSampleStrategy(buf(4), source, max_staleness=2)
    batch, metrics, _ = await ss.sample(5)
    assert [int(e.reward) for e in batch] == [1, 3]  # short batch: the source ran dry
    assert metrics["sample/count"] == 2 and metrics["sample/stale_dropped"] == 3
    assert source.asked == [4, 2]  # 4 -> kept 2 of 4; 2 -> got only [v1], stale: dry
    batch, metrics, reprs = await ss.sample(6)
    assert batch == [] and reprs == [] and metrics["sample/count"] == 0
    assert metrics["sample/stale_dropped"] == 0 and metrics["sample/stale_dropped_total"] == 3
    assert "sample/model_version/min" not in metrics


async def test_everything_stale_then_dry_gives_empty_batch(anyio_backend):
    source = MemorySource([mk(i, 0) for i in range(7)])
    ss = StalenessControlSampleStrategy(buf(3), source, max_staleness=0)
    batch, metrics, _ = await ss.sample(3)  # version 2: all version-0 experiences are stale
    assert batch == [] and metrics["sample/stale_dropped"] == 7
    assert metrics["sample/count"] == 0


async def test_no_limit_and_on_policy(anyio_backend):
    versions = [0, 5, 2, 9]
    ss = StalenessControlSampleStrategy(
        buf(4), MemorySource([mk(i, v) for i, v in enumerate(versions)])
    )
    batch, metrics, _ = await ss.sample(100)
    assert [e.model_version for e in batch] == versions
    assert metrics["sample/stale_dropped"] == 0 and "sample/min_model_version" not in metrics
    ss = StalenessControlSampleStrategy(
        buf(4), MemorySource([mk(i, v) for i, v in enumerate(versions)]), max_staleness=float("inf")
    )
    assert ss.max_staleness is None
    # max_staleness 0 at step 10 (version 9): only version >= 9
    ss = StalenessControlSampleStrategy(
        buf(4), MemorySource([mk(i, v) for i, v in enumerate(versions)]), max_staleness=0
    )
    batch, metrics, _ = await ss.sample(10)
    assert [e.model_version for e in batch] == [9] and metrics["sample/stale_dropped"] == 3


async def test_current_version_callable_overrides_step(anyio_backend):
    versions = [1, 2, 3, 4, 5, 6]
    version = {"v": 5}
    ss = StalenessControlSampleStrategy(
        buf(2),
        MemorySource([mk(i, v) for i, v in enumerate(versions)]),
        max_staleness=1,
        current_version=lambda: version["v"],
    )
    batch, metrics, _ = await ss.sample(1)  # step ignored: version 5 keeps >= 4
    assert [e.model_version for e in batch] == [4, 5] and metrics["sample/stale_dropped"] == 3
    assert metrics["sample/min_model_version"] == 4


@pytest.mark.parametrize("bad", [-1, -0.5, float("nan"), "3", True])
async def test_invalid_max_staleness(anyio_backend, bad):
    with pytest.raises(ConfigError) as info:
        StalenessControlSampleStrategy(buf(2), MemorySource([]), max_staleness=bad)
    assert info.value.key_path == "algorithm.sample_strategy_args.max_staleness"


async def test_waits_for_fresh_data_and_survives_cancellation(anyio_backend):
    send, receive = anyio.create_memory_object_stream[Experience](20)
    ss = StalenessControlSampleStrategy(buf(4), StreamSource(receive), max_staleness=1)
    # step 3 -> version 2 -> keep >= 1
    for i, v in enumerate([0, 2, 1, 0]):
        await send.send(mk(i, v, reward=float(i)))
    with anyio.move_on_after(0.1) as scope:
        await ss.sample(3)  # kept 2, then blocks on the second read
    assert scope.cancelled_caught
    result = {}

    async def consumer():
        result["batch"], result["metrics"], _ = await ss.sample(4)  # version 3 -> keep >= 2

    async with anyio.create_task_group() as tg:
        tg.start_soon(consumer)
        for i, v in [(4, 0), (5, 3), (6, 2), (7, 3)]:
            await anyio.sleep(0.02)
            assert "batch" not in result
            await send.send(mk(i, v, reward=float(i)))
    # carried [1 (v2), 2 (v1 -> now stale)], then 5, 6, 7 fresh and 4 stale
    assert [int(e.reward) for e in result["batch"]] == [1, 5, 6, 7]
    assert result["metrics"]["sample/stale_dropped"] == 2
    assert result["metrics"]["sample/stale_dropped_total"] == 4
    send.close()
