"""Three stages across two operator processes; one is SIGKILLed mid-run and restarted.
Afterwards every raw experience is on exp.train exactly once (checked by experience id)."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import anyio
import nats.js.errors
import pytest
import yaml

from rftstream.bus.client import Bus
from rftstream.bus.state import RunState
from rftstream.config import config_from_dict
from rftstream.experience import decode_group
from rftstream.runtime import prepare_run, provision
from tests.integration._util import _group, read_stream, small_config, user_env

pytestmark = pytest.mark.integration

CLI = [sys.executable, "-m", "rftstream.cli"]

SLOW_OPERATOR = '''
import time
from operators import EXPERIENCE_OPERATORS, ExperienceOperator


@EXPERIENCE_OPERATORS.register_module("slow_passthrough")
class SlowPassthrough(ExperienceOperator):
    """Keeps everything, slowly: a kill is likely to land mid-batch."""

    def process(self, exps):
        time.sleep(0.15)
        return exps, {"seen": len(exps)}
'''


async def delivered(bus: Bus, durable: str) -> int:
    """Messages the durable has delivered so far (0 before its process created it)."""
    try:
        return int(
            (
                await bus.transport.js.consumer_info(bus.names.exp_stream, durable)
            ).delivered.consumer_seq
        )
    except nats.js.errors.NotFoundError:
        return 0


async def in_flight(bus: Bus, durable: str) -> bool:
    """True while the durable has delivered messages not yet acked (a batch is mid-way)."""
    return (
        int((await bus.transport.js.consumer_info(bus.names.exp_stream, durable)).num_ack_pending)
        > 0
    )


def test_sigkilled_stage_loses_nothing_and_doubles_nothing(
    tmp_path: Path, tiny_model_path: str, nats_url: str
) -> None:
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / "slow.py").write_text(SLOW_OPERATOR)
    cfg = small_config(tmp_path, tiny_model_path)
    cfg["data_processor"] = {"experience_pipeline": {"input_stage": "s1", "batch_messages": 4}}
    cfg["nats"] = {"ack_wait": 5.0}  # the killed batch is redelivered after 5 s, not 60
    cfg_path = tmp_path / "run.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    run = prepare_run(config_from_dict(cfg))
    anyio.run(provision, run, nats_url, backend="asyncio")
    common = ["--config", str(cfg_path), "--nats-url", nats_url]
    env = user_env(tiny_model_path)

    def start_a(n: int) -> subprocess.Popen[bytes]:
        # stage 1: raw -> s1, a user's (slow) operator
        with open(tmp_path / f"a{n}.log", "w") as out:
            return subprocess.Popen(
                [
                    *CLI,
                    "operator",
                    "slow_passthrough",
                    "--from",
                    "raw",
                    "--to",
                    "s1",
                    "--plugin-dir",
                    str(plugins),
                    "--name",
                    f"a{n}",
                    *common,
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
            )

    # stage 2: s1 -> train, the configured pipeline (GRPO group advantage)
    with open(tmp_path / "b.log", "w") as out:
        b = subprocess.Popen(
            [*CLI, "operator", "--name", "b", *common],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
    a = start_a(1)
    n_groups = 60
    published = []
    try:

        async def produce_kill_restart() -> None:
            nonlocal a
            async with await Bus.connect(nats_url, run.names, run.cfg.nats, "producer") as bus:
                for i in range(n_groups):
                    group = _group(i, float(i % 2)) + _group(i, float((i + 1) % 2))[:2]
                    published.extend(e.eid.uid for e in group)
                    await bus.publish_group("raw", group, msg_id=f"raw-{i}")
                    if i == 25:
                        # wait until stage 1 is visibly working, then kill it without warning
                        with anyio.fail_after(120):
                            while await delivered(bus, "op_raw_to_s1") < 10 or not await in_flight(
                                bus, "op_raw_to_s1"
                            ):
                                await anyio.sleep(0.02)
                        a.send_signal(signal.SIGKILL)
                        a.wait(timeout=10)
                        await anyio.sleep(1.0)
                        a = start_a(2)
                    await anyio.sleep(0.02)
                with anyio.fail_after(240):
                    while True:
                        assert b.poll() is None, (tmp_path / "b.log").read_text()[-3000:]
                        done = True
                        for durable in ("op_raw_to_s1", "op_s1_to_train"):
                            info = await bus.transport.js.consumer_info(
                                run.names.exp_stream, durable
                            )
                            done &= info.num_pending == 0 and info.num_ack_pending == 0
                        if done:
                            break
                        await anyio.sleep(0.5)
                # the batch the kill interrupted was delivered again to the restarted process
                assert await delivered(bus, "op_raw_to_s1") > n_groups
                await RunState(await bus.kv()).set_status("finished")

        anyio.run(produce_kill_restart, backend="asyncio")
        for p in (a, b):
            p.wait(timeout=30)
        assert b.returncode == 0, (tmp_path / "b.log").read_text()[-3000:]
    finally:
        for p in (a, b):
            if p.poll() is None:
                p.kill()

    async def check() -> None:
        train = [
            e
            for m in await read_stream(nats_url, "rft.itest.exp.train")
            for e in decode_group(m.data)
        ]
        uids = [e.eid.uid for e in train]
        assert len(uids) == len(set(uids)), "an experience reached the trainer's stage twice"
        assert sorted(uids) == sorted(published), "an experience was lost"
        assert all(e.advantages is not None for e in train)

    anyio.run(check, backend="asyncio")
