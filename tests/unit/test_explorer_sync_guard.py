"""The explorer loads published weights only with a trainer and an engine that can load them,
and a load that fails keeps the current weights instead of crashing the explorer.

Logic above the bus: the run state is a stand-in with the one method ``_load`` reads;
the weights themselves travel through the real ``memory`` store.
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest
import torch

from rftstream.bus.client import Bus
from rftstream.config.schema import Config
from rftstream.errors import RftError
from rftstream.subjects import RunNames
from rftstream.weights import save_weights
from rftstream.wire import WeightsPointer
from tests.resolved_runs import resolved_run

pytestmark = pytest.mark.anyio


class State:
    def __init__(self, ptr: WeightsPointer | None) -> None:
        self.ptr, self.reads = ptr, 0

    async def latest_weights(self) -> WeightsPointer | None:
        self.reads += 1
        return self.ptr


class Engine:
    def __init__(self, *, can_load: bool = True, fail: bool = False) -> None:
        self.can_load_weights = can_load
        self.fail = fail
        self.model_version = 0
        self.loaded: list[tuple[dict[str, torch.Tensor], int]] = []

    async def load_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        if self.fail:
            raise RftError("load_weights: state dict does not match the model")
        self.loaded.append((state_dict, version))
        self.model_version = version


def _explorer(
    mode: str, engine: Engine, run: str, sync_method: str = "checkpoint", **sync: Any
) -> Any:
    from rftstream.actors.explorer import Explorer
    from rftstream.config.schema import SynchronizerConfig

    bus = Bus.in_memory(RunNames(run))
    cfg = Config(
        mode=mode,
        synchronizer=SynchronizerConfig(sync_method=sync_method, **sync),
    )
    explorer = Explorer(cfg, bus, resolved=resolved_run(cfg), model_path="unused")
    explorer.engine = engine
    return explorer


def _published(run: str, version: int) -> tuple[WeightsPointer, dict[str, torch.Tensor]]:
    weights = {"w": torch.full((2,), float(version))}
    return save_weights("memory", run, version, weights, None, step=version), weights  # type: ignore[arg-type]


async def test_weights_load_with_a_trainer_into_an_engine_that_can() -> None:
    ptr, weights = _published("guard_a", 3)
    engine = Engine()
    explorer = _explorer("both", engine, "guard_a")
    assert explorer._syncs_weights()
    await explorer._load(State(ptr), 0)
    assert engine.model_version == 3 and torch.equal(engine.loaded[0][0]["w"], weights["w"])


@pytest.mark.parametrize(
    "mode,engine",
    [
        ("both", Engine(can_load=False)),  # an external server (engine_type openai)
        ("explore", Engine()),  # no trainer and weights in memory: nothing to sync with
        ("bench", Engine()),  # bench loads saved checkpoints itself
    ],
    ids=["cannot-load", "explore", "bench"],
)
async def test_no_sync_without_a_trainer_or_into_an_engine_that_cannot(
    mode: str, engine: Engine
) -> None:
    ptr, _ = _published("guard_b", 2)
    explorer = _explorer(mode, engine, "guard_b", "memory" if mode == "explore" else "checkpoint")
    state = State(ptr)
    assert not explorer._syncs_weights()
    await explorer._load(state, 0)
    await explorer._sync_weights(state, 5)
    assert engine.loaded == [] and engine.model_version == 0 and state.reads == 0


async def test_a_failed_load_keeps_the_current_weights() -> None:
    ptr, _ = _published("guard_c", 4)
    engine = Engine(fail=True)
    explorer = _explorer("both", engine, "guard_c")
    await explorer._load(State(ptr), 0)  # logged, not raised
    assert engine.model_version == 0 and explorer._version() == 0


async def test_an_explore_half_takes_a_separate_trainers_checkpoint_without_waiting() -> None:
    """mode: explore with checkpoint sync (Trinity's explorer half of an explorer/trainer
    pair) loads the newest published weights at its sync interval; it never waits for a
    version, even in the fixed style, which would make a mode: both explorer wait."""
    ptr, weights = _published("guard_d", 2)
    engine = Engine()
    explorer = _explorer("explore", engine, "guard_d", sync_style="fixed", sync_interval=2)
    assert explorer._syncs_weights()
    state = State(ptr)
    with anyio.fail_after(5):  # before step 5 the fixed style would wait for version 4
        await explorer._sync_weights(state, 5)
    assert engine.model_version == 2 and torch.equal(engine.loaded[0][0]["w"], weights["w"])


async def test_a_fixed_style_explorer_wakes_on_the_trainers_weights_write() -> None:
    # sync_style fixed, interval 1: before step 2 the explorer needs version 1. It waits on
    # the run's KV write notification, not a poll: one read before the write, one after it,
    # one by the load.
    from rftstream.bus.state import RunState
    from rftstream.control import KeyWrites
    from rftstream.subjects import KV_STATUS, KV_WEIGHTS

    ptr, weights = _published("guard_fixed", 1)
    engine = Engine()
    explorer = _explorer("both", engine, "guard_fixed", sync_style="fixed", sync_interval=1)
    await explorer.bus.provision()
    state = RunState(await explorer.bus.kv())
    reads: list[float] = []
    real_latest = state.latest_weights

    async def latest_weights() -> WeightsPointer | None:
        reads.append(anyio.current_time())
        return await real_latest()

    state.latest_weights = latest_weights  # type: ignore[method-assign]
    explorer._weights_changes = KeyWrites(await explorer.bus.kv(), (KV_WEIGHTS, KV_STATUS))
    await explorer._weights_changes.start()
    synced_at: list[float] = []

    async def sync() -> None:
        await explorer._sync_weights(state, 2)
        synced_at.append(anyio.current_time())

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(sync)
            await anyio.sleep(0.6)  # a poll every 0.1 s would read six times meanwhile
            published_at = anyio.current_time()
            await state.set_latest_weights(ptr)
    await explorer._weights_changes.stop()
    assert len(reads) == 3, reads
    assert synced_at[0] - published_at < 0.2
    assert engine.model_version == 1 and torch.equal(engine.loaded[0][0]["w"], weights["w"])
