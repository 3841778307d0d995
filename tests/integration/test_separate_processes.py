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

from rftstream.bus.server import free_port
from tests.integration._util import (
    actor_config,
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


@pytest.mark.parametrize("nodes", [1, 2])
def test_sft_trainer_under_torchrun(
    tmp_path: Path, tiny_model_path: str, hand_started_server: str, nodes: int
) -> None:
    """``mode: train`` on a dataset file (SFT), the trainer as 2 torchrun ranks: rank 0 reads
    the file and splits each batch of 8 rows between the ranks. ``nodes`` 2: each rank is
    its own torchrun "node" (``--nnodes 2 --node-rank N``, both on this host, so rank 1
    has ``LOCAL_RANK`` 0 as on a second machine)."""
    cfg = sft_config(tmp_path, tiny_model_path, "sft_ranks", rows=16, batch=8)
    path = write_config(cfg, tmp_path / "sft.yaml")
    run_dir = tmp_path / "run"
    trainer = [*CLI[1:], "trainer", "--config", str(path), "--nats-url", hand_started_server]
    trainer += ["--run-dir", str(run_dir)]
    env = user_env(tiny_model_path)
    second = None
    if nodes == 1:
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
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]  # 16 rows, one epoch, batches of 8
    assert all(r["trainer/rank_rows/0"] == r["trainer/rank_rows/1"] == 4 for r in records)
    assert proc.stdout.count("step    1") == 1  # rank 1 prints nothing
