"""Actors that share nothing but the NATS URL: each process in its own working directory
with its own run directory and its own copy of the model (as on separate machines);
weights reach the explorer over the weights stream (sync_method jetstream)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

from rftstream.wire import WeightsPointer, decode_json
from tests.integration._util import (
    actor_config,
    read_stream,
    user_env,
    wait_processes,
    write_config,
)

pytestmark = pytest.mark.integration


def test_trainer_and_explorer_with_no_common_path(
    tmp_path: Path, tiny_model_path: str, nats_url: str
) -> None:
    hosts = {role: tmp_path / f"host-{role}" for role in ("trainer", "operator", "explorer")}
    procs: dict[str, subprocess.Popen[bytes]] = {}
    logs = {role: host / "actor.log" for role, host in hosts.items()}
    env = user_env(tiny_model_path)
    for role, host in hosts.items():
        host.mkdir()
        model = host / "model"  # each host has its own copy of the model
        shutil.copytree(tiny_model_path, model)
        # max_staleness 0: the explorer must wait for, fetch and swap in each new version
        cfg = actor_config(tmp_path, str(model), "hosts", steps=4, max_staleness=0)
        del cfg["checkpoint_root_dir"]  # nothing shared: checkpoints stay on the trainer
        cfg["synchronizer"]["sync_method"] = "jetstream"
        path = write_config(cfg, host / "run.yaml")
        with open(logs[role], "w") as log:
            procs[role] = subprocess.Popen(
                [sys.executable, "-m", "rftstream.cli", role, "--config", path.name]
                + ["--nats-url", nats_url, "--run-dir", "run"],
                cwd=host,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
            )
    try:
        wait_processes(procs, logs)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
    records = [
        json.loads(x) for x in (hosts["trainer"] / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["weights/version"] for r in records] == [1, 2, 3, 4]
    assert all(r["staleness/max"] == 0 for r in records)  # each batch from the newest weights
    assert all(r["sync/trainer_blocking_seconds"] > 0 for r in records)
    assert sum(r.get("sync/bytes", 0) for r in records) > 0
    # nothing but NATS carried the weights: no weight files on any host
    for host in hosts.values():
        assert not list(host.rglob("v*.safetensors")), list(host.rglob("v*.safetensors"))
    assert not (hosts["explorer"] / "run" / "checkpoints").exists()

    async def read() -> tuple[set[int], WeightsPointer, list[dict]]:
        raw = await read_stream(nats_url, "rft.hosts.exp.raw")
        kv = await read_stream(nats_url, "$KV.rft_hosts_state.weights.latest")
        metrics = await read_stream(nats_url, "rft.hosts.metrics.explorer")
        return (
            {int(m.headers["Rft-Model-Version"]) for m in raw},
            decode_json(kv[-1].data, WeightsPointer, "weights.latest"),
            [json.loads(m.data)["values"] for m in metrics],
        )

    versions, pointer, explorer_metrics = anyio.run(read, backend="asyncio")
    assert {0, 1, 2, 3} <= versions, versions  # it generated with every version it fetched
    assert pointer.method == "jetstream" and pointer.version == 4
    assert pointer.uri.startswith("nats:RFT_HOSTS_WEIGHTS/")
    swaps = sum(m.get("sync/swaps", 0) for m in explorer_metrics)
    pauses = [
        m["sync/explorer_pause_seconds"]
        for m in explorer_metrics
        if "sync/explorer_pause_seconds" in m
    ]
    assert swaps >= 3 and pauses and max(pauses) < 0.1
