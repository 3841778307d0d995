"""Smoke: `rftstream up` in mode explore (no trainer) and mode bench (evaluations only)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration._util import user_env

pytestmark = pytest.mark.smoke

RFTSTREAM = [sys.executable, "-m", "rftstream.cli"]
ROOT = Path(__file__).resolve().parents[2]


def _up(tmp_path: Path, tiny_model_path: str, yaml_text: str) -> subprocess.CompletedProcess:
    config = tmp_path / "run.yaml"
    config.write_text(yaml_text)
    env = {**user_env(tiny_model_path), "COLUMNS": "400"}  # long paths on one line
    proc = subprocess.run(
        [*RFTSTREAM, "up", "--config", str(config), "--run-dir", str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=420,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_up_explore_mode(tmp_path: Path, tiny_model_path: str) -> None:
    proc = _up(
        tmp_path,
        tiny_model_path,
        """
mode: explore
name: up_explore
buffer:
  batch_size: 2
  total_steps: 2
  explorer_input:
    taskset:
      path: builtin:arithmetic
      rollout_args: {max_tokens: 6}
algorithm: {algorithm_type: grpo, repeat_times: 2}
explorer: {runner_num: 2}
""",
    )
    out = " ".join(proc.stdout.split())  # the summary wraps its values at word boundaries
    assert "2 explorer steps, 4 experience groups on rft.up_explore.exp.train" in out
    assert "JetStream store" in out
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # no trainer
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_up_bench_mode(tmp_path: Path, tiny_model_path: str) -> None:
    ckpt = tmp_path / "run" / "checkpoints" / "global_step_1"
    shutil.copytree(tiny_model_path, ckpt)
    proc = _up(
        tmp_path,
        tiny_model_path,
        f"""
mode: bench
name: up_bench
buffer:
  explorer_input:
    eval_tasksets:
      - name: arith
        path: {ROOT / "examples" / "data" / "arithmetic_eval.jsonl"}
        rollout_args: {{max_tokens: 6}}
""",
    )
    out = proc.stdout
    assert "eval step 0 (the given model)" in out and f"eval step 1 ({ckpt})" in out
    assert "arith/accuracy/mean" in out
    assert "2 evaluations" in out
    records = [json.loads(x) for x in (tmp_path / "run" / "eval.jsonl").read_text().splitlines()]
    assert [(r["step"], r["checkpoint"]) for r in records] == [(0, None), (1, str(ckpt))]


def test_up_train_mode_with_two_trainer_ranks(tmp_path: Path, tiny_model_path: str) -> None:
    """``mode: train`` (SFT on a dataset file) with ``trainer.n_gpus_per_node`` 2: up starts
    rank 1 beside the trainer (rank 0), and each step's 8 rows are split 4 and 4."""
    import yaml

    from tests.integration._util import sft_config

    cfg = sft_config(tmp_path, tiny_model_path, "up_train_ranks", rows=16, batch=8)
    cfg.setdefault("trainer", {})["n_gpus_per_node"] = 2
    proc = _up(tmp_path, tiny_model_path, yaml.safe_dump(cfg))
    assert "trainer ranks 1..1 run in processes" in " ".join(proc.stdout.split())
    records = [
        json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().split("\n") if x
    ]
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["trainer/rank_rows/0"] == r["trainer/rank_rows/1"] == 4 for r in records)
    assert (tmp_path / "run" / "logs" / "trainer-rank-1.log").exists()
