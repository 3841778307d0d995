"""``rftstream operator NAME --unsplice`` resuming an unsplice whose owner died, on the
in-memory transport (every ``Bus.connect`` of :func:`run_spliced` and its replicas opens a
connection to one in-memory server; the trainer's KV side is played by the test)."""

from __future__ import annotations

import time
from pathlib import Path

import anyio
import pytest

from rftstream.actors.spliced import run_spliced
from rftstream.bus.client import Bus
from rftstream.bus.memory import MemoryTransport
from rftstream.bus.state import RunState
from rftstream.control.splice import operator_side
from rftstream.control.splice.protocol import Claim, TrainerCut
from rftstream.runtime import provision
from rftstream.subjects import KV_SPLICE, KV_STAGE
from rftstream.wire import SPLICE, STAGE, SpliceDrained, SpliceRequested
from tests.kv_json import read_json, write_json
from tests.unit._memory_util import MEMORY_URL, memory_run, serve_in_memory
from tests.unit._splice_util import THRESHOLD, filter_pipelines, mixed_groups

pytestmark = pytest.mark.anyio

CUT = 4


async def _count(server: MemoryTransport, stream: str, subject: str) -> int:
    return (await server.stream_state(stream, subjects_filter=subject)).subjects.get(subject, 0)


async def _trainer_answers(state: RunState) -> None:
    """The trainer's KV side: claim the unsplice request, answer it with the cut, and
    return once the owner wrote ``drained``."""
    while True:
        record, rev = await state.entry(SPLICE)
        if isinstance(record, SpliceRequested):
            assert await operator_side.apply(state, record, rev, Claim()) is not None
            claimed, rev = await state.entry(SPLICE)
            cut = TrainerCut(consumer="trainer")
            assert await operator_side.apply(state, claimed, rev, cut) is not None
        if isinstance(record, SpliceDrained):
            return
        await anyio.sleep(0.01)


@pytest.mark.parametrize("crashed_in", ["requested", "cut"])
async def test_resumed_unsplice_never_processes_past_its_cut(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, crashed_in: str
) -> None:
    """The owner died during an unsplice (``requested``: its durable acked up to the cut;
    ``cut``: it had deleted its durable already). The resumed process must not process one
    message after the cut: from there on the trainer reads exp.train itself."""
    server = serve_in_memory(monkeypatch)
    run = memory_run(tmp_path)
    n = run.names
    durable = n.stage_consumer("train", "filtered")
    await provision(run, MEMORY_URL)
    bus = await Bus.connect(MEMORY_URL, n, run.cfg.nats, "test")
    state = RunState(await bus.kv())
    for i in range(10):
        await bus.publish_group("train", mixed_groups(i), msg_id=f"g{i}")
    if crashed_in == "requested":  # the parked replicas acked everything up to the cut
        await bus.ensure_consumer(
            n.exp_stream,
            durable,
            n.exp_subject("train"),
            description="test",
            role="operator",
            start_seq=1,
        )
        consumer = await bus.pull(n.exp_stream, durable)
        for m in await consumer.fetch(CUT, timeout=0.01):
            await m.ack()
    gone = {"actor": "filter", "pid": 0, "host": "elsewhere", "ts": 0}
    await write_json(
        state,
        KV_STAGE.format(stage="filtered"),
        {
            "operator": "reward_filter",
            "args": {"threshold": THRESHOLD},
            "from_stage": "train",
            "to_stage": "filtered",
            "durable": durable,
            "start_seq": 1,
            "owner": gone,
        },
    )
    unsplice = {"id": "u1", "kind": "unsplice", "state": crashed_in, "operator": "reward_filter"}
    where = {"from_stage": "train", "to_stage": "filtered", "cut_seq": CUT, "ts": time.time()}
    await write_json(state, KV_SPLICE, {**unsplice, **where})
    lines: list[str] = []
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(_trainer_answers, state)
            outcome = await run_spliced(
                run,
                MEMORY_URL,
                operator="reward_filter",
                args={"threshold": THRESHOLD},
                to_stage="filtered",
                pipelines=filter_pipelines(2),
                name="filter",
                stop=anyio.Event(),
                say=lines.append,
                unsplice_now=True,
            )
    assert outcome == "removed", lines
    assert await state.get(STAGE.of(stage="filtered")) is None
    final = await read_json(state, KV_SPLICE)
    assert (final["state"], final["cut_seq"], final["drain_until"]) == ("drained", CUT, 0)
    # past the cut: the trainer's own; nothing went through the filter
    assert await _count(server, n.exp_stream, n.exp_subject("filtered")) == 0
    assert await _count(server, n.exp_stream, n.exp_subject("train")) == 10
