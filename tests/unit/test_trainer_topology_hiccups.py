"""The trainer's side of splices (:class:`TrainerTopology`) when its KV calls time out, on the
in-memory transport: an operator splices in and out while every kind of KV call of the
trainer fails once; the trainer's reads go on, and each change is answered (and recorded)
exactly once."""

from __future__ import annotations

import time
from typing import Any

import anyio
import pytest

from rftstream.actors import topology as topology_module
from rftstream.actors.common import InProgressTicker
from rftstream.actors.feed import ExperienceFeed
from rftstream.actors.topology import TrainerTopology
from rftstream.bus.client import Bus
from rftstream.bus.memory import MemoryTransport
from rftstream.bus.state import RunState
from rftstream.bus.transport import KeyValueStore
from rftstream.config.schema import NatsConfig
from rftstream.control.liveness import heartbeat_loop
from rftstream.control.splice import operator_side
from rftstream.errors import BusTimeout
from rftstream.subjects import KV_TOPOLOGY, KV_TRAINER_INPUT, RunNames
from rftstream.wire import SPLICE, Heartbeat, SpliceDone
from tests.kv_json import read_json
from tests.unit._splice_util import mixed_groups

pytestmark = pytest.mark.anyio

NAMES = RunNames("hiccups")


class FlakyKV:
    """A KV bucket whose every kind of call (method and key) times out the first time it is
    made while ``on``: each step of answering a request hits a hiccup once."""

    CALLS = ("get", "put", "update", "create", "delete", "keys")

    def __init__(self, kv: KeyValueStore) -> None:
        self._kv = kv
        self.on = False
        self.failed: list[tuple[str, str | None]] = []

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._kv, name)
        if name not in self.CALLS:
            return attr

        async def call(*args: Any, **kwargs: Any) -> Any:
            what = (name, args[0] if args else None)
            if self.on and what not in self.failed:
                self.failed.append(what)
                raise BusTimeout(f"KV {name}: timed out (injected)")
            return await attr(*args, **kwargs)

        return call


def _trainer_beat() -> Heartbeat:
    """A live trainer's heartbeat (the splice waits for one)."""
    return Heartbeat(actor="trainer", role="trainer", ts=time.time())


async def test_kv_hiccups_do_not_fail_the_trainer_while_it_answers_splices(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(topology_module, "POLL_S", 0.02)  # the trainer polls every 20 ms
    server = MemoryTransport()
    tbus = Bus(server.connection(), NAMES, NatsConfig(), "trainer")
    obus = Bus(server.connection(), NAMES, NatsConfig(), "operator")
    await obus.provision()
    state = RunState(await obus.kv())
    flaky = FlakyKV(await tbus.kv())
    topology = TrainerTopology(tbus, RunState(flaky), "trainer")  # type: ignore[arg-type]
    consumer = await topology.open()
    ticker = InProgressTicker(1.0)

    async def never() -> bool:
        return False

    feed = ExperienceFeed(tbus, consumer, ticker, never, fetch_batch=4, fetch_timeout=0.02)
    await topology.attach(feed)
    for i in range(6):
        await obus.publish_group("train", mixed_groups(i), msg_id=f"g{i}")
    read: list[str] = []

    async def trainer() -> None:
        while True:
            batch = await feed.read(4)
            read.extend(e.eid.uid for e in batch)
            await feed.commit()

    async def read_at_least(k: int) -> None:
        while len(read) < k:
            await anyio.sleep(0.01)

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(ticker.run)
            tg.start_soon(heartbeat_loop, state, _trainer_beat, 1.0)
            tg.start_soon(trainer)
            await read_at_least(8)
            flaky.on = True
            cut = await operator_side.request_splice(state, "reward_filter", "filtered")
            await obus.publish_group("filtered", mixed_groups(100), msg_id="f100")
            await read_at_least(6 * 4 + 4)  # all of exp.train (4 a group), then exp.filtered
            await operator_side.request_unsplice(
                state,
                "u1",
                operator="reward_filter",
                from_stage="train",
                to_stage="filtered",
                cut_seq=int(cut.start_seq or 1) - 1,
            )
            end = (await obus.transport.stream_state(NAMES.exp_stream)).last_seq
            await operator_side.finish_unsplice(state, "u1", "filtered", end)
            while not isinstance(await state.get(SPLICE), SpliceDone):
                await anyio.sleep(0.01)
            tg.cancel_scope.cancel()
    # the hiccups happened inside poll, on every step of answering (claim, switch, answer)
    failed = flaky.failed
    assert ("update", "splice") in failed and ("put", "trainer.input") in failed, failed
    assert ("put", "topology") in failed and ("get", "splice") in failed, failed
    assert topology.poll_errors == len(failed), (topology.poll_errors, failed)  # all in poll
    edges = await read_json(state, KV_TOPOLOGY)
    assert [e["op"] for e in edges] == ["splice", "unsplice"]  # each recorded once
    assert (await read_json(state, KV_TRAINER_INPUT))["stage"] == "train"
    assert len(read) == len(set(read)) == 6 * 4 + 4  # nothing read twice
