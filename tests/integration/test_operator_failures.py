"""An operator that raises (or hangs) inside a real operator host, against a real nats-server.

The failing message is retried ``max_retries`` times with backoff, then dead-lettered
on ``rft.<run>.dlq.<stage>`` with the exception in ``Rft-Dlq-Reason`` and the stage in
``Rft-Dlq-Stage``; every other message passes; the host keeps running and processes
messages published afterwards. The metrics stream carries the dead-lettered and
failed-batch counts, the filtered counts by operator and the latencies.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio
import pytest

from operators import EXPERIENCE_OPERATORS, ExperienceOperator, ExperiencePipeline
from rftstream.bus.client import Bus
from rftstream.config import config_from_dict
from rftstream.errors import ConfigError
from rftstream.experience import decode_group
from rftstream.messages import H_DLQ_REASON, H_DLQ_STAGE, MetricsMsg
from rftstream.runtime import PreparedRun, prepare_run, provision, run_operator
from tests.integration._util import (
    _group,
    operate_until_drained,
    read_experiences,
    read_metrics,
    read_stream,
    small_config,
    wait_drained,
)

pytestmark = pytest.mark.integration

THRESHOLD = 0.5
OPERATOR_METRICS = "rft.itest.metrics.operator"


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


def _run(tmp_path: Path, tiny_model_path: str, **pipeline_cfg: object):
    cfg = small_config(tmp_path, tiny_model_path)
    cfg["data_processor"] = {"experience_pipeline": pipeline_cfg}
    return prepare_run(config_from_dict(cfg))


def _groups(tasks: range) -> list[list]:
    # rewards 0, 0, 1, 1 per group: reward_filter(0.5) drops two of each four
    return [_group(t, 0.0, 2) + _group(t, 1.0, 4)[2:] for t in tasks]


async def _wait(cond: Callable[[], Awaitable[bool]], timeout: float = 90) -> None:
    with anyio.fail_after(timeout):
        while not await cond():
            await anyio.sleep(0.1)


async def _train_uids(url: str) -> list[str]:
    return [e.eid.uid for e in await read_experiences(url, "rft.itest.exp.train")]


async def _publish_raw(bus: Bus, groups: list[list]) -> None:
    for g in groups:
        await bus.publish_group("raw", g, msg_id=f"raw-{g[0].eid.task}")


def _operate(run: PreparedRun, url: str, groups: list[list], pipeline: ExperiencePipeline) -> None:
    """Publish ``groups`` on exp.raw, then run an operator host on ``pipeline`` until every
    one is acked (:func:`operate_until_drained`); blocks until then."""

    async def main() -> None:
        await provision(run, url)
        async with await Bus.connect(url, run.names, run.cfg.nats, "producer") as bus:
            await _publish_raw(bus, groups)
            await operate_until_drained(run, url, bus, pipeline=pipeline)

    anyio.run(main, backend="asyncio")


def _total(records: list[MetricsMsg], key: str) -> float:
    return sum(r.values.get(key, 0.0) for r in records)


def test_poison_message_is_retried_then_dead_lettered_and_the_stage_goes_on(
    tmp_path: Path, tiny_model_path: str, nats_url: str
) -> None:
    max_retries = 2
    run = _run(
        tmp_path, tiny_model_path, max_retries=max_retries, retry_backoff=0.05, batch_messages=1
    )
    poison = PoisonOnTask(3)
    pipeline = ExperiencePipeline([poison, EXPERIENCE_OPERATORS.get("reward_filter")(THRESHOLD)])
    first, later = _groups(range(0, 6)), _groups(range(6, 9))

    async def main() -> None:
        await provision(run, nats_url)
        async with await Bus.connect(nats_url, run.names, run.cfg.nats, "producer") as bus:
            await _publish_raw(bus, first)
            async with anyio.create_task_group() as tg:
                tg.start_soon(lambda: run_operator(run, nats_url, pipeline=pipeline))

                async def dead_lettered() -> bool:
                    info = await bus.transport.js.stream_info(run.names.dlq_stream)
                    return info.state.messages >= 1

                await _wait(dead_lettered)
                # the host is still running: messages published now pass too
                await _publish_raw(bus, later)
                await wait_drained(bus.transport.js, run.names.exp_stream, "op_raw_to_train")
                tg.cancel_scope.cancel()

    anyio.run(main, backend="asyncio")
    assert poison.calls["3"] == max_retries + 1

    async def check() -> None:
        dead = await read_stream(nats_url, "rft.itest.dlq.>")
        assert len(dead) == 1
        assert dead[0].subject == "rft.itest.dlq.raw"
        reason = dead[0].headers[H_DLQ_REASON]
        assert "ValueError" in reason and "cannot handle task 3" in reason, reason
        assert f"[{max_retries + 1} attempts]" in reason
        assert dead[0].headers[H_DLQ_STAGE] == "raw"
        assert {e.eid.uid for e in decode_group(dead[0].data)} == {e.eid.uid for e in first[3]}
        expected = sorted(
            e.eid.uid for g in first + later for e in g if e.eid.task != 3 and e.reward >= THRESHOLD
        )
        assert sorted(await _train_uids(nats_url)) == expected
        records = await read_metrics(nats_url, OPERATOR_METRICS)
        filtered = sum(
            1 for g in first + later for e in g if e.eid.task != 3 and e.reward < THRESHOLD
        )
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

    anyio.run(check, backend="asyncio")


def test_an_operator_that_fails_for_a_while_then_recovers_loses_nothing(
    tmp_path: Path, tiny_model_path: str, nats_url: str
) -> None:
    run = _run(tmp_path, tiny_model_path, max_retries=5, retry_backoff=0.01)
    flaky = FlakyAtFirst(3)
    groups = _groups(range(0, 5))

    _operate(run, nats_url, groups, ExperiencePipeline([flaky]))

    async def check() -> None:
        assert await read_stream(nats_url, "rft.itest.dlq.>") == []
        assert sorted(await _train_uids(nats_url)) == sorted(e.eid.uid for g in groups for e in g)
        records = await read_metrics(nats_url, OPERATOR_METRICS)
        assert _total(records, "operator/failed_batches") == 3
        assert max(r.values["operator/failed_batches_total"] for r in records) == 3
        assert _total(records, "operator/dead_lettered") == 0

    anyio.run(check, backend="asyncio")


def test_a_hanging_operator_is_timed_out_and_dead_lettered(
    tmp_path: Path, tiny_model_path: str, nats_url: str
) -> None:
    run = _run(
        tmp_path,
        tiny_model_path,
        max_retries=1,
        retry_backoff=0.01,
        process_timeout=0.5,
        batch_messages=1,
    )
    release = threading.Event()
    groups = _groups(range(0, 4))

    try:
        _operate(run, nats_url, groups, ExperiencePipeline([HangsOnTask(2, release)]))
    finally:
        release.set()

    async def check() -> None:
        dead = await read_stream(nats_url, "rft.itest.dlq.>")
        assert len(dead) == 1
        assert "process_timeout=0.5s" in dead[0].headers[H_DLQ_REASON]
        assert {e.eid.task for e in decode_group(dead[0].data)} == {2}
        expected = sorted(e.eid.uid for g in groups for e in g if e.eid.task != 2)
        assert sorted(await _train_uids(nats_url)) == expected
        records = await read_metrics(nats_url, OPERATOR_METRICS)
        assert _total(records, "operator/failed_batches") == 2

    anyio.run(check, backend="asyncio")


def test_retry_settings_are_checked_with_their_key() -> None:
    from rftstream.actors.operator_host import OperatorHost
    from rftstream.subjects import RunNames

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
def test_an_operators_own_timeout_error_is_dead_lettered_as_itself(
    tmp_path: Path, tiny_model_path: str, nats_url: str, process_timeout: float | None
) -> None:
    """A TimeoutError the operator raises is a failure like any other: its own text is the
    reason, with or without ``process_timeout``; only the deadline is reported as one."""
    cfg: dict[str, object] = {"max_retries": 0, "batch_messages": 1}
    if process_timeout is not None:
        cfg["process_timeout"] = process_timeout
    run = _run(tmp_path, tiny_model_path, **cfg)
    groups = _groups(range(0, 3))

    _operate(run, nats_url, groups, ExperiencePipeline([RaisesItsOwnTimeout(1)]))

    async def check() -> None:
        dead = await read_stream(nats_url, "rft.itest.dlq.>")
        assert len(dead) == 1
        reason = dead[0].headers[H_DLQ_REASON]
        assert "TimeoutError: reward server timed out" in reason
        assert "process_timeout" not in reason
        expected = sorted(e.eid.uid for g in groups for e in g if e.eid.task != 1)
        assert sorted(await _train_uids(nats_url)) == expected

    anyio.run(check, backend="asyncio")
