"""One run, abused: every actor kind and the nats-server SIGKILLed mid-run and restarted,
and 500 malformed messages published on exp.raw. The run must finish and its account
(:func:`rftstream.operations.account.account_run`) balance exactly.

One run carries every case (CI time): the module fixture drives it, in this order,
while the actors run as separate ``rftstream explorer|operator|trainer`` processes:

1. the trainer, after a checkpoint (``trainer.save_interval``), which resumes from it;
2. 500 malformed messages on ``exp.raw`` (random bytes, wrong schema, a future schema
   version, out-of-vocabulary tokens, NaN reward, empty body, oversize);
3. one of two operator replicas of the stage raw -> train, killed while the replicas
   work through the malformed burst;
4. the explorer;
5. the nats-server, restarted on the same store and port.

Each test then checks its case in what the run left behind.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import msgspec
import nats
import nats.errors
import pytest

from rftstream.bus.client import Bus
from rftstream.config import config_from_dict
from rftstream.experience import EID, Experience, encode_group
from rftstream.nats_server.embedded import free_port
from rftstream.operations.account import RunAccount, account_run
from rftstream.subjects import RunNames
from tests.integration._util import (
    actor_config,
    read_stream,
    start_nats_server,
    user_env,
    write_config,
)

pytestmark = pytest.mark.integration

CLI = [sys.executable, "-m", "rftstream.cli"]
RUN = "chaos"
STEPS = 10
EVERY = 2  # trainer.save_interval
SERVER_MAX_PAYLOAD = 1024 * 1024  # nats-server's default: the oversize messages exceed it
MALFORMED = {  # kind -> how many (500 in all)
    "random_bytes": 80,
    "wrong_schema": 70,
    "future_schema": 70,
    "oov_tokens": 70,
    "nan_reward": 70,
    "empty_body": 70,
    "oversize": 70,
}
# what the reason of each kind's dead letter must say
REASON = {
    "random_bytes": "not a rft.experience.v1 message",
    "wrong_schema": "not a rft.experience.v1 message",
    "future_schema": "unsupported schema 'rft.experience.v2'",
    "oov_tokens": "outside the model's vocabulary",
    "nan_reward": "reward is not finite",
    "empty_body": "not a rft.experience.v1 message",
}


@dataclass
class ChaosRun:
    """What the fixture did and what the run left behind."""

    tmp: Path
    url: str
    names: RunNames
    logs: dict[str, Path]
    events: list[str] = field(default_factory=list)
    refused: Counter[str] = field(default_factory=Counter)  # kind -> refused at publish
    published: dict[str, str] = field(default_factory=dict)  # Nats-Msg-Id -> kind
    returncodes: dict[str, int | None] = field(default_factory=dict)
    account: RunAccount | None = None
    dead: list[tuple[dict[str, str], str]] = field(default_factory=list)  # (headers, subject)

    def log(self, name: str) -> str:
        path = self.logs[name]
        return path.read_text() if path.exists() else ""


def _config(tmp: Path, tiny_model_path: str) -> Path:
    cfg = actor_config(
        tmp,
        tiny_model_path,
        RUN,
        steps=STEPS,
        # max_staleness 1 paces the explorer by the trainer: the run lasts long enough for the kills
        max_staleness=1,
        buffer__total_epochs=20,
        trainer__save_interval=EVERY,
        # the 500 malformed groups would fill any dead-letter window: this run is meant to
        # survive them, so the watcher (monitor.dead_letter_window) is off
        monitor={"dead_letter_window": 0, "plot": False},
        nats__ack_wait=3.0,
        data_processor__experience_pipeline__batch_messages=4,
    )
    config_from_dict(cfg)  # a typo here fails at once, not in five subprocesses
    return write_config(cfg, tmp / "chaos.yaml")


def _exp(kind: str, i: int, **over: object) -> Experience:
    fields: dict = {
        "tokens": [5, 6, 7, 8, 9],
        "prompt_length": 2,
        "reward": 1.0,
        "logprobs": [-1.0, -1.0, -1.0],
        "eid": EID(f"chaos_{kind}", i, 0),
    }
    fields.update(over)
    return Experience(**fields)


def malformed_bodies(rng: random.Random) -> Iterator[tuple[str, bytes]]:
    """``(kind, body)`` for every malformed message of :data:`MALFORMED`."""
    for kind, n in MALFORMED.items():
        for i in range(n):
            if kind == "random_bytes":
                body = rng.randbytes(rng.randint(1, 2000))
            elif kind == "wrong_schema":
                body = msgspec.msgpack.encode({"schema": "rft.experience.v1", "task": i})
            elif kind == "future_schema":
                group = msgspec.msgpack.decode(encode_group([_exp(kind, i)]))
                group["schema"] = "rft.experience.v2"
                body = msgspec.msgpack.encode(group)
            elif kind == "oov_tokens":
                body = encode_group([_exp(kind, i, tokens=[5, 6, 10**7 + i, 8, 9])])
            elif kind == "nan_reward":
                body = encode_group([_exp(kind, i, reward=math.nan)])
            elif kind == "empty_body":
                body = b""
            else:  # oversize: one experience larger than the server's max_payload
                big = [7] * (SERVER_MAX_PAYLOAD // 4 + 1000)
                body = encode_group([_exp(kind, i, tokens=big, logprobs=[-1.0] * (len(big) - 2))])
            yield kind, body


async def publish_malformed(url: str, names: RunNames, chaos: ChaosRun) -> None:
    """Publish the malformed messages to ``exp.raw`` the way a broken producer would."""
    nc = await nats.connect(url)
    js = nc.jetstream()
    try:
        for n, (kind, body) in enumerate(malformed_bodies(random.Random(13))):
            msg_id = f"chaos:{kind}:{n}"
            try:
                await js.publish(names.exp_subject("raw"), body, headers={"Nats-Msg-Id": msg_id})
            except nats.errors.MaxPayloadError:
                chaos.refused[kind] += 1
                continue
            chaos.published[msg_id] = kind
    finally:
        await nc.close()


def _steps(path: Path) -> list[int]:
    if not path.exists():
        return []
    return [json.loads(x)["step"] for x in path.read_text().splitlines() if x.strip()]


@pytest.fixture(scope="module")
def chaos(tmp_path_factory: pytest.TempPathFactory, tiny_model_path: str) -> Iterator[ChaosRun]:
    tmp = tmp_path_factory.mktemp("chaos")
    port = free_port()
    url = f"nats://127.0.0.1:{port}"
    store = tmp / "nats-store"
    server = start_nats_server(port, store)
    cfg = _config(tmp, tiny_model_path)
    env = user_env(tiny_model_path)
    names = RunNames(RUN)
    run = ChaosRun(tmp, url, names, logs={})
    procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(key: str, role: str, *extra: str) -> None:
        run.logs[key] = tmp / f"{key}.log"
        with open(run.logs[key], "w") as log:
            procs[key] = subprocess.Popen(
                [*CLI, role, "--config", str(cfg), "--nats-url", url, *extra]
                + ["--run-dir", str(tmp / role), "--log-level", "INFO"],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
            )

    def kill(key: str) -> None:
        assert procs[key].poll() is None, f"{key} ended before the kill:\n{run.log(key)[-3000:]}"
        os.kill(procs[key].pid, signal.SIGKILL)
        procs[key].wait(timeout=10)
        run.returncodes[key] = procs[key].returncode
        del procs[key]

    def alive() -> None:
        for key, p in procs.items():
            assert p.poll() in (None, 0), f"{key} exited {p.returncode}:\n{run.log(key)[-4000:]}"

    def wait_for(what: str, cond: Callable[[], bool], timeout: float = 120) -> None:
        deadline = time.time() + timeout
        while not cond():
            alive()
            assert time.time() < deadline, f"timed out waiting for {what}"
            time.sleep(0.05)

    metrics = tmp / "trainer" / "metrics.jsonl"
    try:
        start("trainer", "trainer")
        start("op_a", "operator", "--name", "op_a")
        start("op_b", "operator", "--name", "op_b")
        start("explorer", "explorer")
        # the trainer, past a checkpoint
        wait_for("a step past a checkpoint", lambda: max(_steps(metrics), default=0) > EVERY, 180)
        kill("trainer")
        start("trainer2", "trainer")
        run.events.append(f"trainer killed after step {max(_steps(metrics))}")
        anyio.run(publish_malformed, url, names, run, backend="asyncio")
        run.events.append("malformed published")
        # an operator replica, while the replicas work through the malformed burst
        kill("op_a")
        start("op_a2", "operator", "--name", "op_a")
        run.events.append("operator killed")
        kill("explorer")
        start("explorer2", "explorer")
        run.events.append("explorer killed")
        wait_for("the restarted trainer", lambda: "resumed from" in run.log("trainer2"))
        server.send_signal(signal.SIGKILL)
        server.wait(timeout=10)
        time.sleep(0.5)
        server = start_nats_server(port, store)
        run.events.append("nats-server killed")
        deadline = time.time() + 240
        while any(p.poll() is None for p in procs.values()):
            alive()
            assert time.time() < deadline, "the run did not finish: " + ", ".join(
                k for k, p in procs.items() if p.poll() is None
            )
            time.sleep(0.2)
        run.returncodes.update({k: p.returncode for k, p in procs.items()})

        async def collect() -> None:
            async with await Bus.connect(url, names, config_from_dict({}).nats, "chaos") as bus:
                run.account = await account_run(bus)
            run.dead = [
                (dict(m.headers or {}), m.subject)
                for m in await read_stream(url, f"rft.{RUN}.dlq.>")
            ]

        anyio.run(collect, backend="asyncio")
        yield run
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
        server.terminate()
        server.wait(timeout=10)


def test_the_run_finishes_and_its_account_balances(chaos: ChaosRun) -> None:
    for key, code in chaos.returncodes.items():
        if not key.endswith(("a", "b")) and key not in ("explorer", "trainer"):
            assert code == 0, f"{key} exited {code}:\n{chaos.log(key)[-3000:]}"
    account = chaos.account
    assert account is not None
    assert account.balanced, str(account)
    assert not account.problems, str(account)
    assert account.trained == STEPS * 2 * 4, str(account)
    raw, train = account.stages
    # every raw message was handled; what is left pending is what the explorer produced
    # (within max_staleness) after the trainer's last step
    assert (raw.from_stage, raw.pending, raw.malformed_pending) == ("raw", 0, 0), str(account)
    assert train.trainer and train.pending == train.experiences_in - 80 - train.dead
    assert "balanced" in str(account) and "NOT" not in str(account)


def test_the_killed_trainer_resumed_and_trained_every_experience_once(chaos: ChaosRun) -> None:
    resumed = re.search(r"resumed from the checkpoint of step (\d+)", chaos.log("trainer2"))
    assert resumed, chaos.log("trainer2")[-3000:]
    killed_after = int(chaos.events[0].rsplit(" ", 1)[-1])
    assert int(resumed[1]) % EVERY == 0 and EVERY <= int(resumed[1]) <= killed_after
    records = [
        json.loads(x) for x in (chaos.tmp / "trainer" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    steps = [
        json.loads(x)
        for x in (chaos.tmp / "trainer" / "trained_uids.jsonl").read_text().splitlines()
    ]
    trained = [u for s in steps for u in s["uids"]]
    assert len(trained) == len(set(trained)), "an experience was trained twice"
    assert chaos.account is not None and len(trained) == chaos.account.trained


def test_every_malformed_message_is_dead_lettered_with_its_fault_or_refused(
    chaos: ChaosRun,
) -> None:
    assert sum(MALFORMED.values()) == 500
    assert chaos.refused == Counter({"oversize": MALFORMED["oversize"]})
    by_id = {h.get("Nats-Msg-Id", ""): h for h, _ in chaos.dead}
    for msg_id, kind in chaos.published.items():
        # a dead letter's own id is "dlq:<stage>:<original id>" (the stage that gave up)
        found = [h for mid, h in by_id.items() if mid.endswith(":" + msg_id)]
        assert len(found) == 1, f"{msg_id} ({kind}) dead-lettered {len(found)} times"
        assert REASON[kind] in found[0]["Rft-Dlq-Reason"], (kind, found[0]["Rft-Dlq-Reason"])
    account = chaos.account
    assert account is not None
    published_malformed = sum(
        1 for k in chaos.published.values() if k not in ("oov_tokens", "nan_reward")
    )
    assert account.malformed == published_malformed
    assert account.malformed_dead == published_malformed


def test_each_actor_and_the_server_were_killed_mid_run(chaos: ChaosRun) -> None:
    assert chaos.events[0].startswith("trainer killed after step")
    assert chaos.events[1:4] == ["malformed published", "operator killed", "explorer killed"]
    assert chaos.events[4] == "nats-server killed"
    for key in ("op_a", "explorer", "trainer"):
        assert chaos.returncodes[key] == -signal.SIGKILL
