"""An operator that raises (or hangs), or a publish that fails, inside a real operator host,
on the in-memory transport (every ``Bus.connect`` of :func:`run_operator` opens a connection
to one in-memory server).

The failing message is retried ``max_retries`` times with backoff, then dead-lettered
on ``rft.<run>.dlq.<stage>`` with the exception in ``Rft-Dlq-Reason`` and the stage in
``Rft-Dlq-Stage``; every other message passes; the host keeps running and processes
messages published afterwards. The metrics stream carries the dead-lettered and
failed-batch counts, the filtered counts by operator and the latencies.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio
import msgspec
import pytest

from operators import EXPERIENCE_OPERATORS, ExperienceOperator, ExperiencePipeline
from rftstream.actors.operator_host import OperatorHost
from rftstream.bus.client import Bus
from rftstream.bus.memory import MemoryTransport
from rftstream.bus.transport import Delivery
from rftstream.errors import ConfigError
from rftstream.experience import decode_group
from rftstream.runtime import PreparedRun, provision, run_operator
from rftstream.subjects import RunNames
from rftstream.wire import H_DLQ_REASON, H_DLQ_STAGE, MetricsMsg
from tests.integration._util import _group
from tests.unit._memory_util import (
    MEMORY_URL,
    memory_run,
    read_metrics,
    read_subject,
    serve_in_memory,
    wait_drained,
)
from tests.unit._publish_faults import FAILS, flaky_publish, stored_once

pytestmark = pytest.mark.anyio

THRESHOLD = 0.5


class PoisonOnTask(ExperienceOperator):
    """Raises on every batch that holds an experience of task ``poison``; counts calls."""

    def __init__(self, poison: int) -> None:
        self.poison = poison
        self.calls: Counter[str] = Counter()

    def process(self, exps):
        tasks = {e.eid.task for e in exps}
        for t in tasks:
            self.calls[str(t)] += 1
        if str(self.poison) in {str(t) for t in tasks}:
            raise ValueError(f"cannot handle task {self.poison}")
        return exps, {}


class FlakyAtFirst(ExperienceOperator):
    """Raises on its first ``failures`` calls, whatever they hold, then works."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.calls = 0

    def process(self, exps):
        self.calls += 1
        if self.calls <= self.failures:
            raise ConnectionError(f"reward server down (call {self.calls})")
        return exps, {}


class HangsOnTask(ExperienceOperator):
    """Blocks (until ``release`` is set) on a batch holding task ``hang``."""

    def __init__(self, hang: int, release: threading.Event) -> None:
        self.hang = hang
        self.release = release

    def process(self, exps):
        if any(str(e.eid.task) == str(self.hang) for e in exps):
            self.release.wait(60)
        return exps, {}


def _run(tmp_path: Path, **pipeline_cfg: object) -> PreparedRun:
    return memory_run(tmp_path, data_processor__experience_pipeline=pipeline_cfg)


def _groups(tasks: range) -> list[list]:
    # rewards 0, 0, 1, 1 per group: reward_filter(0.5) drops two of each four
    return [_group(t, 0.0, 2) + _group(t, 1.0, 4)[2:] for t in tasks]


async def _wait(cond: Callable[[], Awaitable[bool]], timeout: float = 10) -> None:
    with anyio.fail_after(timeout):
        while not await cond():
            await anyio.sleep(0.01)


async def _train_uids(server: MemoryTransport, names: RunNames) -> list[str]:
    msgs = await read_subject(server, names.exp_stream, names.exp_subject("train"))
    return [e.eid.uid for m in msgs for e in decode_group(m.data)]


async def _dead_letters(server: MemoryTransport, names: RunNames) -> list[Delivery]:
    return await read_subject(server, names.dlq_stream, names.dlq_wildcard)


async def _operate(
    server: MemoryTransport, run: PreparedRun, pipeline: ExperiencePipeline, groups: list[list]
) -> None:
    """Publish ``groups`` on exp.raw, run the operator host until it has acked them all."""
    await provision(run, MEMORY_URL)
    bus = await Bus.connect(MEMORY_URL, run.names, run.cfg.nats, "producer")
    for g in groups:
        await bus.publish_group("raw", g, msg_id=f"raw-{g[0].eid.task}")
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: run_operator(run, MEMORY_URL, pipeline=pipeline))
        await wait_drained(server, run.names.exp_stream, "op_raw_to_train")
        tg.cancel_scope.cancel()


def _total(records: list[MetricsMsg], key: str) -> float:
    return sum(r.values.get(key, 0.0) for r in records)


async def test_poison_message_is_retried_then_dead_lettered_and_the_stage_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = serve_in_memory(monkeypatch)
    max_retries = 2
    run = _run(tmp_path, max_retries=max_retries, retry_backoff=0.01, batch_messages=1)
    names = run.names
    poison = PoisonOnTask(3)
    pipeline = ExperiencePipeline([poison, EXPERIENCE_OPERATORS.get("reward_filter")(THRESHOLD)])
    first, later = _groups(range(0, 6)), _groups(range(6, 9))

    await provision(run, MEMORY_URL)
    bus = await Bus.connect(MEMORY_URL, names, run.cfg.nats, "producer")
    for g in first:
        await bus.publish_group("raw", g, msg_id=f"raw-{g[0].eid.task}")
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: run_operator(run, MEMORY_URL, pipeline=pipeline))

        async def dead_lettered() -> bool:
            return (await server.stream_state(names.dlq_stream)).messages >= 1

        await _wait(dead_lettered)
        # the host is still running: messages published now pass too
        for g in later:
            await bus.publish_group("raw", g, msg_id=f"raw-{g[0].eid.task}")
        await wait_drained(server, names.exp_stream, "op_raw_to_train")
        tg.cancel_scope.cancel()
    assert poison.calls["3"] == max_retries + 1

    dead = await _dead_letters(server, names)
    assert len(dead) == 1
    assert dead[0].subject == names.dlq_subject("raw")
    headers = dead[0].headers or {}
    reason = headers[H_DLQ_REASON]
    assert "ValueError" in reason and "cannot handle task 3" in reason, reason
    assert f"[{max_retries + 1} attempts]" in reason
    assert headers[H_DLQ_STAGE] == "raw"
    assert {e.eid.uid for e in decode_group(dead[0].data)} == {e.eid.uid for e in first[3]}
    expected = sorted(
        e.eid.uid for g in first + later for e in g if e.eid.task != 3 and e.reward >= THRESHOLD
    )
    assert sorted(await _train_uids(server, names)) == expected
    records = await read_metrics(server, names, "operator")
    filtered = sum(1 for g in first + later for e in g if e.eid.task != 3 and e.reward < THRESHOLD)
    assert _total(records, "operator/dead_lettered") == 1
    assert _total(records, "operator/dead_lettered_experiences") == len(first[3])
    assert max(r.values["operator/dead_lettered_total"] for r in records) == 1
    assert _total(records, "operator/failed_batches") == max_retries + 1
    assert _total(records, "operator/experiences_filtered") == filtered
    assert _total(records, "operator/filtered/reward_filter") == filtered
    assert _total(records, "operator/filtered/PoisonOnTask") == 0
    assert _total(records, "operator/messages_in") == len(first) + len(later)
    for r in records:  # latency per batch, per message and since arrival, in every record
        assert r.role == "operator" and r.actor == "operator"
        assert r.values["time/operator_batch"] > 0
        assert r.values["time/operator_per_message"] > 0
        assert 0 <= r.values["latency/message_mean"] <= r.values["latency/message_max"]
    poison_record = next(r for r in records if r.values["operator/dead_lettered"] == 1)
    assert poison_record.values["operator/failed_batches"] == max_retries + 1


async def test_an_operator_that_fails_for_a_while_then_recovers_loses_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = serve_in_memory(monkeypatch)
    run = _run(tmp_path, max_retries=5, retry_backoff=0.01)
    groups = _groups(range(0, 5))
    await _operate(server, run, ExperiencePipeline([FlakyAtFirst(3)]), groups)
    assert await _dead_letters(server, run.names) == []
    uids = sorted(e.eid.uid for g in groups for e in g)
    assert sorted(await _train_uids(server, run.names)) == uids
    records = await read_metrics(server, run.names, "operator")
    assert _total(records, "operator/failed_batches") == 3
    assert max(r.values["operator/failed_batches_total"] for r in records) == 3
    assert _total(records, "operator/dead_lettered") == 0


async def test_a_hanging_operator_is_timed_out_and_dead_lettered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = serve_in_memory(monkeypatch)
    cfg = {"max_retries": 1, "retry_backoff": 0.01, "process_timeout": 0.2, "batch_messages": 1}
    run = _run(tmp_path, **cfg)
    release = threading.Event()
    groups = _groups(range(0, 4))
    try:
        await _operate(server, run, ExperiencePipeline([HangsOnTask(2, release)]), groups)
    finally:
        release.set()
    dead = await _dead_letters(server, run.names)
    assert len(dead) == 1
    assert "process_timeout=0.2s" in (dead[0].headers or {})[H_DLQ_REASON]
    assert {e.eid.task for e in decode_group(dead[0].data)} == {2}
    expected = sorted(e.eid.uid for g in groups for e in g if e.eid.task != 2)
    assert sorted(await _train_uids(server, run.names)) == expected
    records = await read_metrics(server, run.names, "operator")
    assert _total(records, "operator/failed_batches") == 2


class NeedsAnApiKey(ExperienceOperator):
    """An LLM-judged filter without its key, as Data-Juicer's llm_quality_score_filter
    fails; counts calls."""

    def __init__(self) -> None:
        self.calls = 0

    def process(self, exps):
        self.calls += 1
        raise RuntimeError("The api_key client option must be set (OPENAI_API_KEY)")


class FailsInsideItsOwnGroup(ExperienceOperator):
    """Fails inside a task group of its own: the error arrives as an ExceptionGroup."""

    def process(self, exps):
        async def check() -> None:
            raise ValueError("prompt of 209 tokens leaves no room in the context of 128")

        async def main() -> None:
            async with anyio.create_task_group() as tg:
                tg.start_soon(check)

        anyio.run(main)
        return exps, {}


async def test_an_operator_without_credentials_stops_the_run_at_its_first_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not retried batch after batch and dead-lettered: the host raises at once, naming the
    operator and the missing key, and acks nothing (the messages wait for a fixed run)."""
    from rftstream.errors import OperatorError

    server = serve_in_memory(monkeypatch)
    run = _run(tmp_path, max_retries=5, retry_backoff=0.01)
    op = NeedsAnApiKey()
    await provision(run, MEMORY_URL)
    bus = await Bus.connect(MEMORY_URL, run.names, run.cfg.nats, "producer")
    for g in _groups(range(0, 3)):
        await bus.publish_group("raw", g, msg_id=f"raw-{g[0].eid.task}")
    with anyio.fail_after(10), pytest.raises(BaseException) as info:
        await run_operator(run, MEMORY_URL, pipeline=ExperiencePipeline([op]))
    from rftstream.errors import first_leaf

    err = first_leaf(info.value)
    assert isinstance(err, OperatorError), repr(info.value)
    assert "NeedsAnApiKey" in str(err) and "api_key client option" in str(err)
    assert "credentials" in str(err)
    assert op.calls == 1
    assert await _dead_letters(server, run.names) == []
    assert await _train_uids(server, run.names) == []


async def test_an_exception_group_is_dead_lettered_as_the_error_inside_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = serve_in_memory(monkeypatch)
    run = _run(tmp_path, max_retries=0, batch_messages=1)
    await _operate(
        server, run, ExperiencePipeline([FailsInsideItsOwnGroup()]), _groups(range(0, 1))
    )
    dead = await _dead_letters(server, run.names)
    reason = (dead[0].headers or {})[H_DLQ_REASON]
    assert "ValueError: prompt of 209 tokens leaves no room" in reason, reason
    assert "unhandled errors" not in reason and "ExceptionGroup" not in reason
    assert reason.count("prompt of 209") == 1  # the cause once, not again as "caused by"


def test_retry_settings_are_checked_with_their_key() -> None:
    class _NoBus:  # the constructor only checks its settings
        names = RunNames("itest")

    def host(**kw: object) -> None:
        OperatorHost(_NoBus(), None, from_stage="raw", to_stage="train", **kw)  # type: ignore[arg-type]

    with pytest.raises(ConfigError, match=r"data_processor\.experience_pipeline\.max_retries"):
        host(max_retries=-1)
    with pytest.raises(ConfigError, match=r"experience_pipeline\.retry_backoff"):
        host(retry_backoff=-0.1)
    with pytest.raises(ConfigError, match=r"experience_pipeline\.process_timeout"):
        host(process_timeout=0)


class RaisesItsOwnTimeout(ExperienceOperator):
    """Raises a ``TimeoutError`` of its own (a reward server that timed out) on task ``bad``."""

    def __init__(self, bad: int) -> None:
        self.bad = bad

    def process(self, exps):
        if any(str(e.eid.task) == str(self.bad) for e in exps):
            raise TimeoutError("reward server timed out")
        return exps, {}


@pytest.mark.parametrize("process_timeout", [None, 30.0])
async def test_an_operators_own_timeout_error_is_dead_lettered_as_itself(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, process_timeout: float | None
) -> None:
    """A TimeoutError the operator raises is a failure like any other: its own text is the
    reason, with or without ``process_timeout``; only the deadline is reported as one."""
    server = serve_in_memory(monkeypatch)
    cfg: dict[str, object] = {"max_retries": 0, "batch_messages": 1}
    if process_timeout is not None:
        cfg["process_timeout"] = process_timeout
    run = _run(tmp_path, **cfg)
    groups = _groups(range(0, 3))
    await _operate(server, run, ExperiencePipeline([RaisesItsOwnTimeout(1)]), groups)
    dead = await _dead_letters(server, run.names)
    assert len(dead) == 1
    reason = (dead[0].headers or {})[H_DLQ_REASON]
    assert "TimeoutError: reward server timed out" in reason
    assert "process_timeout" not in reason
    expected = sorted(e.eid.uid for g in groups for e in g if e.eid.task != 1)
    assert sorted(await _train_uids(server, run.names)) == expected


async def test_operator_gives_inputs_back_on_a_publish_failure(tmp_path: Path) -> None:
    """A publish that fails for NATS reasons (after the bus's own retries) loses nothing and
    dead-letters nothing: the host gives its inputs back and processes them again. Its output
    is split in parts and the failure hits a part ``#1``, so part ``#0`` is stored already:
    the retry's same ``Nats-Msg-Id`` s make every part land once."""
    run = memory_run(tmp_path, nats__ack_wait=600.0)  # nothing in hand is redelivered
    names = run.names
    groups = [_group(t, 1.0, 12) for t in range(3)]  # reward_filter(0.5) keeps every one
    # the transport's time runs 50 times faster: the host's 1 s nak delay passes in 20 ms
    server = MemoryTransport(clock=lambda: 50 * time.monotonic())
    producer = Bus(server.connection(), names, run.cfg.nats, "producer")
    await producer.provision()
    small = msgspec.structs.replace(run.cfg.nats, max_payload=1024)  # 12 exps: 4 parts
    bus = Bus(server.connection(), names, small, "operator")
    for g in groups:
        await producer.publish_group("raw", g, msg_id=f"raw-{g[0].eid.task}")
    failed = flaky_publish(bus, "train")
    pipeline = ExperiencePipeline([EXPERIENCE_OPERATORS.get("reward_filter")(THRESHOLD)])
    host = OperatorHost(
        bus, pipeline, from_stage="raw", to_stage="train", retry_backoff=0.01, fetch_timeout=0.01
    )
    async with anyio.create_task_group() as tg:
        tg.start_soon(host.run)
        await wait_drained(server, names.exp_stream, host.durable)
        tg.cancel_scope.cancel()
    assert len(failed) == FAILS * len(groups)
    assert host.counters.publish_failures >= FAILS
    assert host.counters.dead_lettered_messages == 0
    assert await _dead_letters(server, names) == []
    train = await read_subject(server, names.exp_stream, names.exp_subject("train"))
    assert len(train) == 4 * len(groups)  # every part, once
    assert sorted(stored_once(train)) == sorted(e.eid.uid for g in groups for e in g)
    metrics = await read_metrics(server, names, "operator")
    assert sum(r.values.get("operator/publish_failures", 0) for r in metrics) >= FAILS


async def test_a_group_published_after_the_host_saw_the_end_is_handled_before_it_stops(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An explorer that has not yet seen the run's end still publishes the groups it
    finishes (the chaos run's restarted explorer did, a second after the trainer's last
    step): the host that saw the end handles them before it stops, so nothing is left
    pending on its stage."""
    from rftstream.bus.state import END_STATUSES, RunState

    run = memory_run(tmp_path)
    names = run.names
    server = MemoryTransport()
    producer = Bus(server.connection(), names, run.cfg.nats, "producer")
    await producer.provision()
    await RunState(await producer.kv()).set_status("finished")
    saw_the_end = anyio.Event()
    status = RunState.status

    async def status_seen(self: RunState) -> str:
        value = await status(self)
        if value in END_STATUSES:
            saw_the_end.set()
        return value

    monkeypatch.setattr(RunState, "status", status_seen)
    bus = Bus(server.connection(), names, run.cfg.nats, "operator")
    pipeline = ExperiencePipeline([EXPERIENCE_OPERATORS.get("reward_filter")(THRESHOLD)])
    host = OperatorHost(bus, pipeline, from_stage="raw", to_stage="train", fetch_timeout=0.01)
    late = _group(7, 1.0, 4)
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(host.run)  # returns by itself: the run has ended
            await saw_the_end.wait()
            await producer.publish_group("raw", late, msg_id="raw-late")
    assert sorted(await _train_uids(server, names)) == sorted(e.eid.uid for e in late)
    await wait_drained(server, names.exp_stream, host.durable)
