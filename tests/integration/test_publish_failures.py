"""A publish that fails for NATS reasons (a timeout after the bus's own retries, a 503) loses
nothing and dead-letters nothing, against a real nats-server: the explorer publishes the same
group again. It publishes split groups, and the failure hits a group's second part, so the
first part is already stored when it fails: the retry's same ``Nats-Msg-Id`` s make every
part land once (the server's deduplication). The operator host's side runs on the in-memory
transport in tests/unit/test_operator_host_failures.py.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import anyio
import msgspec
import pytest

from rftstream.actors.explorer import Explorer
from rftstream.bus.client import Bus
from rftstream.config import config_from_dict
from rftstream.experience import decode_group
from rftstream.runtime import prepare_run, provision
from tests.integration._util import read_metrics, read_stream, small_config
from tests.unit._publish_faults import FAILS, flaky_publish, stored_once

pytestmark = pytest.mark.integration


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
            explorer = Explorer(run.cfg, bus, resolved=run.resolved, model_path=run.model_path)
            with anyio.fail_after(240):
                await explorer.run()
            assert explorer.failed_tasks == 0 and explorer.published_groups == len(rows)
        return failed, await read_stream(nats_url, run.names.exp_subject("raw"))

    failed, raw = anyio.run(main, backend="asyncio")
    assert failed, "no group was split into parts: the test checks nothing"
    assert len(failed) == FAILS * len({f for f in failed})

    async def check() -> None:
        assert await read_stream(nats_url, "rft.itest.dlq.>") == []
        uids = stored_once(raw)
        assert len(uids) == len(set(uids)) == 8 * len(rows)  # every task's group, whole
        by_task = Counter(e.info["task_index"] for m in raw for e in decode_group(m.data))
        assert by_task == {i: 8 for i in range(len(rows))}
        metrics = await read_metrics(nats_url, "rft.itest.metrics.explorer")
        assert sum(r.values.get("rollout/publish_failures", 0) for r in metrics) == len(failed)

    anyio.run(check, backend="asyncio")
