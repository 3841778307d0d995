"""A user's session against a live trainer, with the real CLI and a real DeepSpeed trainer:

``rftstream operator reward_filter --splice`` (2 replicas) -> SIGKILL -> ``rftstream status``
says what to do -> the same command resumes it -> ``rftstream account`` balances while it
runs -> ``rftstream operator --unsplice`` removes it -> splice again -> Ctrl-C (SIGINT)
removes it -> the run ends. Experiences keep flowing (exp.raw, through the operator host, to
exp.train) all along. Checked by experience id (a spy on the trainer's step records what
each step trained): nothing trained twice, raw = trained + filtered + dead-lettered, the
filter applied exactly to the messages between each splice's cut and its removal's cut, and
unfiltered experiences reach the trainer again after each removal; and ``rftstream account``
says the same: BALANCED, exit 0.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
import yaml

from rftstream.bus.client import Bus
from rftstream.bus.state import RunState
from rftstream.config import config_from_dict
from rftstream.experience import decode_group
from rftstream.runtime import prepare_run, provision, run_actors
from rftstream.subjects import KV_TASKSET, KV_TOPOLOGY, KV_TRAINER_WAITING
from rftstream.wire import TasksetRecord
from tests.integration._util import _group, read_stream, small_config, user_env
from tests.kv_json import read_json, write_json

pytestmark = pytest.mark.integration

CLI = [sys.executable, "-m", "rftstream.cli"]
THRESHOLD = 0.5


def _mixed(i: int) -> list:
    """Task ``i``'s group of four: rewards 0, 1, 0, 1."""
    low, high = _group(i, 0.0, 4), _group(i, 1.0, 4)
    return [low[0], high[1], low[2], high[3]]


class Job:
    """The trainer and the operator host (in a thread, the trainer spied on) and a producer
    of groups on exp.raw."""

    def __init__(self, run: Any, url: str) -> None:
        self.run = run
        self.url = url
        self.steps: list[list[str]] = []
        self.published: dict[str, float] = {}
        self.errors: list[BaseException] = []
        self.stop = threading.Event()
        self.trainer = threading.Thread(target=self._trainer)
        self.producer = threading.Thread(target=self._producer)

    def _trainer(self) -> None:
        try:
            anyio.run(
                lambda: run_actors(self.run, self.url, roles=("operator", "trainer")),
                backend="asyncio",
            )
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.errors.append(exc)

    def _producer(self) -> None:
        async def main() -> None:
            await provision(self.run, self.url)
            async with await Bus.connect(
                self.url, self.run.names, self.run.cfg.nats, "producer"
            ) as bus:
                i = 0
                while not self.stop.is_set():
                    group = _mixed(i)
                    await bus.publish_group("raw", group, msg_id=f"g{i}")
                    self.published.update({e.eid.uid: float(e.reward) for e in group})
                    i += 1
                    await anyio.sleep(0.3)
                state = RunState(await bus.kv())
                await write_json(
                    state,
                    KV_TASKSET,
                    TasksetRecord(count=i, epochs=1, rows=i, by="producer", ts=time.time()),
                )

        try:
            anyio.run(main, backend="asyncio")
        except BaseException as exc:  # noqa: BLE001
            self.errors.append(exc)

    def trained(self) -> int:
        return sum(len(s) for s in self.steps)

    def wait_trained(self, more: int, timeout: float = 180) -> None:
        target = self.trained() + more
        deadline = time.monotonic() + timeout
        while self.trained() < target:
            assert not self.errors, self.errors
            assert time.monotonic() < deadline, f"trained {self.trained()} < {target}"
            time.sleep(0.2)


def _kv(url: str, run: Any, key: str) -> Any:
    async def get() -> Any:
        async with await Bus.connect(url, run.names, run.cfg.nats, "probe") as bus:
            return await read_json(RunState(await bus.kv()), key)

    return anyio.run(get, backend="asyncio")


def _count_on(url: str, run: Any, stage: str) -> int:
    async def count() -> int:
        async with await Bus.connect(url, run.names, run.cfg.nats, "probe") as bus:
            subject = run.names.exp_subject(stage)
            info = await bus.transport.js.stream_info(run.names.exp_stream, subjects_filter=subject)
            return int((info.state.subjects or {}).get(subject, 0))

    return anyio.run(count, backend="asyncio")


def _wait(cond: Any, what: str, timeout: float = 180, procs: tuple = ()) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        for p, log in procs:
            assert p.poll() is None, f"{what}: exited early\n" + log.read_text()[-3000:]
        assert time.monotonic() < deadline, what
        time.sleep(0.3)


def test_splice_kill_resume_unsplice_resplice_sigint(
    tmp_path: Path, tiny_model_path: str, nats_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rftstream.training.policy_trainer import PolicyTrainer

    data = small_config(tmp_path, tiny_model_path)
    data["name"] = "splicecli"
    data["buffer"].update({"total_steps": None, "train_batch_size": 8})
    data["nats"] = {"ack_wait": 5.0}  # the killed process's batch comes back after 5 s
    cfg_path = tmp_path / "run.yaml"  # the commands': no run_dir (they join the run)
    cfg_path.write_text(yaml.safe_dump({k: v for k, v in data.items() if k != "run_dir"}))
    run = prepare_run(config_from_dict(data))
    job = Job(run, nats_url)
    real_step = PolicyTrainer.train_step

    def spy(self: PolicyTrainer, exps: list) -> dict[str, float]:
        out = real_step(self, exps)
        job.steps.append([e.eid.uid for e in exps])
        return out

    monkeypatch.setattr(PolicyTrainer, "train_step", spy)
    env = user_env(tiny_model_path)
    common = ["--config", str(cfg_path), "--nats-url", nats_url]
    splice_cmd = [
        *CLI,
        "operator",
        "reward_filter",
        "--args",
        json.dumps({"threshold": THRESHOLD}),
        "--splice",
        "--to",
        "filtered",
        *common,
    ]
    procs: list[subprocess.Popen[bytes]] = []

    workdir = tmp_path / "cwd"  # where the operators are started: they leave nothing there
    workdir.mkdir()
    env = {**env, "XDG_STATE_HOME": str(tmp_path / "state")}

    def start(n: int, *extra: str) -> tuple[subprocess.Popen[bytes], Path]:
        log = tmp_path / f"op{n}.log"
        with open(log, "w") as out:
            p = subprocess.Popen(
                [*splice_cmd, "--name", f"filter{n}", *extra],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=workdir,
            )
        procs.append(p)
        return p, log

    def account() -> tuple[int, dict[str, Any]]:
        out = subprocess.run(
            [*CLI, "account", "--json", *common],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )
        assert out.returncode in (0, 1), out.stdout + out.stderr
        return out.returncode, json.loads(out.stdout)

    def status() -> dict[str, Any]:
        out = subprocess.run(
            [*CLI, "status", "--json", *common], capture_output=True, text=True, timeout=60, env=env
        )
        assert out.returncode == 0, out.stdout + out.stderr
        return json.loads(out.stdout)

    job.trainer.start()
    job.producer.start()
    try:
        job.wait_trained(16)

        # splice in with two replicas; wait until experiences flow through the filter
        p1, log1 = start(1, "--replicas", "2")
        _wait(
            lambda: _count_on(nats_url, run, "filtered") >= 3, "filter 1 works", procs=((p1, log1),)
        )
        assert "spliced in: reads exp.train" in log1.read_text()
        s = status()
        assert s["chain"] == "raw -> train -> filtered (reward_filter) -> trainer"
        actors = {h["actor"]: h for h in s["heartbeats"]}
        assert {"filter1-0", "filter1-1", "trainer"} <= set(actors)

        # SIGKILL: the trainer soon says (KV, `rftstream status`) what to run
        p1.send_signal(signal.SIGKILL)
        p1.wait(timeout=30)
        _wait(lambda: _kv(nats_url, run, KV_TRAINER_WAITING) is not None, "trainer.waiting")
        waiting = status()["waiting"]
        assert "reward_filter" in waiting and "--splice --to filtered" in waiting, waiting
        # --unsplice needs the operator running: one line saying how to restart it
        out = subprocess.run(
            [*CLI, "operator", "--unsplice", "filtered", *common],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
        )
        assert out.returncode == 2, out.stdout + out.stderr
        assert "is not running" in out.stdout and "--splice --to filtered" in out.stdout
        assert "Traceback" not in out.stdout + out.stderr
        human = subprocess.run(
            [*CLI, "status", *common], capture_output=True, text=True, timeout=60, env=env
        )
        assert "waiting:" in human.stdout and "--splice" in human.stdout, human.stdout

        # the same command resumes it
        before = _count_on(nats_url, run, "filtered")
        p2, log2 = start(2)
        _wait(
            lambda: _count_on(nats_url, run, "filtered") >= before + 3,
            "filter resumed",
            procs=((p2, log2),),
        )
        assert "resuming exp.filtered" in log2.read_text()
        _wait(lambda: _kv(nats_url, run, KV_TRAINER_WAITING) is None, "waiting cleared")
        # the account of the running, spliced run: what the filter dropped is filtered
        rc, doc = account()
        assert rc == 0 and doc["balanced"] and not doc["problems"], doc
        readers = {(s["from"], s["to"]) for s in doc["stages"]}
        assert {("train", "filtered"), ("train", "trained"), ("filtered", "trained")} <= readers

        # --unsplice from another shell: the running operator drains and exits
        out = subprocess.run(
            [*CLI, "operator", "--unsplice", "filtered", *common],
            capture_output=True,
            text=True,
            timeout=180,
            env=env,
        )
        assert out.returncode == 0, out.stdout + out.stderr
        assert "removed exp.filtered" in out.stdout
        assert p2.wait(timeout=60) == 0, log2.read_text()[-3000:]
        assert "removed" in log2.read_text()
        job.wait_trained(24)  # unfiltered again
        after = status()
        assert after["chain"] == "raw -> train -> trainer"
        # the removed operator's row is gone from `status` (the killed one's stays: it
        # left no word)
        assert "filter2" not in {h["actor"] for h in after["heartbeats"]}

        # splice again, then Ctrl-C: it removes itself and exits 0
        p3, log3 = start(3)
        _wait(lambda: "spliced in" in log3.read_text(), "filter 3 spliced", procs=((p3, log3),))
        before = _count_on(nats_url, run, "filtered")
        _wait(lambda: _count_on(nats_url, run, "filtered") >= before + 3, "filter 3 works")
        p3.send_signal(signal.SIGINT)
        assert p3.wait(timeout=120) == 0, log3.read_text()[-3000:]
        assert "removed: exp.filtered ends at sequence" in log3.read_text()
        job.wait_trained(24)
    finally:
        job.stop.set()
        job.producer.join(timeout=60)
        job.trainer.join(timeout=240)
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert not job.trainer.is_alive() and not job.errors, job.errors

    final = status()
    assert final["status"] == "finished" and final["chain"] == "raw -> train -> trainer"
    rc, doc = account()
    assert rc == 0 and doc["balanced"] and doc["settled"] and not doc["problems"], doc
    assert doc["filtered"] > 0 and doc["trained"] == doc["explored"] - doc["filtered"], doc
    # no runs/<name>/ where they were started; their logs are under the user's state dir
    assert list(workdir.iterdir()) == []
    assert list((tmp_path / "state" / "rftstream").glob("*/operator/logs/rftstream.log"))
    topology = _kv(nats_url, run, KV_TOPOLOGY)
    assert [e["op"] for e in topology] == ["splice", "unsplice", "splice", "unsplice"]
    cuts = [int(e["seq"]) for e in topology]

    async def messages() -> tuple[list, list]:
        train = await read_stream(nats_url, run.names.exp_subject("train"))
        dlq = await read_stream(nats_url, f"rft.{run.names.run}.dlq.>")
        return train, dlq

    train, dlq = anyio.run(messages, backend="asyncio")
    trained = [u for s in job.steps for u in s]
    assert len(trained) == len(set(trained)), "an experience was trained twice"
    assert all(len(s) == 8 for s in job.steps[:-1])  # full batches until the very end
    dead = {e.eid.uid for m in dlq for e in decode_group(m.data)}
    expected, filtered = set(), set()
    for m in train:
        seq = m.metadata.sequence.stream
        through = cuts[0] <= seq < cuts[1] or cuts[2] <= seq < cuts[3]
        for e in decode_group(m.data):
            (filtered if through and e.reward < THRESHOLD else expected).add(e.eid.uid)
    assert set(trained) == expected - dead
    assert len(job.published) == len(trained) + len(filtered) + len(dead)
    assert filtered and not dead
    low_after = [
        e.eid.uid
        for m in train
        if m.metadata.sequence.stream >= cuts[3]
        for e in decode_group(m.data)
        if e.reward < THRESHOLD
    ]
    assert set(low_after) & set(trained), "no unfiltered experience after the last removal"
