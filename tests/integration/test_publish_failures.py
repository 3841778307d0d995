"""A publish that fails for NATS reasons (a timeout after the bus's own retries, a 503) loses
nothing and dead-letters nothing, against a real nats-server: the operator host gives its
inputs back and processes them again; the explorer publishes the same group again. Both
publish split groups, and the failure hits a group's second part, so the first part is
already stored when it fails: the retry's same ``Nats-Msg-Id`` s make every part land once.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest

from operators import EXPERIENCE_OPERATORS, ExperiencePipeline
from rftstream.actors.explorer import Explorer
from rftstream.actors.operator_host import OperatorHost
from rftstream.bus.client import Bus
from rftstream.config import config_from_dict
from rftstream.errors import BusError
from rftstream.experience import H_MSG_ID, decode_group
from rftstream.runtime import prepare_run, provision
from tests.integration._util import _group, read_metrics, read_stream, small_config, wait_drained

pytestmark = pytest.mark.integration

FAILS = 2  # attempts of each second part that fail


def flaky_publish(bus: Bus, stage: str) -> list[str]:
    """Make ``bus`` fail the first ``FAILS`` publishes of every part ``#1`` to ``exp.<stage>``
    (as the bus does after its own retries); returns the ids it failed, one per failure."""
    real = bus.publish
    subject = bus.names.exp_subject(stage)
    attempts: Counter[str] = Counter()
    failed: list[str] = []

    async def publish(subj: str, data: bytes, *, msg_id: str | None = None, **kw: Any) -> Any:
        if subj == subject and msg_id is not None and msg_id.endswith("#1"):
            attempts[msg_id] += 1
            if attempts[msg_id] <= FAILS:
                failed.append(msg_id)
                raise BusError(f"{bus.actor}: publish to {subj} timed out 6 times (injected)")
        return await real(subj, data, msg_id=msg_id, **kw)

    bus.publish = publish  # type: ignore[method-assign]
    return failed


def _stored_once(msgs: list) -> list[str]:
    """Every experience uid on ``msgs``, checking that no message id is stored twice."""
    ids = [m.headers[H_MSG_ID] for m in msgs]
    assert len(ids) == len(set(ids)), ids
    return [e.eid.uid for m in msgs for e in decode_group(m.data)]


def test_operator_gives_inputs_back_on_a_publish_failure(
    tmp_path: Path, tiny_model_path: str, nats_url: str
) -> None:
    run = prepare_run(config_from_dict(small_config(tmp_path, tiny_model_path)))
    groups = [_group(t, 1.0, 12) for t in range(3)]  # reward_filter(0.5) keeps every one

    async def main() -> tuple[list[str], dict[str, float]]:
        await provision(run, nats_url)
        small = msgspec.structs.replace(run.cfg.nats, max_payload=1024)  # 12 exps: 4 parts
        async with (
            await Bus.connect(nats_url, run.names, run.cfg.nats, "producer") as producer,
            await Bus.connect(nats_url, run.names, small, "operator") as bus,
        ):
            for g in groups:
                await producer.publish_group("raw", g, msg_id=f"raw-{g[0].eid.task}")
            failed = flaky_publish(bus, "train")
            pipeline = ExperiencePipeline([EXPERIENCE_OPERATORS.get("reward_filter")(0.5)])
            host = OperatorHost(
                bus, pipeline, from_stage="raw", to_stage="train", retry_backoff=0.05
            )
            async with anyio.create_task_group() as tg:
                tg.start_soon(host.run)
                await wait_drained(
                    producer.transport.js, run.names.exp_stream, host.durable, timeout=120
                )
                tg.cancel_scope.cancel()
            return failed, dict(host.counters)

    failed, counters = anyio.run(main, backend="asyncio")
    assert len(failed) == FAILS * len(groups)
    assert counters["publish_failures"] >= FAILS and counters["dead_lettered_messages"] == 0

    async def check() -> None:
        assert await read_stream(nats_url, "rft.itest.dlq.>") == []  # nothing dead-lettered
        train = await read_stream(nats_url, run.names.exp_subject("train"))
        assert len(train) == 4 * len(groups)  # every part, once
        uids = _stored_once(train)
        assert sorted(uids) == sorted(e.eid.uid for g in groups for e in g)
        metrics = await read_metrics(nats_url, "rft.itest.metrics.operator")
        assert sum(r.values.get("operator/publish_failures", 0) for r in metrics) >= FAILS

    anyio.run(check, backend="asyncio")


def test_explorer_publishes_the_same_group_again_after_a_publish_failure(
    tmp_path: Path, tiny_model_path: str, nats_url: str
) -> None:
    rows = [{"question": f"{a}+{b}=", "answer": str(a + b)} for a, b in [(1, 2), (3, 4), (2, 5)]]
    data = tmp_path / "tasks.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = small_config(tmp_path, tiny_model_path)
    cfg["mode"] = "explore"
    cfg["buffer"] = {
        "batch_size": 3,
        "explorer_input": {"taskset": {"path": str(data), "rollout_args": {"max_tokens": 6}}},
    }
    cfg["algorithm"]["repeat_times"] = 8
    cfg["explorer"]["max_timeout"] = 120
    run = prepare_run(config_from_dict(cfg))

    async def main() -> tuple[list[str], list]:
        await provision(run, nats_url)
        small = msgspec.structs.replace(run.cfg.nats, max_payload=2048)  # a group: parts
        async with await Bus.connect(nats_url, run.names, small, "explorer") as bus:
            failed = flaky_publish(bus, "raw")
            explorer = Explorer(run.cfg, bus, model_path=run.model_path)
            with anyio.fail_after(240):
                await explorer.run()
            assert explorer.failed_tasks == 0 and explorer.published_groups == len(rows)
        return failed, await read_stream(nats_url, run.names.exp_subject("raw"))

    failed, raw = anyio.run(main, backend="asyncio")
    assert failed, "no group was split into parts: the test checks nothing"
    assert len(failed) == FAILS * len({f for f in failed})

    async def check() -> None:
        assert await read_stream(nats_url, "rft.itest.dlq.>") == []
        uids = _stored_once(raw)
        assert len(uids) == len(set(uids)) == 8 * len(rows)  # every task's group, whole
        by_task = Counter(e.info["task_index"] for m in raw for e in decode_group(m.data))
        assert by_task == {i: 8 for i in range(len(rows))}
        metrics = await read_metrics(nats_url, "rft.itest.metrics.explorer")
        assert sum(r.values.get("rollout/publish_failures", 0) for r in metrics) == len(failed)

    anyio.run(check, backend="asyncio")
