"""Explorer → operator → trainer over a real nats-server with the tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import anyio
import msgspec
import pytest

from rftstream.bus.client import Bus
from rftstream.bus.state import RunState
from rftstream.config import config_from_dict
from rftstream.experience import EID, Experience, decode_group
from rftstream.runtime import prepare_run, provision, run_operator, run_trainer
from rftstream.wire import H_DLQ_REASON, H_DLQ_STAGE
from tests.integration._util import (
    _group,
    operate_until_drained,
    read_experiences,
    read_kv,
    read_stream,
    run_actors_to_end,
    small_config,
)

pytestmark = pytest.mark.integration


def test_explorer_operator_trainer_steps(
    tmp_path: Path, tiny_model_path: str, nats_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    data = small_config(tmp_path, tiny_model_path)
    run = prepare_run(config_from_dict(data))
    steps = run_actors_to_end(run, nats_url, timeout=240)
    assert [r["step"] for r in steps] == [1, 2]
    lines = [json.loads(x) for x in (run.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2]
    for r in lines:
        assert r["experience/trained"] == 8
        assert "staleness/mean" in r and "time/trainer_wait" in r
        assert r["actor/pg_loss"] == r["actor/pg_loss"]  # finite, not NaN
    assert lines[0]["reward/mean"] is not None
    assert (
        sum(r["reward/raw_count"] for r in lines) >= 8
    )  # raw rewards seen through exp.raw headers
    # the final checkpoint is an HF directory transformers can load
    from transformers import AutoModelForCausalLM

    ckpt = run.run_dir / "checkpoints" / "global_step_2"
    assert (ckpt / "model.safetensors").is_file()
    AutoModelForCausalLM.from_pretrained(ckpt)

    async def inspect() -> None:
        raw = await read_stream(nats_url, "rft.itest.exp.raw")
        train = await read_stream(nats_url, "rft.itest.exp.train")
        assert raw and train
        h = raw[0].headers
        for key in (
            "Rft-Schema",
            "Rft-Task",
            "Rft-Model-Version",
            "Rft-Count",
            "Rft-Reward-Mean",
            "Rft-Tokens",
            "Rft-Actor",
            "Nats-Msg-Id",
        ):
            assert key in h, key
        assert h["Rft-Count"] == "4"
        group = decode_group(train[0].data)
        assert len(group) == 4 and all(e.advantages is not None for e in group)
        async with await Bus.connect(nats_url, run.names, run.cfg.nats, "inspector") as bus:
            info = await bus.transport.js.stream_info(run.names.exp_stream)
            assert "experience" in (info.config.description or "")
            assert info.config.metadata and info.config.metadata["rft.run"] == "itest"
            cinfo = await bus.transport.js.consumer_info(run.names.exp_stream, "trainer")
            assert cinfo.config.metadata["rft.role"] == "trainer"
            state = RunState(await bus.kv())
            assert await state.status() == "finished"
            ptr = await state.latest_weights()
            assert (
                ptr is not None and ptr.version == 2 and ptr.method == "checkpoint" and ptr.sha256
            )

    anyio.run(inspect, backend="asyncio")
    check_status_cli(tmp_path, data, nats_url, capsys)


def check_status_cli(
    tmp_path: Path, data: dict, nats_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`rftstream status` of the finished run agrees with the KV bucket's raw records."""
    import time

    import yaml

    from rftstream.cli import main

    cfg_path = tmp_path / "status.yaml"
    cfg_path.write_text(yaml.safe_dump(data))

    kv = anyio.run(read_kv, nats_url, "rft_itest_state", backend="asyncio")
    t0 = time.time()
    capsys.readouterr()
    assert main(["status", "--json", "--config", str(cfg_path), "--nats-url", nats_url]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["run"] == "itest" and report["status"] == "finished"
    assert report["trainer"]["step"] == 2
    assert report["weights"]["version"] == 2 == kv["weights.latest"]["version"]
    assert report["trainer"]["version"] == kv["trainer.step"] == 2
    assert kv["heartbeat.trainer"]["version"] == 2  # the trainer's last heartbeat, at its end
    assert report["chain"] == "raw -> train -> trainer"
    [explorer] = report["explorers"]
    hb = kv["heartbeat.explorer"]
    assert explorer["name"] == "explorer"
    assert explorer["step"] == kv["explorer.explorer.step"] >= 1
    # the explorer's final heartbeat, written at its end: the step it was on (one the run's end
    # cut short is not recorded as done) and the weights it had
    assert kv["explorer.explorer.step"] <= hb["step"] <= kv["explorer.explorer.step"] + 1
    assert explorer["model_version"] == hb["model_version"]
    assert explorer["staleness"] == 2 - hb["model_version"]
    assert explorer["heartbeat_age"] == pytest.approx(t0 - hb["ts"], abs=5.0)
    roles = {h["actor"]: h["role"] for h in report["heartbeats"]}
    assert roles == {"explorer": "explorer", "operator": "operator", "trainer": "trainer"}
    for h in report["heartbeats"]:
        assert h["age"] >= 0 and h["age"] == pytest.approx(
            t0 - kv[f"heartbeat.{h['actor']}"]["ts"], abs=5.0
        )
    # the readable form says the same
    assert main(["status", "--config", str(cfg_path), "--nats-url", nats_url]) == 0
    text = capsys.readouterr().out
    assert "trainer step 2" in text and "weights v2" in text and "raw -> train -> trainer" in text
    assert "explorer" in text and "heartbeats" in text


def test_same_msg_id_is_trained_once(tmp_path: Path, tiny_model_path: str, nats_url: str) -> None:
    """The same group published twice with one Nats-Msg-Id, and once more under another id
    (a redelivery), is trained once: stream dedup plus the trainer's eid dedup."""
    cfg = small_config(tmp_path, tiny_model_path, buffer__train_batch_size=4, buffer__total_steps=2)
    run = prepare_run(config_from_dict(cfg))
    steps: list[dict] = []

    async def main() -> None:
        await provision(run, nats_url)
        async with await Bus.connect(nats_url, run.names, run.cfg.nats, "producer") as bus:
            a = _group(1, 1.0)
            assert await bus.publish_group("train", a, msg_id="dup-a") == 1
            assert (
                await bus.publish_group("train", a, msg_id="dup-a") == 0
            )  # deduplicated by the stream
            assert (
                await bus.publish_group("train", a, msg_id="dup-a-again") == 1
            )  # stored, dropped by the trainer
            assert await bus.publish_group("train", _group(2, 0.0), msg_id="b") == 1
        with anyio.fail_after(120):
            await run_trainer(run, nats_url, on_step=steps.append)

    anyio.run(main, backend="asyncio")
    assert [r["step"] for r in steps] == [1, 2]
    assert steps[0]["reward/train_mean"] == 1.0
    assert steps[1]["reward/train_mean"] == 0.0  # not group A a second time
    assert steps[1]["experience/duplicates_dropped"] == 4
    assert steps[1]["experience/trained_total"] == 8


def test_malformed_message_is_dead_lettered_and_run_goes_on(
    tmp_path: Path, tiny_model_path: str, nats_url: str
) -> None:
    run = prepare_run(config_from_dict(small_config(tmp_path, tiny_model_path)))

    async def main() -> None:
        await provision(run, nats_url)
        async with await Bus.connect(nats_url, run.names, run.cfg.nats, "producer") as bus:
            await bus.publish(
                run.names.exp_subject("raw"), b"\x00not msgpack at all", msg_id="garbage-1"
            )
            await bus.publish_group("raw", _group(3, 1.0) + _group(3, 0.0)[:2], msg_id="good-1")
            async with anyio.create_task_group() as tg:
                tg.start_soon(run_operator, run, nats_url)
                with anyio.fail_after(60):
                    while True:
                        train = await bus.transport.js.stream_info(
                            run.names.exp_stream, subjects_filter=run.names.exp_subject("train")
                        )
                        dlq = await bus.transport.js.stream_info(run.names.dlq_stream)
                        if dlq.state.messages >= 1 and (train.state.subjects or {}).get(
                            run.names.exp_subject("train")
                        ):
                            break
                        await anyio.sleep(0.2)
                tg.cancel_scope.cancel()

    anyio.run(main, backend="asyncio")

    async def check() -> None:
        dead = await read_stream(nats_url, "rft.itest.dlq.>")
        assert len(dead) == 1
        assert dead[0].data == b"\x00not msgpack at all"
        assert dead[0].subject == "rft.itest.dlq.raw"
        assert "rft.experience.v1" in dead[0].headers[H_DLQ_REASON]
        assert dead[0].headers[H_DLQ_STAGE] == "raw"
        train = await read_stream(nats_url, "rft.itest.exp.train")
        assert len(train) == 1
        group = decode_group(train[0].data)
        assert len(group) == 6
        # GRPO advantage ran in the operator host: rewards 1,1,1,1,0,0 -> positive for 1s, negative for 0s
        assert all(float(e.advantages[0]) > 0 for e in group if e.reward == 1.0)
        assert all(float(e.advantages[0]) < 0 for e in group if e.reward == 0.0)

    anyio.run(check, backend="asyncio")


def test_group_split_into_parts_arrives_whole(
    tmp_path: Path, tiny_model_path: str, nats_url: str
) -> None:
    """A group over max_payload travels in parts; every part reaches exp.train (no id collisions)."""
    cfg = small_config(tmp_path, tiny_model_path)
    cfg["data_processor"] = {"experience_pipeline": {"batch_messages": 1}}
    run = prepare_run(config_from_dict(cfg))
    group = [
        Experience(
            tokens=list(range(2, 202)), prompt_length=100, reward=float(i % 2), eid=EID(0, 9, i)
        )
        for i in range(8)
    ]

    async def main() -> None:
        await provision(run, nats_url)
        small = msgspec.structs.replace(run.cfg.nats, max_payload=3000)
        async with await Bus.connect(nats_url, run.names, small, "producer") as bus:
            stored = await bus.publish_group("raw", group, msg_id="big")
            assert stored >= 4  # split into parts
            await operate_until_drained(run, nats_url, bus, timeout=60)

    anyio.run(main, backend="asyncio")

    async def check() -> None:
        train = await read_experiences(nats_url, "rft.itest.exp.train")
        assert sorted(e.eid.uid for e in train) == sorted(e.eid.uid for e in group)

    anyio.run(check, backend="asyncio")


def test_max_staleness_with_a_dropping_filter_does_not_deadlock(
    tmp_path: Path, tiny_model_path: str, nats_url: str
) -> None:
    """Filters that drop most experience must not stall the run under max_staleness."""
    cfg = small_config(tmp_path, tiny_model_path, buffer__train_batch_size=8, buffer__total_steps=2)
    cfg["synchronizer"]["max_staleness"] = 0
    cfg["buffer"]["batch_size"] = 4
    cfg["data_processor"] = {
        "experience_pipeline": {
            "operators": [{"name": "reward_filter", "args": {"threshold": 1.0}}]
        }
    }
    run = prepare_run(config_from_dict(cfg))
    steps = run_actors_to_end(run, nats_url, timeout=240)
    assert [r["step"] for r in steps] == [1, 2]
    assert sum(r["experience/filtered"] for r in steps) > 0
    assert all(r["reward/train_mean"] == 1.0 for r in steps)


def test_untrainable_experience_is_dead_lettered_not_crash_looped(
    tmp_path: Path, tiny_model_path: str, nats_url: str
) -> None:
    cfg = small_config(tmp_path, tiny_model_path, buffer__train_batch_size=4, buffer__total_steps=2)
    run = prepare_run(config_from_dict(cfg))
    steps: list[dict] = []
    bad = [
        Experience(tokens=[5, 6, 10**6, 8], prompt_length=2, reward=1.0, eid=EID(0, 7, i))
        for i in range(4)
    ]

    async def main() -> None:
        await provision(run, nats_url)
        async with await Bus.connect(nats_url, run.names, run.cfg.nats, "producer") as bus:
            await bus.publish_group("train", _group(1, 1.0), msg_id="good-1")
            await bus.publish_group("train", bad, msg_id="bad")
            await bus.publish_group("train", _group(2, 0.0), msg_id="good-2")
        with anyio.fail_after(120):
            await run_trainer(run, nats_url, on_step=steps.append)

    anyio.run(main, backend="asyncio")
    assert [r["step"] for r in steps] == [1, 2]
    assert [r["reward/train_mean"] for r in steps] == [1.0, 0.0]

    async def check() -> None:
        dead = await read_stream(nats_url, "rft.itest.dlq.train")
        assert len(dead) == 1 and "vocabulary" in dead[0].headers[H_DLQ_REASON]
        assert decode_group(dead[0].data)[0].eid.uid == bad[0].eid.uid

    anyio.run(check, backend="asyncio")
