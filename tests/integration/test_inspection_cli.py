"""`rftstream operator NAME --from --to`, `streams`, `tail` and `decode`, run as a user runs them."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import anyio
import pytest
import yaml

from rftstream.bus.client import Bus
from rftstream.bus.state import RunState
from rftstream.config import config_from_dict
from rftstream.experience import decode_group
from rftstream.runtime import prepare_run, provision
from tests.integration._util import (
    _group,
    read_metrics,
    read_stream,
    small_config,
    user_env,
    wait_drained,
)

pytestmark = pytest.mark.integration

CLI = [sys.executable, "-m", "rftstream.cli"]


def test_operator_name_from_to_then_streams_tail_decode(
    tmp_path: Path, tiny_model_path: str, nats_url: str
) -> None:
    cfg = small_config(tmp_path, tiny_model_path)
    cfg["synchronizer"]["sync_method"] = "checkpoint"
    cfg_path = tmp_path / "run.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    run = prepare_run(config_from_dict(cfg))
    common = ["--config", str(cfg_path), "--nats-url", nats_url]

    async def publish() -> None:
        await provision(run, nats_url)
        async with await Bus.connect(nats_url, run.names, run.cfg.nats, "producer") as bus:
            await bus.publish_group("raw", _group(1, 1.0), msg_id="g1")
            await bus.publish_group("raw", _group(2, 0.0), msg_id="g2")
            await bus.publish_group("raw", _group(3, 1.0)[:2] + _group(3, 0.0)[:2], msg_id="g3")

    anyio.run(publish, backend="asyncio")
    log = tmp_path / "op.log"
    with open(log, "w") as out:
        op = subprocess.Popen(
            [
                *CLI,
                "operator",
                "reward_filter",
                "--args",
                '{"threshold": 0.5}',
                "--from",
                "raw",
                "--to",
                "filtered",
                "--replicas",
                "2",
                *common,
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=user_env(tiny_model_path),
        )
    try:

        async def wait_and_finish() -> list:
            async with await Bus.connect(nats_url, run.names, run.cfg.nats, "checker") as bus:
                with anyio.fail_after(120):
                    while True:
                        assert op.poll() is None, log.read_text()[-3000:]
                        info = await bus.transport.js.stream_info(
                            run.names.exp_stream, subjects_filter=">"
                        )
                        if (info.state.subjects or {}).get("rft.itest.exp.filtered", 0) >= 2:
                            break
                        await anyio.sleep(0.3)
                # the stage's one durable (test_module_class_replicas_share_one_durable
                # shows both replicas take work from it)
                c = await bus.transport.js.consumer_info(run.names.exp_stream, "op_raw_to_filtered")
                assert c.config.filter_subject == "rft.itest.exp.raw"
                await RunState(await bus.kv()).set_status("finished")
            return await read_stream(nats_url, "rft.itest.exp.filtered")

        filtered = anyio.run(wait_and_finish, backend="asyncio")
        op.wait(timeout=30)
        assert op.returncode == 0, log.read_text()[-3000:]
    finally:
        if op.poll() is None:
            op.kill()
    exps = [e for m in filtered for e in decode_group(m.data)]
    assert len(filtered) == 2 and len(exps) == 6 and all(e.reward == 1.0 for e in exps)

    env = user_env(tiny_model_path)
    # a reader that stays: `tail` follows exp.raw through an ephemeral (ordered) consumer
    tail_log = tmp_path / "tail.log"
    with open(tail_log, "w") as out:
        follower = subprocess.Popen(
            [*CLI, "tail", "raw", "--json", *common], stdout=out, stderr=subprocess.STDOUT, env=env
        )
    try:
        deadline = time.monotonic() + 60
        while len(tail_log.read_text().splitlines()) < 3:
            assert follower.poll() is None and time.monotonic() < deadline, tail_log.read_text()
            time.sleep(0.2)
        streams = subprocess.run(
            [*CLI, "streams", "--json", *common],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
        )
        human = subprocess.run(  # wide enough that no cell folds
            [*CLI, "streams", *common],
            capture_output=True,
            text=True,
            timeout=60,
            env={**env, "COLUMNS": "300"},
        )
    finally:
        follower.kill()
        follower.wait(timeout=30)
    assert streams.returncode == 0, streams.stderr
    report = {r["name"]: r for r in json.loads(streams.stdout)["streams"]}
    assert set(report) == {
        "RFT_ITEST_TASKS",
        "RFT_ITEST_EXP",
        "RFT_ITEST_DLQ",
        "RFT_ITEST_METRICS",
        "RFT_ITEST_WEIGHTS",
    }
    exp = report["RFT_ITEST_EXP"]
    assert exp["subjects"] == {"rft.itest.exp.raw": 3, "rft.itest.exp.filtered": 2}
    consumers = {c["name"]: c for c in exp["consumers"]}
    assert (
        consumers["op_raw_to_filtered"]["pending"] == 0
        and consumers["op_raw_to_filtered"]["ack_pending"] == 0
    )
    assert (
        consumers["op_raw_to_train"]["pending"] == 3
    )  # nobody ran the configured pipeline: its lag
    # every consumer says who reads: the durables, and the tail's ephemeral reader
    # every consumer of the run says who reads: the durables, and the tail's ephemeral reader
    # (the test's own read of exp.filtered above, plain nats-py, is the one without)
    assert all(c["description"] for c in exp["consumers"] if c["durable"]), exp["consumers"]
    (ephemeral,) = [
        c for c in exp["consumers"] if c["filter"].endswith(".raw") and not c["durable"]
    ]
    assert ephemeral["description"].startswith("rftstream tail of run itest"), ephemeral
    assert human.returncode == 0 and "RFT_ITEST_EXP" in human.stdout and "consumers" in human.stdout
    assert "(ephemeral)" in human.stdout and "rftstream tail of run itest" in human.stdout

    tail = subprocess.run(
        [*CLI, "tail", "filtered", "--no-follow", "--json", "-n", "1", *common],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert tail.returncode == 0, tail.stderr
    lines = [json.loads(x) for x in tail.stdout.splitlines() if x.strip()]
    assert len(lines) == 1  # only the latest
    assert (
        lines[0]["subject"] == "rft.itest.exp.filtered"
        and lines[0]["count"] == 2
        and lines[0]["reward_mean"] == 1.0
    )

    body = filtered[0].data
    dec = subprocess.run([*CLI, "decode"], input=body, capture_output=True, timeout=60, env=env)
    assert dec.returncode == 0
    summary = json.loads(dec.stdout)
    assert (
        summary["schema"] == "rft.experience.v1"
        and summary["count"] == 4
        and summary["rewards"] == [1.0] * 4
    )
    bad = subprocess.run(
        [*CLI, "decode"], input=b"\x01garbage", capture_output=True, timeout=60, env=env
    )
    assert bad.returncode == 1 and "undecodable" in json.loads(bad.stdout)


BOTH_REPLICAS = """
import threading

from operators import ExperienceOperator

_BARRIER = threading.Barrier(2, timeout=60)


class BothReplicas(ExperienceOperator):
    \"\"\"Each replica's first batch waits for the other replica's first batch: it passes
    only if both replicas were given messages from the shared durable.\"\"\"

    def __init__(self, keep_min: float = 0.0) -> None:
        self.keep_min = keep_min
        self.first = True

    def process(self, exps):
        if self.first:
            self.first = False
            _BARRIER.wait()
        return [e for e in exps if e.reward >= self.keep_min], {"seen": len(exps)}
"""


def test_module_class_replicas_share_one_durable(
    tmp_path: Path, tiny_model_path: str, nats_url: str
) -> None:
    """`rftstream operator module:Class --replicas 2`: one durable, both replicas consume it."""
    mod = tmp_path / "mods"
    mod.mkdir()
    (mod / "my_ops.py").write_text(BOTH_REPLICAS)
    cfg = small_config(tmp_path, tiny_model_path)
    cfg["data_processor"] = {"experience_pipeline": {"batch_messages": 1}}
    cfg_path = tmp_path / "run.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    run = prepare_run(config_from_dict(cfg))
    groups = [_group(i, float(i % 2)) for i in range(6)]

    async def publish() -> None:
        await provision(run, nats_url)
        async with await Bus.connect(nats_url, run.names, run.cfg.nats, "producer") as bus:
            for i, g in enumerate(groups):
                await bus.publish_group("raw", g, msg_id=f"g{i}")

    anyio.run(publish, backend="asyncio")
    env = user_env(tiny_model_path)
    env["PYTHONPATH"] = str(mod) + ":" + env.get("PYTHONPATH", "")
    log = tmp_path / "op.log"
    with open(log, "w") as out:
        op = subprocess.Popen(
            [
                *CLI,
                "operator",
                "my_ops:BothReplicas",
                "--args",
                '{"keep_min": 0.5}',
                "--from",
                "raw",
                "--to",
                "kept",
                "--replicas",
                "2",
                "--name",
                "both",
                "--config",
                str(cfg_path),
                "--nats-url",
                nats_url,
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
    try:

        def alive() -> None:
            assert op.poll() is None, log.read_text()[-3000:]

        async def wait_and_finish() -> None:
            async with await Bus.connect(nats_url, run.names, run.cfg.nats, "checker") as bus:
                # missing_ok: the process has not created the durable yet
                await wait_drained(
                    bus.transport.js,
                    run.names.exp_stream,
                    "op_raw_to_kept",
                    timeout=120,
                    missing_ok=True,
                    check=alive,
                )
                await RunState(await bus.kv()).set_status("finished")

        anyio.run(wait_and_finish, backend="asyncio")
        op.wait(timeout=60)
        assert op.returncode == 0, log.read_text()[-3000:]
    finally:
        if op.poll() is None:
            op.kill()

    async def check() -> None:
        async with await Bus.connect(nats_url, run.names, run.cfg.nats, "checker") as bus:
            infos = await bus.transport.js.consumers_info(run.names.exp_stream)
            # one consumer for this stage (besides the configured pipeline's own on exp.raw)
            mine = [c for c in infos if c.name not in ("op_raw_to_train", "trainer")]
            assert [c.name for c in mine] == ["op_raw_to_kept"]
            assert mine[0].config.filter_subject == "rft.itest.exp.raw"
            assert mine[0].delivered.consumer_seq == len(groups)  # each delivered once
        per_replica = {}
        for actor in ("both-0", "both-1"):
            records = await read_metrics(nats_url, f"rft.itest.metrics.{actor}")
            per_replica[actor] = sum(r.values["operator/messages_in"] for r in records)
        # both replicas processed messages from the shared durable, together all of them
        assert all(n >= 1 for n in per_replica.values()), per_replica
        assert sum(per_replica.values()) == len(groups)
        kept = [
            e
            for m in await read_stream(nats_url, "rft.itest.exp.kept")
            for e in decode_group(m.data)
        ]
        assert sorted(e.eid.uid for e in kept) == sorted(
            e.eid.uid for g in groups for e in g if e.reward >= 0.5
        )
        assert await read_stream(nats_url, "rft.itest.dlq.>") == []

    anyio.run(check, backend="asyncio")


def test_operator_errors_are_one_line_before_connecting(
    tmp_path: Path, tiny_model_path: str
) -> None:
    """A constructor that raises, and a class that is no operator: exit 2, one line, no
    traceback, and nothing connects (the NATS URL points nowhere)."""
    mod = tmp_path / "mods"
    mod.mkdir()
    (mod / "bad_ops.py").write_text(
        "class Plain:\n    def process(self, exps):\n        return exps, {}\n"
    )
    cfg_path = tmp_path / "run.yaml"
    cfg_path.write_text(yaml.safe_dump(small_config(tmp_path, tiny_model_path)))
    env = user_env(tiny_model_path)
    env["PYTHONPATH"] = str(mod) + ":" + env.get("PYTHONPATH", "")
    common = ["--to", "x", "--config", str(cfg_path), "--nats-url", "nats://127.0.0.1:9"]
    for operator, args, expected in [
        ("staleness_filter", '{"max_staleness": -3}', "operator 'staleness_filter'"),
        ("bad_ops:Plain", "{}", "Plain is not an ExperienceOperator"),
    ]:
        out = subprocess.run(
            [*CLI, "operator", operator, "--args", args, *common],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )
        assert out.returncode == 2, out.stdout + out.stderr
        lines = [x for x in out.stdout.splitlines() if x.strip()]
        errors = [x for x in lines if x.startswith("error:")]
        assert len(errors) == 1 and expected in errors[0], out.stdout
        assert "Traceback" not in out.stdout + out.stderr
