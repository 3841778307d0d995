"""A trainer process SIGKILLed between two checkpoints and started again with the same
command resumes from the last checkpoint: the run finishes, steps are continuous, every
experience is trained once (the killed process's steps after the checkpoint are redone
from redelivered messages; their records move to ``*.discarded.jsonl``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import anyio
import nats
import pytest

from rftstream.experience import decode_group
from tests.integration._util import (
    actor_config,
    read_stream,
    user_env,
    wait_processes,
    write_config,
)
from tests.integration.test_separate_processes import CLI, hand_started_server  # noqa: F401

pytestmark = pytest.mark.integration

STEPS = 8
EVERY = 4  # trainer.save_interval


def _config(tmp_path: Path, tiny_model_path: str) -> Path:
    # max_staleness 0 with save_interval 4: trained messages held for the checkpoint
    # must not count as backlog, or the explorer waits forever
    cfg = actor_config(
        tmp_path,
        tiny_model_path,
        "resume",
        steps=STEPS,
        max_staleness=0,
        trainer__save_interval=EVERY,
        nats__ack_wait=4.0,
    )
    return write_config(cfg, tmp_path / "resume.yaml")


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def test_a_killed_trainer_resumes_and_trains_every_experience_once(
    tmp_path: Path,
    tiny_model_path: str,
    hand_started_server: str,  # noqa: F811
) -> None:
    cfg = _config(tmp_path, tiny_model_path)
    env = user_env(tiny_model_path)
    run_dir = tmp_path / "trainer"
    logs = {r: tmp_path / f"{r}.log" for r in ("trainer", "trainer2", "operator", "explorer")}

    def start(role: str, log_name: str) -> subprocess.Popen:
        with open(logs[log_name], "w") as log:
            return subprocess.Popen(
                [*CLI, role, "--config", str(cfg), "--nats-url", hand_started_server]
                + ["--run-dir", str(tmp_path / role), "--log-level", "INFO"],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
            )

    procs = {"trainer": start("trainer", "trainer")}
    procs["operator"] = start("operator", "operator")
    procs["explorer"] = start("explorer", "explorer")
    metrics = run_dir / "metrics.jsonl"
    try:
        deadline = time.time() + 300
        uids = run_dir / "trained_uids.jsonl"  # written after metrics.jsonl, per step
        while time.time() < deadline and not any(r["step"] > EVERY for r in _lines(uids)):
            assert procs["trainer"].poll() is None, logs["trainer"].read_text()[-4000:]
            time.sleep(0.02)
        # past the checkpoint of step EVERY, before the one of step 2 * EVERY
        os.kill(procs["trainer"].pid, signal.SIGKILL)
        procs["trainer"].wait(timeout=10)
        killed_at = max(r["step"] for r in _lines(metrics))
        assert killed_at < 2 * EVERY, "the kill came too late to land between two checkpoints"
        procs["trainer2"] = start("trainer", "trainer2")  # the same command again
        del procs["trainer"]
        wait_processes(procs, logs)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
    resumed_log = logs["trainer2"].read_text()
    assert f"resumed from the checkpoint of step {EVERY}" in resumed_log, resumed_log[-3000:]

    records = _lines(metrics)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert [r["step"] for r in _lines(run_dir / "metrics.discarded.jsonl")] == list(
        range(EVERY + 1, killed_at + 1)
    )
    assert all(r["staleness/max"] >= 0 and r["staleness/mean"] >= 0 for r in records)
    assert records[-1]["experience/trained_total"] == sum(r["experience/trained"] for r in records)

    steps = _lines(run_dir / "trained_uids.jsonl")
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    trained = [u for s in steps for u in s["uids"]]
    assert len(trained) == len(set(trained)), "an experience was trained twice"
    assert len(trained) == records[-1]["experience/trained_total"]
    redone = {u for s in _lines(run_dir / "trained_uids.discarded.jsonl") for u in s["uids"]}
    assert redone and redone <= set(trained), "experience the killed trainer lost was not redone"

    async def consumer_and_stream() -> tuple[object, list, int]:
        msgs = await read_stream(hand_started_server, "rft.resume.exp.train")
        raw = len(await read_stream(hand_started_server, "rft.resume.exp.raw"))
        nc = await nats.connect(hand_started_server)
        info = await nc.jetstream().consumer_info("RFT_RESUME_EXP", "trainer")
        await nc.close()
        return info, msgs, raw

    info, msgs, raw_groups = anyio.run(consumer_and_stream, backend="asyncio")
    # the upstream figures (raw groups, their rewards) of the first resumed step start after
    # the checkpoint's step, not at the run's start: each raw group is counted once
    counted = sum(r["rollout/groups"] for r in records)
    assert 0 < counted <= raw_groups, (counted, raw_groups)
    assert records[EVERY]["rollout/groups"] < sum(r["rollout/groups"] for r in records[:EVERY])
    groups = [{e.eid.uid for e in decode_group(m.data)} for m in msgs]
    assert set(trained) <= set().union(*groups)
    fully_trained = sum(1 for g in groups if g <= set(trained))
    acked = len(msgs) - int(info.num_pending or 0) - int(info.num_ack_pending or 0)
    # every message whose experience was all trained is acked, and no other one
    assert acked == fully_trained, (acked, fully_trained, info)
    # the explorer took the restarted trainer's weights although their version was lower
    explorer_log = (tmp_path / "explorer" / "logs" / "rftstream.log").read_text()
    assert "of the restarted trainer (incarnation 1" in explorer_log, explorer_log[-3000:]
