"""Splice an operator in front of a reading trainer, crash it, resume it, remove it; splice
and remove it with ``--unsplice``; splice, crash and remove it with ``NAME --unsplice``; all
while experiences keep flowing; then check every experience by id.

The trainer side is the real :class:`ExperienceFeed` and :class:`TrainerTopology` on a real
nats-server (the DeepSpeed step is left out: ``test_splice_cli`` runs the whole trainer).
Expected outcome, computed from the cuts the KV ``topology`` records: a message of
``exp.train`` before a splice's cut or after its removal's cut is trained as it is; one in
between went through the filter, so it is trained exactly when its reward passes. Nothing is
trained twice and nothing is lost.

The resumed unsplice and the trainer's KV hiccups run on the in-memory transport
(tests/unit/test_spliced_unsplice_resume.py, tests/unit/test_trainer_topology_hiccups.py).
"""

from __future__ import annotations

import functools
import time
from pathlib import Path

import anyio
import pytest

from rftstream.actors.common import InProgressTicker
from rftstream.actors.feed import ExperienceFeed
from rftstream.actors.spliced import run_spliced
from rftstream.actors.topology import TrainerTopology
from rftstream.actors.trainer import Trainer
from rftstream.bus.client import Bus
from rftstream.bus.state import RunState
from rftstream.config import config_from_dict
from rftstream.control.liveness import heartbeat_loop
from rftstream.control.splice import operator_side
from rftstream.experience import decode_group
from rftstream.runtime import prepare_run, provision
from rftstream.subjects import KV_TASKSET, KV_TOPOLOGY
from rftstream.wire import STAGE, Heartbeat, SpliceDone, SpliceDrained, TasksetRecord
from tests.integration._util import read_stream, small_config
from tests.kv_json import read_json, write_json
from tests.unit._splice_util import THRESHOLD, filter_pipelines, mixed_groups

pytestmark = pytest.mark.integration

BATCH = 8


class FakeTrainer:
    """The trainer's reading side, with a short sleep for the step."""

    def __init__(self, run, bus: Bus) -> None:
        self.run = run
        self.bus = bus
        self.trained: list[str] = []
        self.duplicates = 0

    async def __call__(self) -> None:
        state = RunState(await self.bus.kv())
        topology = TrainerTopology(self.bus, state, "trainer")
        consumer = await topology.open()
        ticker = InProgressTicker(1.0)
        real = Trainer(
            self.run.cfg, self.bus, model_path="", resolved=self.run.resolved, run_dir=Path(".")
        )
        feed = ExperienceFeed(self.bus, consumer, ticker, real._exhausted, fetch_batch=4)
        real.feed = feed
        await topology.attach(feed)
        async with anyio.create_task_group() as tg:
            tg.start_soon(ticker.run)
            tg.start_soon(heartbeat_loop, state, _trainer_beat, 1.0)
            while True:
                batch = await feed.read(BATCH)
                if not batch:
                    break
                await anyio.sleep(0.02)  # the training step
                self.trained.extend(e.eid.uid for e in batch)
                await feed.commit()
            self.duplicates = feed.duplicates
            tg.cancel_scope.cancel()


def _trainer_beat() -> Heartbeat:
    """A live trainer's heartbeat (the splice waits for one)."""
    return Heartbeat(actor="trainer", role="trainer", ts=time.time())


def test_splice_crash_resume_unsplice_twice_exactly_once(
    tmp_path: Path, tiny_model_path: str, nats_url: str
) -> None:
    cfg = small_config(tmp_path, tiny_model_path)
    cfg["nats"] = {"ack_wait": 2.0}  # a crashed replica's batch comes back after 2 s
    run = prepare_run(config_from_dict(cfg))
    published: dict[str, float] = {}
    lines: list[str] = []
    say = lines.append
    outcomes: list[str] = []

    async def main() -> tuple[FakeTrainer, list]:
        await provision(run, nats_url)
        async with await Bus.connect(nats_url, run.names, run.cfg.nats, "trainer") as tbus:
            trainer = FakeTrainer(run, tbus)
            async with await Bus.connect(nats_url, run.names, run.cfg.nats, "producer") as bus:
                state = RunState(await bus.kv())
                stop_producing = anyio.Event()

                async def produce() -> None:
                    i = 0
                    while not stop_producing.is_set():
                        group = mixed_groups(i)
                        published.update({e.eid.uid: e.reward for e in group})
                        await bus.publish_group("train", group, msg_id=f"g{i}")
                        i += 1
                        await anyio.sleep(0.02)
                    # the run's end: the trainer finishes once everything is drained
                    await write_json(
                        state,
                        KV_TASKSET,
                        TasksetRecord(count=i, epochs=1, rows=i, by="producer", ts=time.time()),
                    )

                async def trained_more(k: int) -> None:
                    target = len(trainer.trained) + k
                    with anyio.fail_after(120):
                        while len(trainer.trained) < target:
                            await anyio.sleep(0.05)

                async def on_filtered() -> int:
                    subject = run.names.exp_subject("filtered")
                    info = await bus.transport.js.stream_info(
                        run.names.exp_stream, subjects_filter=subject
                    )
                    return int((info.state.subjects or {}).get(subject, 0))

                async def through_filter(more: int) -> None:
                    """Wait until ``more`` groups more than now went through the filter."""
                    target = await on_filtered() + more
                    with anyio.fail_after(120):
                        while await on_filtered() < target:
                            await anyio.sleep(0.05)

                def operator(stop: anyio.Event, **kw) -> functools.partial:
                    return functools.partial(
                        run_spliced,
                        run,
                        nats_url,
                        operator="reward_filter",
                        args={"threshold": THRESHOLD},
                        to_stage="filtered",
                        name="filter",
                        stop=stop,
                        say=say,
                        **kw,
                    )

                async with anyio.create_task_group() as tg:
                    tg.start_soon(trainer)
                    tg.start_soon(produce)
                    await trained_more(16)

                    # 1. splice in (2 replicas), then "crash": cancel it mid-run
                    stop1 = anyio.Event()
                    async with anyio.create_task_group() as op:
                        op.start_soon(operator(stop1, pipelines=filter_pipelines(2)))
                        await through_filter(3)
                        op.cancel_scope.cancel()
                    record = await state.get(STAGE.of(stage="filtered"))
                    assert record is not None and record.operator == "reward_filter"

                    # 2. the same command resumes it; a graceful stop removes it
                    async def resumed_then_stopped() -> None:
                        outcomes.append(await operator(stop1, pipelines=filter_pipelines(1))())

                    async with anyio.create_task_group() as op:
                        op.start_soon(resumed_then_stopped)
                        await through_filter(5)
                        stop1.set()
                    assert outcomes == ["removed"]
                    assert await state.get(STAGE.of(stage="filtered")) is None
                    await trained_more(24)  # unfiltered again, straight from exp.train

                    # 3. splice again under the same stage name; remove it with --unsplice
                    async def spliced_then_asked() -> None:
                        outcomes.append(
                            await operator(anyio.Event(), pipelines=filter_pipelines(2))()
                        )

                    async with anyio.create_task_group() as op:
                        op.start_soon(spliced_then_asked)
                        await through_filter(5)
                        ask = await operator_side.ask_unsplice(state, "filtered")
                        done = await operator_side.wait_unsplice(state, ask, "filtered")
                        assert isinstance(done, SpliceDrained | SpliceDone)
                    assert outcomes == ["removed", "removed"]
                    await trained_more(24)

                    # 4. splice, crash, then `rftstream operator NAME --unsplice`: resume to remove
                    async with anyio.create_task_group() as op:
                        op.start_soon(operator(anyio.Event(), pipelines=filter_pipelines(1)))
                        await through_filter(5)
                        op.cancel_scope.cancel()
                    outcomes.append(
                        await operator(
                            anyio.Event(), pipelines=filter_pipelines(1), unsplice_now=True
                        )()
                    )
                    assert outcomes == ["removed"] * 3
                    await trained_more(16)
                    stop_producing.set()
                topology = await read_json(state, KV_TOPOLOGY)
            return trainer, topology

    trainer, topology = anyio.run(main, backend="asyncio")
    assert any(line.startswith("resuming exp.filtered") for line in lines), lines
    assert [e["op"] for e in topology] == ["splice", "unsplice"] * 3

    async def train_messages() -> list:
        return await read_stream(nats_url, run.names.exp_subject("train"))

    msgs = anyio.run(train_messages, backend="asyncio")
    cuts = [int(e["seq"]) for e in topology]  # first sequence of each new owner
    expected: list[str] = []
    filtered: list[str] = []
    for m in msgs:
        seq = m.metadata.sequence.stream
        through = any(cuts[k] <= seq < cuts[k + 1] for k in (0, 2, 4))
        for e in decode_group(m.data):
            if through and e.reward < THRESHOLD:
                filtered.append(e.eid.uid)
            else:
                expected.append(e.eid.uid)
    assert len(trainer.trained) == len(set(trainer.trained)), "an experience was trained twice"
    assert trainer.duplicates == 0  # exact by the protocol, not by the feed's dedup
    assert sorted(trainer.trained) == sorted(expected)
    assert sorted(trainer.trained + filtered) == sorted(published)  # raw = trained + filtered
    # unfiltered experiences reached the trainer after each removal
    after = {
        e.eid.uid
        for m in msgs
        if m.metadata.sequence.stream >= cuts[1]
        for e in decode_group(m.data)
    }
    assert any(published[u] < THRESHOLD for u in after & set(trainer.trained))
    assert filtered and all(published[u] < THRESHOLD for u in filtered)
