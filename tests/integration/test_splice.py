"""Splicing the seeds' RewardFilter in front of the trainer of a running job.

From the cut on, the trainer reads only what the filter passed, and every
raw experience is accounted for exactly once: trained, filtered or
dead-lettered.
"""

from __future__ import annotations

import functools
import json
import threading
import time
from pathlib import Path

import anyio
import msgspec
import nats
import nats.js.errors
import pytest

from rftstream.bus.state import RunState
from rftstream.config import config_from_dict
from rftstream.experience import decode_group
from rftstream.messages import MetricsMsg
from rftstream.plugins import load_plugins
from rftstream.runtime import prepare_run, run_actors, run_operator, splice_in
from tests.integration._util import read_stream, small_config
from tests.integration.test_seed_plugins import REWARD_FILTER

pytestmark = pytest.mark.integration

THRESHOLD = 0.5


def _config(tmp_path: Path, tiny_model_path: str) -> dict:
    cfg = small_config(tmp_path, tiny_model_path)
    cfg["name"] = "splice"
    cfg["buffer"].update({"batch_size": 4, "total_steps": None, "total_epochs": 1})
    cfg["synchronizer"] = {"sync_method": "memory", "sync_style": "dynamic_by_explorer"}
    return cfg


async def _trainer_step(url: str, run) -> int:
    nc = await nats.connect(url)
    try:
        kv = await nc.jetstream().key_value(run.names.kv_bucket)
        return await RunState(kv).trainer_step()
    except nats.js.errors.BucketNotFoundError:
        return 0  # not provisioned yet
    finally:
        await nc.close()


async def _count(url: str, subject: str) -> int:
    return sum(len(decode_group(m.data)) for m in await read_stream(url, subject))


def test_spliced_reward_filter_gates_the_trainer_and_counts_add_up(
    tmp_path: Path, tiny_model_path: str, nats_url: str
) -> None:
    plugin_dir = tmp_path / "plugins"
    plugin_dir.mkdir()
    (plugin_dir / "reward_filter.py").write_text(REWARD_FILTER)
    load_plugins([plugin_dir])
    from operators import EXPERIENCE_OPERATORS, ExperiencePipeline

    run = prepare_run(config_from_dict(_config(tmp_path, tiny_model_path)))
    steps: list[dict] = []
    errors: list[BaseException] = []

    def run_job() -> None:
        try:
            anyio.run(functools.partial(run_actors, run, nats_url, on_step=steps.append))
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    job = threading.Thread(target=run_job)
    job.start()
    deadline = time.monotonic() + 120
    while anyio.run(_trainer_step, nats_url, run) < 2:
        assert job.is_alive() and time.monotonic() < deadline, errors
        time.sleep(0.2)

    async def operator() -> None:
        cut = await splice_in(run, nats_url, "reward_filter", "filtered")
        assert (cut.from_stage, cut.to_stage) == ("train", "filtered") and cut.start_seq > 1
        pipeline = ExperiencePipeline([EXPERIENCE_OPERATORS.get("reward_filter")(THRESHOLD)])
        with anyio.fail_after(240):
            await run_operator(
                run,
                nats_url,
                "reward-filter",
                pipeline=pipeline,
                from_stage=cut.from_stage,
                to_stage=cut.to_stage,
                start_seq=cut.start_seq,
            )

    anyio.run(operator)
    job.join(timeout=240)
    assert not job.is_alive() and not errors, errors

    records = [json.loads(x) for x in (run.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert records and records[-1]["step"] > 2
    sources = [
        (r.get("experience/trained_from/train", 0), r.get("experience/trained_from/filtered", 0))
        for r in records
    ]
    # the cut: once a step is all from the filter's stage, the trainer never reads exp.train again
    first_all_filtered = next(i for i, (old, new) in enumerate(sources) if new and not old)
    assert all(old == 0 for old, _ in sources[first_all_filtered:])
    assert any(old for old, _ in sources[:first_all_filtered])  # it did read exp.train before
    for r, (old, _new) in zip(records, sources, strict=True):
        if old == 0:
            assert r["reward/train_min"] >= THRESHOLD, r

    async def accounts() -> tuple[int, int, int, int]:
        raw = await _count(nats_url, "rft.splice.exp.raw")
        dlq = await _count(nats_url, "rft.splice.dlq.>")
        filtered = 0
        for m in await read_stream(nats_url, "rft.splice.metrics.>"):
            msg = msgspec.json.decode(m.data, type=MetricsMsg)
            if msg.role == "operator":
                filtered += int(msg.values.get("operator/experiences_filtered", 0))
        passed = await _count(nats_url, "rft.splice.exp.filtered")
        return raw, dlq, filtered, passed

    raw, dlq, filtered, passed = anyio.run(accounts)
    trained = records[-1]["experience/trained_total"]
    assert filtered > 0 and passed > 0
    assert raw == trained + filtered + dlq, (raw, trained, filtered, dlq)
    # everything the filter passed was trained, nothing twice
    assert sum(new for _, new in sources) == passed
    assert all(r["experience/duplicates_dropped"] == 0 for r in records)
