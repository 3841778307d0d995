"""When the trainer writes resumable checkpoints, in process against a real nats-server:
by time (``trainer.save_interval_seconds``) with the step trigger off; when the trained
messages it holds for the next checkpoint reach a quarter of a stream limit (a long time
trigger must not stall explorers on a full stream); on cancel (SIGINT / SIGTERM), its last
completed step, its held messages acked after it. A trainer restarted in a run without a
checkpoint moves the earlier trainer's step records aside."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import anyio
import nats
import pytest

from rftstream.actors.trainer import Trainer, held_limits
from rftstream.bus.client import Bus
from rftstream.bus.state import RunState
from rftstream.config import config_from_dict
from rftstream.experience import decode_group
from rftstream.runtime import prepare_run, run_actors
from rftstream.wire import TRAINER_STEP, WEIGHTS_PENDING, WeightsPending
from tests.integration._util import read_kv, read_stream, run_actors_to_end, small_config

pytestmark = pytest.mark.integration


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _kv(url: str, run: str) -> dict[str, Any]:
    return anyio.run(read_kv, url, f"rft_{run}_state", backend="asyncio")


def _acked_and_fully_trained(url: str, run: str, trained: set[str]) -> tuple[int, int]:
    """Messages of exp.train the trainer acked, and those whose experiences were all trained."""

    async def read() -> tuple[int, int]:
        msgs = await read_stream(url, f"rft.{run}.exp.train")
        nc = await nats.connect(url)
        info = await nc.jetstream().consumer_info(f"RFT_{run.upper()}_EXP", "trainer")
        await nc.close()
        groups = [{e.eid.uid for e in decode_group(m.data)} for m in msgs]
        acked = len(msgs) - int(info.num_pending or 0) - int(info.num_ack_pending or 0)
        return acked, sum(1 for g in groups if g <= trained)

    return anyio.run(read, backend="asyncio")


def test_the_time_trigger_writes_resumable_checkpoints_without_a_step_interval(
    tmp_path: Path, tiny_model_path: str, nats_url: str
) -> None:
    data = small_config(
        tmp_path,
        tiny_model_path,
        name="timeckpt",
        buffer__total_steps=3,
        trainer__save_interval=0,
        trainer__save_interval_seconds=0.01,
    )
    run = prepare_run(config_from_dict(data))
    steps = run_actors_to_end(run, nats_url, timeout=120)
    assert [r["step"] for r in steps] == [1, 2, 3]
    # every step is 10 ms past the previous checkpoint; the last is the end's
    assert [r.get("checkpoint/trigger") for r in steps] == ["time", "time", "end"]
    assert all(r["checkpoint/seconds"] > 0 for r in steps)
    lines = _lines(run.run_dir / "metrics.jsonl")
    assert [r["checkpoint/trigger"] for r in lines] == ["time", "time", "end"]
    kv = _kv(nats_url, "timeckpt")
    assert kv["trainer.checkpoint"]["step"] == 3
    ckpts = run.run_dir / "checkpoints"
    assert sorted(p.name for p in (ckpts / "resume").glob("global_step_*")) == [
        "global_step_2",
        "global_step_3",
    ]
    # the HF checkpoints stay tied to save_interval (off) and the end
    assert sorted(p.name for p in ckpts.glob("global_step_*")) == ["global_step_3"]
    assert kv["trainer.trained_unacked"]["trained"] == kv["trainer.trained_unacked"]["acked"]


def test_held_messages_trigger_a_checkpoint_before_the_stream_fills(
    tmp_path: Path, tiny_model_path: str, nats_url: str
) -> None:
    # a tiny message limit: explorers stop publishing at 80% of 16 messages. Held for the
    # default 600 s time trigger, the trained messages would fill it and the run would
    # stall; a quarter of it (4 messages) triggers a checkpoint instead
    data = small_config(
        tmp_path,
        tiny_model_path,
        name="heldckpt",
        buffer__total_steps=8,
        nats__streams__experience__max_msgs=16,
        nats__streams__experience__keep_acked_msgs=0,
    )
    cfg = config_from_dict(data)
    assert cfg.trainer.save_interval_seconds == 600.0 and cfg.trainer.save_interval == 0
    assert held_limits(cfg) == (4, int(0.25 * cfg.nats.streams.experience.max_bytes))
    run = prepare_run(cfg)
    steps = run_actors_to_end(run, nats_url, timeout=120)
    assert [r["step"] for r in steps] == list(range(1, 9))
    triggers = [r.get("checkpoint/trigger") for r in steps]
    assert "held" in triggers and "time" not in triggers and triggers[-1] == "end", triggers
    kv = _kv(nats_url, "heldckpt")
    assert kv["trainer.checkpoint"]["step"] == 8
    assert kv["trainer.trained_unacked"]["trained"] == kv["trainer.trained_unacked"]["acked"]


def test_a_cancelled_trainer_checkpoints_its_last_completed_step(
    tmp_path: Path, tiny_model_path: str, nats_url: str
) -> None:
    # the defaults: no step interval, a 600 s time trigger, so no checkpoint before the cancel
    data = small_config(tmp_path, tiny_model_path, name="cancelckpt", buffer__total_steps=40)
    run = prepare_run(config_from_dict(data))
    seen: list[int] = []

    async def main() -> None:
        with anyio.fail_after(120), anyio.CancelScope() as scope:

            def on_step(record: dict[str, Any]) -> None:
                seen.append(record["step"])
                if record["step"] >= 2:
                    scope.cancel()  # as SIGINT / SIGTERM cancel the actors' task group

            await run_actors(run, nats_url, on_step=on_step)

    started = time.monotonic()
    anyio.run(main, backend="asyncio")
    assert time.monotonic() - started < 120
    records = _lines(run.run_dir / "metrics.jsonl")
    last = records[-1]["step"]
    assert last >= 2 and [r["step"] for r in records] == list(range(1, last + 1))
    kv = _kv(nats_url, "cancelckpt")
    # the checkpoint of the last completed step is committed, its messages acked
    assert kv["trainer.checkpoint"]["step"] == last
    assert (run.run_dir / "checkpoints" / "resume" / f"global_step_{last}").is_dir()
    assert kv["trainer.done"]["status"] == "stopped" and kv["trainer.done"]["step"] == last
    held = kv["trainer.trained_unacked"]
    assert held["trained"] == held["acked"] > 0
    steps = _lines(run.run_dir / "trained_uids.jsonl")
    assert [s["step"] for s in steps] == list(range(1, last + 1))
    trained = {u for s in steps for u in s["uids"]}
    acked, fully_trained = _acked_and_fully_trained(nats_url, "cancelckpt", trained)
    assert acked == fully_trained > 0


@pytest.mark.parametrize("earlier", ["weights", "step", None])
def test_a_restart_without_a_checkpoint_moves_the_earlier_records_aside(
    tmp_path: Path, tiny_model_path: str, nats_url: str, earlier: str | None
) -> None:
    name = f"nockpt{earlier or 'first'}"
    run = prepare_run(config_from_dict(small_config(tmp_path, tiny_model_path, name=name)))
    run_dir = tmp_path / "trainer"
    run_dir.mkdir()
    old = [{"step": s, "reward/mean": 0.5} for s in (1, 2, 3)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in old))
    (run_dir / "trained_uids.jsonl").write_text(
        "".join(json.dumps({"step": s, "uids": [f"u{s}"]}) + "\n" for s in (1, 2, 3))
    )

    async def resume() -> Trainer:
        async with await Bus.connect(nats_url, run.names, run.cfg.nats, "t") as bus:
            state = RunState(await bus.kv())
            if earlier == "weights":  # a trainer stepped and published, never checkpointed
                await state.put(WEIGHTS_PENDING, WeightsPending(version=3, incarnation=0, ts=0))
            elif earlier == "step":  # a trainer stepped without publishing weights yet
                await state.put(TRAINER_STEP, 3)
            trainer = Trainer(
                run.cfg, bus, model_path=run.model_path, resolved=run.resolved, run_dir=run_dir
            )
            await trainer._resume(state, None, None)  # no checkpoint: neither is touched
            return trainer

    trainer = anyio.run(resume, backend="asyncio")
    assert trainer.step == 0
    metrics, discarded = run_dir / "metrics.jsonl", run_dir / "metrics.discarded.jsonl"
    if earlier is None:  # a first start: nothing of an earlier trainer in KV, nothing moved
        assert trainer.incarnation == 0
        assert _lines(metrics) == old and not discarded.exists()
        return
    assert trainer.incarnation == (1 if earlier == "weights" else 0)
    assert _lines(metrics) == [] and _lines(discarded) == old
    assert _lines(run_dir / "trained_uids.jsonl") == []
    assert [s["step"] for s in _lines(run_dir / "trained_uids.discarded.jsonl")] == [1, 2, 3]
