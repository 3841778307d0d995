"""Three actor processes plus a separately started nats-server make a working run;
`rftstream up --nats-url` uses an existing server."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from rftstream.nats_server.embedded import free_port
from tests.integration._util import (
    actor_config,
    descendants,
    read_stream,
    sft_config,
    start_nats_server,
    user_env,
    wait_processes,
    write_config,
)

pytestmark = pytest.mark.integration

CLI = [sys.executable, "-m", "rftstream.cli"]


@pytest.fixture
def hand_started_server(tmp_path: Path) -> Iterator[str]:
    """`nats-server -js` started the way a user would, not through rftstream."""
    port = free_port()
    proc = start_nats_server(port, tmp_path / "hand-nats")
    time.sleep(0.3)
    try:
        yield f"nats://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


# the trainer as one process, or as 2 ranks started by torchrun (rank 0 on the bus)
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]


@pytest.mark.parametrize("trainer_ranks", [1, 2])
def test_three_actor_processes_against_a_hand_started_server(
    tmp_path: Path, tiny_model_path: str, hand_started_server: str, trainer_ranks: int
) -> None:
    # max_staleness 0: the explorer must wait for, and load, each new checkpoint
    data = actor_config(tmp_path, tiny_model_path, "procs", steps=3, max_staleness=0)
    cfg = write_config(data, tmp_path / "procs.yaml")
    env = user_env(tiny_model_path)
    procs = {}
    for role in ("trainer", "operator", "explorer"):
        launcher = TORCHRUN if role == "trainer" and trainer_ranks == 2 else [sys.executable]
        with open(tmp_path / f"{role}.log", "w") as log:
            procs[role] = subprocess.Popen(
                [*launcher, *CLI[1:], role, "--config", str(cfg), "--nats-url", hand_started_server]
                + ["--run-dir", str(tmp_path / role)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
            )
    logs = {role: tmp_path / f"{role}.log" for role in procs}
    try:
        wait_processes(procs, logs)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
    outputs = {role: path.read_text() for role, path in logs.items()}
    records = [
        json.loads(x) for x in (tmp_path / "trainer" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["experience/trained"] == 8 for r in records)
    if trainer_ranks == 2:
        # rank 0 read each batch once; the ranks' whole-group shards partition it
        assert all(r["trainer/rank_rows/0"] + r["trainer/rank_rows/1"] == 8 for r in records)
        assert all(r["trainer/rank_rows/1"] > 0 for r in records)
        assert "trainer rank 0 of 2" in outputs["trainer"]
    # weights went through checkpoint files on the shared path, picked up by the explorer process
    weights = sorted(
        (tmp_path / "shared-ckpt" / "rftstream" / "procs" / "weights").glob("v*.safetensors")
    )
    assert weights, "no weights published"
    assert (
        tmp_path / "shared-ckpt" / "rftstream" / "procs" / "global_step_3" / "model.safetensors"
    ).is_file()
    assert "step    3" in outputs["trainer"]
    # the explorer process generated with weights it loaded from the trainer's checkpoint files
    assert all(r["staleness/max"] == 0 for r in records)

    async def versions() -> set[int]:
        raw = await read_stream(hand_started_server, "rft.procs.exp.raw")
        return {int(m.headers["Rft-Model-Version"]) for m in raw}

    seen = anyio.run(versions, backend="asyncio")
    assert {1, 2} <= seen, seen


def test_up_against_an_existing_server(
    tmp_path: Path, tiny_model_path: str, hand_started_server: str
) -> None:
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [
            *CLI,
            "up",
            "--steps",
            "2",
            "--nats-url",
            hand_started_server,
            "--run-dir",
            str(run_dir),
            "--set",
            "name=external",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=user_env(tiny_model_path),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"using {hand_started_server}" in proc.stdout
    assert not (run_dir / "nats").exists()  # no embedded server was started
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]


def srun_port() -> tuple[str, int]:
    """A Slurm job id whose rendezvous port (:data:`~rftstream.training.world.SLURM_PORT_BASE`
    plus its last four digits) is free here, and that port."""
    import random
    import socket

    from rftstream.training.world import SLURM_PORT_BASE

    for _ in range(100):
        last = random.randrange(10000)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", SLURM_PORT_BASE + last))
            except OSError:
                continue
        return f"77{last:04d}", SLURM_PORT_BASE + last
    raise AssertionError("no free port for the srun rendezvous")


@pytest.mark.parametrize("launcher", ["torchrun", "torchrun-2-nodes", "srun"])
def test_sft_trainer_under_a_launcher(
    tmp_path: Path, tiny_model_path: str, hand_started_server: str, launcher: str
) -> None:
    """``mode: train`` on a dataset file (SFT), the trainer as 2 ranks: rank 0 reads the
    file and splits each batch of 8 rows between the ranks. ``torchrun-2-nodes``: each rank
    is its own torchrun "node" (``--nnodes 2 --node-rank N``, both on this host, so rank 1
    has ``LOCAL_RANK`` 0 as on a second machine), and the config says so
    (``trainer.nnodes`` 2). ``srun``: no torchrun, two processes with the variables Slurm's
    ``srun`` gives two tasks on two nodes; the rendezvous is the node list's first host
    and the port the job id gives."""
    cfg = sft_config(tmp_path, tiny_model_path, "sft_ranks", rows=16, batch=8)
    if launcher == "torchrun-2-nodes":
        cfg.setdefault("trainer", {})["nnodes"] = 2
    path = write_config(cfg, tmp_path / "sft.yaml")
    run_dir = tmp_path / "run"
    trainer = [*CLI[1:], "trainer", "--config", str(path), "--nats-url", hand_started_server]
    trainer += ["--run-dir", str(run_dir)]
    env = user_env(tiny_model_path)
    second = None
    if launcher == "srun":
        job, port = srun_port()
        tasks = {
            "SLURM_JOB_ID": job,
            "SLURM_STEP_ID": "0",
            "SLURM_LOCALID": "0",
            "SLURM_STEP_NUM_TASKS": "2",
            "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
            "SLURM_STEP_NODELIST": "127.0.0.[1-2]",
        }
        launch = [sys.executable]
        env = {**env, **tasks, "SLURM_PROCID": "0", "SLURM_NODEID": "0"}
        with open(tmp_path / "node1.log", "w") as log:
            second = subprocess.Popen(
                [sys.executable, *trainer],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**env, "SLURM_PROCID": "1", "SLURM_NODEID": "1"},
            )
    elif launcher == "torchrun":
        launch = TORCHRUN
    else:
        multi = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2"]
        multi += ["--nproc-per-node=1", "--master-addr=127.0.0.1", f"--master-port={free_port()}"]
        launch = [*multi, "--node-rank=0"]
        with open(tmp_path / "node1.log", "w") as log:
            second = subprocess.Popen(
                [*multi, "--node-rank=1", *trainer], stdout=log, stderr=subprocess.STDOUT, env=env
            )
    try:
        proc = subprocess.run(
            [*launch, *trainer], capture_output=True, text=True, timeout=300, env=env
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        if second is not None:
            assert second.wait(timeout=60) == 0, (tmp_path / "node1.log").read_text()[-3000:]
    finally:
        if second is not None and second.poll() is None:
            second.kill()
    if launcher == "srun":
        assert f"trainer rank 0 of 2 (srun tasks, rendezvous 127.0.0.1:{port})" in proc.stdout
    if launcher == "torchrun-2-nodes":
        assert "trainer rank 0 of 2 on 2 nodes" in proc.stdout
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]  # 16 rows, one epoch, batches of 8
    assert all(r["trainer/rank_rows/0"] == r["trainer/rank_rows/1"] == 4 for r in records)
    assert proc.stdout.count("step    1") == 1  # rank 1 prints nothing


def test_a_trainer_node_that_dies_stops_the_run_with_one_line(
    tmp_path: Path, tiny_model_path: str, hand_started_server: str
) -> None:
    """Two torchrun "nodes" of one rank each train SFT; after 3 steps the second node dies
    (its torchrun and its rank SIGKILLed, as a machine that goes down). The first node's
    torchrun exits non-zero within a minute (no hang) and rank 0 says what happened in
    one line, naming what it was doing."""
    import os
    import signal

    cfg = sft_config(tmp_path, tiny_model_path, "sft_dead_node", rows=4000, batch=8)
    cfg.setdefault("trainer", {})["nnodes"] = 2
    path = write_config(cfg, tmp_path / "sft.yaml")
    run_dir = tmp_path / "run"
    trainer = [*CLI[1:], "trainer", "--config", str(path), "--nats-url", hand_started_server]
    trainer += ["--run-dir", str(run_dir)]
    multi = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2"]
    multi += ["--nproc-per-node=1", "--master-addr=127.0.0.1", f"--master-port={free_port()}"]
    env = user_env(tiny_model_path)
    logs = [tmp_path / f"node{k}.log" for k in range(2)]
    nodes = []
    for k, log_path in enumerate(logs):
        with open(log_path, "w") as log:
            nodes.append(
                subprocess.Popen(
                    [*multi, f"--node-rank={k}", *trainer],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    start_new_session=True,
                )
            )
    metrics = run_dir / "metrics.jsonl"
    try:
        deadline = time.time() + 180
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
            assert nodes[0].poll() is None, logs[0].read_text()[-3000:]
            assert time.time() < deadline, logs[0].read_text()[-3000:]
            time.sleep(0.1)
        for pid in [nodes[1].pid, *descendants(nodes[1].pid)]:
            os.kill(pid, signal.SIGKILL)
        killed = time.time()
        code = nodes[0].wait(timeout=60)
        stopped_after = time.time() - killed
    finally:
        for node in nodes:
            if node.poll() is None:
                for pid in [node.pid, *descendants(node.pid)]:
                    os.kill(pid, signal.SIGKILL)
    out = logs[0].read_text()
    assert code != 0, out[-3000:]
    lines = [x for x in out.splitlines() if "another rank stopped answering" in x]
    assert len(lines) == 1, out[-3000:]
    assert lines[0].startswith("error: trainer rank 0 of 2: another rank stopped answering while ")
    assert "a node died, a rank was killed" in lines[0]
    assert "Traceback" not in out.split(lines[0])[0]  # rank 0's own error is that line alone
    assert stopped_after < 60
