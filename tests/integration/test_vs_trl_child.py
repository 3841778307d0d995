"""The TRL side of ``benchmarks/vs_trl.py`` (its ``_trl`` child) runs for real: a few
steps of TRL's ``GRPOTrainer`` on the default workload, the clock's record of every step
and, with ``--log-metrics``, TRL's own metrics of every step beside it."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from tests.integration._util import user_env

ROOT = Path(__file__).resolve().parents[2]


def test_the_trl_child_records_every_step_and_its_own_metrics(
    tmp_path: Path, tiny_model_path: str
) -> None:
    out = tmp_path / "trl.jsonl"
    argv = [
        sys.executable,
        str(ROOT / "benchmarks" / "vs_trl.py"),
        "_trl",
        *("--out", str(out), "--snapshots", str(tmp_path / "snapshots")),
        *("--workload", "default", "--seed", "1", "--max-steps", "3"),
        *("--t0", repr(time.time()), "--threads", "1", "--eval-every", "1e9"),
        *("--after-s", "0", "--budget-s", "300", "--log-metrics"),
    ]
    proc = subprocess.run(
        argv, capture_output=True, text=True, timeout=300, env=user_env(tiny_model_path)
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    steps = [json.loads(x) for x in out.read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2, 3]
    assert all(0.0 <= s["reward"] <= 1.0 and s["train_s"] > 0 for s in steps)
    logged = [json.loads(x) for x in Path(f"{out}.metrics.jsonl").read_text().splitlines()]
    per_step = [m for m in logged if "entropy" in m]
    assert [m["step"] for m in per_step] == [1, 2, 3], logged
    for m in per_step:
        assert m["entropy"] > 0 and m["grad_norm"] >= 0, m
        assert 1 <= m["completions/mean_length"] <= 6, m  # the default workload's 6 tokens
    # the reward TRL logged is the one the clock recorded for that step
    assert [round(m["reward"], 6) for m in per_step] == [round(s["reward"], 6) for s in steps]
