"""Smoke: the `rftstream up` command itself, as a user runs it."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.integration._util import run_up, user_env

pytestmark = pytest.mark.smoke

RFTSTREAM = [sys.executable, "-m", "rftstream.cli"]


def _up_until_the_first_step(tmp_path: Path, tiny_model_path: str) -> tuple[Any, Path]:
    """``rftstream up --steps 1000`` in ``tmp_path / "run"``, its output in ``up.log``; returns
    (the process, the log) once the trainer has written its first step (at most 300 s)."""
    run_dir = tmp_path / "run"
    log = tmp_path / "up.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [*RFTSTREAM, "up", "--steps", "1000", "--run-dir", str(run_dir)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=user_env(tiny_model_path),
        )
    deadline = time.time() + 300
    metrics = run_dir / "metrics.jsonl"
    while time.time() < deadline and not (metrics.exists() and metrics.read_text().strip()):
        if proc.poll() is not None:
            raise AssertionError(log.read_text()[-3000:])
        time.sleep(0.5)
    if not metrics.exists():
        proc.kill()
        raise AssertionError("no trainer step within 300 s")
    return proc, log


def test_up_three_steps(tmp_path: Path, tiny_model_path: str) -> None:
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [*RFTSTREAM, "up", "--steps", "3", "--run-dir", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=420,
        env=user_env(tiny_model_path),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "NATS" in out and "nats://127.0.0.1:" in out
    assert "export NATS_URL=nats://127.0.0.1:" in out and "nats stream ls" in out
    assert "NATS_PASSWORD=$(cat " in out  # the password itself is never shown
    for step in (1, 2, 3):
        assert f"step {step:>4}" in out
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        for key in ("reward/mean", "staleness/mean", "time/trainer_wait", "trainer/idle_share"):
            assert key in r
        assert 0.0 <= r["trainer/idle_share"] <= 1.0
    shares = [r["explorer/idle_share"] for r in records if "explorer/idle_share" in r]
    assert shares and all(0.0 <= x <= 1.0 for x in shares)
    assert "idle after step 1: trainer" in " ".join(out.split())
    # the embedded default runs the explorer and the operator host in processes of their own
    assert "explorer and operator host run in processes" in " ".join(out.split())
    # the explorer's process was started while the run was being prepared (rftstream.launch.prestart)
    assert "(started early) runs explorer" in (run_dir / "logs" / "rftstream.log").read_text()
    for role in ("explorer", "operator"):
        child_log = (run_dir / "logs" / f"{role}.log").read_text()
        assert f"running {role} of run default" in child_log
        assert "done after" in child_log and "(exit 0)" in child_log
    assert "FutureWarning" not in out  # the child's library noise stays in its log
    assert (run_dir / "metrics.png").is_file()
    assert (run_dir / "checkpoints" / "global_step_3" / "model.safetensors").is_file()
    assert (run_dir / "nats" / "jetstream").is_dir()


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_up_signal_stops_everything(tmp_path: Path, tiny_model_path: str, signum: int) -> None:
    proc, log = _up_until_the_first_step(tmp_path, tiny_model_path)
    try:
        children = psutil.Process(proc.pid).children(recursive=True)
        assert any("nats-server" in c.name() for c in children)
        t0 = time.time()
        proc.send_signal(signum)
        proc.wait(timeout=10)
        assert time.time() - t0 < 10
        assert proc.returncode == 130, log.read_text()[-3000:]
        _gone, alive = psutil.wait_procs(children, timeout=2)
        assert not alive, f"left running: {alive}"
        assert "stopped by signal" in log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()


def test_the_staleness_bound_holds_from_the_first_step(
    tmp_path: Path, tiny_model_path: str
) -> None:
    """The first batches are in transit while the trainer still starts and waits: its
    starving flag must not let the explorer run past ``max_staleness`` (it did: staleness 3
    at step 4 under a bound of 2)."""
    for bound in (1, 2):
        _, records = run_up(
            tmp_path / f"run{bound}",
            tiny_model_path,
            *("--steps", "12", "--set", f"synchronizer.max_staleness={bound}"),
        )
        staleness = [r["staleness/max"] for r in records]
        assert len(staleness) == 12 and max(staleness) <= bound, staleness


def test_a_fixed_style_run_is_on_policy_at_every_step(tmp_path: Path, tiny_model_path: str) -> None:
    """``sync_style: fixed`` with interval 1: the explorer waits for each step's weights (woken
    by the trainer's write), so every step trains on experience of the newest weights."""
    sync = ("--set", "synchronizer.sync_style=fixed", "--set", "synchronizer.sync_interval=1")
    _, records = run_up(tmp_path / "run", tiny_model_path, "--steps", "6", *sync)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert [r["staleness/max"] for r in records] == [0] * 6


def test_a_dead_rollout_process_is_started_again_and_stopped_with_the_run(
    tmp_path: Path, tiny_model_path: str
) -> None:
    proc, log = _up_until_the_first_step(tmp_path, tiny_model_path)
    try:
        children = [
            c
            for c in psutil.Process(proc.pid).children(recursive=True)
            if "rftstream.launch.actor_process" in " ".join(c.cmdline())
        ]
        assert len(children) == 2  # the explorer and the operator host
        explorer = [c for c in children if "--roles explorer" in " ".join(c.cmdline())]
        explorer[0].kill()  # as the OOM killer would
        deadline = time.time() + 60
        said = ""
        while "starting it again" not in said:
            assert proc.poll() is None and time.time() < deadline, said[-3000:]
            time.sleep(0.2)
            said = " ".join(log.read_text().split())
        assert f"the explorer process (pid {explorer[0].pid}) was killed by SIGKILL" in said
        assert "explorer.log" in said
        record = json.loads((tmp_path / "run" / "run.lock").read_text())
        deadline = time.time() + 30
        while explorer[0].pid in record["children"] or len(record["children"]) != 2:
            assert time.time() < deadline, record  # the new pid is recorded
            time.sleep(0.2)
            record = json.loads((tmp_path / "run" / "run.lock").read_text())
        now = [psutil.Process(pid) for pid in record["children"]]
        proc.send_signal(signal.SIGINT)  # the run stops, its children with it
        proc.wait(timeout=120)
        assert proc.returncode == 130, log.read_text()[-3000:]
        _gone, alive = psutil.wait_procs(children[1:] + now, timeout=20)
        assert not alive, f"left running: {alive}"
        assert json.loads((tmp_path / "run" / "run.lock").read_text())["status"] == "stopped"
    finally:
        if proc.poll() is None:
            proc.kill()


def test_bad_config_is_one_clear_line(tmp_path: Path) -> None:
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(
        "buffer:\n  batch_size: 4\n  explorer_input:\n    taskset:\n      prompt_kye: q\nsynchronizer:\n  sync_style: sometimes\n"
    )
    proc = subprocess.run(
        [*RFTSTREAM, "up", "--config", str(cfg)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2
    out = " ".join(proc.stdout.split())
    assert "bad.yaml" in out
    assert "buffer.explorer_input.taskset.prompt_kye" in out
    assert "Traceback" not in proc.stdout + proc.stderr


def test_up_twice_in_the_same_run_dir_starts_a_new_run_and_keeps_the_finished_one(
    tmp_path: Path, tiny_model_path: str
) -> None:
    run_dir = tmp_path / "run"
    cmd = [*RFTSTREAM, "up", "--steps", "2", "--run-dir", str(run_dir)]
    first = subprocess.run(
        cmd, capture_output=True, text=True, timeout=300, env=user_env(tiny_model_path)
    )
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    second = subprocess.run(
        cmd, capture_output=True, text=True, timeout=300, env=user_env(tiny_model_path)
    )
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    said = " ".join(second.stdout.split())
    assert "a new run starts (the earlier run had finished)" in said, said[-2000:]
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]  # the second run's own steps, not appended
    assert records[0]["experience/trained"] == 64
    # the finished run moved aside whole, never deleted
    (aside,) = [p for p in tmp_path.iterdir() if p.name.startswith("run.")]
    assert aside.name in said.replace(" ", "")
    first_records = (aside / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in first_records] == [1, 2]
    assert (aside / "nats" / "jetstream").is_dir() and not (run_dir / "run.lock").read_text() == ""
