"""Splicing the seeds' RewardFilter in front of the trainer of a running job.

From the cut on, the trainer reads only what the filter passed, and every
raw experience is accounted for exactly once: trained, filtered or
dead-lettered. ``rftstream account`` says so too (BALANCED, exit 0) for a run
that ends spliced, with replicas, while acked experience is purged; and NOT
BALANCED (exit 1) once an experience is really lost.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import anyio
import nats
import nats.js.errors
import pytest
import yaml

from rftstream.bus.client import Bus
from rftstream.bus.jetstream import JetStreamTransport
from rftstream.bus.state import RunState
from rftstream.config import config_from_dict
from rftstream.errors import BucketNotFound
from rftstream.experience import decode_group
from rftstream.operations.account import RunAccount, account_run
from rftstream.plugins.loader import load_plugins
from rftstream.runtime import prepare_run, run_actors, run_operator, splice_in
from tests.integration._util import read_metrics, read_stream, small_config, user_env

# the seeds' RewardFilter operator, loaded as a user's plugin file
REWARD_FILTER = Path(__file__).parents[1] / "seed_plugins" / "reward_filter.py"

pytestmark = pytest.mark.integration

CLI = [sys.executable, "-m", "rftstream.cli"]

THRESHOLD = 0.5


def _config(tmp_path: Path, tiny_model_path: str) -> dict:
    cfg = small_config(tmp_path, tiny_model_path)
    cfg["name"] = "splice"
    cfg["buffer"].update({"batch_size": 4, "total_steps": None, "total_epochs": 1})
    # the explorer may not run far ahead of the trainer, or the trainer has fetched
    # everything before the cut (as in the CLI test below)
    cfg["synchronizer"] = {
        "sync_method": "memory",
        "sync_style": "dynamic_by_explorer",
        "max_staleness": 1,
    }
    # the accounts below count what the streams hold: nothing acked may be purged meanwhile
    cfg.setdefault("nats", {}).setdefault("streams", {})["experience"] = {"purge_acked": False}
    return cfg


async def _trainer_step(url: str, run) -> int:
    nc = await nats.connect(url)
    try:
        transport = JetStreamTransport(nc, retry_window=5.0, max_inflight_bytes=1 << 20)
        kv = await transport.kv(run.names.kv_bucket, create=False)
        return await RunState(kv).trainer_step()
    except BucketNotFound:
        return 0  # not provisioned yet
    finally:
        await nc.close()


async def _lose_one_group(url: str, run, trainer_durable: str) -> None:
    """Publish one group of 4 as if it had passed every stage (exp.raw, exp.train,
    exp.filtered), then take it from the trainer's durable and ack it without training it."""
    from tests.integration._util import _group

    group = _group(10_000, 1.0, 4)
    async with await Bus.connect(url, run.names, run.cfg.nats, "tamper") as bus:
        for stage in ("raw", "train", "filtered"):
            await bus.publish_group(stage, group, msg_id=f"lost-{stage}")
    nc = await nats.connect(url)
    try:
        sub = await nc.jetstream().pull_subscribe_bind(trainer_durable, run.names.exp_stream)
        for msg in await sub.fetch(1, timeout=10):
            await msg.ack_sync()
    finally:
        await nc.close()


async def _count(url: str, subject: str) -> int:
    return sum(len(decode_group(m.data)) for m in await read_stream(url, subject))


def test_spliced_reward_filter_gates_the_trainer_and_counts_add_up(
    tmp_path: Path, tiny_model_path: str, nats_url: str
) -> None:
    plugin_dir = tmp_path / "plugins"
    plugin_dir.mkdir()
    (plugin_dir / "reward_filter.py").write_text(REWARD_FILTER.read_text())
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

    check_gate_and_accounts(run, nats_url)

    async def account() -> RunAccount:
        async with await Bus.connect(nats_url, run.names, run.cfg.nats, "account") as bus:
            return await account_run(bus)

    # the run ended spliced: the account agrees with the streams
    acc = anyio.run(account)
    assert acc.balanced and acc.settled and not acc.problems, str(acc)
    assert acc.filtered > 0 and [s.trainer for s in acc.stages].count(True) == 2, str(acc)


def check_gate_and_accounts(run, nats_url: str, whole_streams: bool = True) -> None:
    """From the cut on the trainer reads only what passed; raw = trained + filtered +
    dead-lettered, counted from the streams (``whole_streams``: nothing was purged)."""
    records = [json.loads(x) for x in (run.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert records and records[-1]["step"] > 2
    sources = [
        (r.get("experience/trained_from/train", 0), r.get("experience/trained_from/filtered", 0))
        for r in records
    ]
    # the cut: once a step is all from the filter's stage, the trainer never reads exp.train again
    first_all_filtered = next((i for i, (old, new) in enumerate(sources) if new and not old), None)
    assert first_all_filtered is not None, (
        f"no step trained only from exp.filtered after the splice; (exp.train, exp.filtered) "
        f"per step: {sources}"
    )
    assert all(old == 0 for old, _ in sources[first_all_filtered:])
    assert any(old for old, _ in sources[:first_all_filtered])  # it did read exp.train before
    for r, (old, _new) in zip(records, sources, strict=True):
        if old == 0:
            assert r["reward/train_min"] >= THRESHOLD, r
    assert all(r["experience/duplicates_dropped"] == 0 for r in records)
    if not whole_streams:
        return

    async def accounts() -> tuple[int, int, int, int]:
        raw = await _count(nats_url, f"rft.{run.names.run}.exp.raw")
        dlq = await _count(nats_url, f"rft.{run.names.run}.dlq.>")
        filtered = 0
        for msg in await read_metrics(nats_url, f"rft.{run.names.run}.metrics.>"):
            if msg.role == "operator":
                filtered += int(msg.values.get("operator/experiences_filtered", 0))
        passed = await _count(nats_url, f"rft.{run.names.run}.exp.filtered")
        return raw, dlq, filtered, passed

    raw, dlq, filtered, passed = anyio.run(accounts)
    trained = records[-1]["experience/trained_total"]
    assert filtered > 0 and passed > 0
    assert raw == trained + filtered + dlq, (raw, trained, filtered, dlq)
    # everything the filter passed was trained, nothing twice
    assert sum(new for _, new in sources) == passed


def test_rftstream_operator_splice_against_a_running_up(
    tmp_path: Path, tiny_model_path: str, nats_url: str
) -> None:
    """The acceptance as a user runs it: `rftstream up`, then `rftstream operator --splice`."""
    plugin_dir = tmp_path / "plugins"
    plugin_dir.mkdir()
    (plugin_dir / "reward_filter.py").write_text(REWARD_FILTER.read_text())
    data = _config(tmp_path, tiny_model_path)
    data["name"] = "splicecli"
    # long enough for the operator process to start mid-run
    data["buffer"]["total_epochs"] = 4
    # acked experience is purged (keeping only the newest 8 of each stage, however young):
    # the account counts the purged part of exp.train from its record, split at the cut
    data["nats"]["streams"]["experience"] = {
        "purge_acked": True,
        "keep_acked_msgs": 8,
        "keep_acked_s": 0,
    }
    cfg_path = tmp_path / "run.yaml"
    cfg_path.write_text(yaml.safe_dump(data))
    run = prepare_run(config_from_dict(data))
    common = ["--config", str(cfg_path), "--nats-url", nats_url]
    env = user_env(tiny_model_path)
    with open(tmp_path / "up.log", "w") as out:
        up = subprocess.Popen([*CLI, "up", *common], stdout=out, stderr=subprocess.STDOUT, env=env)
    op = None
    try:
        deadline = time.monotonic() + 180
        while anyio.run(_trainer_step, nats_url, run) < 1:
            assert up.poll() is None, (tmp_path / "up.log").read_text()
            assert time.monotonic() < deadline, (tmp_path / "up.log").read_text()
            time.sleep(0.3)
        with open(tmp_path / "op.log", "w") as out:
            op = subprocess.Popen(
                [
                    *CLI,
                    "operator",
                    "reward_filter",
                    "--args",
                    json.dumps({"threshold": THRESHOLD}),
                    "--splice",
                    "--to",
                    "filtered",
                    "--replicas",
                    "2",
                    "--plugin-dir",
                    str(plugin_dir),
                    *common,
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
            )
        assert up.wait(timeout=300) == 0, (tmp_path / "up.log").read_text()
        assert op.wait(timeout=60) == 0, (tmp_path / "op.log").read_text()
    finally:
        for proc in (up, op):
            if proc is not None and proc.poll() is None:
                proc.kill()
    assert "spliced in: reads exp.train" in (tmp_path / "op.log").read_text()
    check_gate_and_accounts(run, nats_url, whole_streams=False)

    def account() -> tuple[int, dict]:
        out = subprocess.run(
            [*CLI, "account", "--json", *common], capture_output=True, text=True, env=env
        )
        assert out.returncode in (0, 1), out.stdout + out.stderr
        return out.returncode, json.loads(out.stdout)

    rc, doc = account()
    assert rc == 0 and doc["balanced"] and doc["settled"] and not doc["problems"], doc
    assert doc["filtered"] > 0 and doc["trained"] + doc["filtered"] == doc["explored"], doc
    rows = {(s["from"], s["to"]): s for s in doc["stages"]}
    assert rows[("train", "filtered")]["filtered"] == doc["filtered"]
    cut = rows[("train", "filtered")]["sequences"][0][0]
    assert rows[("train", "trained")]["sequences"] == [[0, cut]]
    # the purge passed the cut: its record split exp.train there
    assert doc["purged"]["train"]["below_seq"] > cut, doc["purged"]
    assert str(cut) in doc["purged"]["train"]["splits"], doc["purged"]

    # an experience the trainer acks and never trains is lost: NOT BALANCED, exit 1
    anyio.run(_lose_one_group, nats_url, run, rows[("filtered", "trained")]["durable"])
    rc, doc = account()
    assert rc == 1 and not doc["balanced"], doc
    assert any("lost" in p for p in doc["problems"]), doc["problems"]
