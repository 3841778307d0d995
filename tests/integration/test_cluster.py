"""A run on a 3-node nats-server cluster (loopback, each node its own store) with every
stream and the KV bucket replicated 3 times: a node SIGKILLed mid-run (one the actors
are not connected to, then the one they are) and restarted on its store; the run
finishes, every experience explored is trained exactly once (checked by experience
id) and the restarted node's replicas catch up."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest

from rftstream.bus.client import Bus
from rftstream.config import config_from_dict
from rftstream.nats_server.cluster import LocalNatsCluster
from rftstream.operations.account import account_run
from rftstream.runtime import (
    PreparedRun,
    prepare_run,
    provision,
    run_actors,
    run_explorer,
    run_operator,
    run_trainer,
)
from rftstream.subjects import RAW_STAGE, TRAIN_STAGE
from tests.integration._util import small_config

pytestmark = pytest.mark.integration


@pytest.fixture
def nats_cluster(tmp_path: Path) -> Iterator[LocalNatsCluster]:
    """Three clustered JetStream nodes on free loopback ports, stopped after the test."""
    with LocalNatsCluster(tmp_path / "cluster") as cluster:
        yield cluster


async def replica_state(bus: Bus, stream: str) -> tuple[str, dict[str, bool]]:
    """``(leader, {follower: current})`` of ``stream``'s raft group, from stream info."""
    info = await bus.transport.js.stream_info(stream)
    assert info.cluster is not None, f"stream {stream} has no cluster info"
    followers = {
        str(p.name): bool(p.current) and not p.offline and not (p.lag or 0)
        for p in info.cluster.replicas or []
    }
    return str(info.cluster.leader), followers


async def wait_replicas_current(bus: Bus, streams: list[str], timeout: float = 30) -> None:
    """Block until every stream in ``streams`` has a leader and 2 current followers."""
    with anyio.fail_after(timeout):
        while True:
            states = [await replica_state(bus, s) for s in streams]
            if all(lead and len(f) == 2 and all(f.values()) for lead, f in states):
                return
            await anyio.sleep(0.2)


def test_streams_and_kv_get_three_current_replicas(
    tmp_path: Path, tiny_model_path: str, nats_cluster: LocalNatsCluster
) -> None:
    cfg = config_from_dict(
        {
            "name": "repl",
            "model": {"model_path": tiny_model_path},
            "nats": {"num_replicas": 3},
            "run_dir": str(tmp_path / "run"),
        }
    )
    run = prepare_run(cfg)
    anyio.run(provision, run, nats_cluster.urls[1], backend="asyncio")

    async def check() -> None:
        async with await Bus.connect(nats_cluster.urls[2], run.names, run.cfg.nats, "t") as bus:
            n = run.names
            kv_stream = f"KV_{n.kv_bucket}"
            streams = [n.tasks_stream, n.exp_stream, n.dlq_stream, n.metrics_stream, kv_stream]
            for stream in streams:
                info = await bus.transport.js.stream_info(stream)
                assert info.config.num_replicas == 3, (stream, info.config.num_replicas)
            await wait_replicas_current(bus, streams)
            for stream in streams:
                leader, followers = await replica_state(bus, stream)
                assert {leader, *followers} == {"n1", "n2", "n3"}, (stream, leader, followers)
            # the KV bucket is usable through any node
            await (await bus.kv()).put("probe", b"1")
        async with await Bus.connect(nats_cluster.urls[0], run.names, run.cfg.nats, "u") as bus:
            assert (await (await bus.kv()).get("probe")).value == b"1"

    anyio.run(check, backend="asyncio")


async def check_every_experience_once(run: PreparedRun, url: str, steps: int) -> None:
    """The run's account balances (every experience explored was trained, filtered or is
    still pending; nothing stored twice or from nowhere; nothing dead-lettered), and every
    experience trained was trained once. Counted once every durable answers again (one
    whose leader was on the killed node answers after the survivors elected another)."""
    async with await Bus.connect(url, run.names, run.cfg.nats, "checker") as bus:
        with anyio.fail_after(60):
            while True:
                await bus.transport.consumers(run.names.exp_stream)
                if not bus.transport.unreachable_durables(run.names.exp_stream):
                    break
                await anyio.sleep(0.5)
        account = await account_run(bus)
    assert account.balanced and not account.problems, str(account)
    assert account.dead_letters == 0, str(account)
    expected = steps * run.cfg.buffer.batch_size * run.cfg.algorithm.repeat_times
    assert account.trained == expected, str(account)
    lines = (run.run_dir / "trained_uids.jsonl").read_text().splitlines()
    trained = [u for line in lines for u in json.loads(line)["uids"]]
    assert len(trained) == len(set(trained)) == expected, "an experience was trained twice"


def _run_config(tmp_path: Path, tiny_model_path: str, steps: int) -> PreparedRun:
    data = small_config(tmp_path, tiny_model_path, buffer__total_steps=steps)
    data["nats"] = {"num_replicas": 3, "ack_wait": 4.0}
    return prepare_run(config_from_dict(data))


async def run_spread(
    run: PreparedRun, urls: dict[str, str], on_step: Callable[[dict[str, Any]], None]
) -> None:
    """What :func:`run_actors` does, each actor connected to its own node (``urls`` by role)."""
    await provision(run, urls["trainer"])
    async with anyio.create_task_group() as tg:
        tg.start_soon(run_operator, run, urls["operator"])
        tg.start_soon(run_explorer, run, urls["explorer"])
        await run_trainer(run, urls["trainer"], on_step=on_step)
        tg.cancel_scope.cancel()


@pytest.mark.parametrize("victim", ["other", "connected", "spread"])
def test_run_survives_a_killed_node(
    tmp_path: Path, tiny_model_path: str, nats_cluster: LocalNatsCluster, victim: str
) -> None:
    """``other``: the EXP stream's leader, which no actor is connected to, is SIGKILLed after
    the first trainer step (a stream leader election mid-run; the actors connect through
    `nats.servers`, the two other nodes), restarted on its store after
    the second, and its replicas catch up. ``connected``: the node every actor is connected
    to (and the EXP stream's leader) is SIGKILLed: the clients reconnect to the survivors,
    which finish the run; it is restarted only for the account afterwards.
    ``spread``: explorer, operator and trainer each on their own node; the operator's (the
    EXP stream's leader) is SIGKILLed, then restarted."""
    steps = 4
    run = _run_config(tmp_path, tiny_model_path, steps)
    anyio.run(provision, run, nats_cluster.urls[0], backend="asyncio")

    async def leader_of_exp() -> str:
        async with await Bus.connect(nats_cluster.urls[0], run.names, run.cfg.nats, "t") as bus:
            await wait_replicas_current(bus, [run.names.exp_stream])
            return (await replica_state(bus, run.names.exp_stream))[0]

    target = anyio.run(leader_of_exp, backend="asyncio")
    node_of = {node.name: node for node in nats_cluster.nodes}
    others = [node.url for node in nats_cluster.nodes if node.name != target]
    connect = node_of[target].url
    if victim == "other":  # through `nats.servers`: the two nodes that are not the leader
        nats_cfg = msgspec.structs.replace(run.cfg.nats, servers=others)
        run = dataclasses.replace(run, cfg=msgspec.structs.replace(run.cfg, nats=nats_cfg))
        connect = ""
    spread = {"explorer": others[0], "operator": node_of[target].url, "trainer": others[1]}
    done_steps: list[dict] = []
    step_seen = [anyio.Event() for _ in range(steps + 1)]
    killed_after: list[int] = []  # trainer steps done when the node died

    def on_step(record: dict) -> None:
        done_steps.append(record)
        step_seen[min(len(done_steps), steps)].set()

    async def main() -> None:
        async def chaos() -> None:
            await step_seen[1].wait()
            nats_cluster.kill(target)
            killed_after.append(len(done_steps))
            if victim != "connected":
                await step_seen[2].wait()
                await anyio.to_thread.run_sync(nats_cluster.restart, target)

        with anyio.fail_after(150):
            async with anyio.create_task_group() as tg:
                tg.start_soon(chaos)
                if victim == "spread":
                    await run_spread(run, spread, on_step)
                else:
                    await run_actors(run, connect, on_step=on_step)

    anyio.run(main, backend="asyncio")
    assert [r["step"] for r in done_steps] == list(range(1, steps + 1))
    assert killed_after and killed_after[0] < steps, f"the node died after the run: {killed_after}"
    survivor = next(node.url for node in nats_cluster.nodes if node.running)
    if victim == "connected":
        # The run finished on the two survivors. The account needs every consumer of the
        # EXP stream to answer: an R1 ephemeral reader (mem storage, as nats-py makes every
        # ordered consumer) placed on the dead node answers only once it is back.
        nats_cluster.restart(target)

    async def caught_up() -> None:
        n = run.names
        async with await Bus.connect(survivor, n, run.cfg.nats, "t") as bus:
            streams = [n.tasks_stream, n.exp_stream, n.dlq_stream, n.metrics_stream]
            streams.append(f"KV_{n.kv_bucket}")
            await wait_replicas_current(bus, streams)

    anyio.run(caught_up, backend="asyncio")
    # after the restarted node caught up: a read it serves is not stale
    anyio.run(check_every_experience_once, run, survivor, steps, backend="asyncio")


def test_a_reader_on_a_node_that_stays_down_does_not_hold_back_the_durables(
    tmp_path: Path, tiny_model_path: str, nats_cluster: LocalNatsCluster
) -> None:
    """nats-py makes every ordered reader an R1 consumer: on a node that stays down it never
    answers a listing again. The connection that opened it (or saw it listed) knows it is a
    reader, so the purge of acked experience, which needs only the durables' floors, goes
    on; a connection that never saw it counts it as a durable that did not answer."""
    run = _run_config(tmp_path, tiny_model_path, 2)
    anyio.run(provision, run, nats_cluster.urls[0], backend="asyncio")
    n = run.names
    connected = next(node.name for node in nats_cluster.nodes if node.url == nats_cluster.urls[0])

    async def unreachable_settled(bus: Bus) -> list[str]:
        """What stays unreachable once the durables on the dead node have new leaders."""
        with anyio.fail_after(30):
            while True:
                infos = await bus.transport.consumers(n.exp_stream)
                durables = {c.name for c in infos if c.durable}
                if {n.trainer_consumer, n.stage_consumer(RAW_STAGE, TRAIN_STAGE)} <= durables:
                    return bus.transport.unreachable_durables(n.exp_stream)
                await anyio.sleep(0.5)

    async def check() -> None:
        url = nats_cluster.urls[0]
        async with await Bus.connect(url, n, run.cfg.nats, "reader") as bus:
            await wait_replicas_current(bus, [n.exp_stream])
            with anyio.fail_after(30):  # readers until one lives on another node
                while True:
                    reader = await bus.transport.read(n.exp_stream, n.exp_wildcard)
                    info = await reader._sub.consumer_info()
                    if info.cluster.leader != connected:
                        break
            name, node = info.name, info.cluster.leader
            nats_cluster.kill(node)
            assert await unreachable_settled(bus) == []
            assert name in bus.transport.js.missing_consumers[n.exp_stream]
            async with await Bus.connect(url, n, run.cfg.nats, "newcomer") as other:
                assert await unreachable_settled(other) == [name]
            await reader.close()

    anyio.run(check, backend="asyncio")
