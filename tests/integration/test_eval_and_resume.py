"""Eval tasksets, mixed training tasksets and resuming explorers, on a real nats-server
with the tiny model."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from rftstream.actors.explorer import Explorer
from rftstream.bus.client import Bus
from rftstream.bus.state import RunState
from rftstream.config import config_from_dict
from rftstream.experience import decode_group
from rftstream.plugins.loader import load_plugins
from rftstream.runtime import PreparedRun, prepare_run, provision
from rftstream.subjects import KV_TASKSET_CLAIM
from rftstream.tasksets import TasksetPlan, plan_tasks
from rftstream.tiny_model import arithmetic_problems
from rftstream.wire import TaskMsg, TasksetClaim, encode_json
from tests.integration._util import (
    read_metrics,
    read_stream,
    run_actors_to_end,
    small_config,
    user_env,
)

pytestmark = pytest.mark.integration

PROBLEMS = [{"question": q, "answer": a} for q, a in arithmetic_problems()]

# A math workflow that logs every run ("<epoch> <index>") and, while the gate file
# exists, blocks every run after the first `block_after` ones: an explorer stuck mid-step.
GATED_PLUGIN = """
from pathlib import Path

import anyio

from workflows import WORKFLOWS
from workflows.math_workflow import MathWorkflow


@WORKFLOWS.register_module("gated_math")
class GatedMath(MathWorkflow):
    async def run_async(self):
        args = self.task.workflow_args
        log = Path(args["log"])
        with open(log, "a") as f:
            f.write(f"{self.task.epoch} {self.task.index}\\n")
        n = len(log.read_text().splitlines())
        while n > args["block_after"] and Path(args["gate"]).exists():
            await anyio.sleep(0.05)
        return await super().run_async()
"""


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


async def _run_explorer(run: PreparedRun, url: str, **kw: Any) -> Explorer:
    async with await Bus.connect(url, run.names, run.cfg.nats, "explorer") as bus:
        explorer = Explorer(run.cfg, bus, resolved=run.resolved, model_path=run.model_path, **kw)
        await explorer.run()
    return explorer


# ---------------------------------------------------------------- evaluation


def test_eval_taskset_during_training_never_reaches_exp_raw(
    tmp_path: Path, tiny_model_path: str, nats_url: str
) -> None:
    train = _jsonl(tmp_path / "train.jsonl", PROBLEMS[:50])  # a in 0..4
    held = PROBLEMS[50:58]  # a = 5
    cfg = small_config(tmp_path, tiny_model_path)
    cfg["buffer"]["explorer_input"] = {
        "taskset": {"name": "arith", "path": str(train), "rollout_args": {"max_tokens": 6}},
        "eval_tasksets": [
            {
                "name": "held",
                "path": str(_jsonl(tmp_path / "held.jsonl", held)),
                "repeat_times": 2,
                "rollout_args": {"max_tokens": 6},
            }
        ],
    }
    cfg["explorer"]["eval_interval"] = 1
    run = prepare_run(config_from_dict(cfg))
    steps = run_actors_to_end(run, nats_url, timeout=240)
    assert [r["step"] for r in steps] == [1, 2]

    async def check() -> None:
        metrics = await read_metrics(nats_url, "rft.itest.metrics.>")
        evals = [m for m in metrics if "eval/held/reward/mean" in m.values and m.role == "explorer"]
        assert evals
        assert evals[0].step == 1
        v = evals[0].values
        assert v["eval/held/tasks"] == 8 and v["eval/held/failed_tasks"] == 0
        assert 0.0 <= v["eval/held/accuracy/mean"] <= v["eval/held/accuracy/best@2"] <= 1.0
        assert v["eval/held/accuracy/mean"] == v["eval/held/reward/mean"]  # math reward: 0/1
        assert v["eval/final"] == 0.0 and "eval/model_version" in v
        raw = await read_stream(nats_url, "rft.itest.exp.raw")
        exps = [e for m in raw for e in decode_group(m.data)]
        assert exps
        held_questions = {r["question"] for r in held}
        assert all(isinstance(e.eid.batch, int) for e in exps)  # the epoch, never "eval:..."
        assert not any(q in (e.prompt_text or "") for e in exps for q in held_questions), (
            "an eval rollout was published for training"
        )
        groups = sum(m.values.get("rollout/groups", 0) for m in metrics if m.role == "explorer")
        assert len(raw) >= groups  # (a step cut short by the run's end publishes no metrics)

    anyio.run(check, backend="asyncio")
    records = [json.loads(x) for x in (run.run_dir / "eval.jsonl").read_text().splitlines()]
    assert records[0]["step"] == 1 and records[0]["eval/held/tasks"] == 8


def test_final_eval_when_the_tasks_run_out_and_tasksets_mix(
    tmp_path: Path, tiny_model_path: str, nats_url: str
) -> None:
    """Two training tasksets (jsonl + parquet) are mixed and each task runs once; the
    explorer evaluates after step total_steps and at the end (eval_interval far away)."""
    pq.write_table(pa.Table.from_pylist(PROBLEMS[10:14]), tmp_path / "b.parquet")
    cfg = small_config(tmp_path, tiny_model_path, buffer__total_epochs=1)
    cfg["buffer"]["explorer_input"] = {
        "tasksets": [
            {
                "name": "a",
                "path": str(_jsonl(tmp_path / "a.jsonl", PROBLEMS[:4])),
                "rollout_args": {"max_tokens": 6},
            },
            {
                "name": "b",
                "path": str(tmp_path / "b.parquet"),
                "total_epochs": 2,
                "repeat_times": 2,
                "rollout_args": {"max_tokens": 6},
            },
        ],
        "eval_tasksets": [
            {
                "name": "ev",
                "path": str(_jsonl(tmp_path / "ev.jsonl", PROBLEMS[90:93])),
                "rollout_args": {"max_tokens": 6},
            }
        ],
    }
    run = prepare_run(config_from_dict(cfg))
    evals: list[dict] = []

    async def main() -> None:
        await provision(run, nats_url)
        with anyio.fail_after(120):
            explorer = await _run_explorer(run, nats_url, on_eval=evals.append)
        assert explorer.step == 6  # 4 + 4 * 2 = 12 tasks, 2 per step

    anyio.run(main, backend="asyncio")
    # after step buffer.total_steps (2), then the final one when the tasks ran out
    assert [(r["step"], r["eval/final"]) for r in evals] == [(2, 0.0), (6, 1.0)]
    assert evals[1]["eval/ev/tasks"] == 3 and "eval/ev/accuracy/best@1" not in evals[1]

    async def check() -> None:
        raw = await read_stream(nats_url, "rft.itest.exp.raw")
        ids = Counter(m.headers["Nats-Msg-Id"].split("#")[0] for m in raw)
        expected = {f"raw:a:0:{i}" for i in range(4)} | {
            f"raw:b:{e}:{i}" for e in range(2) for i in range(4)
        }
        assert set(ids) == expected and all(n == 1 for n in ids.values())
        # the two tasksets share row indices: the task ids stay apart
        tids = {e.eid.tid for m in raw for e in decode_group(m.data)}
        assert len(tids) == 12 and "0/b:3" in tids and "0/a:3" in tids
        sizes = {
            decode_group(m.data)[0].eid.task.split(":")[0]: len(decode_group(m.data)) for m in raw
        }
        assert sizes == {"a": 4, "b": 2}  # b's own repeat_times
        async with await Bus.connect(nats_url, run.names, run.cfg.nats, "check") as bus:
            info = await bus.transport.js.stream_info(run.names.tasks_stream)
            assert info.state.messages == 0  # work queue: every task acked
        metrics = await read_metrics(nats_url, "rft.itest.metrics.>")
        assert [m.values["eval/final"] for m in metrics if "eval/final" in m.values] == [0.0, 1.0]

    anyio.run(check, backend="asyncio")
    lines = (run.run_dir / "eval.jsonl").read_text().splitlines()
    assert [json.loads(x) for x in lines] == evals


# ---------------------------------------------------------------- resume


def _resume_config(tmp_path: Path, tiny_model_path: str, name: str) -> dict:
    plugins = tmp_path / "plugins"
    plugins.mkdir(exist_ok=True)
    (plugins / "gated.py").write_text(GATED_PLUGIN)
    (tmp_path / "gate").write_text("closed")
    cfg = small_config(tmp_path, tiny_model_path, buffer__total_epochs=2)
    cfg["name"] = name
    cfg["buffer"]["batch_size"] = 4
    cfg["buffer"]["explorer_input"] = {
        "taskset": {
            "name": "arith",
            "path": str(_jsonl(tmp_path / "t.jsonl", PROBLEMS[20:32])),  # 12 rows x 2 epochs
            "default_workflow_type": "gated_math",
            "workflow_args": {
                "log": str(tmp_path / "runs.log"),
                "gate": str(tmp_path / "gate"),
                "block_after": 8,  # two steps finish, the third hangs
            },
            "rollout_args": {"max_tokens": 6},
        }
    }
    cfg["explorer"] = {"runner_num": 4, "max_retry_times": 0}
    cfg["algorithm"]["repeat_times"] = 2
    cfg["nats"] = {"ack_wait": 3.0}
    return cfg


def _runs(tmp_path: Path) -> list[tuple[int, int]]:
    lines = (tmp_path / "runs.log").read_text().splitlines()
    return [(int(a), int(b)) for a, b in (x.split() for x in lines)]


def _check_resumed(tmp_path: Path, url: str, run: str, runs_before: int) -> None:
    """Every task ran, and only the 4 in flight at the stop ran twice; exp.raw has each once."""
    runs = _runs(tmp_path)
    first, second = runs[:runs_before], runs[runs_before:]
    assert len(first) == 12  # 8 finished + 4 stuck in step 3
    everything = {(e, i) for e in range(2) for i in range(12)}
    counts = Counter(runs)
    assert set(counts) == everything, "a task was skipped"
    twice = {t for t, n in counts.items() if n > 1}
    assert twice == set(first[8:]), "only the tasks in flight at the stop may run again"
    assert all(n <= 2 for n in counts.values())
    assert len(second) == 24 - 8

    async def raw_ids() -> Counter:
        raw = await read_stream(url, f"rft.{run}.exp.raw")
        return Counter(m.headers["Nats-Msg-Id"].split("#")[0] for m in raw)

    ids = anyio.run(raw_ids, backend="asyncio")
    assert set(ids) == {f"raw:arith:{e}:{i}" for e, i in everything}
    assert all(n == 1 for n in ids.values())


def _wait_for_runs(tmp_path: Path, n: int, timeout: float, proc: Any = None) -> None:
    deadline = time.time() + timeout
    log = tmp_path / "runs.log"
    while time.time() < deadline:
        if log.exists() and len(log.read_text().splitlines()) >= n:
            return
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"explorer exited {proc.returncode}")
        time.sleep(0.05)
    raise AssertionError(f"fewer than {n} workflow runs after {timeout} s")


def test_stopped_explorer_is_resumed_by_a_new_one(
    tmp_path: Path, tiny_model_path: str, nats_url: str
) -> None:
    """Cancel an explorer mid-step: it naks what it holds; a new explorer takes over at once."""
    cfg = _resume_config(tmp_path, tiny_model_path, "resume")
    load_plugins([tmp_path / "plugins"], entry_points=False)
    run = prepare_run(config_from_dict(cfg))
    progress: list[dict] = []

    async def main() -> int:
        async with await Bus.connect(nats_url, run.names, run.cfg.nats, "setup") as bus:
            # a tasks ack wait far beyond fail_after(120) below (the run's own is 10 s)
            await bus.provision(stages=run.stages, task_ack_wait=960.0)
        await provision(run, nats_url)
        async with anyio.create_task_group() as tg:
            tg.start_soon(_run_explorer, run, nats_url)
            with anyio.fail_after(120):
                while not (tmp_path / "runs.log").exists() or len(_runs(tmp_path)) < 12:
                    await anyio.sleep(0.05)
            await anyio.sleep(0.3)  # the stuck step is really stuck
            tg.cancel_scope.cancel()
        before = len(_runs(tmp_path))
        # the tasks' ack wait (960 s) is far beyond fail_after(120) below: the 4 tasks of the
        # stuck step (run again, see _check_resumed) come back only because they were nak'ed
        async with await Bus.connect(nats_url, run.names, run.cfg.nats, "check") as bus:
            tasks = (run.names.tasks_stream, run.names.explorer_consumer)
            assert (await bus.transport.js.consumer_info(*tasks)).config.ack_wait > 120
        (tmp_path / "gate").unlink()
        t0 = time.monotonic()
        with anyio.fail_after(120):
            explorer = await _run_explorer(run, nats_url, on_progress=progress.append)
        assert time.monotonic() - t0 < 60
        assert explorer.step == 6
        return before

    before = anyio.run(main, backend="asyncio")
    # the new explorer went on counting steps where the stopped one left off
    assert [p["step"] for p in progress] == [3, 4, 5, 6]
    _check_resumed(tmp_path, nats_url, "resume", before)


def test_killed_explorer_process_is_resumed_by_a_new_one(
    tmp_path: Path, tiny_model_path: str, nats_url: str
) -> None:
    """SIGKILL an explorer process mid-step: its tasks come back after the ack wait."""
    cfg = _resume_config(tmp_path, tiny_model_path, "killed")
    config_path = tmp_path / "killed.yaml"
    config_path.write_text(yaml.safe_dump(cfg))
    load_plugins([tmp_path / "plugins"], entry_points=False)
    run = prepare_run(config_from_dict(cfg))

    async def provision_short_ack_wait() -> None:
        async with await Bus.connect(nats_url, run.names, run.cfg.nats, "setup") as bus:
            await bus.provision(stages=run.stages, task_ack_wait=4.0)
        await provision(run, nats_url)

    anyio.run(provision_short_ack_wait, backend="asyncio")
    with open(tmp_path / "explorer1.log", "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "rftstream.cli", "explorer", "--config", str(config_path)]
            + ["--nats-url", nats_url, "--plugin-dir", str(tmp_path / "plugins")]
            + ["--run-dir", str(tmp_path / "run")],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=user_env(tiny_model_path),
            start_new_session=True,
        )
    try:
        _wait_for_runs(tmp_path, 12, timeout=120, proc=proc)
        time.sleep(0.3)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    before = len(_runs(tmp_path))
    (tmp_path / "gate").unlink()
    progress: list[dict] = []

    async def main() -> None:
        with anyio.fail_after(120):
            explorer = await _run_explorer(run, nats_url, on_progress=progress.append)
        assert explorer.step == 6

    anyio.run(main, backend="asyncio")
    assert progress[0]["step"] == 3
    _check_resumed(tmp_path, nats_url, "killed", before)


# ---------------------------------------------------------------- taskset publishing


def test_taskset_publisher_that_died_is_taken_over(
    tmp_path: Path, tiny_model_path: str, nats_url: str
) -> None:
    """A claim whose publisher died mid-way is taken over; what it had published is not doubled."""
    cfg = small_config(tmp_path, tiny_model_path, buffer__total_epochs=2)
    cfg["name"] = "takeover"
    cfg["buffer"]["explorer_input"] = {
        "taskset": {"name": "t", "path": str(_jsonl(tmp_path / "t.jsonl", PROBLEMS[:30]))}
    }
    run = prepare_run(config_from_dict(cfg))
    plan = plan_tasks([TasksetPlan(name="t", rows=30, epochs=2)])

    async def main() -> None:
        await provision(run, nats_url)
        async with await Bus.connect(nats_url, run.names, run.cfg.nats, "ghost") as bus:
            state = RunState(await bus.kv())
            claim = TasksetClaim(by="ghost", ts=time.time(), seq=0)
            await state.kv.create(KV_TASKSET_CLAIM, encode_json(claim))
            ghost = Explorer(
                run.cfg, bus, resolved=run.resolved, model_path=run.model_path, name="ghost"
            )
            for p in plan[:10]:  # what the ghost published before it died
                await ghost.publisher.publish_task(
                    TaskMsg(
                        taskset="t",
                        index=p.index,
                        epoch=p.epoch,
                        seq=p.seq,
                        raw_task=PROBLEMS[p.index],
                    )
                )
            heir = Explorer(
                run.cfg, bus, resolved=run.resolved, model_path=run.model_path, name="heir"
            )
            heir.publisher.claim_stale_s = 1.0
            t0 = time.monotonic()
            with anyio.fail_after(30):
                await heir.publisher.run(state)
            assert 1.0 <= time.monotonic() - t0  # waited claim_stale_s before taking over
            record = await state.taskset()
            assert record is not None and record.by == "heir" and record.count == 60
            assert record.tasksets == {"t": 60}
            final = msgspec.json.decode((await state.kv.get(KV_TASKSET_CLAIM)).value)
            assert final["by"] == "heir" and final["seq"] == 60
            info = await bus.transport.js.stream_info(run.names.tasks_stream)
            assert info.state.messages == 60
            # a later explorer finds the record and publishes nothing
            late = Explorer(
                run.cfg, bus, resolved=run.resolved, model_path=run.model_path, name="late"
            )
            await late.publisher.run(state)
            info = await bus.transport.js.stream_info(run.names.tasks_stream)
            assert info.state.messages == 60
            stored = [
                msgspec.json.decode(
                    (await bus.transport.js.get_msg(run.names.tasks_stream, seq)).data, type=TaskMsg
                )
                for seq in range(info.state.first_seq, info.state.last_seq + 1)
            ]
            assert sorted((t.epoch, t.index) for t in stored) == sorted(
                (p.epoch, p.index) for p in plan
            )

    anyio.run(main, backend="asyncio")
